"""The fault module's pure parts (``torchtitan_ft.testing.faults``): the seeded schedule and the
rule for which groups a fault may take, table-tested without processes."""

from __future__ import annotations

import itertools

import pytest

from torchtitan_ft.testing.faults import (
    CORRELATED_SPACING,
    DEFAULT_KINDS,
    FaultKind,
    donor_may_die,
    fault_schedule,
    fault_victims,
)

ALL = list(DEFAULT_KINDS)


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
        ({"groups": 1, "kinds": [FaultKind.CORRELATED]}, ">= 2 groups"),
        ({"min_interval_s": 0.0}, "min_interval_s"),
        ({"min_interval_s": 40.0}, "min_interval_s"),
    ],
)
def test_schedule_refuses_bad_arguments(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _schedule(**overrides)


def test_schedule_without_correlated_is_unchanged_by_it() -> None:
    """A schedule that does not name CORRELATED draws nothing for it: the seeds published
    before it existed give the same faults."""
    faults = _schedule(3)
    assert all(f.kind is not FaultKind.CORRELATED for f in faults)
    assert faults == _schedule(3, kinds=[*ALL])


def test_correlated_is_rare_spaced_and_takes_every_group() -> None:
    counts = []
    for seed in range(40):
        faults = _schedule(seed, end_s=30.0 * 200, kinds=[*ALL, FaultKind.CORRELATED])
        where = [i for i, f in enumerate(faults) if f.kind is FaultKind.CORRELATED]
        counts.append(len(where))
        assert all(i >= CORRELATED_SPACING for i in where[:1])
        assert all(b - a > CORRELATED_SPACING for a, b in itertools.pairwise(where))
        assert all(faults[i].groups == (0, 1, 2) for i in where)
    # about 200 faults a run at 2 %: a few each, never most of them
    assert 0 < sum(counts) / len(counts) < 8


def test_correlated_alone_is_every_fault() -> None:
    faults = _schedule(kinds=[FaultKind.CORRELATED])
    assert faults and {f.kind for f in faults} == {FaultKind.CORRELATED}


@pytest.mark.parametrize(
    ("kind", "wanted", "holders", "expected"),
    [
        # one victim: another holder must survive it
        (FaultKind.SIGKILL, (1,), {0, 1, 2}, (1,)),
        (FaultKind.SIGKILL, (1,), {1}, None),
        (FaultKind.SIGKILL, (1,), {0, 1}, (1,)),
        # a wanted group that does not hold the state: the next holder instead
        (FaultKind.SIGKILL, (1,), {0, 2}, (2,)),
        (FaultKind.SIGSTOP, (2,), {0, 1}, (0,)),
        (FaultKind.LINK_DOWN, (0,), {0, 2}, (0,)),
        (FaultKind.LIGHTHOUSE_GROUP_AWAY, (0,), {0, 1}, (0,)),
        (FaultKind.LIGHTHOUSE_GROUP_AWAY, (0,), {0}, None),
        # the lighthouse alone takes no group (it still waits for a holder to exist)
        (FaultKind.LIGHTHOUSE, (0,), {2}, ()),
        (FaultKind.LIGHTHOUSE, (0,), set(), None),
        # two victims: a third holder survives
        (FaultKind.TWO_GROUPS, (0, 1), {0, 1, 2}, (0, 1)),
        (FaultKind.TWO_GROUPS, (0, 1), {0, 1}, None),
        (FaultKind.TWO_GROUPS, (2, 0), {0, 1, 2}, (2, 0)),
        (FaultKind.TWO_GROUPS, (1, 2), {0, 2, 3}, (2, 3)),
        # donor_kill reserves the donor too: victim, donor and a third holder
        (FaultKind.DONOR_KILL, (1,), {0, 1, 2}, (1,)),
        (FaultKind.DONOR_KILL, (1,), {0, 1}, None),
        # correlated: every group, whatever the holders
        (FaultKind.CORRELATED, (0, 1, 2), {0, 1, 2}, (0, 1, 2)),
        (FaultKind.CORRELATED, (0, 1, 2), set(), (0, 1, 2)),
    ],
)
def test_fault_victims(
    kind: FaultKind, wanted: tuple, holders: set, expected: tuple | None
) -> None:
    groups = 4 if 3 in holders else 3
    assert fault_victims(kind, wanted, holders, groups) == expected


@pytest.mark.parametrize(
    ("donor", "holders", "expected"),
    [
        (1, {0, 1}, True),
        (1, {1}, False),  # the last holder: its death would lose the state
        (1, set(), False),
        (1, {2}, True),  # the donor is no longer a holder: another one is
    ],
)
def test_donor_may_die(donor: int, holders: set, expected: bool) -> None:
    assert donor_may_die(donor, holders) is expected


def test_every_kind_but_correlated_has_a_victim_count() -> None:
    """Adding a kind without saying how many holders it takes fails here."""
    from torchtitan_ft.testing.faults import STATE_VICTIMS

    assert set(STATE_VICTIMS) == set(FaultKind) - {FaultKind.CORRELATED}
