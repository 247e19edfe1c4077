"""The LocalSGD / (Streaming) DiLoCo sync schedule, with and without an outer overlap, as a
table: no strategy, no Manager."""

from __future__ import annotations

from typing import Any

import pytest

from torchtitan_ft.semi_sync.overlap import OuterOverlap
from torchtitan_ft.semi_sync.schedule import SyncActions, SyncSchedule

NOTHING = SyncActions()
DELAYED, EAGER = OuterOverlap.DELAYED, OuterOverlap.EAGER


def _sync(fragment: int, *, quorum: bool = True, apply: bool = True) -> SyncActions:
    return SyncActions(
        form_quorum=quorum,
        start_fragment=fragment if quorum else None,
        end_cycle=apply,
        apply_fragment=fragment if apply else None,
    )


def _overlapped(finish: int | None, start: int) -> SyncActions:
    return SyncActions(
        finish_fragment=finish, form_quorum=True, start_fragment=start, end_cycle=True
    )


@pytest.mark.parametrize(
    ("schedule", "local_step", "syncs_committed", "in_flight", "expected"),
    [
        # LocalSGD / plain DiLoCo: everything after step H.
        (SyncSchedule(4), 1, 0, None, NOTHING),
        (SyncSchedule(4), 3, 0, None, NOTHING),
        (SyncSchedule(4), 4, 0, None, _sync(0)),
        (SyncSchedule(4), 4, 7, None, _sync(0)),
        (SyncSchedule(1), 1, 0, None, _sync(0)),
        # Streaming DiLoCo, H=8, F=2, tau=0: a cycle of 4 steps, fragments in turn.
        (SyncSchedule(8, 2), 3, 0, None, NOTHING),
        (SyncSchedule(8, 2), 4, 0, None, _sync(0)),
        (SyncSchedule(8, 2), 4, 1, None, _sync(1)),
        (SyncSchedule(8, 2), 4, 2, None, _sync(0)),
        # tau=1: quorum and start after step 3, apply after step 4 (the sync then in flight).
        (SyncSchedule(8, 2, 1), 2, 0, None, NOTHING),
        (SyncSchedule(8, 2, 1), 3, 1, None, _sync(1, apply=False)),
        (SyncSchedule(8, 2, 1), 4, 1, 1, _sync(1, quorum=False)),
        # tau=3 (the largest for a cycle of 4): start after step 1.
        (SyncSchedule(8, 2, 3), 1, 0, None, _sync(0, apply=False)),
        (SyncSchedule(8, 2, 3), 2, 0, None, NOTHING),
        (SyncSchedule(8, 2, 3), 4, 0, None, _sync(0, quorum=False)),
        # One step per cycle: every step syncs the next fragment.
        (SyncSchedule(3, 3), 1, 5, None, _sync(2)),
        # Outer overlap: only the cycle's last step acts: finish the sync in flight (none at
        # the first sync point or after a load), quorum, start the next, end the cycle.
        (SyncSchedule(4, overlap=DELAYED), 1, 0, None, NOTHING),
        (SyncSchedule(4, overlap=DELAYED), 3, 0, 0, NOTHING),
        (SyncSchedule(4, overlap=DELAYED), 4, 0, None, _overlapped(None, 0)),
        (SyncSchedule(4, overlap=DELAYED), 4, 3, 0, _overlapped(0, 0)),
        (SyncSchedule(4, overlap=EAGER), 4, 3, 0, _overlapped(0, 0)),
        # Streaming with overlap: fragment 1 in flight; asked again after it committed (2
        # syncs, nothing in flight), the next start is fragment 0.
        (SyncSchedule(10, 2, overlap=DELAYED), 5, 1, 1, _overlapped(1, 1)),
        (SyncSchedule(10, 2, overlap=DELAYED), 5, 2, None, _overlapped(None, 0)),
        (SyncSchedule(10, 2, overlap=EAGER), 4, 1, 1, NOTHING),
        # a 1-step cycle acts every step
        (SyncSchedule(3, 3, overlap=DELAYED), 1, 5, 1, _overlapped(1, 2)),
    ],
)
def test_actions_at_each_position(
    schedule: SyncSchedule,
    local_step: int,
    syncs_committed: int,
    in_flight: int | None,
    expected: SyncActions,
) -> None:
    assert schedule.actions(local_step, syncs_committed, in_flight) == expected


def _run(schedule: SyncSchedule, steps: int, failing: tuple[int, ...] = ()) -> list[str]:
    """Drives ``schedule`` for ``steps`` inner steps as the strategies do (asked again after
    the finish and quorum; a sync commits unless its finish or apply falls on a step in
    ``failing``); returns what happened, as ``"<step>:finish <i>"``, ``"<step>:quorum"``,
    ``"<step>:start <i>"`` and ``"<step>:apply <i>"``."""
    log: list[str] = []
    local_step, committed, in_flight = 0, 0, None
    for step in range(1, steps + 1):
        local_step += 1
        actions = schedule.actions(local_step, committed, in_flight)
        if actions.finish_fragment is not None:
            log.append(f"{step}:finish {actions.finish_fragment}")
            committed += step not in failing
            in_flight = None
        if actions.form_quorum:
            log.append(f"{step}:quorum")
        actions = schedule.actions(local_step, committed, in_flight)
        if actions.start_fragment is not None:
            log.append(f"{step}:start {actions.start_fragment}")
            in_flight = actions.start_fragment
        if actions.end_cycle:
            local_step = 0
        if actions.apply_fragment is not None:
            log.append(f"{step}:apply {actions.apply_fragment}")
            committed += step not in failing
            in_flight = None
    return log


def test_streaming_diloco_starts_each_fragment_tau_steps_before_applying_it() -> None:
    assert _run(SyncSchedule(sync_every=6, num_fragments=3, fragment_sync_delay=1), 7) == [
        "1:quorum",
        "1:start 0",
        "2:apply 0",
        "3:quorum",
        "3:start 1",
        "4:apply 1",
        "5:quorum",
        "5:start 2",
        "6:apply 2",
        "7:quorum",
        "7:start 0",
    ]


def test_local_sgd_syncs_every_sync_every_steps() -> None:
    assert _run(SyncSchedule(3), 7) == [
        "3:quorum",
        "3:start 0",
        "3:apply 0",
        "6:quorum",
        "6:start 0",
        "6:apply 0",
    ]


def test_a_fragment_whose_sync_fails_is_synced_again_next_cycle() -> None:
    log = _run(SyncSchedule(sync_every=4, num_fragments=2), 8, failing=(2,))
    assert [entry for entry in log if "apply" in entry] == [
        "2:apply 0",
        "4:apply 0",
        "6:apply 1",
        "8:apply 0",
    ]


def test_an_overlapped_sync_is_finished_at_the_next_sync_point_before_the_quorum() -> None:
    assert _run(SyncSchedule(sync_every=4, num_fragments=2, overlap=DELAYED), 7) == [
        "2:quorum",
        "2:start 0",
        "4:finish 0",
        "4:quorum",
        "4:start 1",
        "6:finish 1",
        "6:quorum",
        "6:start 0",
    ]


def test_an_overlapped_fragment_whose_sync_fails_is_started_again() -> None:
    log = _run(SyncSchedule(sync_every=4, num_fragments=2, overlap=EAGER), 8, failing=(4,))
    assert [entry for entry in log if "start" in entry] == [
        "2:start 0",
        "4:start 0",
        "6:start 1",
        "8:start 0",
    ]


def test_cycle_and_quorum_step() -> None:
    schedule = SyncSchedule(sync_every=12, num_fragments=3, fragment_sync_delay=2)
    assert (schedule.cycle, schedule.quorum_step) == (4, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 4, "num_fragments": 0}, "at least one fragment, got 0"),
        ({"sync_every": 0}, r"sync_every \(0\) must be >= the number of fragments \(1\)"),
        ({"sync_every": 2, "num_fragments": 3}, r"sync_every \(2\) must be >= the number of"),
        ({"sync_every": 5, "num_fragments": 2}, "must be a multiple of the number of fragments"),
        (
            {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 4},
            r"fragment_sync_delay must be in \[0, sync_every / num_fragments = 4\), got 4",
        ),
        ({"sync_every": 4, "fragment_sync_delay": -1}, r"must be in \[0, .* = 4\), got -1"),
        (
            {"sync_every": 4, "fragment_sync_delay": 1, "overlap": DELAYED},
            "outer_overlap='delayed' .* fragment_sync_delay must be 0 with it, got 1",
        ),
    ],
)
def test_a_schedule_that_cannot_run_is_refused_at_construction(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SyncSchedule(**kwargs)
