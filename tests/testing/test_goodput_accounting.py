"""The goodput benchmark's accounting (``torchtitan_ft.testing.goodput_accounting``), on
hand-built records."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from torchtitan_ft.testing.goodput_accounting import (
    faults_losing_state,
    job_samples,
    ledger_check,
    samples_per_cpu_s,
    samples_rolled_back,
    second_lines,
    state_losses,
    time_to_samples,
)


@pytest.mark.parametrize(
    ("points", "target", "rollback", "expected"),
    [
        # per-step FT: a restarted group reports 0 before its heal; the job never goes back
        ([(1, 10), (2, 20), (3, 0), (4, 30)], 30, False, 4),
        ([(1, 10), (2, 30), (3, 0), (4, 40)], 30, False, 2),
        ([(1, 10), (2, 20)], 30, False, None),
        # checkpoint-restart: reached at 2, rolled back at 3, reached again at 5
        ([(1, 10), (2, 30), (3, 10), (4, 20), (5, 30)], 30, True, 5),
        ([(1, 10), (2, 30), (3, 40)], 30, True, 2),
        ([], 1, True, None),
        # unsorted input is ordered by time
        ([(2, 30), (1, 10)], 30, False, 2),
    ],
)
def test_time_to_samples(points: list, target: int, rollback: bool, expected: float) -> None:
    assert time_to_samples(points, target, rollback=rollback) == expected


@pytest.mark.parametrize(
    ("points", "loss_times", "expected"),
    [
        # no loss: the highest so far (a restarted group's own lower count does not count)
        ([(1, 10), (2, 20), (3, 0), (4, 30)], [], [(1, 10), (2, 20), (3, 20), (4, 30)]),
        # a loss at 3: the job starts over from what its first second-line commit holds
        (
            [(1, 10), (2, 30), (3, 20), (4, 30), (5, 40)],
            [3],
            [(1, 10), (2, 30), (3, 20), (4, 30), (5, 40)],
        ),
        (
            [(1, 10), (2, 30), (3, 6), (4, 0), (5, 12)],
            [3],
            [(1, 10), (2, 30), (3, 6), (4, 6), (5, 12)],
        ),
        # two losses; an observation before the first loss sorted in from out of order
        (
            [(5, 8), (1, 10), (3, 4), (2, 20), (4, 2)],
            [3, 4.5],
            [(1, 10), (2, 20), (3, 4), (4, 4), (5, 8)],
        ),
    ],
)
def test_job_samples(points: list, loss_times: list, expected: list) -> None:
    assert job_samples(points, loss_times) == expected


def test_rolled_back_samples_are_the_job_s_less_the_state_it_went_on_from() -> None:
    series = job_samples([(1, 12), (2, 24), (3, 36), (4, 18), (5, 24)], [4])
    # 36 samples before the loss at 4; the checkpoint it resumed from held 12
    assert samples_rolled_back(series, 4, resumed=12) == 24
    assert samples_rolled_back(series, 4, resumed=0) == 36  # no checkpoint: from scratch
    assert samples_rolled_back(series, 0.5, resumed=0) == 0  # nothing before it


@pytest.mark.parametrize(
    ("finals", "expected"),
    [
        (
            {0: {"consumed": [5, 4], "position": 5}, 1: {"consumed": [5, 4], "position": 4}},
            {"exactly_once": True, "ledgers_agree": True, "lost": 0, "duplicated": 0},
        ),
        # group 1's reader is one batch past its entry: that batch would be trained again
        (
            {0: {"consumed": [5, 4], "position": 5}, 1: {"consumed": [5, 4], "position": 5}},
            {"exactly_once": False, "ledgers_agree": True, "lost": 0, "duplicated": 1},
        ),
        # the ledgers disagree, and group 0 has read less than its entry says it trained
        (
            {0: {"consumed": [5, 4], "position": 3}, 1: {"consumed": [6, 4], "position": 4}},
            {"exactly_once": False, "ledgers_agree": False, "lost": 2, "duplicated": 0},
        ),
        # a group without a final record
        (
            {0: {"consumed": [5, 4], "position": 5}},
            {"exactly_once": False, "ledgers_agree": False, "lost": 0, "duplicated": 0},
        ),
    ],
)
def test_ledger_check(finals: dict, expected: dict) -> None:
    assert ledger_check(finals, groups=2) == expected


@dataclass
class _R:
    time: float
    pid: int
    group: int | None
    step: int
    committed: bool = True


def test_second_lines_and_state_losses() -> None:
    records = [
        _R(1.0, 10, 0, 5),
        _R(1.1, 11, 1, 5),
        _R(2.0, 10, 0, 6),
        # a replacement that healed commits at the job's step: no second line
        _R(3.0, 12, 2, 6),
        # every holder gone: two processes start over from step 1, a third heals from them
        _R(10.0, 13, 0, 1),
        _R(10.1, 14, 1, 1),
        _R(11.0, 13, 0, 2),
        _R(12.0, 15, 2, 2),
        # an uncommitted iteration is no commit
        _R(12.5, 16, 2, 0, committed=False),
    ]
    lines = second_lines(records)
    assert [(line["pid"], line["step"], line["job_step"]) for line in lines] == [
        (13, 1, 6),
        (14, 1, 6),
        (15, 2, 6),
    ]
    (loss,) = state_losses(lines)
    assert loss == {"time": 10.0, "job_step": 6, "to_step": 1, "groups": [0, 1, 2]}
    # the new line passes the old one, then loses its state again: a second loss
    later = [*records, _R(20.0, 13, 0, 9), _R(30.0, 17, 1, 0)]
    assert [(x["time"], x["job_step"]) for x in state_losses(second_lines(later))] == [
        (10.0, 6),
        (30.0, 9),
    ]
    assert state_losses([]) == []


@pytest.mark.parametrize(
    ("fault_times", "loss_times", "expected"),
    [
        ([1.0, 5.0, 9.0], [], set()),
        ([1.0, 5.0, 9.0], [6.0], {1}),  # the last fault before the loss
        ([1.0, 5.0, 9.0], [6.0, 9.5], {1, 2}),
        ([1.0, 5.0], [0.5], set()),  # before any fault: nobody's
        ([1.0, 5.0], [5.0], {1}),
    ],
)
def test_faults_losing_state(fault_times: list, loss_times: list, expected: set) -> None:
    assert faults_losing_state(fault_times, [{"time": t} for t in loss_times]) == expected


@pytest.mark.parametrize(
    ("samples", "seconds", "cpus", "expected"),
    [
        (1200, 240.0, 1.5, 1200 / 360),  # 3 groups of 0.5 CPU
        (1200, 240.0, 2.0, 1200 / 480),  # the same with a hot spare: a quarter less per CPU-s
        (1200, None, 1.5, None),  # the target never reached
        (1200, 0.0, 1.5, None),
        (1200, 240.0, 0.0, None),
    ],
)
def test_samples_per_cpu_s(
    samples: int, seconds: float | None, cpus: float, expected: float | None
) -> None:
    assert samples_per_cpu_s(samples, seconds, cpus) == (
        pytest.approx(expected) if expected is not None else None
    )
