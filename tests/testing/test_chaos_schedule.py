"""The goodput benchmark's and the soak tests' pure parts: the seeded fault schedule and the
accounting over per-step records (``torchtitan_ft.testing.chaos``)."""

from __future__ import annotations

import itertools

import pytest

from torchtitan_ft.testing.chaos import (
    FaultKind,
    fault_schedule,
    ledger_check,
    time_to_samples,
)

ALL = list(FaultKind)


def _schedule(seed: int = 1, **overrides: object) -> list:
    kwargs: dict = {
        "start_s": 10.0,
        "end_s": 1000.0,
        "mean_interval_s": 30.0,
        "min_interval_s": 5.0,
        "groups": 3,
        "ranks": 2,
        "kinds": ALL,
    }
    kwargs.update(overrides)
    return fault_schedule(seed, **kwargs)


def test_schedule_is_reproducible_and_seed_dependent() -> None:
    assert _schedule(7) == _schedule(7)
    assert _schedule(7) != _schedule(8)


def test_schedule_spacing_window_and_victims() -> None:
    faults = _schedule()
    times = [f.at_s for f in faults]
    assert times == sorted(times)
    assert times[0] > 10.0 and times[-1] <= 1000.0
    assert all(b - a >= 5.0 - 1e-3 for a, b in itertools.pairwise(times))
    # mean interval 30 s over 990 s: about 33 faults
    assert 20 <= len(faults) <= 50
    for f in faults:
        assert len(f.groups) == (2 if f.kind is FaultKind.TWO_GROUPS else 1)
        assert len(set(f.groups)) == len(f.groups)
        assert all(0 <= g < 3 for g in f.groups) and 0 <= f.rank < 2


def test_every_kind_appears_in_each_round() -> None:
    faults = _schedule(end_s=10.0 + 30.0 * 40)
    first_round = [f.kind for f in faults[: len(ALL)]]
    assert sorted(first_round) == sorted(ALL)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kinds": []}, "at least one"),
        ({"groups": 1}, ">= 2 groups"),
        ({"min_interval_s": 0.0}, "min_interval_s"),
        ({"min_interval_s": 40.0}, "min_interval_s"),
    ],
)
def test_schedule_refuses_bad_arguments(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _schedule(**overrides)


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
