"""Going on without the lighthouse (``manager.outage``): which rounds may use the previous
quorum, what that quorum looks like to the ranks, and when a waiting round stops waiting."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.manager.decisions import compute_quorum_results
from torchtitan_ft.manager.outage import (
    OUTAGE_GRACE_S,
    LighthouseOutage,
    OutageState,
    go_on_without_lighthouse,
    previous_quorum_round,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NOW = datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
ON = LighthouseOutage.PREVIOUS_QUORUM


def quorum(**steps: int) -> Quorum:
    members = tuple(
        QuorumMember(replica_id=r, address=f"http://{r}:1", store_address=f"{r}:2", step=s)
        for r, s in sorted(steps.items())
    )
    return Quorum(7, members, T0)


@pytest.mark.parametrize(
    ("mode", "previous", "excluded", "steps", "failures", "why"),
    [
        (LighthouseOutage.WAIT, quorum(a=4, b=4), False, [5], 0, "is 'wait'"),
        (ON, None, False, [5], 0, "no quorum yet"),
        (ON, quorum(b=4, c=4), False, [5], 0, "not a member"),  # left out of it
        (ON, quorum(a=4, b=4), True, [5], 0, "straggler policy"),
        (ON, quorum(a=4, b=4), False, [5], 2, "failed its last 2 commit(s)"),
        (ON, quorum(a=4, b=4), False, [4], 0, "not all at 5"),  # discarded step 4
        (ON, quorum(a=4, b=4), False, [5, 4], 0, "steps [4, 5]"),  # ranks disagree
        (ON, quorum(a=2, b=4), False, [3], 0, "not all at 5"),  # a behind: its heal failed
    ],
)
def test_a_round_waits_for_the_lighthouse_unless_the_group_committed_the_previous_quorum(
    mode, previous, excluded, steps, failures, why
) -> None:
    round_ = previous_quorum_round(mode, previous, excluded, "a", steps, failures, NOW)
    assert round_.quorum is None
    assert why in round_.reason


@pytest.mark.parametrize(
    ("previous", "steps"),
    [
        (quorum(a=4, b=4), [5]),  # steady state
        (quorum(a=4, b=4, c=4), [5, 5]),  # a group of two ranks
        (quorum(a=2, b=4), [5]),  # a healed from b at step 4 and committed it
        (quorum(a=4, b=1), [5]),  # b healed; a committed (b's own commit is b's to check)
    ],
)
def test_the_previous_quorum_goes_on_one_step_later_under_its_id(previous, steps) -> None:
    round_ = previous_quorum_round(ON, previous, False, "a", steps, 0, NOW)
    assert round_.quorum is not None
    assert round_.quorum.quorum_id == previous.quorum_id  # no rank reconfigures
    assert round_.quorum.created == NOW
    assert [m.replica_id for m in round_.quorum.participants] == [
        m.replica_id for m in previous.participants
    ]
    assert {m.step for m in round_.quorum.participants} == {5}
    assert f"quorum {previous.quorum_id}" in round_.reason
    result = compute_quorum_results("a", 0, round_.quorum, init_sync=True)
    assert not result.heal and result.max_step == 5 and result.commit_failures == 0
    assert result.replica_world_size == len(previous.participants)


def test_an_outage_round_chains_into_the_next() -> None:
    first = previous_quorum_round(ON, quorum(a=4, b=4), False, "a", [5], 0, NOW).quorum
    second = previous_quorum_round(ON, first, False, "a", [6], 0, NOW).quorum
    assert second is not None and {m.step for m in second.participants} == {6}


def test_a_member_reporting_failures_or_shrink_in_the_previous_quorum_is_not_carried_over() -> None:
    prev = quorum(a=4, b=4)
    prev = Quorum(
        prev.quorum_id,
        (prev.participants[0], QuorumMember("b", step=4, commit_failures=3, shrink_only=True)),
        T0,
    )
    reused = previous_quorum_round(ON, prev, False, "a", [5], 0, NOW).quorum
    assert reused is not None
    assert all(m.commit_failures == 0 and not m.shrink_only for m in reused.participants)


def test_no_steps_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        previous_quorum_round(ON, quorum(a=4), False, "a", [], 0, NOW)


@pytest.mark.parametrize(
    ("unreachable", "known", "waited", "go_on"),
    [
        (True, False, 0.0, True),  # a connection attempt failed: at once
        (False, False, 30.0, False),  # reachable, no outage seen: wait as long as it takes
        (False, True, OUTAGE_GRACE_S / 2, False),  # outage seen: a short grace
        (False, True, OUTAGE_GRACE_S, True),
    ],
)
def test_when_a_round_stops_waiting_for_the_lighthouse(unreachable, known, waited, go_on) -> None:
    assert go_on_without_lighthouse(unreachable, known, waited) is go_on


def test_outage_state_counts_the_rounds_of_an_outage() -> None:
    """The server's outage state: the previous quorum it answered with, whether an outage is
    known (a round went on without the lighthouse, or the heartbeat stream broke since it last
    answered), and how many rounds the outage lasted when the lighthouse answers again."""
    state = OutageState(ON)
    assert state.round("a", [5], 0, NOW).quorum is None  # no quorum yet
    state.answered_with(quorum(a=4, b=4), excluded=False)
    assert state.round("a", [5], 0, NOW).quorum is not None
    assert not state.known(breaks=0)
    assert state.known(breaks=1)  # the heartbeat stream broke since
    assert state.lighthouse_answered(breaks=1) is None  # no outage to end
    assert not state.known(breaks=1)
    assert state.went_on() is True  # the first round without the lighthouse starts one
    assert state.went_on() is False
    assert state.known(breaks=1)
    assert state.lighthouse_answered(breaks=1) == 2
    assert state.steps is None and not state.known(breaks=1)
    state.answered_with(quorum(a=4, b=4), excluded=True)
    assert "straggler policy" in state.round("a", [5], 0, NOW).reason
