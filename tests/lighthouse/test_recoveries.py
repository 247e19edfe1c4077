"""The lighthouse's breakdown of the groups' recoveries (``lighthouse.recoveries``): reports
and departures built by hand, the book that pairs them, the state that records departures,
and the status page's, ``/status.json``'s and ``torchft_lighthouse status``'s views."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from tests.lighthouse._helpers import get
from torchtitan_ft.events import read_events
from torchtitan_ft.lighthouse.decision import DecisionOptions
from torchtitan_ft.lighthouse.groups import GroupBook
from torchtitan_ft.lighthouse.recoveries import (
    Departure,
    describe,
    html_section,
    recovery,
    text_lines,
)
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.summary import fetch, render
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.recoveries import PHASES, Noticed, RecoveryKind, recoveries
from torchtitan_ft.testing.mlp_job import MlpJob, wait_until
from torchtitan_ft.testing.processes import LighthouseProcess, free_port

OLD, NEW = "replica_1:aaa", "replica_1:bbb"


def start(healed: bool = True, **kw) -> pb.RecoveryReport:
    fields = dict(
        kind="start",
        process_started=105.0,
        manager_built=110.0,
        quorum_asked=120.0,
        quorum_received=130.0,
        first_commit=138.0,
    )
    if healed:
        fields |= dict(
            healed=134.0,
            heal_to_step=11,
            donor_replica_rank=0,
            donor_address="http://host-a:1234",
            heal_path="http://10.0.0.1:5555/checkpoint",
            heal_outcome="applied",
            heal_seconds=3.9,
            heal_bytes=300_000_000,
        )
    return pb.RecoveryReport(**(fields | kw))


@pytest.mark.parametrize(
    ("report", "departure", "kind", "phases"),
    [
        (  # a replacement: every phase, from the failed process's last sign of life
            start(),
            Departure(OLD, 100.0, 101.0, Noticed.STREAM_END),
            RecoveryKind.REPLACEMENT,
            {"noticed": 1, "restart": 4, "imports": 5, "setup": 10, "quorum": 10, "heal": 4,
             "first_commit": 4},
        ),
        (  # torchrun restarted it before the lighthouse noticed: noticed counts to the start
            start(healed=False),
            Departure(OLD, 100.0, 112.0, Noticed.HEARTBEAT_TIMEOUT),
            RecoveryKind.REPLACEMENT,
            {"noticed": 12, "restart": 0, "imports": 0, "setup": 8, "quorum": 10,
             "first_commit": 8},
        ),
        (  # no departure seen, healed at its first quorum: a join
            start(),
            None,
            RecoveryKind.JOIN,
            {"quorum": 10, "heal": 4, "first_commit": 4},
        ),
        (  # a running process's heal
            start(kind="heal"),
            Departure(OLD, 100.0, 101.0, Noticed.STREAM_END),
            RecoveryKind.HEAL,
            {"quorum": 10, "heal": 4, "first_commit": 4},
        ),
        (start(healed=False), None, None, None),  # a first start: no recovery
        (start(kind="future"), None, None, None),  # a newer client's kind: ignored
        (  # a departure after this process's start is not the one it replaced
            start(healed=False),
            Departure(OLD, 115.0, 115.0, Noticed.STREAM_END),
            None,
            None,
        ),
    ],
)  # fmt: skip
def test_recovery(report, departure, kind, phases) -> None:
    found = recovery(NEW, report, departure)
    if kind is None:
        assert found is None
        return
    assert found is not None and found.kind is kind
    assert found.phases == pytest.approx(phases)
    assert found.total_s == pytest.approx(sum(phases.values()))
    assert list(found.phases) == [p for p in PHASES if p in phases]
    assert found.complete


def test_the_book_pairs_a_start_with_its_groups_departure_once() -> None:
    book = GroupBook()
    book.departed(Departure(OLD, 100.0, 101.0, Noticed.STREAM_END))
    book.departed(Departure(OLD, 100.5, 103.0, Noticed.QUORUM))  # the first notice counts
    progress = pb.GroupProgress()
    progress.heals.append(pb.HealReport(to_step=11, bytes=400_000_000, outcome="applied"))
    progress.recoveries.append(start())
    book.report(NEW, progress, 140.0)
    (view,) = book.views(140.0)
    (r,) = view["recoveries"]
    assert (r["kind"], r["noticed_by"], r["failed_replica_id"]) == (
        "replacement",
        "heartbeat_stream_end",
        OLD,
    )
    assert r["phases"]["noticed"] == 1.0
    assert r["heal"]["bytes"] == 400_000_000  # the group's ranks summed, not rank 0's alone
    assert r["heal"]["path"] == "http://10.0.0.1:5555/checkpoint"
    # The departure is used up: another start of the group is no second replacement of it.
    again = pb.GroupProgress()
    again.recoveries.append(start(healed=False))
    book.report("replica_1:ccc", again, 150.0)
    assert [len(v["recoveries"]) for v in book.views(150.0)] == [1, 0]  # NEW, then ccc
    # Kept across a lighthouse restart; a file saved before recoveries existed loads.
    saved = book.to_json(150.0)
    assert GroupBook.from_json(saved, 160.0).views(160.0)[0]["recoveries"] == [r]
    for g in saved["groups"].values():
        del g["recoveries"]
    assert GroupBook.from_json(saved, 160.0).views(160.0)[0]["recoveries"] == []


def test_a_group_back_in_the_quorum_did_not_depart() -> None:
    book = GroupBook()
    book.departed(Departure(OLD, 100.0, 101.0, Noticed.QUORUM))  # left out of one quorum
    book.quorum([OLD], 102.0)  # and back
    book.departed(Departure(OLD, 500.0, 500.0, Noticed.STREAM_END))  # it dies much later
    assert book.departures["replica_1"].last_seen == 500.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall_us(self) -> int:
        return int((self.now + 1e9) * 1e6)


def _state(clock: Clock) -> LighthouseState:
    opts = DecisionOptions(min_replicas=1, join_timeout=1.0, heartbeat_timeout=2.0)
    return LighthouseState(opts, clock=clock, wall_us=clock.wall_us)


def test_the_state_records_a_stream_end_and_a_heartbeat_timeout() -> None:
    clock = Clock()
    state = _state(clock)
    for rid in ("a:1", "b:1", "c:1"):
        state.asked.add(rid)
        state.stream_opened(rid)
    state.tick()
    clock.now += 0.5
    state.stream_closed("a:1")  # died: the stream ends at once
    state.stream_closed("c:1", finished=True)  # said goodbye: no failure
    clock.now += 1.0
    state.heartbeat("b:1")  # last heard at +1.5
    clock.now += 3.0
    state.tick()  # b's heartbeats stopped 3 s ago, 2 s is the timeout
    got = state.groups.departures
    assert set(got) == {"a", "b"}
    assert (got["a"].how, got["a"].last_seen, got["a"].noticed_at) == (
        Noticed.STREAM_END,
        1e9 + 1000.5,
        1e9 + 1000.5,
    )
    assert got["b"].how is Noticed.HEARTBEAT_TIMEOUT
    assert (got["b"].last_seen, got["b"].noticed_at) == pytest.approx((1e9 + 1001.5, 1e9 + 1003.5))


def test_the_views_name_every_phase_and_the_heal() -> None:
    r = recovery(NEW, start(), Departure(OLD, 100.0, 101.0, Noticed.STREAM_END))
    assert r is not None
    groups = [{"replica_id": NEW, "recoveries": [r.to_json()]}, {"replica_id": "x"}]
    line = describe(r.to_json())
    for value in ("replacement", "heartbeat_stream_end", "38.00 s", "heal 4.00", "300.0 MB",
                  "76.923 MB/s", "http://10.0.0.1:5555/checkpoint", "applied"):  # fmt: skip
        assert value in line, (value, line)
    assert text_lines(groups)[-1] == f"  {NEW}: {line}"
    assert html.escape(line) in html_section(groups)
    assert text_lines([{"replica_id": "x"}]) == [] and html_section([]) == ""


@pytest.mark.slow  # two MLP group start-ups and a replacement: 45 to 200 s at load 22
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_replaced_group_shows_its_recovery_on_the_status_page(tmp_path: Path) -> None:
    """Two MLP groups train under a real lighthouse; group 1 is SIGKILLed and a new process
    replaces it, heals from group 0 and trains on. ``/status.json`` shows the replacement:
    noticed by the end of its heartbeat stream, the failed process named, the heal's bytes and
    path, phases that add up to the total and, from ``imports`` on, are the event stream's
    (the same milestones); ``torchft_lighthouse status`` prints it."""
    lighthouse = LighthouseProcess(
        1,
        join_timeout_ms=500,
        heartbeat_timeout_ms=1000,
        log=(tmp_path / "lighthouse.log").open("a"),
        status_port=free_port(),
    )
    base = str(lighthouse.status_address)
    with MlpJob(tmp_path, lighthouse, stop_participants=2) as job:
        for replica in (0, 1):
            job.start(replica)
        wait_until(
            "groups 0 and 1 to commit 3 steps together",
            lambda: (
                len(c := job.commits(participants=2)) == 2 and all(len(v) >= 3 for v in c.values())
            ),
            timeout_s=120.0,
        )
        failed = job.replica_id(job.current[1].pid)
        job.kill(1)
        replacing = job.start(1)

        def replacement() -> dict | None:
            groups = json.loads(get(base + "status.json")[1])["groups"]
            found = [r for g in groups for r in g["recoveries"] if r["kind"] == "replacement"]
            return found[0] if found else None

        shown = wait_until("the replacement on the status page", replacement, timeout_s=120.0)
        new_id = job.replica_id(replacing.pid)
        text = render(*fetch(base.rstrip("/"), None))

    assert (shown["replica_id"], shown["failed_replica_id"]) == (new_id, failed)
    assert shown["noticed_by"] == "heartbeat_stream_end" and shown["complete"]
    assert list(shown["phases"]) == list(PHASES)
    assert sum(shown["phases"].values()) == pytest.approx(shown["total_s"], abs=1e-5)
    heal = shown["heal"]
    assert heal["outcome"] == "applied" and heal["bytes"] > 0, heal
    # the link it came over: the donor's address and interface (all on loopback here)
    assert re.fullmatch(r"127\.0\.0\.1:\d+ on lo", heal["path"]), heal
    assert heal["donor_replica_rank"] == 0, heal
    (stream,) = [r for r in recoveries(read_events(job.events)) if r.replica_id == new_id]
    for phase in ("imports", "setup", "quorum", "heal", "first_commit"):
        assert shown["phases"][phase] == pytest.approx(stream.phases[phase], abs=1e-5), phase
    assert describe(shown) in text
