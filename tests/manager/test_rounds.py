"""Table tests of the ManagerServer's rounds: calls fed in by hand, decisions checked."""

from __future__ import annotations

import pytest

from torchtitan_ft.manager.rounds import (
    Ask,
    Ballot,
    Decided,
    Found,
    GroupRounds,
    Joined,
    Record,
    Refused,
    Unknown,
    Waiting,
)

A, B = "ipv4:10.0.0.1:4000", "ipv4:10.0.0.2:5000"


def joined(rank: int, peer: str = A, step: int = 0, metadata: str = "", **kw) -> Joined:
    return Joined(
        group_rank=rank,
        peer=peer,
        step=step,
        shrink_only=kw.get("shrink_only", False),
        commit_failures=kw.get("commit_failures", 0),
        checkpoint_metadata=metadata or f"ckpt-{rank}",
        init_sync=True,
    )


def ask(rounds: GroupRounds, *calls: Joined) -> Ask:
    decisions = [rounds.join(call) for call in calls]
    assert all(isinstance(d, Waiting) for d in decisions[:-1])
    assert isinstance(decisions[-1], Ask)
    return decisions[-1]


# ------------------------------------------------------------------------------ quorum round


def test_the_last_rank_to_join_asks_for_the_whole_group() -> None:
    rounds = GroupRounds("g", world_size=3)
    assert rounds.join(joined(0, step=4)) == Waiting(0, 1)
    assert rounds.join(joined(1, step=7, commit_failures=2)) == Waiting(0, 2)
    decision = rounds.join(joined(2, step=5, shrink_only=True))
    assert isinstance(decision, Ask)
    assert (decision.round, decision.step, decision.shrink_only) == (0, 7, True)
    assert (decision.commit_failures, sorted(decision.calls)) == (2, [0, 1, 2])
    assert rounds.joining() == []  # a new round forms
    assert rounds.join(joined(0)) == Waiting(1, 1)


@pytest.mark.parametrize(
    ("second_peer", "expected"),
    [
        (A, "replaces"),  # the rank's own client retrying
        (B, "refused"),  # another connection: an impostor
    ],
)
def test_a_second_call_for_a_waiting_rank(second_peer: str, expected: str) -> None:
    rounds = GroupRounds("g", world_size=2)
    first, second = joined(0, A, metadata="first"), joined(0, second_peer, metadata="second")
    rounds.join(first)
    decision = rounds.join(second)
    if expected == "refused":
        assert isinstance(decision, Refused)
        assert decision.bound_peer == A
        assert decision.reason.startswith("join the quorum as group rank 0 of replica 'g'")
        full = rounds.join(joined(1))
        assert isinstance(full, Ask) and full.calls[0] is first
    else:
        assert decision == Waiting(0, 1)
        full = rounds.join(joined(1))
        assert isinstance(full, Ask) and full.calls[0] is second


def test_a_call_that_gives_up_before_the_round_is_full_no_longer_counts() -> None:
    rounds = GroupRounds("g", world_size=2)
    call = joined(0)
    rounds.join(call)
    rounds.withdraw(0, call)
    assert rounds.joining() == []
    assert rounds.join(joined(1)) == Waiting(0, 1)


def test_withdrawing_a_replaced_call_or_from_a_full_round_changes_nothing() -> None:
    rounds = GroupRounds("g", world_size=2)
    first, retry = joined(0), joined(0)
    rounds.join(first)
    rounds.join(retry)
    rounds.withdraw(0, first)  # replaced: the retry still counts
    assert rounds.joining() == [0]
    full = ask(rounds, joined(1))
    rounds.withdraw(full.round, retry)  # the round is with the lighthouse: it keeps the rank
    rounds.finish_quorum(full.round, succeeded=[0, 1])
    assert rounds.records[0] == Record("ckpt-0", A)


# ------------------------------------------------------------------------ records, metadata


def test_records_come_from_the_ranks_that_succeeded_when_the_round_finishes() -> None:
    rounds = GroupRounds("g", world_size=2)
    full = ask(rounds, joined(0, A, metadata="m0"), joined(1, B, metadata="m1"))
    rounds.finish_quorum(full.round, succeeded=[1])
    assert rounds.records == {1: Record("m1", B)}
    assert rounds.checkpoint_metadata(1) == Found("m1")


def test_a_failed_round_leaves_the_previous_records() -> None:
    rounds = GroupRounds("g", world_size=1)
    rounds.finish_quorum(ask(rounds, joined(0, A, metadata="old")).round, succeeded=[0])
    rounds.finish_quorum(ask(rounds, joined(0, B, metadata="stray")).round, succeeded=[])
    assert rounds.records == {0: Record("old", A)}


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("never joined", Unknown),
        ("joining, round not full", Unknown),
        ("round with the lighthouse", Waiting),
        ("round failed", Unknown),
        ("round succeeded", Found),
        ("recorded, next round with the lighthouse", Found),  # the record, at once
    ],
)
def test_checkpoint_metadata(state: str, expected: type) -> None:
    rounds = GroupRounds("g", world_size=2)
    if state == "recorded, next round with the lighthouse":
        rounds.finish_quorum(ask(rounds, joined(0), joined(1)).round, succeeded=[0, 1])
    if state != "never joined":
        rounds.join(joined(0, metadata="m"))
    if state != "joining, round not full" and state != "never joined":
        full = rounds.join(joined(1))
        assert isinstance(full, Ask)
        if state == "round failed":
            rounds.finish_quorum(full.round, succeeded=[])
        if state == "round succeeded":
            rounds.finish_quorum(full.round, succeeded=[0, 1])
    answer = rounds.checkpoint_metadata(0)
    assert isinstance(answer, expected)
    if isinstance(answer, Unknown):
        assert answer.reason.startswith("no checkpoint metadata for group rank 0 of replica 'g'")
    if isinstance(answer, Waiting):
        assert answer.round == full.round


def test_metadata_waits_for_the_latest_round_the_rank_is_in() -> None:
    rounds = GroupRounds("g", world_size=1)
    first = ask(rounds, joined(0))
    second = ask(rounds, joined(0))  # a retry after the first call gave up
    assert rounds.checkpoint_metadata(0) == Waiting(second.round)
    rounds.finish_quorum(second.round, succeeded=[])
    assert rounds.checkpoint_metadata(0) == Waiting(first.round)
    rounds.finish_quorum(first.round, succeeded=[0])
    assert rounds.checkpoint_metadata(0) == Found("ckpt-0")


def test_a_rank_that_reconnected_is_bound_again_by_its_next_quorum() -> None:
    rounds = GroupRounds("g", world_size=1)
    rounds.finish_quorum(ask(rounds, joined(0, A)).round, succeeded=[0])
    assert isinstance(rounds.vote(Ballot(0, 1, True, B)), Refused)  # not before its quorum
    rounds.finish_quorum(ask(rounds, joined(0, B)).round, succeeded=[0])
    assert isinstance(rounds.vote(Ballot(0, 1, True, B)), Decided)
    assert isinstance(rounds.vote(Ballot(0, 2, True, A)), Refused)


# ------------------------------------------------------------------------------ commit round


def recorded(world_size: int, *peers: str) -> GroupRounds:
    rounds = GroupRounds("g", world_size)
    full = ask(rounds, *[joined(rank, peer) for rank, peer in enumerate(peers)])
    rounds.finish_quorum(full.round, succeeded=range(len(peers)))
    return rounds


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([(0, True), (1, True)], True),
        ([(0, True), (1, False)], False),
        ([(0, False), (0, True), (1, True)], False),  # a "no" sticks
        ([(0, True), (0, True), (1, True)], True),
    ],
)
def test_the_last_vote_decides_the_and_of_all(votes, expected: bool) -> None:
    rounds = recorded(2, A, B)
    peers = {0: A, 1: B}
    decisions = [rounds.vote(Ballot(r, 3, v, peers[r])) for r, v in votes]
    assert all(isinstance(d, Waiting) for d in decisions[:-1])
    last = decisions[-1]
    assert isinstance(last, Decided) and last.should_commit is expected
    assert list(last.votes) == [0, 1]


def test_a_vote_from_another_connection_than_the_ranks_quorum_is_refused() -> None:
    rounds = recorded(2, A, B)
    refused = rounds.vote(Ballot(0, 3, True, B))
    assert isinstance(refused, Refused)
    assert refused.reason.startswith("vote as group rank 0 of replica 'g' refused")
    assert refused.bound_peer == A


def test_a_rank_without_a_record_may_vote_from_anywhere() -> None:
    rounds = GroupRounds("g", world_size=1)
    assert isinstance(rounds.vote(Ballot(0, 3, True, B)), Decided)


def test_steps_have_their_own_rounds_and_a_withdrawn_vote_no_longer_counts() -> None:
    rounds = recorded(2, A, B)
    step3 = Ballot(0, 3, True, A)
    waiting = rounds.vote(step3)
    assert isinstance(waiting, Waiting)
    assert isinstance(rounds.vote(Ballot(1, 4, True, B)), Waiting)  # another step
    assert rounds.withdraw_vote(waiting.round, step3)  # the round is now empty: forgotten
    again = rounds.vote(Ballot(1, 3, False, B))
    assert isinstance(again, Waiting) and again.round != waiting.round
    decided = rounds.vote(Ballot(0, 4, True, A))
    assert isinstance(decided, Decided) and decided.should_commit


def test_withdrawing_a_replaced_vote_keeps_the_round() -> None:
    rounds = recorded(2, A, B)
    first, again = Ballot(0, 3, True, A), Ballot(0, 3, True, A)
    waiting = rounds.vote(first)
    rounds.vote(again)
    assert isinstance(waiting, Waiting)
    assert not rounds.withdraw_vote(waiting.round, first)
    decided = rounds.vote(Ballot(1, 3, True, B))
    assert isinstance(decided, Decided) and decided.round == waiting.round
