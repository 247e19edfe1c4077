"""TorchTitan 0.3.0's own fault-tolerance trainer on this project: ``MODULE=torchft.llama3
CONFIG=llama3_torchft_debugmodel ./run_train.sh --fault_tolerance.enable ...`` (its
``FaultTolerantTrainer``, which imports torchft) trains on torchtitan_ft through the opt-in
compatibility package (``compat/`` on PYTHONPATH, as installing it would do), with the
registry's DiLoCo over 2 fragments (docs/titan.md, "TorchTitan's own FT trainer on 0.3.0")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_ft.events import EventKind, HealOutcome
from torchtitan_ft.testing.titan_jobs import ROOT, TrainRun, finish_all, lighthouse, remaining

COMPAT = ROOT / "compat"
REGISTRY = {"MODULE": "torchft.llama3", "CONFIG": "llama3_torchft_debugmodel"}

SMALL_CPU = (
    "--training.seq_len=256",
    "--training.local_batch_size=2",
    "--validator.no-enable",
    "--profiler.no-enable-profiling",
    "--metrics.disable_color_printing",
)
"""The registry's debug model at debug_cpu.toml's shape (batch 8 x 2048 is slow on a CPU),
without its profiler and validator."""

NO_ACTIVATION_CHECKPOINTING = "activation-checkpoint:none"
"""tyro's subcommand for the registry's selective activation checkpointing; it goes last."""


def with_compat() -> str:
    """PYTHONPATH with the torchft compatibility package first, as installing it would do."""
    return os.pathsep.join([str(COMPAT), str(ROOT), os.environ.get("PYTHONPATH", "")])


def titan_group(tmp_path: Path, replica: int, steps: int, address: str) -> TrainRun:
    """Replica group ``replica`` of TorchTitan's FaultTolerantTrainer (1 rank): the
    registry's Streaming DiLoCo over 2 fragments, syncing every 2 steps (a fragment a step,
    instead of the registry's 10) so that a few steps exercise it; TorchTitan's FT checkpoint
    manager on, so that a restarted group heals the trainer's step too."""
    return TrainRun(
        f"replica group {replica}",
        steps,
        tmp_path / f"replica{replica}",
        "--fault_tolerance.enable",
        f"--fault_tolerance.replica_id={replica}",
        "--fault_tolerance.group_size=2",
        "--fault_tolerance.sync_steps=2",
        "--checkpoint.enable",
        *SMALL_CPU,
        NO_ACTIVATION_CHECKPOINTING,
        env={
            **REGISTRY,
            "PYTHONPATH": with_compat(),
            "TORCHFT_LIGHTHOUSE": address,
        },
    )


def _run_train_sh(pythonpath: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.enable"],
        env={**os.environ, **REGISTRY, "PYTHON": sys.executable, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=remaining(120),
    )


def test_without_a_torchft_it_stops_before_torchrun_with_one_line() -> None:
    result = _run_train_sh(str(ROOT))
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    assert "--module torchft.llama3 is a config of TorchTitan's own FT trainer" in line
    assert "scripts/install_torchft_compat.sh" in line and "--module llama3" in line


def test_beside_a_real_torchft_it_stops_with_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "torchft"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise AssertionError('the fake torchft was imported')\n")
    result = _run_train_sh(os.pathsep.join([with_compat(), str(tmp_path / "site")]))
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    assert "another torchft is also visible" in line and str(fake) in line


@pytest.mark.multiprocess
@pytest.mark.slow  # 2 to 4 min under load; the refusals without compat are in the default tier
@pytest.mark.timeout(480)
def test_two_groups_train_diloco_and_a_killed_group_heals(tmp_path: Path) -> None:
    """min_replicas 1: the survivor syncs alone while group 1 is down, long enough (150
    steps of 0.3 to 0.6 s; 60 were over before a restart under load 15 had started) for the
    restart to join it; each group then trains to its last step on its own. (min_replicas 2
    does not end: the restarted group heals TorchTitan's step from the donor's snapshot, taken
    when the donor's quorum starts, one step before its sync, so it needs one sync more than
    the survivor, which has ended by then.)"""
    steps = 150
    with lighthouse(min_replicas=1, heartbeat_timeout_ms=2000) as address:
        survivor, victim = (titan_group(tmp_path, r, steps, address) for r in range(2))
        deadline = time.monotonic() + remaining(240)
        while not any(e.data["participants"] == 2 for e in victim.events(EventKind.COMMIT)):
            assert time.monotonic() < deadline, "the 2 groups never committed a sync together"
            assert victim.returncode is None and survivor.returncode is None
            time.sleep(0.2)
        victim.sigkill()
        restarted = titan_group(tmp_path, 1, steps, address)
        finish_all([survivor, restarted])
    for replica in range(2):
        # TorchTitan's FT checkpoint manager wrote the group's dataloader checkpoints (its
        # trainer ran; torchtitan_ft's has no such folder).
        assert (tmp_path / f"replica{replica}" / "checkpoint" / f"ft-replicat-{replica}").is_dir()
    heals = restarted.events(EventKind.HEAL_END)
    assert heals, "the restarted group did not heal: did the survivor end before it started?"
    assert all(e.data["outcome"] == HealOutcome.APPLIED for e in heals), heals
    # 2 fragments syncing every 2 steps: a fragment's sync (a commit) at every step, and the
    # initial sync.
    assert len(survivor.events(EventKind.COMMIT)) == steps + 1
    for run in (survivor, restarted):
        commits = run.events(EventKind.COMMIT)
        assert any(e.data["participants"] == 2 for e in commits), commits
        assert not run.events(EventKind.DISCARD)
        assert run.step_lines()[-1][0] == steps
    # The restarted group healed TorchTitan's step from the survivor (the FT checkpoint
    # manager's train_state): it did not train all the steps again.
    assert len(restarted.step_lines()) < steps
