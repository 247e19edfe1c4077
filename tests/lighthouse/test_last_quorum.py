"""The last quorum kept under ``--state_dir``: the pure parts by hand (when to write, who the
restarted guard counts as heard from, what a damaged file gets), then a lighthouse state that
restarts on the same directory and guards as before the restart, which one without the
directory cannot."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.lighthouse.decision import DecisionOptions
from torchtitan_ft.lighthouse.last_quorum import (
    WRITE_INTERVAL_S,
    LastQuorum,
    LastQuorumFile,
    heard_since_restart,
    write_due,
)
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.testing.mlp_job import MlpJob, wait_until
from torchtitan_ft.testing.processes import LighthouseProcess

AB = {"a": 40, "b": 38}


@pytest.mark.parametrize(
    ("written", "current", "since_s", "due"),
    [
        (None, LastQuorum(AB), 0.0, True),  # nothing written yet
        (LastQuorum(AB), LastQuorum(AB), 60.0, False),  # unchanged
        (LastQuorum(AB), LastQuorum({"a": 41}), 0.0, True),  # new members: at once
        (LastQuorum(AB), LastQuorum(AB, frozenset("b")), 0.0, True),  # b ended: at once
        (LastQuorum(AB), LastQuorum({"a": 41, "b": 39}), 0.1, False),  # steps alone: wait
        # the first step past 0: at once (a record at 0 would not guard against step 0)
        (LastQuorum({"a": 0, "b": 0}), LastQuorum({"a": 1, "b": 0}), 0.1, True),
        (LastQuorum(AB), LastQuorum({"a": 41, "b": 39}), WRITE_INTERVAL_S, True),
    ],
)
def test_write_due(written, current, since_s, due) -> None:
    assert write_due(written, current, since_s) is due


@pytest.mark.parametrize(
    ("ended", "heartbeats", "expected"),
    [
        (set(), {}, {"a": 50.0, "b": 50.0}),  # none heard since: the restart counts
        (set(), {"a": 53.0}, {"a": 53.0, "b": 50.0}),  # a heartbeat since counts
        ({"b"}, {}, {"a": 50.0}),  # b's process is gone: not waited for
        (set(), {"x": 52.0}, {"a": 50.0, "b": 50.0, "x": 52.0}),  # others as they are
    ],
)
def test_heard_since_restart(ended, heartbeats, expected) -> None:
    assert heard_since_restart(["a", "b"], ended, heartbeats, 50.0) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[]", "expected a JSON object"),
        ('{"ended": []}', "steps must be a non-empty object"),
        ('{"steps": {}}', "steps must be a non-empty object"),
        ('{"steps": {"a": -1}}', "steps['a'] must be"),
        ('{"steps": {"a": 1}, "ended": "a"}', "ended must be a list"),
    ],
)
def test_a_damaged_record_names_its_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("[", r"\[")):
        LastQuorum.from_json(json.loads(text))


def test_a_damaged_or_missing_file_is_no_record(tmp_path: Path) -> None:
    file = LastQuorumFile(str(tmp_path))
    assert file.load() is None
    file.path.write_text("{not json")
    assert file.load() is None
    file.save(LastQuorum(AB, frozenset("b")))
    assert file.load() == LastQuorum(AB, frozenset("b"))


OPTS = DecisionOptions(min_replicas=1, join_timeout=1.0, heartbeat_timeout=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _restart_with_a_fresh_replacement(state_dir: str | None) -> list[str | None]:
    """Groups a (step 40) and b train; a's process stops (no heartbeat), b's dies, the
    lighthouse restarts, and a fresh replacement c asks at step 0. Returns, tick by tick
    (0.5 s), the quorum issued (its members joined by "+"), or None while none is."""
    clock = Clock()
    issued: list[str | None] = []

    def file() -> LastQuorumFile | None:
        return None if state_dir is None else LastQuorumFile(state_dir)

    async def run() -> None:
        before = LighthouseState(OPTS, clock=clock, last_quorum=file())
        for rid, step in (("a", 40), ("b", 40)):
            before.stream_opened(rid)
            before.request(QuorumMember(rid, step=step), QuorumMember(rid, step=step).to_proto())
        assert before.quorum is not None
        clock.now += 1.0
        before.stream_closed("b")  # b dies; a stops: its stream stays open, silent
        before.tick()
        clock.now += 5.0
        after = LighthouseState(OPTS, clock=clock, last_quorum=file())
        after.stream_opened("c")
        c = QuorumMember("c", step=0)
        fut = after.request(c, c.to_proto())
        for _ in range(16):
            clock.now += 0.5
            after.heartbeat("c")
            after.tick()
            done = after.quorum is not None and fut.done()
            issued.append(
                "+".join(m.replica_id for m in after.quorum.participants) if done else None
            )

    asyncio.run(run())
    return issued


def test_a_restarted_lighthouse_guards_the_state_only_with_its_state_dir(tmp_path: Path) -> None:
    """With ``--state_dir``, the restarted lighthouse waits for a (which may hold step 40,
    heard from at the restart as far as it knows) for 3 heartbeat timeouts (6 s) before it
    lets c train alone from step 0; b's stream had ended, so it is not waited for. Without,
    c gets its quorum after the join timeout: the second line of steps the guard exists
    to prevent."""
    guarded = _restart_with_a_fresh_replacement(str(tmp_path))
    first = next(i for i, q in enumerate(guarded) if q is not None)
    assert guarded[first] == "c"
    assert first * 0.5 + 0.5 >= 3 * OPTS.heartbeat_timeout, guarded
    saved = json.loads((tmp_path / "last_quorum.json").read_text())
    assert saved["steps"] == {"c": 0}  # the new quorum replaced the restored one

    unguarded = _restart_with_a_fresh_replacement(None)
    assert unguarded[0] == "c", unguarded


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_replacement_waits_for_the_stopped_state_holder_across_a_lighthouse_restart(
    tmp_path: Path,
) -> None:
    """Groups 0 and 1 train together. Group 0 is SIGSTOPped (the one group left with the
    job's state once group 1 is killed); the lighthouse is SIGKILLed, group 1 too, and a fresh
    group 1 starts at step 0; the lighthouse restarts on its ``--state_dir``; group 0 is
    SIGCONTed 1.5 s later (inside the guard's 3 heartbeat timeouts of 2 s). The fresh group
    must commit no step before it has healed from group 0: before ``last_quorum``, the
    restarted lighthouse knew no previous quorum and let it train alone from step 0 (a second
    line of steps). Both end bitwise identical."""
    log = (tmp_path / "lighthouse.log").open("a")
    lighthouse = LighthouseProcess(
        1,
        join_timeout_ms=500,
        heartbeat_timeout_ms=2000,
        state_dir=str(tmp_path / "state"),
        log=log,
    )
    with MlpJob(tmp_path, lighthouse, stop_participants=2) as job:

        def commits_with_both(replica_id: str) -> list[Any]:
            return job.commits(participants=2).get(replica_id, [])

        holder, first = job.spawn(0, "holder"), job.spawn(1, "first")
        holder_id = wait_until(
            "group 0 to start", lambda: job.replica_id(holder.pid), timeout_s=90.0
        )
        wait_until(
            "groups 0 and 1 to commit step 5 together",
            lambda: any(e.step >= 5 for e in commits_with_both(holder_id)),
            timeout_s=90.0,
        )
        os.kill(holder.pid, signal.SIGSTOP)
        wait_until("group 0 to stop", lambda: _stopped(holder.pid), timeout_s=90.0)
        lighthouse.kill()
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        fresh = job.spawn(1, "fresh")
        fresh_id = wait_until(
            "the fresh group 1 to start", lambda: job.replica_id(fresh.pid), timeout_s=90.0
        )
        lighthouse.start()
        time.sleep(1.5)
        os.kill(holder.pid, signal.SIGCONT)
        back = wait_until(
            "the fresh group 1 to commit with group 0",
            lambda: commits_with_both(fresh_id),
            timeout_s=90.0,
        )
        job.stop_at(back[0].step + 3)
        job.join((holder, fresh), timeout_s=90)

    mine = [e for e in read_events(job.events) if e.replica_id == fresh_id]
    kinds = [e.kind for e in mine]
    steps = [(e.kind.value, e.step) for e in mine]
    assert EventKind.HEAL_END in kinds, f"the fresh group trained a line of its own: {steps}"
    healed = kinds.index(EventKind.HEAL_END)
    assert EventKind.COMMIT not in kinds[:healed], steps
    a, b = (torch.load(job.state_path(t), weights_only=False) for t in ("holder", "fresh"))
    assert a["step"] == b["step"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
