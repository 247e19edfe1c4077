"""Table tests of the ManagerServer's rounds: calls fed in by hand, decisions checked."""

from __future__ import annotations

import pytest

from torchtitan_ft.manager.rounds import (
    NEW_SESSION,
    Ask,
    Ballot,
    Decided,
    Found,
    GroupRounds,
    Held,
    Joined,
    Record,
    Refused,
    Unknown,
    Waiting,
)

A, B = "ipv4:10.0.0.1:4000", "ipv4:10.0.0.2:5000"
C, D = "ipv4:10.0.0.3:6000", "ipv4:10.0.0.2:5001"
"""C: a stranger's connection; D: rank 1's client after a reconnect."""
GRACE = 5.0


def joined(
    rank: int, peer: str = A, step: int = 0, metadata: str = "", session: str | None = None, **kw
) -> Joined:
    return Joined(
        group_rank=rank,
        peer=peer,
        session=session,
        step=step,
        shrink_only=kw.get("shrink_only", False),
        commit_failures=kw.get("commit_failures", 0),
        checkpoint_metadata=metadata or f"ckpt-{rank}",
        init_sync=True,
    )


def ask(rounds: GroupRounds, *calls: Joined) -> Ask:
    decisions = [rounds.join(call, now=0.0) for call in calls]
    assert all(isinstance(d, Waiting) for d in decisions[:-1])
    assert isinstance(decisions[-1], Ask)
    return decisions[-1]


# ------------------------------------------------------------------------------ quorum round


def test_the_last_rank_to_join_asks_for_the_whole_group() -> None:
    rounds = GroupRounds("g", world_size=3)
    assert rounds.join(joined(0, step=4), now=0.0) == Waiting(0, 1)
    assert rounds.join(joined(1, step=7, commit_failures=2), now=0.0) == Waiting(0, 2)
    decision = rounds.join(joined(2, step=5, shrink_only=True), now=0.0)
    assert isinstance(decision, Ask)
    assert (decision.round, decision.step, decision.shrink_only) == (0, 7, True)
    assert (decision.commit_failures, sorted(decision.calls)) == (2, [0, 1, 2])
    assert rounds.joining() == []  # a new round forms
    assert rounds.join(joined(0), now=0.0) == Waiting(1, 1)


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
    rounds.join(first, now=0.0)
    decision = rounds.join(second, now=0.0)
    if expected == "refused":
        assert isinstance(decision, Refused)
        assert decision.bound_peer == A
        assert decision.reason.startswith("join the quorum as group rank 0 of replica 'g'")
        full = rounds.join(joined(1), now=0.0)
        assert isinstance(full, Ask) and full.calls[0] is first
    else:
        assert decision == Waiting(0, 1)
        full = rounds.join(joined(1), now=0.0)
        assert isinstance(full, Ask) and full.calls[0] is second


def test_a_call_that_gives_up_before_the_round_is_full_no_longer_counts() -> None:
    rounds = GroupRounds("g", world_size=2)
    call = joined(0)
    rounds.join(call, now=0.0)
    rounds.withdraw(0, call)
    assert rounds.joining() == []
    assert rounds.join(joined(1), now=0.0) == Waiting(0, 1)


def test_withdrawing_a_replaced_call_or_from_a_full_round_changes_nothing() -> None:
    rounds = GroupRounds("g", world_size=2)
    first, retry = joined(0), joined(0)
    rounds.join(first, now=0.0)
    rounds.join(retry, now=0.0)
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
    rounds = GroupRounds("g", world_size=1, rebind_grace=0.0)  # B takes the rank over at once
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
        rounds.join(joined(0, metadata="m"), now=0.0)
    if state != "joining, round not full" and state != "never joined":
        full = rounds.join(joined(1), now=0.0)
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


def test_a_rank_taken_over_is_bound_to_its_new_connection() -> None:
    rounds = GroupRounds("g", world_size=1, rebind_grace=0.0)
    rounds.finish_quorum(ask(rounds, joined(0, A)).round, succeeded=[0])
    assert isinstance(rounds.vote(Ballot(0, 1, True, B)), Refused)  # not before its quorum
    rounds.finish_quorum(ask(rounds, joined(0, B)).round, succeeded=[0])
    assert isinstance(rounds.vote(Ballot(0, 1, True, B)), Decided)
    assert isinstance(rounds.vote(Ballot(0, 2, True, A)), Refused)


# ---------------------------------------------------------------- between rounds: held calls


def sessions() -> GroupRounds:
    """Ranks 0 (connection A) and 1 (connection B) that completed a round with clients that
    take sessions: their sessions are ``s0`` and ``s1``."""
    issued = iter(f"s{n}" for n in range(100))
    rounds = GroupRounds("g", world_size=2, rebind_grace=GRACE, new_session=lambda: next(issued))
    full = ask(rounds, joined(0, A, session=NEW_SESSION), joined(1, B, session=NEW_SESSION))
    assert rounds.finish_quorum(full.round, succeeded=[0, 1]) == {0: "s0", 1: "s1"}
    assert rounds.records[1] == Record("ckpt-1", B, "s1")
    return rounds


def test_a_stranger_between_rounds_is_held_until_the_holder_joins_then_refused() -> None:
    rounds = sessions()
    stranger = joined(1, C, metadata="evil", session=NEW_SESSION)
    held = rounds.join(stranger, now=0.0)
    assert held == Held(round=1, until=None, bound_peer=B)  # rank 0 has not called yet
    assert (rounds.joining(), rounds.holding()) == ([], [1])
    assert rounds.join(joined(0, A, session="s0"), now=1.0) == Waiting(1, 1)
    assert rounds.retry(stranger, held.round, now=2.0) == Held(1, 1.0 + GRACE, B)
    full = rounds.join(joined(1, B, metadata="real", session="s1"), now=3.0)
    assert isinstance(full, Ask) and full.calls[1].checkpoint_metadata == "real"
    refused = rounds.retry(stranger, held.round, now=3.0)
    assert isinstance(refused, Refused) and refused.bound_peer == B
    assert refused.reason.startswith("join the quorum as group rank 1 of replica 'g' refused")
    assert rounds.finish_quorum(full.round, succeeded=[0, 1]) == {0: "s0", 1: "s1"}  # kept
    assert rounds.checkpoint_metadata(1) == Found("real")


def test_the_holder_refuses_a_held_call_even_after_the_grace_until_it_is_taken_over() -> None:
    rounds = sessions()
    stranger = joined(1, C, session=NEW_SESSION)
    held = rounds.join(stranger, now=0.0)
    rounds.join(joined(0, A, session="s0"), now=0.0)
    assert isinstance(rounds.join(joined(1, B, session="s1"), now=GRACE + 1), Ask)
    assert isinstance(rounds.retry(stranger, held.round, now=GRACE + 1), Refused)


@pytest.mark.parametrize(
    ("session", "peer", "expected"),
    [
        ("s1", B, Ask),  # the holder
        ("s1", D, Ask),  # the holder after a reconnect: its session
        (NEW_SESSION, B, Ask),  # its connection (a client whose first answer was lost)
        (None, B, Ask),
        ("s0", D, Held),  # rank 0's session is not rank 1's
        ("wrong", D, Held),
        (NEW_SESSION, D, Held),  # a new client: a restarted process, or a stranger
        (None, D, Held),
    ],
)
def test_a_call_matches_a_record_by_connection_or_session(session, peer, expected) -> None:
    rounds = sessions()
    rounds.join(joined(0, A, session="s0"), now=0.0)
    assert isinstance(rounds.join(joined(1, peer, session=session), now=0.0), expected)
    vote = rounds.vote(Ballot(1, 1, True, peer, session))
    assert isinstance(vote, Refused if expected is Held else Waiting)


def test_after_the_grace_the_earliest_held_call_takes_the_rank_over() -> None:
    rounds = sessions()
    restarted, later = joined(1, C, metadata="new", session=NEW_SESSION), joined(1, D)
    held = rounds.join(restarted, now=0.0)
    assert rounds.join(later, now=0.5) == Held(1, None, B)
    assert rounds.join(joined(0, A, session="s0"), now=1.0) == Waiting(1, 1)
    assert rounds.retry(later, held.round, now=1.0 + GRACE) == Held(1, None, B)  # not first
    assert rounds.retry(restarted, held.round, now=1.0 + GRACE - 0.01) == Held(1, 1.0 + GRACE, B)
    full = rounds.retry(restarted, held.round, now=1.0 + GRACE)
    assert isinstance(full, Ask) and full.calls[1] is restarted
    assert isinstance(rounds.retry(later, held.round, now=1.0 + GRACE), Refused)
    assert rounds.finish_quorum(full.round, succeeded=[0, 1]) == {0: "s0", 1: "s2"}
    assert rounds.records[1] == Record("new", C, "s2")
    # The old client's session is dead: it is held, and refused from voting.
    assert isinstance(rounds.vote(Ballot(1, 1, True, B, "s1")), Refused)
    assert isinstance(rounds.vote(Ballot(1, 1, True, C, "s2")), Waiting)
    assert isinstance(rounds.join(joined(1, B, session="s1"), now=10.0), Held)


def test_the_grace_starts_when_every_rank_has_called_and_stops_when_one_gives_up() -> None:
    rounds = GroupRounds("g", world_size=3, rebind_grace=GRACE)
    rounds.finish_quorum(ask(rounds, joined(0), joined(1, B), joined(2, B)).round, [0, 1, 2])
    one, two = joined(1, C), joined(2, C)  # two restarted ranks: each counts the other
    assert rounds.join(one, now=0.0) == Held(1, None, B)
    rank0 = joined(0)
    assert rounds.join(rank0, now=1.0) == Waiting(1, 1)
    assert rounds.join(two, now=2.0) == Held(1, 2.0 + GRACE, B)
    rounds.withdraw(1, rank0)
    assert rounds.retry(one, 1, now=3.0) == Held(1, None, B)
    rounds.join(joined(0), now=4.0)
    assert rounds.retry(one, 1, now=4.0 + GRACE) == Waiting(1, 2)
    full = rounds.retry(two, 1, now=4.0 + GRACE)
    assert isinstance(full, Ask) and (full.calls[1], full.calls[2]) == (one, two)


def test_a_held_call_that_gives_up_or_is_retried_is_no_longer_held() -> None:
    rounds = sessions()
    first, retry = joined(1, C), joined(1, C)
    held = rounds.join(first, now=0.0)
    assert rounds.join(retry, now=0.0) == held  # the same client: it replaces the first
    assert isinstance(rounds.retry(first, held.round, now=0.0), Refused)
    rounds.withdraw(held.round, retry)
    assert rounds.holding() == []


def test_a_client_that_takes_no_session_is_bound_to_its_connection() -> None:
    """torchft's client: no session in, none out; a restart takes the rank over the same way."""
    rounds = GroupRounds("g", world_size=1, rebind_grace=GRACE)
    full = ask(rounds, joined(0, A))
    assert rounds.finish_quorum(full.round, succeeded=[0]) == {}
    assert rounds.records[0] == Record("ckpt-0", A, None)
    assert isinstance(rounds.join(joined(0, A), now=0.0), Ask)
    restarted = joined(0, B)
    assert rounds.join(restarted, now=1.0) == Held(2, 1.0 + GRACE, A)
    assert isinstance(rounds.retry(restarted, 2, now=1.0 + GRACE), Ask)


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="rebind_grace must be >= 0 seconds, got -1"):
        GroupRounds("g", world_size=1, rebind_grace=-1)


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
