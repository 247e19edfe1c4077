"""Streaming DiLoCo on TorchTitan 0.3.0: 2 replica groups, ``--fault_tolerance.semi_sync_method
=diloco`` with 2 fragments, through run_train.sh with the registry config (the semi-sync axis
is the release-neutral one of 0.2.2; tests/titan/test_semi_sync_run.py checks its numerics)."""

from pathlib import Path

import pytest

from tests.titan030.test_ft_e2e import FT, NO_ACTIVATION_CHECKPOINTING, SMALL_CPU
from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_jobs import TrainRun, finish_all, lighthouse

STEPS = 6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_streaming_diloco_trains_and_commits_in_both_groups(tmp_path: Path) -> None:
    with lighthouse(min_replicas=2) as address:
        runs = [
            TrainRun(
                f"replica group {r}",
                STEPS,
                tmp_path / f"outputs{r}",
                *SMALL_CPU,
                *FT,
                f"--fault_tolerance.replica_id={r}",
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=2",
                "--fault_tolerance.num_fragments=2",
                NO_ACTIVATION_CHECKPOINTING,
                env={
                    "MODULE": "llama3",
                    "CONFIG": "llama3_debugmodel",
                    "TORCHFT_LIGHTHOUSE": address,
                },
            )
            for r in range(2)
        ]
        finish_all(runs)
    for run in runs:
        assert run.step_lines()[-1][0] == STEPS
        commits = run.events(EventKind.COMMIT)
        assert commits, f"{run.name} committed no sync"
        # Every commit is a fragment sync both groups took part in.
        assert [e["participants"] for e in commits] == [2] * len(commits)
        assert not run.events(EventKind.DISCARD)
