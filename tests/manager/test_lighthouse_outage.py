"""Training through a lighthouse outage (``lighthouse_outage="previous_quorum"``), with real
processes: three MLP groups keep committing while their lighthouse is SIGKILLed, and after it
is restarted the next membership change (a group killed, a fresh one healing in) still works;
all groups end bitwise identical."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.testing.mlp_job import MlpJob, wait_until
from torchtitan_ft.testing.processes import LighthouseProcess

OUTAGE_COMMITS = 10
"""Commits every group must make while the lighthouse is down."""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(360)  # 18 to 165 s at load 20 to 50
def test_groups_commit_through_a_lighthouse_outage_and_change_membership_after_it(
    tmp_path: Path,
) -> None:
    log = (tmp_path / "lighthouse.log").open("a")
    lighthouse = LighthouseProcess(2, join_timeout_ms=1000, heartbeat_timeout_ms=2000, log=log)

    with MlpJob(tmp_path, lighthouse, stop_participants=3) as job:

        def by_name(since: float, participants: int) -> dict[str, list[Any]]:
            """``commits`` keyed by replica name (a fresh group 2 is ``replica_2`` too)."""
            return {evs[0].replica_name: evs for evs in job.commits(since, participants).values()}

        groups = [job.spawn(r, f"g{r}") for r in range(3)]
        wait_until(
            "the three groups to commit 5 steps together",
            lambda: (
                len(c := job.commits(participants=3)) == 3 and all(len(v) >= 5 for v in c.values())
            ),
            timeout_s=120.0,
        )
        killed_at = time.time()
        lighthouse.kill()
        during = wait_until(
            f"every group to commit {OUTAGE_COMMITS} steps without the lighthouse",
            lambda: (
                len(c := by_name(killed_at, 3)) == 3
                and all(len(v) >= OUTAGE_COMMITS for v in c.values())
                and c
            ),
            timeout_s=30.0,
        )
        for name, evs in during.items():  # no step skipped or repeated
            steps = [e.step for e in evs]
            assert steps == list(range(steps[0], steps[0] + len(steps))), (name, steps)
        lighthouse.start()
        restarted_at = time.time()
        # The next membership change goes through the restarted lighthouse.
        os.kill(groups[2].pid, signal.SIGKILL)
        groups[2].join(10)
        shrunk_at = time.time()
        wait_until(
            "groups 0 and 1 to commit without group 2",
            lambda: {"replica_0", "replica_1"} <= set(by_name(shrunk_at, 2)),
            timeout_s=60.0,
        )
        fresh = job.spawn(2, "fresh")
        fresh_id = wait_until(
            "the fresh group 2 to start", lambda: job.replica_id(fresh.pid), timeout_s=60.0
        )
        back = wait_until(
            "the fresh group 2 to heal in and commit with the others",
            lambda: job.commits(restarted_at, 3).get(fresh_id),
            timeout_s=90.0,
        )
        job.stop_at(back[-1].step + 3)
        job.join((groups[0], groups[1], fresh), timeout_s=90)

    healed = [e for e in read_events(job.events) if e.kind is EventKind.HEAL_END]
    assert any(e.replica_id == fresh_id for e in healed), healed
    outs = [torch.load(job.state_path(t), weights_only=False) for t in ("g0", "g1", "fresh")]
    assert len({o["step"] for o in outs}) == 1
    for other in outs[1:]:
        for name, tensor in outs[0]["model"].items():
            assert torch.equal(tensor, other["model"][name]), name
