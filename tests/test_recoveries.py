"""A job's recoveries from its event stream (``torchtitan_ft.recoveries``): events built by
hand, the phases each recovery is cut into, and the command that prints them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchtitan_ft.events import Event, EventKind
from torchtitan_ft.recoveries import PHASES, Noticed, RecoveryKind, main, recoveries

OLD, NEW, OTHER = "replica_1:aaa", "replica_1:bbb", "replica_0:ccc"


def ev(t: float, kind: EventKind, rid: str, step: int = 0, rank: int = 0, **data: Any) -> Event:
    return Event(t, kind, rid, rank, step, data)


def quorum(t: float, rid: str, members: list[str], role: str, asked: float | None = None) -> Event:
    return ev(t, EventKind.QUORUM, rid, replica_ids=members, role=role, asked_at=asked or t)


def commit(t: float, rid: str, step: int) -> Event:
    return ev(t, EventKind.COMMIT, rid, step, participants=2)


def _replacement_job(notice: Event | None, process_started: float = 105.0) -> list[Event]:
    """Group 1's process OLD dies after its event at 100; NEW replaces it and heals."""
    return [
        quorum(1.0, OTHER, [OTHER, OLD], "participant"),
        quorum(1.0, OLD, [OTHER, OLD], "participant"),
        commit(100.0, OLD, 10),
        commit(100.0, OTHER, 10),
        *([notice] if notice else []),
        ev(110.0, EventKind.START, NEW, process_started=process_started),
        quorum(130.0, NEW, [OTHER, NEW], "healing", asked=120.0),
        ev(
            130.1,
            EventKind.HEAL_START,
            NEW,
            to_step=11,
            source_replica_rank=0,
            source_address="http://host-a:1234",
        ),
        ev(
            130.2,
            EventKind.HEAL_START,
            NEW,
            rank=1,
            to_step=11,
            source_replica_rank=0,
            source_address="http://host-a:1234",
        ),
        ev(134.0, EventKind.HEAL_END, NEW, 11, outcome="applied", seconds=3.9, bytes=300_000_000),
        ev(
            134.5,
            EventKind.HEAL_END,
            NEW,
            11,
            rank=1,
            outcome="applied",
            seconds=4.3,
            bytes=100_000_000,
        ),
        commit(135.0, NEW, 12),  # the healing step: not a participant
        quorum(136.0, NEW, [OTHER, NEW], "participant"),
        commit(138.0, NEW, 13),
    ]


@pytest.mark.parametrize(
    ("notice", "process_started", "noticed_by", "phases"),
    [
        (  # a connection error at 101: every phase in order
            ev(101.0, EventKind.FAULT, OTHER, error="RuntimeError", collective=True),
            105.0,
            Noticed.COLLECTIVE_ERROR,
            [1.0, 4.0, 5.0, 10.0, 10.0, 4.0, 4.0],
        ),
        (  # a hung peer: the others' collective timed out at 111, after the restart began
            ev(111.0, EventKind.FAULT, OTHER, error="TimeoutError", collective=True),
            105.0,
            Noticed.TIMEOUT,
            [11.0, 0.0, 0.0, 9.0, 10.0, 4.0, 4.0],
        ),
        (  # the lighthouse dropped it: the others' next quorum lacks it
            quorum(102.0, OTHER, [OTHER], "participant"),
            103.0,
            Noticed.QUORUM,
            [2.0, 1.0, 7.0, 10.0, 10.0, 4.0, 4.0],
        ),
        (None, 105.0, Noticed.NOT_SEEN, [0.0, 5.0, 5.0, 10.0, 10.0, 4.0, 4.0]),
    ],
)
def test_a_replacement_is_cut_into_phases_that_add_up(
    notice: Event | None, process_started: float, noticed_by: Noticed, phases: list[float]
) -> None:
    (found,) = recoveries(_replacement_job(notice, process_started))
    assert found.kind is RecoveryKind.REPLACEMENT
    assert (found.replica, found.replica_id, found.failed_replica_id) == ("replica_1", NEW, OLD)
    assert found.noticed_by is noticed_by
    assert list(found.phases) == list(PHASES)
    assert list(found.phases.values()) == pytest.approx(phases)
    assert found.started == 100.0 and found.complete
    assert found.total_s == pytest.approx(38.0) == pytest.approx(sum(found.phases.values()))
    heal = found.heal
    assert heal is not None
    assert (heal.bytes, heal.seconds, heal.donor_replica_rank) == (400_000_000, 3.9, 0)
    assert heal.donor_address == "http://host-a:1234" and heal.outcome == "applied"
    assert heal.rate_mb_s == pytest.approx(400 / 3.9, abs=1e-3)


def test_a_replacement_without_a_heal_or_a_commit() -> None:
    events = [
        e
        for e in _replacement_job(None)
        if (e.kind not in (EventKind.HEAL_START, EventKind.HEAL_END) and e.replica_id != NEW)
        or e.kind in (EventKind.START, EventKind.QUORUM)
    ]
    (found,) = recoveries(events)
    # no heal phase; it never committed as a participant: incomplete, up to its last quorum
    assert list(found.phases) == ["noticed", "restart", "imports", "setup", "quorum"]
    assert not found.complete and found.heal is None
    assert found.total_s == pytest.approx(30.0)


def test_a_replacement_that_trained_before_it_healed_heals_apart() -> None:
    """Its first quorum had it participate (the job's state was away): its heal later is a
    heal of its own, not the replacement's (which ended at its first commit)."""
    events = [
        quorum(1.0, OLD, [OLD], "participant"),
        commit(100.0, OLD, 10),
        ev(110.0, EventKind.START, NEW, process_started=105.0),
        quorum(130.0, NEW, [NEW], "participant", asked=120.0),
        commit(131.0, NEW, 1),
        quorum(140.0, NEW, [OTHER, NEW], "healing", asked=139.0),
        ev(140.1, EventKind.HEAL_START, NEW, 1, to_step=11, source_replica_rank=0),
        ev(141.0, EventKind.HEAL_END, NEW, 11, outcome="applied", seconds=0.9, bytes=10),
        quorum(142.0, NEW, [OTHER, NEW], "participant"),
        commit(143.0, NEW, 12),
    ]
    replaced, healed = recoveries(events)
    assert (replaced.kind, replaced.heal, replaced.total_s) == (RecoveryKind.REPLACEMENT, None, 31)
    assert healed.kind is RecoveryKind.HEAL
    assert healed.phases == {"quorum": 1.0, "heal": 1.0, "first_commit": 2.0}


def test_a_heal_without_a_restart() -> None:
    events = [
        quorum(1.0, OTHER, [OTHER, OLD], "participant"),
        quorum(1.0, OLD, [OTHER, OLD], "participant"),
        ev(50.0, EventKind.DISCARD, OLD, 5, participants=2, reason="x"),
        quorum(52.0, OLD, [OTHER, OLD], "healing", asked=51.0),
        ev(
            52.5,
            EventKind.HEAL_START,
            OLD,
            5,
            to_step=7,
            source_replica_rank=0,
            source_address="http://a:1",
        ),
        ev(54.0, EventKind.HEAL_END, OLD, 7, outcome="applied", seconds=1.5, bytes=0),
        quorum(55.0, OLD, [OTHER, OLD], "participant"),
        commit(56.0, OLD, 8),
    ]
    (found,) = recoveries(events)
    assert found.kind is RecoveryKind.HEAL and found.noticed_by is None
    assert found.phases == {"quorum": 1.0, "heal": 2.0, "first_commit": 2.0}
    assert (found.started, found.total_s) == (51.0, 5.0)
    assert found.heal is not None and found.heal.rate_mb_s == 0.0


def test_a_first_process_that_heals_at_its_first_quorum_joins() -> None:
    events = [
        ev(1.0, EventKind.START, OLD, process_started=0.5),
        quorum(3.0, OLD, [OTHER, OLD], "healing", asked=2.0),
        ev(3.1, EventKind.HEAL_START, OLD, to_step=4, source_replica_rank=0,
           source_address="http://a:1"),
        ev(4.0, EventKind.HEAL_END, OLD, 4, outcome="applied", seconds=0.9, bytes=10),
        quorum(5.0, OLD, [OTHER, OLD], "participant"),
        commit(6.0, OLD, 5),
    ]  # fmt: skip
    (found,) = recoveries(events)
    assert found.kind is RecoveryKind.JOIN
    assert found.phases == {"quorum": 1.0, "heal": 1.0, "first_commit": 2.0}


def test_a_job_without_failures_has_no_recoveries() -> None:
    events = [quorum(1.0, OTHER, [OTHER], "participant"), commit(2.0, OTHER, 1)]
    assert recoveries(events) == []


def _write(folder: Path, events: list[Event]) -> None:
    folder.mkdir()
    for rid in {e.replica_id for e in events}:
        for rank in (0, 1):
            lines = [e.to_json() for e in events if e.replica_id == rid and e.group_rank == rank]
            if lines:
                name = f"{rid.replace(':', '_')}.r{rank}.jsonl"
                (folder / name).write_text("\n".join(lines) + "\n")


def test_the_command_prints_json_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "events", _replacement_job(None))
    assert main([str(tmp_path / "events"), "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["kind"] == "replacement" and record["noticed_by"] == "not_seen"
    assert sum(record["phases"].values()) == pytest.approx(record["total_s"])
    assert record["heal"]["bytes"] == 400_000_000
    assert main([str(tmp_path / "events")]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["replica", "kind", "noticed"]
    assert row.split()[:3] == ["replica_1", "replacement", "not_seen"]


def test_the_command_refuses_a_folder_without_events(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path)])
    assert stop.value.code == 2
