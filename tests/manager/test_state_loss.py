"""A job that loses every copy of its state, with real processes: two MLP groups train under a
real lighthouse process, both are SIGKILLed, and fresh groups ask for a quorum behind the
job's step. The lighthouse declares the state lost (its ``/status.json``, ``/events`` and
``/metrics``), every fresh group records a ``state_lost`` event, and then either stops with
exit status 3 (``on_state_loss="stop"``, also a group started after the loss) or trains on
from step 0 (``"from_scratch"``)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.manager.state_loss import STATE_LOST_EXIT
from torchtitan_ft.testing.mlp_job import MlpJob, wait_until
from torchtitan_ft.testing.processes import LighthouseProcess, free_port

STEPS_BEFORE_KILL = 5
"""Steps the first two groups commit together before both are SIGKILLed."""


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _lost_job(
    tmp_path: Path, on_state_loss: str, min_replicas: int
) -> tuple[MlpJob, LighthouseProcess]:
    log = (tmp_path / "lighthouse.log").open("a")
    lighthouse = LighthouseProcess(
        min_replicas,
        join_timeout_ms=500,
        heartbeat_timeout_ms=1000,
        log=log,
        status_port=free_port(),
    )
    job = MlpJob(tmp_path, lighthouse, stop_participants=2, on_state_loss=on_state_loss)
    return job, lighthouse


def _kill_every_holder(job: MlpJob) -> int:
    """Trains groups 0 and 1 together, SIGKILLs both; the highest step they committed."""
    holders = [job.spawn(r, f"holder{r}") for r in range(2)]
    commits = wait_until(
        f"groups 0 and 1 to commit {STEPS_BEFORE_KILL} steps together",
        lambda: (
            len(c := job.commits(participants=2)) == 2
            and all(len(v) >= STEPS_BEFORE_KILL for v in c.values())
            and c
        ),
        timeout_s=120.0,
    )
    for proc in holders:
        os.kill(proc.pid, signal.SIGKILL)
    for proc in holders:
        proc.join(10)
    return max(e.step for evs in job.commits().values() for e in evs) if commits else 0


def _lighthouse_loss(lighthouse: LighthouseProcess) -> dict[str, Any]:
    """The lighthouse's record of the loss once it is declared: its ``/status.json``'s
    ``state_loss``, its ``state_lost`` events and its ``/metrics`` counter."""
    base = lighthouse.status_address
    assert base is not None
    status = wait_until(
        "the lighthouse to declare the state lost",
        lambda: (s := json.loads(_get(base + "status.json")))["state_losses"] and s,
        timeout_s=60.0,
    )
    events = json.loads(_get(base + "events"))["events"]
    metrics = _get(base + "metrics").splitlines()
    return {
        "status": status,
        "events": [e for e in events if e["kind"] == "state_lost"],
        "counter": next(
            float(line.split()[1])
            for line in metrics
            if line.startswith("torchft_lighthouse_state_losses_total ")
        ),
    }


def _state_lost_events(job: MlpJob, pids: set[int]) -> dict[str, Event]:
    """Replica id -> the ``state_lost`` event of each group process in ``pids``."""
    started = {e.replica_id: e["pid"] for e in read_events(job.events) if e.kind is EventKind.START}
    return {
        e.replica_id: e
        for e in read_events(job.events)
        if e.kind is EventKind.STATE_LOST and started.get(e.replica_id) in pids
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_lost_state_is_declared_and_stop_stops_every_group(tmp_path: Path) -> None:
    job, lighthouse = _lost_job(tmp_path, "stop", min_replicas=1)
    with job:
        reached = _kill_every_holder(job)
        fresh = [job.spawn(r, f"fresh{r}") for r in range(2, 4)]
        for proc in fresh:
            proc.join(90)
        assert [p.exitcode for p in fresh] == [STATE_LOST_EXIT] * 2
        seen = _lighthouse_loss(lighthouse)
        loss = seen["status"]["state_loss"]
        # The quorum before the kill asked at the last committed step or the one before.
        assert reached - 1 <= loss["lost_step"] <= reached
        assert loss["lost_step"] >= STEPS_BEFORE_KILL - 1
        # Both killed groups, or group 0 alone when it asked a last quorum between the kills.
        assert loss["holders"] and all(
            h.split(":")[0] in ("replica_0", "replica_1") for h in loss["holders"]
        )
        assert seen["status"]["state_losses"] == 1 == len(seen["events"]) == seen["counter"]
        events = _state_lost_events(job, {p.pid for p in fresh})
        assert len(events) == 2
        for e in events.values():
            assert e["lost_step"] == loss["lost_step"] and e["on_state_loss"] == "stop"
            assert e["max_step"] == 0
        assert not job.commits(since=min(e.time for e in events.values()))
        # A group started after the loss (torchrun's restart) stops too: the lighthouse holds
        # the loss until a quorum reaches the lost step again.
        late = job.spawn(4, "late")
        late.join(90)
        assert late.exitcode == STATE_LOST_EXIT
        assert len(_state_lost_events(job, {late.pid})) == 1
        assert json.loads(_get(lighthouse.status_address + "status.json"))["state_losses"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_from_scratch_trains_on_from_step_0_having_said_so(tmp_path: Path) -> None:
    # Two fresh groups form the first quorum after the loss together (min_replicas=2): one
    # alone could train past the lost step before the other starts, which ends the loss.
    job, lighthouse = _lost_job(tmp_path, "from_scratch", min_replicas=2)
    with job:
        reached = _kill_every_holder(job)
        fresh = [job.spawn(r, f"fresh{r}") for r in range(2, 4)]
        job.stop_at(3)
        job.join(fresh, timeout_s=90)
        seen = _lighthouse_loss(lighthouse)
        loss = seen["status"]["state_loss"]
        assert reached - 1 <= loss["lost_step"] <= reached
        assert seen["status"]["state_losses"] == 1 == len(seen["events"]) == seen["counter"]
        events = _state_lost_events(job, {p.pid for p in fresh})
        assert len(events) == 2
        assert all(e["on_state_loss"] == "from_scratch" for e in events.values())
        # Each trains on from its quorum's step (0), after the event, without a gap.
        assert [e["max_step"] for e in events.values()] == [0, 0]
        commits = job.commits()
        for rid, event in events.items():
            steps = [c.step for c in commits[rid]]
            assert steps == list(range(event["max_step"] + 1, event["max_step"] + 1 + len(steps)))
            assert commits[rid][0].time >= event.time
