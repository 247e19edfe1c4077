"""The first screen of ``./run_local.sh`` (``scripts/local_job.py``): every line carries one
prefix naming its source, and the warnings known to be harmless on CPU are gone."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from scripts.local_job import one_prefix
from torchtitan_ft.testing.titan_jobs import ROOT

LINE_PREFIX = re.compile(
    r"\[(lighthouse|run_local|replica=\d+( rank=\d+( train_step=\d+ committed_steps=\d+)?)?)\] "
)
QUIETED = (
    "lspci",
    "fallback to A100",
    "CPU Autocast",
    "set_vital",
    "TORCH_NCCL_ASYNC_ERROR",
    # TorchTitan 0.3.0's (titan.known_warnings)
    "initial_load_model_only=True has no effect",
    "DTensor random operators may not have complete support on cpu",
    "model.safetensors.index.json not found",
    "CUDA graph capture is only supported",
    "please use `get_last_lr()`",  # a healing group's LR scheduler load
    "_warn_get_lr_called_within_step",  # that warning's source line
    "already served",  # manager.rendezvous's TCPStore line: at DEBUG
    "\x1b[",  # TorchTitan's colour codes: run_train.sh's output is not a terminal here
)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (  # a trainer log line: the trainer's prefix goes first, in place of torchrun's
            "[rank0]:[titan] 12:00:01 - root - INFO - "
            "[replica=1 rank=0 train_step=3 committed_steps=2] step: 3\n",
            "[replica=1 rank=0 train_step=3 committed_steps=2] [titan] 12:00:01 - root - INFO - "
            "step: 3\n",
        ),
        (  # a log line before the prefix is installed, a warning, a continuation line
            "[rank0]:[titan] 12:00:00 - root - INFO - Starting job\n",
            "[replica=1 rank=0] [titan] 12:00:00 - root - INFO - Starting job\n",
        ),
        ("[rank2]:  torch.set_vital(...)\n", "[replica=1 rank=2]   torch.set_vital(...)\n"),
        ("[rank0]:\n", "[replica=1 rank=0] \n"),
        (  # torchrun's agent
            "W1126 12:00:00 torch/distributed/run.py:800] setting OMP_NUM_THREADS\n",
            "[replica=1] W1126 12:00:00 torch/distributed/run.py:800] setting OMP_NUM_THREADS\n",
        ),
    ],
)
def test_each_line_gets_one_prefix_in_front(line: str, expected: str) -> None:
    assert one_prefix(1, line) == expected
    assert LINE_PREFIX.match(expected)


def _free_port_pair() -> int:
    """A free port whose successor (the status page's) is free too."""
    for _ in range(20):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


@pytest.mark.slow  # the default release's job: tests/titan030/test_local_job.py, by default
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_local_job_prints_one_prefix_per_line_and_no_known_harmless_warning() -> None:
    check_local_job()


def check_local_job() -> None:
    """``./run_local.sh``'s job trains 2 steps; every line carries one prefix and no known
    harmless warning is printed."""
    run = subprocess.run(
        [sys.executable, "scripts/local_job.py", "--steps", "2", "--port", str(_free_port_pair())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    lines = output.splitlines()
    assert any("step:  2" in line for line in lines), output[-5000:]
    assert [line for line in lines if not LINE_PREFIX.match(line)] == []
    assert [line for line in lines if "[rank" in line or "] [replica=" in line] == []
    assert [line for line in lines if any(q in line for q in QUIETED)] == []
