"""Training through a lighthouse outage (``lighthouse_outage="previous_quorum"``), with real
processes: three MLP groups keep committing while their lighthouse is SIGKILLed, and after it
is restarted the next membership change (a group killed, a fresh one healing in) still works;
all groups end bitwise identical."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank
from torchtitan_ft.testing.processes import LighthouseProcess

OUTAGE_COMMITS = 10
"""Commits every group must make while the lighthouse is down."""


def _wait(what: str, ready: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s}s still waiting for {what}")
        time.sleep(0.05)
    return got


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(360)  # 18 to 165 s at load 20 to 50
def test_groups_commit_through_a_lighthouse_outage_and_change_membership_after_it(
    tmp_path: Path,
) -> None:
    events = tmp_path / "events"
    stop_file = tmp_path / "stop_step"
    log = (tmp_path / "lighthouse.log").open("a")
    lighthouse = LighthouseProcess(2, join_timeout_ms=1000, heartbeat_timeout_ms=2000, log=log)
    procs: list[Any] = []

    def spawn(replica: int, tag: str) -> Any:
        cfg = WorkerConfig(
            lighthouse_addr=lighthouse.address,
            replica=replica,
            out_path=str(tmp_path / f"{tag}.pt"),
            stop_step_file=str(stop_file),
            stop_participants=3,
            step_sleep_s=0.02,
            max_iterations=100_000,
            timeout_s=10.0,
            events_dir=str(events),
        )
        procs.append(spawn_rank(cfg))
        return procs[-1]

    def commits(since: float = 0.0, participants: int | None = None) -> dict[str, list[Any]]:
        """replica name -> its COMMIT events after ``since`` (with that many participants)."""
        out: dict[str, list[Any]] = {}
        for e in read_events(events):
            if e.kind is not EventKind.COMMIT or e.time <= since:
                continue
            if participants is None or e["participants"] == participants:
                out.setdefault(e.replica_id, []).append(e)
        return out

    def by_name(since: float, participants: int | None = None) -> dict[str, list[Any]]:
        return {rid.rsplit(":", 1)[0]: evs for rid, evs in commits(since, participants).items()}

    lighthouse.start()
    try:
        groups = [spawn(r, f"g{r}") for r in range(3)]
        _wait(
            "the three groups to commit 5 steps together",
            lambda: len(c := commits(participants=3)) == 3 and all(len(v) >= 5 for v in c.values()),
            timeout_s=120.0,
        )
        killed_at = time.time()
        lighthouse.kill()
        during = _wait(
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
        _wait(
            "groups 0 and 1 to commit without group 2",
            lambda: {"replica_0", "replica_1"} <= set(by_name(shrunk_at, 2)),
        )
        fresh = spawn(2, "fresh")
        fresh_id = _wait(
            "the fresh group 2 to start",
            lambda: next(
                (
                    e.replica_id
                    for e in read_events(events)
                    if e.kind is EventKind.START and e["pid"] == fresh.pid
                ),
                None,
            ),
        )
        back = _wait(
            "the fresh group 2 to heal in and commit with the others",
            lambda: commits(restarted_at, 3).get(fresh_id),
            timeout_s=90.0,
        )
        stop_file.write_text(str(back[-1].step + 3))
        for proc in (groups[0], groups[1], fresh):
            proc.join(90)
            assert proc.exitcode == 0, proc.exitcode
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        lighthouse.kill()
        log.close()

    healed = [e for e in read_events(events) if e.kind is EventKind.HEAL_END]
    assert any(e.replica_id == fresh_id for e in healed), healed
    outs = [torch.load(tmp_path / f"{t}.pt", weights_only=False) for t in ("g0", "g1", "fresh")]
    assert len({o["step"] for o in outs}) == 1
    for other in outs[1:]:
        for name, tensor in outs[0]["model"].items():
            assert torch.equal(tensor, other["model"][name]), name
