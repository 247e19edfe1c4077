"""Group rank 0's record of its own recoveries (``manager.recovery``): the events of a rank
fed by hand, the reports it makes, and the same breakdown as the event stream's."""

from __future__ import annotations

import pytest

from tests.test_recoveries import OLD, OTHER, _replacement_job, commit, ev, quorum
from torchtitan_ft.events import EventKind
from torchtitan_ft.lighthouse.recoveries import Departure, recovery
from torchtitan_ft.manager.recovery import RecoveryWatch
from torchtitan_ft.recoveries import Noticed, RecoveryKind, recoveries

NEW = "replica_1:bbb"


def _watch(events) -> RecoveryWatch:
    watch = RecoveryWatch()
    for e in events:
        watch.observe(e)
    return watch


def test_a_replacement_is_reported_at_its_first_participating_commit() -> None:
    """The replacing process's rank 0 reports its start once it committed as a participant
    (not at the healing step's commit), with the heal's figures; the lighthouse's breakdown
    of it has the event stream's phases from ``restart`` on (the milestones are the same
    events), and its ``noticed`` from the departure it saw."""
    events = _replacement_job(None)
    own = [e for e in events if e.replica_id == NEW and e.group_rank == 0]
    watch = RecoveryWatch()
    for e in own[:-1]:
        watch.observe(e)
    assert watch.take_reports() == []  # the healing step's commit is not a participant's
    watch.observe(own[-1])
    (report,) = watch.take_reports()
    assert watch.take_reports() == []
    assert (report.kind, report.process_started, report.manager_built) == ("start", 105.0, 110.0)
    assert (report.quorum_asked, report.quorum_received, report.healed) == (120.0, 130.0, 134.0)
    assert (report.first_commit, report.heal_to_step, report.donor_replica_rank) == (138.0, 11, 0)
    assert (report.heal_outcome, report.heal_bytes) == ("applied", 300_000_000)

    departure = Departure(OLD, 100.0, 102.0, Noticed.STREAM_END)
    mine = recovery(NEW, report, departure, heal_bytes=400_000_000)
    (stream,) = recoveries(events)
    assert mine is not None and mine.kind is RecoveryKind.REPLACEMENT
    assert (mine.noticed_by, mine.failed_replica_id) == (Noticed.STREAM_END, OLD)
    assert mine.phases["noticed"] == 2.0
    assert {p: s for p, s in mine.phases.items() if p != "noticed"} == {
        p: s for p, s in stream.phases.items() if p not in ("noticed", "restart")
    } | {"restart": 3.0}
    assert mine.total_s == pytest.approx(sum(mine.phases.values()))
    assert mine.heal == stream.heal


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        (  # a first start without a heal: reported, the lighthouse keeps none
            [
                ev(10.0, EventKind.START, NEW, process_started=9.0),
                quorum(12.0, NEW, [NEW], "participant", asked=11.0),
                commit(13.0, NEW, 1),
            ],
            [("start", 11.0, 12.0, 0.0, 13.0)],
        ),
        (  # a running process heals: from the healing quorum's request
            [
                ev(10.0, EventKind.START, NEW, process_started=9.0),
                quorum(12.0, NEW, [NEW, OTHER], "participant", asked=11.0),
                commit(13.0, NEW, 1),
                quorum(21.0, NEW, [NEW, OTHER], "healing", asked=20.0),
                ev(21.1, EventKind.HEAL_START, NEW, to_step=5, source_replica_rank=1),
                ev(23.0, EventKind.HEAL_END, NEW, outcome="applied", seconds=1.9, bytes=10),
                commit(24.0, NEW, 6),  # the healing step
                quorum(25.0, NEW, [NEW, OTHER], "participant", asked=24.5),
                commit(26.0, NEW, 7),
            ],
            [("start", 11.0, 12.0, 0.0, 13.0), ("heal", 20.0, 21.0, 23.0, 26.0)],
        ),
        (  # a failed heal retried at the next quorum: one recovery, the last heal's end
            [
                ev(10.0, EventKind.START, NEW, process_started=9.0),
                quorum(12.0, NEW, [NEW, OTHER], "healing", asked=11.0),
                ev(12.1, EventKind.HEAL_START, NEW, to_step=5, source_replica_rank=1),
                ev(13.0, EventKind.HEAL_END, NEW, outcome="failed", seconds=0.9, bytes=0),
                quorum(15.0, NEW, [NEW, OTHER], "healing", asked=14.0),
                ev(15.1, EventKind.HEAL_START, NEW, to_step=6, source_replica_rank=1),
                ev(17.0, EventKind.HEAL_END, NEW, outcome="applied", seconds=1.9, bytes=10),
                quorum(18.0, NEW, [NEW, OTHER], "participant", asked=17.5),
                commit(19.0, NEW, 8),
            ],
            [("start", 11.0, 12.0, 17.0, 19.0)],
        ),
        (  # a start that trained before it healed: the heal is in its first_commit phase
            [
                ev(10.0, EventKind.START, NEW, process_started=9.0),
                quorum(12.0, NEW, [NEW], "participant", asked=11.0),
                quorum(14.0, NEW, [NEW, OTHER], "healing", asked=13.0),
                ev(14.1, EventKind.HEAL_START, NEW, to_step=5, source_replica_rank=1),
                ev(15.0, EventKind.HEAL_END, NEW, outcome="applied", seconds=0.9, bytes=10),
                quorum(16.0, NEW, [NEW, OTHER], "participant", asked=15.5),
                commit(17.0, NEW, 6),
            ],
            [("start", 11.0, 12.0, 0.0, 17.0)],
        ),
        (  # no commit as a participant yet: nothing reported
            [
                ev(10.0, EventKind.START, NEW, process_started=9.0),
                quorum(12.0, NEW, [NEW, OTHER], "spare", asked=11.0),
                commit(13.0, NEW, 1),
            ],
            [],
        ),
    ],
)
def test_reports(events, expected) -> None:
    got = [
        (r.kind, r.quorum_asked, r.quorum_received, r.healed, r.first_commit)
        for r in _watch(events).take_reports()
    ]
    assert got == expected
