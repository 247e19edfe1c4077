"""TorchTitan's own fault-tolerance trainer, ``TRAIN_FILE=torchtitan.experiments.ft.train``
(docs/titan.md, "TorchTitan's FT doc, command by command"): with the opt-in torchft
compatibility package (``compat/`` on PYTHONPATH, as installing it would do) it trains on
torchtitan_ft, CPU fixes applied; without it, ``run_train.sh`` stops with one line.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.titan._jobs import CONFIGS, ROOT, STEP_LINE, group_events, remaining, run_ft_groups
from torchtitan_ft.events import EventKind

COMPAT = ROOT / "compat"
TRAINER = "torchtitan.experiments.ft.train"


def _pythonpath_without_compat() -> str:
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != COMPAT.resolve()
    ]
    return os.pathsep.join([str(ROOT), *kept])


def test_without_the_compat_package_it_stops_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.enable", f"--job.dump_folder={tmp_path}"],
        env={**os.environ, "TRAIN_FILE": TRAINER, "PYTHONPATH": _pythonpath_without_compat()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"torchtitan_ft: TRAIN_FILE={TRAINER} is TorchTitan's own")
    assert "torchtitan_ft.titan.train" in lines[0]
    assert "scripts/install_torchft_compat.sh" in lines[0]


def test_beside_a_real_torchft_it_stops_with_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "torchft"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise AssertionError('the fake torchft was imported')\n")
    path = os.pathsep.join([str(COMPAT), _pythonpath_without_compat(), str(tmp_path / "site")])
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.enable", f"--job.dump_folder={tmp_path}"],
        env={**os.environ, "TRAIN_FILE": TRAINER, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "another torchft is also visible" in lines[0] and str(fake) in lines[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_with_the_compat_package_two_groups_train_on_torchtitan_ft(tmp_path: Path) -> None:
    steps = 2
    path = os.pathsep.join([str(COMPAT), _pythonpath_without_compat()])
    outputs = run_ft_groups(
        tmp_path,
        1,
        steps,
        CONFIGS / "debug_cpu.toml",
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size=2",
        "--fault_tolerance.process_group=gloo",
        "--training.mixed_precision_param=float32",
        env={"TRAIN_FILE": TRAINER, "PYTHONPATH": path},
    )
    assert remaining() > 0
    for replica, output in enumerate(outputs):
        # TorchTitan's FTManager named the replica; torchtitan_ft's Manager and ManagerServer ran.
        assert f"torchtitan_ft_{replica}" in output
        assert "torchtitan_ft.manager.server" in output
        commits = group_events(tmp_path, replica, EventKind.COMMIT)
        assert any(e["participants"] == 2 for e in commits), commits
        trained = sorted({int(m.group(2)) for m in STEP_LINE.finditer(output)})
        assert trained and trained[-1] == steps, output[-3000:]
