"""The straggler policy: table tests of the pure exclusion decision."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from torchtitan_ft.lighthouse.exclusion import (
    Action,
    Exclusion,
    ExclusionOptions,
    StragglerPolicy,
    decide_exclusion,
)

ON = ExclusionOptions(
    StragglerPolicy.EXCLUDE, min_excluded_s=10.0, max_exclusions=2, window_s=100.0
)
OFF = ExclusionOptions(StragglerPolicy.OFF, min_excluded_s=10.0, max_exclusions=2, window_s=100.0)
NOW = 1000.0


@dataclass
class Case:
    name: str
    prior: Exclusion
    straggler: bool
    others: int  # healthy groups in the quorum without it
    opts: ExclusionOptions
    excluded: bool  # expected state after
    action: Action | None


CASES = [
    Case("policy off: a straggler stays in", Exclusion(), True, 3, OFF, False, None),
    Case("not a straggler: stays in", Exclusion(), False, 3, ON, False, None),
    Case("a straggler is left out", Exclusion(), True, 3, ON, True, Action.EXCLUDED),
    Case(
        "left out only while the others reach min_replicas (2 >= 2)",
        Exclusion(),
        True,
        2,
        ON,
        True,
        Action.EXCLUDED,
    ),
    Case("never below min_replicas: kept in", Exclusion(), True, 1, ON, False, None),
    Case(
        "max_exclusions in the window: kept in",
        Exclusion(None, (950.0, 990.0)),
        True,
        3,
        ON,
        False,
        None,
    ),
    Case(
        "exclusions older than the window do not count",
        Exclusion(None, (850.0, 990.0)),
        True,
        3,
        ON,
        True,
        Action.EXCLUDED,
    ),
    Case("out and still slow: stays out", Exclusion(995.0, (995.0,)), True, 3, ON, True, None),
    Case(
        "fast again but out < min_excluded_s: stays out",
        Exclusion(995.0, (995.0,)),
        False,
        3,
        ON,
        True,
        None,
    ),
    Case(
        "fast again and out >= min_excluded_s: taken back",
        Exclusion(990.0, (990.0,)),
        False,
        3,
        ON,
        False,
        Action.READMITTED,
    ),
    Case(
        "the quorum needs it: taken back at once, even slow",
        Exclusion(999.0, (999.0,)),
        True,
        1,
        ON,
        False,
        Action.READMITTED,
    ),
    Case(
        "policy turned off while out: taken back",
        Exclusion(999.0, (999.0,)),
        True,
        3,
        OFF,
        False,
        Action.READMITTED,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decide_exclusion(case: Case) -> None:
    after, action, reason = decide_exclusion(
        case.prior, case.straggler, case.others, 2, NOW, case.opts
    )
    assert after.excluded == case.excluded, reason
    assert action == case.action, reason
    if action is Action.EXCLUDED:
        assert after.since == NOW and after.history[-1] == NOW


def test_flapping_is_bounded() -> None:
    """A group whose speed flips every request is left out at most max_exclusions times per
    window, and each time for at least min_excluded_s."""
    state, exclusions, out_at = Exclusion(), 0, None
    for i in range(400):  # one request a second for 400 s, straggler every other one
        now = float(i)
        state, action, _ = decide_exclusion(state, i % 2 == 0, 3, 2, now, ON)
        if action is Action.EXCLUDED:
            exclusions += 1
            out_at = now
        if action is Action.READMITTED:
            assert out_at is not None and now - out_at >= ON.min_excluded_s
    assert exclusions <= ON.max_exclusions * (400 / ON.window_s + 1)


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"policy": "exclude"}, "'exclude'"),
        ({"min_excluded_s": -1.0}, "-1.0"),
        ({"max_exclusions": 0}, "0"),
        ({"window_s": 0.0}, "0.0"),
    ],
)
def test_bad_options_are_named(kwargs: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        ExclusionOptions(**kwargs)
