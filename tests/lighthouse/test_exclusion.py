"""The straggler policy: table tests of the pure exclusion decision."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from torchtitan_ft.lighthouse.decision import DecisionOptions
from torchtitan_ft.lighthouse.exclusion import (
    Action,
    Exclusion,
    ExclusionOptions,
    StragglerPolicy,
    decide_exclusion,
    group_of,
)
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb

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


def _member(rid: str, step: int) -> QuorumMember:
    return QuorumMember(replica_id=rid, step=step)


def _progress(step: int, compute: float) -> pb.GroupProgress:
    timing = pb.StepTiming(step=step, step_seconds=compute + 0.01, compute_seconds=compute)
    return pb.GroupProgress(steps=[timing])


def test_lighthouse_leaves_a_straggler_out_and_takes_it_back() -> None:
    """On the lighthouse's state (fake clock): a group 4x slower is answered at once with a
    quorum of itself marked excluded, the others form quorums without waiting for it; it is
    taken back once fast for min_excluded_s, and at once when the others fall below
    min_replicas."""
    now = [0.0]
    state = LighthouseState(
        DecisionOptions(min_replicas=2, join_timeout=10.0, heartbeat_timeout=5.0),
        clock=lambda: now[0],
        stragglers=StragglerOptions(factor=1.5, steps=1, window=1),
        exclusion=ExclusionOptions(StragglerPolicy.EXCLUDE, min_excluded_s=5.0),
    )

    def response(fut) -> tuple[list[str], dict[str, pb.GroupSpeed]]:
        msg = pb.LighthouseQuorumResponse.FromString(fut.result())
        return [p.replica_id for p in msg.quorum.participants], {
            s.replica_id: s for s in msg.speeds
        }

    def round(step: int, slow_compute: float, ids: str = "sab") -> dict[str, object]:
        futs = {}
        for rid in ids:
            m = _member(rid, step)
            compute = slow_compute if rid == "s" else 0.01
            futs[rid] = state.request(m, m.to_proto(), _progress(step - 1, compute))
        return futs

    async def run() -> None:
        for rid in ("a", "b", "s"):
            state.stream_opened(rid)
        futs = round(1, 0.04, ids="abs")  # s's first sample: 4x slower
        assert all(f.done() for f in futs.values())
        ids, speeds = response(futs["s"])
        assert ids == ["s"] and speeds["s"].excluded and speeds["s"].straggler
        ids, speeds = response(futs["a"])
        assert ids == ["a", "b"] and speeds["s"].excluded
        assert state.status()["speeds"][2]["excluded"] is True
        assert state.metrics.exclusions == 1

        now[0] = 2.0
        futs = round(2, 0.01)  # fast again, but out for 2 s < min_excluded_s
        assert response(futs["s"])[0] == ["s"] and response(futs["a"])[0] == ["a", "b"]

        now[0] = 6.0
        futs = round(3, 0.01)  # out for 6 s and fast: taken back, in the others' quorum
        assert response(futs["s"])[0] == ["a", "b", "s"]
        assert not response(futs["s"])[1]["s"].excluded
        assert state.metrics.readmissions == 1

        now[0] = 7.0
        futs = round(4, 0.04)  # slow again: left out a second time
        assert response(futs["s"])[0] == ["s"]
        state.stream_closed("b")  # b dies: a alone is below min_replicas
        now[0] = 8.0
        futs = round(5, 0.04, ids="sa")  # still slow, but the quorum needs it back
        assert response(futs["a"])[0] == ["a", "s"]
        assert state.metrics.exclusions == 2 and state.metrics.readmissions == 2

    asyncio.run(run())


@pytest.mark.parametrize(
    "replica_id, group",
    [("replica_3:0f51916d", "replica_3"), ("replica_3", "replica_3"), ("a:b:c", "a:b"), ("", "")],
)
def test_group_of(replica_id: str, group: str) -> None:
    assert group_of(replica_id) == group


def test_a_restarted_group_goes_on_with_its_exclusion_count() -> None:
    """A group left out its ``max_exclusions`` times, whose process is then restarted (a new
    per-process replica id), is kept in when slow again: no fresh count. Another group is
    not affected, and the count ends with the window."""
    now = [0.0]
    state = LighthouseState(
        DecisionOptions(min_replicas=2, join_timeout=10.0, heartbeat_timeout=5.0),
        clock=lambda: now[0],
        stragglers=StragglerOptions(factor=1.5, steps=1, window=1),
        exclusion=ExclusionOptions(
            StragglerPolicy.EXCLUDE, min_excluded_s=0.0, max_exclusions=1, window_s=100.0
        ),
    )

    def ask(rids: list[str], slow: str, step: int) -> dict[str, list[str]]:
        for rid in rids:
            state.heartbeat(rid)
        futs = {}
        for rid in rids:  # in this order
            m = _member(rid, step)
            compute = 0.04 if rid == slow else 0.01
            futs[rid] = state.request(m, m.to_proto(), _progress(step - 1, compute))
        return {
            rid: [
                p.replica_id
                for p in pb.LighthouseQuorumResponse.FromString(f.result()).quorum.participants
            ]
            for rid, f in futs.items()
        }

    async def run() -> None:
        for rid in ("a:1", "b:1", "c:1", "s:1"):
            state.stream_opened(rid)
        assert ask(["a:1", "b:1", "c:1", "s:1"], "s:1", 1)["s:1"] == ["s:1"]  # left out
        assert state.metrics.exclusions == 1
        state.stream_closed("s:1")  # its process dies; the group restarts
        state.stream_opened("s:2")
        now[0] = 1.0
        # s:2 first: a fast quorum of the others would not wait for a newcomer.
        got = ask(["s:2", "a:1", "b:1", "c:1"], "s:2", 2)
        assert got["s:2"] == ["a:1", "b:1", "c:1", "s:2"]  # slow, but kept in
        assert state.metrics.exclusions == 1
        now[0] = 2.0
        assert ask(["a:1", "b:1", "c:1", "s:2"], "c:1", 3)["c:1"] == ["c:1"]  # its own count
        now[0] = 101.0
        state.tick()
        assert ask(["s:2", "a:1", "b:1"], "s:2", 4)["s:2"] == ["s:2"]  # the window moved on

    asyncio.run(run())
