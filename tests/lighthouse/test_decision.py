"""Table tests of the pure quorum decision: states built by hand, decisions and reasons checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from torchtitan_ft.lighthouse.decision import (
    HOLDER_WAIT_HEARTBEATS,
    DecisionOptions,
    Pending,
    decide,
    gone_members,
    group_last_seen,
    newcomer_ahead,
    next_gone_check,
    next_quorum_id,
    state_guard,
)
from torchtitan_ft.lighthouse.types import QuorumMember, StateLoss

OPTS = DecisionOptions(min_replicas=2, join_timeout=10.0, heartbeat_timeout=5.0)
NOW = 100.0


def member(rid: str, shrink_only: bool = False, commit_failures: int = 0) -> QuorumMember:
    return QuorumMember(replica_id=rid, shrink_only=shrink_only, commit_failures=commit_failures)


@dataclass
class Case:
    name: str
    pending: dict[str, float]  # replica -> joined time
    heartbeats: dict[str, float]  # replica -> last seen
    previous: list[str] | None
    expected: list[str] | None
    reason: str  # a substring of the reason
    shrink_only: set[str] = field(default_factory=set)
    opts: DecisionOptions = OPTS


CASES = [
    Case(
        "first quorum once every healthy replica asked",
        pending={"b": 99.0, "a": 99.5},
        heartbeats={"a": 99.5, "b": 99.0},
        previous=None,
        expected=["a", "b"],
        reason="all 2 eligible healthy replicas asked",
    ),
    Case(
        "below min_replicas",
        pending={"a": 99.0},
        heartbeats={"a": 99.0},
        previous=None,
        expected=None,
        reason="min_replicas=2",
    ),
    Case(
        "join timeout not passed: waits for a healthy straggler",
        pending={"a": 95.0, "b": 96.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=None,
        expected=None,
        reason="1 healthy replica(s) have not asked; issuing without them in 5.0s",
    ),
    Case(
        "join timeout passed: issues without the straggler",
        pending={"a": 89.0, "b": 96.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=None,
        expected=["a", "b"],
        reason="join timeout passed, issuing without 1",
    ),
    Case(
        "expired heartbeat: the requester no longer counts",
        pending={"a": 99.0, "b": 90.0},
        heartbeats={"a": 99.0, "b": 94.0},
        previous=None,
        expected=None,
        reason="1 healthy replica(s) asked, min_replicas=2",
    ),
    Case(
        "expired heartbeat: a silent replica no longer blocks the round",
        pending={"a": 99.0, "b": 99.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 90.0},
        previous=["a", "b", "c"],
        expected=["a", "b"],
        reason="all 2 eligible healthy replicas asked",
    ),
    Case(
        "fast quorum: all previous members are back",
        pending={"a": 99.9, "b": 99.9},
        heartbeats={"a": 99.9, "b": 99.9, "c": 99.9},
        previous=["a", "b"],
        expected=["a", "b"],
        reason="fast quorum: all 2 previous members are back",
    ),
    Case(
        "fast quorum includes a newcomer already waiting",
        pending={"a": 99.9, "b": 99.9, "c": 99.0},
        heartbeats={"a": 99.9, "b": 99.9, "c": 99.0},
        previous=["a", "b"],
        expected=["a", "b", "c"],
        reason="plus 1 newcomer(s)",
    ),
    Case(
        "fast quorum comes before the min_replicas check, as in torchft",
        pending={"a": 99.9},
        heartbeats={"a": 99.9},
        previous=["a"],
        expected=["a"],
        reason="fast quorum",
        opts=DecisionOptions(min_replicas=2, join_timeout=10.0, heartbeat_timeout=5.0),
    ),
    Case(
        "split brain: two of four healthy is not a majority",
        pending={"a": 80.0, "b": 80.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0, "d": 99.0},
        previous=None,
        expected=None,
        reason="need a strict majority (split-brain guard)",
    ),
    Case(
        "majority of healthy issues after the join timeout",
        pending={"a": 80.0, "b": 80.0, "c": 80.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0, "d": 99.0},
        previous=None,
        expected=["a", "b", "c"],
        reason="join timeout passed",
    ),
    Case(
        "quorum changed: a member died, survivors go without waiting",
        pending={"a": 99.0, "c": 99.0},
        heartbeats={"a": 99.0, "c": 99.0},
        previous=["a", "b", "c"],
        expected=["a", "c"],
        reason="all 2 eligible healthy replicas asked",
    ),
    Case(
        "shrink only drops a newcomer and issues at once",
        pending={"a": 99.0, "b": 99.0, "z": 99.0},
        heartbeats={"a": 99.0, "b": 99.0, "z": 99.0},
        previous=["a", "b", "c"],
        expected=["a", "b"],
        reason="all 2 eligible healthy replicas asked",
        shrink_only={"a"},
    ),
    Case(
        "join during shrink: newcomer alone is not a quorum",
        pending={"z": 99.0, "a": 99.0},
        heartbeats={"a": 99.0, "b": 99.0, "z": 99.0},
        previous=["a", "b"],
        expected=None,
        reason="1 healthy replica(s) asked, min_replicas=2",
        shrink_only={"a"},
    ),
    Case(
        "shrink only waits for a previous member that has not asked",
        pending={"a": 99.0, "b": 99.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=["a", "b", "c"],
        expected=None,
        reason="1 healthy replica(s) have not asked",
        shrink_only={"b"},
    ),
    # The semi-sync deadline (an outer sync of LocalSGD/DiLoCo is a quorum; the join timeout
    # is its deadline): c, a member of the last sync, is late for this one.
    Case(
        "outer sync: a late group of the last sync is waited for until the deadline",
        pending={"a": 95.0, "b": 99.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=["a", "b", "c"],
        expected=None,
        reason="issuing without them in 5.0s",
    ),
    Case(
        "outer sync: at the deadline it goes ahead with the groups that are ready",
        pending={"a": 89.0, "b": 99.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=["a", "b", "c"],
        expected=["a", "b"],
        reason="join timeout passed, issuing without 1",
    ),
    Case(
        "outer sync: the late group alone waits for the others' next sync",
        pending={"c": 80.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=["a", "b"],
        expected=None,
        reason="1 healthy replica(s) asked, min_replicas=2",
    ),
    Case(
        "outer sync: the late group joins the next sync at once (and heals there)",
        pending={"a": 99.0, "b": 99.5, "c": 80.0},
        heartbeats={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=["a", "b"],
        expected=["a", "b", "c"],
        reason="fast quorum: all 2 previous members are back plus 1 newcomer",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decide(case: Case) -> None:
    pending = {
        rid: Pending(member(rid, shrink_only=rid in case.shrink_only), joined)
        for rid, joined in case.pending.items()
    }
    previous = tuple(member(r) for r in case.previous) if case.previous is not None else None
    decision = decide(pending, case.heartbeats, previous, NOW, case.opts)
    got = [m.replica_id for m in decision.members] if decision.members is not None else None
    assert got == case.expected
    assert case.reason in decision.reason


STEPS = {"a": 0, "b": 0, "c": 40}


@pytest.mark.parametrize(
    ("steps", "heartbeats", "expected", "reason"),
    [
        # fresh replacements a, b (step 0); c, with the state (step 40), heartbeats but sits in
        # a collective timeout: wait for it past the join timeout
        (STEPS, {"a": 99.0, "b": 99.0, "c": 99.0}, None, "state guard"),
        # c's heartbeat lags (10 s, under 3 heartbeat timeouts of 5 s): still wait
        (STEPS, {"a": 99.0, "b": 99.0, "c": 90.0}, None, "state guard"),
        # c silent for 20 s, or its stream ended (gone): go on without it
        (STEPS, {"a": 99.0, "b": 99.0, "c": 80.0}, ["a", "b"], "eligible healthy replicas asked"),
        (STEPS, {"a": 99.0, "b": 99.0}, ["a", "b"], "eligible healthy replicas asked"),
        # an asker is at the previous quorum's step: it holds the state, no need to wait
        ({"a": 40, "b": 0, "c": 40}, {"a": 99.0, "b": 99.0, "c": 99.0}, ["a", "b"], "join"),
    ],
)
def test_state_guard_waits_for_the_member_with_the_latest_state(
    steps: dict, heartbeats: dict, expected: list | None, reason: str
) -> None:
    previous = tuple(QuorumMember(replica_id=r, step=40 if r == "c" else 38) for r in "abc")
    pending = {r: Pending(QuorumMember(replica_id=r, step=steps[r]), 80.0) for r in "ab"}
    decision = decide(pending, heartbeats, previous, NOW, OPTS)
    got = [m.replica_id for m in decision.members] if decision.members is not None else None
    assert got == expected
    assert reason in decision.reason


def test_members_sorted_by_replica_id() -> None:
    pending = {rid: Pending(member(rid), 99.0) for rid in ["c", "a", "b"]}
    decision = decide(pending, dict.fromkeys("abc", 99.0), None, NOW, OPTS)
    assert [m.replica_id for m in decision.members] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("previous", "members", "expected"),
    [
        (None, ["a", "b"], 5_000),  # first quorum: the floor
        (["a", "b"], ["a", "b"], 41),  # same members: id kept
        (["a", "b"], ["a", "c"], 5_000),  # changed: bumped to the floor
        (["a", "b"], ["a"], 5_000),
        (["a", "b", "c"], ["a", "b"], 5_000),
    ],
)
def test_next_quorum_id_on_membership(previous, members, expected) -> None:
    prev = tuple(member(r) for r in previous) if previous is not None else None
    assert next_quorum_id(41, prev, tuple(member(r) for r in members), floor=5_000) == expected


def test_next_quorum_id_bumps_on_commit_failures() -> None:
    prev = (member("a"), member("b"))
    now = (member("a", commit_failures=1), member("b"))
    assert next_quorum_id(41, prev, now, floor=0) == 42


def test_next_quorum_id_never_goes_back_when_floor_is_behind() -> None:
    prev = (member("a"),)
    assert next_quorum_id(9_000, prev, (member("b"),), floor=5_000) == 9_001


def test_a_join_timeout_countdown_is_one_log_line_per_wait() -> None:
    """The reason shows the countdown (status page); what decides logging does not change with
    it, only with who is waited for."""
    pending = {rid: Pending(member(rid), 95.0) for rid in ["a", "b"]}
    beats = dict.fromkeys("abc", 99.0)
    first, later = (decide(pending, beats, None, now, OPTS) for now in (NOW, NOW + 0.1))
    assert first.reason != later.reason and "in 5.0s" in first.reason
    assert first.log_as == later.log_as
    more_stragglers = decide(pending, dict.fromkeys("abcd", 99.0), None, NOW, OPTS)
    assert more_stragglers.log_as != first.log_as
    issued = decide(pending, beats, None, NOW + 6, OPTS)
    assert issued.log_as == issued.reason


@pytest.mark.parametrize(
    ("rid", "step", "previous_max", "warns"),
    [
        ("stranger", 10**12, 100, True),  # newcomer far ahead
        ("stranger", 101, 100, True),
        ("stranger", 100, 100, False),  # a tie is plausible (and not caught: see the doc)
        ("new", 0, 100, False),  # an ordinary newcomer, behind: it heals
        ("a", 10**12, 100, False),  # a member of the previous quorum is not a newcomer
        ("stranger", 10**12, None, False),  # no previous quorum: nothing to compare with
    ],
)
def test_newcomer_ahead_of_the_previous_quorum_is_flagged(rid, step, previous_max, warns) -> None:
    joining = QuorumMember(replica_id=rid, address="http://evil:1", step=step)
    warning = newcomer_ahead(joining, frozenset({"a", "b"}), previous_max)
    assert (warning is not None) == warns
    if warns:
        assert f"joins at step {step}" in warning and "--auth_token" in warning
        assert "http://evil:1" in warning


def test_the_state_logs_a_wait_for_stragglers_once(caplog) -> None:
    """~600 lines per wait before: the countdown changed the reason at every tick."""
    import asyncio

    from torchtitan_ft.lighthouse.state import LighthouseState

    now = [0.0]
    state = LighthouseState(OPTS, clock=lambda: now[0])

    async def wait_with_a_straggler() -> None:
        state.heartbeat("c")  # healthy, never asks
        for rid in ("a", "b"):
            state.request(member(rid), member(rid).to_proto())
        for _ in range(50):  # 5 s of 100 ms ticks, inside the 10 s join timeout
            now[0] += 0.1
            state.heartbeat("c")
            state.tick()

    with caplog.at_level("INFO", logger="torchtitan_ft.lighthouse.state"):
        asyncio.run(wait_with_a_straggler())
    waits = [r for r in caplog.records if "have not asked" in r.getMessage()]
    assert len(waits) == 1, [r.getMessage() for r in waits]
    assert "issuing without them in" in state.reason  # the status page still counts down


@pytest.mark.parametrize(
    "watched, heartbeats, expected",
    [
        (["b", "c"], {"b": 99.0, "c": 99.9}, ()),  # both heard from within the timeout
        (["b", "c"], {"b": 95.0, "c": 99.9}, ("b",)),  # b silent exactly the timeout: gone
        (["c", "b"], {"b": 90.0, "c": 80.0}, ("b", "c")),  # sorted, whatever the order asked
        (["b"], {}, ()),  # no record (stream ended, or a restarted lighthouse): not reported
        (["b", "b"], {"b": 90.0}, ("b",)),  # asked twice, named once
        ([], {"b": 90.0}, ()),  # only the watched count
    ],
)
def test_gone_members(watched, heartbeats, expected) -> None:
    assert gone_members(watched, heartbeats, NOW, OPTS.heartbeat_timeout) == expected


@pytest.mark.parametrize(
    "watched, heartbeats, expected",
    [
        (["b", "c"], {"b": 99.0, "c": 99.5}, 4.0),  # b's timeout ends first, at 104
        (["b"], {"b": 94.0}, 0.0),  # gone already
        (["b", "c"], {"c": 97.5}, 2.5),  # b has no record: only c can be named
        (["b"], {}, None),  # nobody known: the caller polls
        ([], {"b": 99.0}, None),
    ],
)
def test_next_gone_check_is_the_first_watched_expiry(watched, heartbeats, expected) -> None:
    assert next_gone_check(watched, heartbeats, NOW, OPTS.heartbeat_timeout) == expected
    if expected is not None:  # exactly then, gone_members names it
        assert gone_members(watched, heartbeats, NOW + expected, OPTS.heartbeat_timeout)


@pytest.mark.parametrize(
    "heartbeats, rank_heartbeats, expected",
    [
        ({"a": 99.0}, {}, {"a": 99.0}),  # no rank streams: the groups' own heartbeats
        ({"a": 99.0}, {"a": {1: 98.0, 2: 99.5}}, {"a": 98.0}),  # its most silent rank
        ({"a": 97.0}, {"a": {1: 99.0}}, {"a": 97.0}),  # rank 0 older: rank 0
        ({"a": 99.0, "b": 99.0}, {"a": {1: 90.0}}, {"a": 90.0, "b": 99.0}),  # per group
        ({"a": 99.0}, {"x": {1: 90.0}}, {"a": 99.0}),  # a rank of an unknown group: ignored
        ({"a": 99.0}, {"a": {}}, {"a": 99.0}),  # every rank stream ended
    ],
)
def test_group_last_seen(heartbeats, rank_heartbeats, expected) -> None:
    assert dict(group_last_seen(heartbeats, rank_heartbeats)) == expected


def test_a_hung_rank_makes_its_group_gone_and_unhealthy() -> None:
    """Group "b"'s rank 0 heartbeats, its rank 1 went silent 6 s ago (over the 5 s timeout):
    its peers abort (gone), and the next round does not wait for it (not healthy)."""
    seen = group_last_seen({"a": 99.9, "b": 99.9}, {"b": {1: 94.0}})
    assert gone_members(["a", "b"], seen, NOW, OPTS.heartbeat_timeout) == ("b",)
    pending = {"a": Pending(member("a"), 99.0)}
    one = DecisionOptions(min_replicas=1, join_timeout=10.0, heartbeat_timeout=5.0)
    decision = decide(pending, seen, (member("a"), member("b")), NOW, one)
    assert decision.members == (member("a"),), decision.reason


WINDOW = HOLDER_WAIT_HEARTBEATS * OPTS.heartbeat_timeout
"""How long the state guard waits for a holder after it was last heard from (15 s)."""


@pytest.mark.parametrize(
    ("name", "previous", "askers", "heard", "waiting", "lost"),
    [
        # A fresh job: no previous quorum, nothing to guard.
        ("fresh job at step 0", None, {"a": 0, "b": 0}, {}, (), None),
        # The askers are at the job's highest step: nothing is lost.
        ("an asker holds the step", {"a": 40, "c": 40}, {"a": 40, "b": 0}, {}, (), None),
        # Behind, c (the holder) heartbeats but has not asked: wait for it.
        ("holder alive", {"a": 38, "c": 40}, {"a": 0, "b": 0}, {"c": NOW - 1}, ("c",), None),
        # Behind, c's stream ended 5 s ago (a stream a living process reconnects, or a
        # dead one): it may come back within the wait, so no second line starts meanwhile.
        (
            "holder's stream ended within the wait",
            {"c": 40},
            {"a": 0},
            {"c": NOW - 5},
            ("c",),
            None,
        ),
        # ... and after the wait the state is lost.
        ("holder gone past the wait", {"c": 40}, {"a": 0}, {"c": NOW - WINDOW}, (), (40, ("c",))),
        # A holder without any record (forgotten) is not waited for.
        ("holder forgotten", {"c": 40}, {"a": 0}, {}, (), (40, ("c",))),
        # Two groups died together, then the last holder: both gone, lost.
        (
            "every holder gone",
            {"b": 0, "c": 71},
            {"a": 0, "d": 0},
            {"b": NOW - 20, "c": NOW - 16},
            (),
            (71, ("b", "c")),
        ),
        # One of two holders comes back (heard 1 s ago): wait for it, not a loss.
        (
            "a holder returns within the wait",
            {"b": 71, "c": 71},
            {"a": 0},
            {"b": NOW - 30, "c": NOW - 1},
            ("c",),
            None,
        ),
        # The holder's process restarted with the same id and asks at step 0: its state is
        # gone, nothing to wait for.
        ("the holder restarted", {"c": 40}, {"a": 0, "c": 0}, {"c": NOW}, (), (40, ("c",))),
    ],
)
def test_state_guard(
    name: str,
    previous: dict[str, int] | None,
    askers: dict[str, int],
    heard: dict[str, float],
    waiting: tuple[str, ...],
    lost: tuple[int, tuple[str, ...]] | None,
) -> None:
    candidates = [Pending(QuorumMember(replica_id=r, step=s), NOW - 1) for r, s in askers.items()]
    prev = (
        tuple(QuorumMember(replica_id=r, step=s) for r, s in previous.items())
        if previous is not None
        else None
    )
    guard = state_guard(candidates, askers.keys(), heard, prev, NOW, OPTS)
    assert guard.waiting == waiting, name
    assert guard.lost == (StateLoss(*lost) if lost is not None else None), name


@pytest.mark.parametrize(
    ("name", "finished", "heard", "waiting", "lost"),
    [
        # c ended its stream itself (its run finished, or it stopped on an error it said):
        # not waited for, and nothing is lost though no holder is left.
        ("the holder finished", {"c"}, {"c": NOW - 1}, (), None),
        # b finished, c died a moment ago: c may come back with the state, so wait for it.
        ("one finished, one may return", {"b"}, {"b": NOW - 1, "c": NOW - 1}, ("c",), None),
        # b finished, c died past the wait: the state left with b's finished run, no loss.
        ("one finished, one gone", {"b"}, {"b": NOW - 1, "c": NOW - WINDOW}, (), None),
        # Neither finished (both SIGKILLed) and gone: lost.
        ("none finished, both gone", set(), {"b": NOW - WINDOW, "c": NOW - WINDOW}, (),
         (71, ("b", "c"))),
    ],
)  # fmt: skip
def test_state_guard_holders_that_finished(
    name: str,
    finished: set[str],
    heard: dict[str, float],
    waiting: tuple[str, ...],
    lost: tuple[int, tuple[str, ...]] | None,
) -> None:
    candidates = [Pending(QuorumMember(replica_id="a", step=0), NOW - 1)]
    prev = (QuorumMember(replica_id="b", step=71), QuorumMember(replica_id="c", step=71))
    guard = state_guard(candidates, ["a"], heard, prev, NOW, OPTS, frozenset(finished))
    assert guard.waiting == waiting, name
    assert guard.lost == (StateLoss(*lost) if lost is not None else None), name


def test_a_quorum_issued_with_the_state_lost_says_so() -> None:
    """``decide`` issues the quorum behind the lost step, its ``state_loss`` set; waiting for
    a holder, it issues nothing and names it."""
    previous = (QuorumMember(replica_id="c", step=40),)
    pending = {r: Pending(QuorumMember(replica_id=r, step=0), 80.0) for r in "ab"}
    beats = {"a": 99.0, "b": 99.0}
    lost = decide(pending, beats, previous, NOW, OPTS, heard={**beats, "c": NOW - WINDOW})
    assert [m.replica_id for m in lost.members or ()] == ["a", "b"]
    assert lost.state_loss == StateLoss(40, ("c",))
    assert "step 40 is LOST" in lost.reason
    waiting = decide(pending, beats, previous, NOW, OPTS, heard={**beats, "c": NOW - 2})
    assert waiting.members is None and waiting.state_loss is None
    assert "state guard" in waiting.reason and "(c)" in waiting.reason
