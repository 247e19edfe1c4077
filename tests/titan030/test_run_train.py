"""run_train.sh on TorchTitan 0.3.0: what 0.3.0 cannot read stops before torchrun, with one
line that gives the 0.3.0 form (the trainers themselves: test_ft_e2e.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_train(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("env", "named", "instead"),
    [
        (
            {"TRAIN_FILE": "torchtitan.experiments.ft.train"},
            "TRAIN_FILE=torchtitan.experiments.ft.train",
            "the 0.3.0 form of this command is `MODULE=torchft.llama3",
        ),
        ({"TRAIN_FILE": "torchtitan.experiments.forge.x"}, "forge.x", "leave TRAIN_FILE unset"),
        (  # the start command in the header of configs/llama3_ft_debug_cpu.toml
            {"MODEL": "llama3_ft", "CONFIG": "llama3_ft_debugmodel"},
            "config module 'llama3_ft'",
            "`CONFIG_FILE=configs/llama3_ft_debug_cpu.toml ./run_train.sh --module llama3",
        ),
    ],
)
def test_what_0_3_0_cannot_read_is_one_line(env: dict, named: str, instead: str) -> None:
    result = run_train(env)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and named in lines[0] and instead in lines[0], result.stderr
    assert result.stdout == ""
