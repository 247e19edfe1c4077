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
    rounds.finish_quorum(full.round, succeeded=[0, 1], now=0.0)
    assert rounds.records[0] == Record("ckpt-0", A)


# ------------------------------------------------------------------------ records, metadata


def test_records_come_from_the_ranks_that_succeeded_when_the_round_finishes() -> None:
    rounds = GroupRounds("g", world_size=2)
    full = ask(rounds, joined(0, A, metadata="m0"), joined(1, B, metadata="m1"))
    rounds.finish_quorum(full.round, succeeded=[1], now=0.0)
    assert rounds.records == {1: Record("m1", B)}
    assert rounds.checkpoint_metadata(1) == Found("m1")


def test_a_failed_round_leaves_the_previous_records() -> None:
    rounds = GroupRounds("g", world_size=1)
    rounds.finish_quorum(ask(rounds, joined(0, A, metadata="old")).round, succeeded=[0], now=0.0)
    rounds.connections_listed([], listed_at=1.0)  # A closed: B takes the rank over at once
    rounds.finish_quorum(ask(rounds, joined(0, B, metadata="stray")).round, succeeded=[], now=1.0)
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
        rounds.finish_quorum(ask(rounds, joined(0), joined(1)).round, succeeded=[0, 1], now=0.0)
    if state != "never joined":
        rounds.join(joined(0, metadata="m"))
    if state != "joining, round not full" and state != "never joined":
        full = rounds.join(joined(1))
        assert isinstance(full, Ask)
        if state == "round failed":
            rounds.finish_quorum(full.round, succeeded=[], now=0.0)
        if state == "round succeeded":
            rounds.finish_quorum(full.round, succeeded=[0, 1], now=0.0)
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
    rounds.finish_quorum(second.round, succeeded=[], now=0.0)
    assert rounds.checkpoint_metadata(0) == Waiting(first.round)
    rounds.finish_quorum(first.round, succeeded=[0], now=0.0)
    assert rounds.checkpoint_metadata(0) == Found("ckpt-0")


def test_a_rank_taken_over_is_bound_to_its_new_connection() -> None:
    rounds = GroupRounds("g", world_size=1)
    rounds.finish_quorum(ask(rounds, joined(0, A)).round, succeeded=[0], now=0.0)
    rounds.connections_listed([], listed_at=1.0)
    assert isinstance(rounds.vote(Ballot(0, 1, True, B)), Refused)  # not before its quorum
    rounds.finish_quorum(ask(rounds, joined(0, B)).round, succeeded=[0], now=1.0)
    assert rounds.gone == set()  # B is the holder now
    assert isinstance(rounds.vote(Ballot(0, 1, True, B)), Decided)
    assert isinstance(rounds.vote(Ballot(0, 2, True, A)), Refused)


# ---------------------------------------------------------------- between rounds: held calls


def sessions() -> GroupRounds:
    """Ranks 0 (connection A) and 1 (connection B) that completed a round with clients that
    take sessions: their sessions are ``s0`` and ``s1``."""
    issued = iter(f"s{n}" for n in range(100))
    rounds = GroupRounds("g", world_size=2, new_session=lambda: next(issued))
    full = ask(rounds, joined(0, A, session=NEW_SESSION), joined(1, B, session=NEW_SESSION))
    assert rounds.finish_quorum(full.round, succeeded=[0, 1], now=0.0) == {0: "s0", 1: "s1"}
    assert rounds.records[1] == Record("ckpt-1", B, "s1")
    return rounds


def test_a_stranger_between_rounds_is_held_until_the_holder_joins_then_refused() -> None:
    rounds = sessions()
    stranger = joined(1, C, metadata="evil", session=NEW_SESSION)
    held = rounds.join(stranger)
    assert held == Held(round=1, bound_peer=B)
    assert (rounds.joining(), rounds.holding()) == ([], [1])
    assert rounds.join(joined(0, A, session="s0")) == Waiting(1, 1)
    assert rounds.connections_listed([A, B, C], listed_at=10.0) is False  # B still open
    assert rounds.retry(stranger, held.round) == Held(1, B)
    full = rounds.join(joined(1, B, metadata="real", session="s1"))
    assert isinstance(full, Ask) and full.calls[1].checkpoint_metadata == "real"
    refused = rounds.retry(stranger, held.round)
    assert isinstance(refused, Refused) and refused.bound_peer == B
    assert refused.reason.startswith("join the quorum as group rank 1 of replica 'g' refused")
    assert rounds.finish_quorum(full.round, succeeded=[0, 1], now=0.0) == {0: "s0", 1: "s1"}  # kept
    assert rounds.checkpoint_metadata(1) == Found("real")


def test_the_holder_back_with_its_session_refuses_a_held_call_after_its_connection_closed():
    """A live rank whose channel reconnected comes back with its session before the held call
    retried: the held call is refused."""
    rounds = sessions()
    stranger = joined(1, C, session=NEW_SESSION)
    held = rounds.join(stranger)
    rounds.join(joined(0, A, session="s0"))
    assert isinstance(rounds.join(joined(1, D, session="s1")), Ask)
    assert rounds.connections_listed([A, C, D], listed_at=1.0) is False  # holds nothing now
    assert isinstance(rounds.retry(stranger, held.round), Refused)


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
    rounds.join(joined(0, A, session="s0"))
    assert isinstance(rounds.join(joined(1, peer, session=session)), expected)
    vote = rounds.vote(Ballot(1, 1, True, peer, session))
    assert isinstance(vote, Refused if expected is Held else Waiting)


def test_once_the_holders_connection_closed_the_earliest_held_call_takes_the_rank_over():
    rounds = sessions()
    restarted, later = joined(1, C, metadata="new", session=NEW_SESSION), joined(1, D)
    held = rounds.join(restarted)
    assert rounds.join(later) == Held(1, B)
    assert rounds.join(joined(0, A, session="s0")) == Waiting(1, 1)
    assert rounds.retry(restarted, held.round) == Held(1, B)  # B is still open
    assert rounds.connections_listed([A, C, D], listed_at=3.0) is True  # B closed
    assert rounds.retry(later, held.round) == Held(1, B)  # not the first
    full = rounds.retry(restarted, held.round)
    assert isinstance(full, Ask) and full.calls[1] is restarted
    assert isinstance(rounds.retry(later, held.round), Refused)
    assert rounds.finish_quorum(full.round, succeeded=[0, 1], now=4.0) == {0: "s0", 1: "s2"}
    assert rounds.records[1] == Record("new", C, "s2", 4.0)
    # The old client's session is dead: it is held, and refused from voting.
    assert isinstance(rounds.vote(Ballot(1, 1, True, B, "s1")), Refused)
    assert isinstance(rounds.vote(Ballot(1, 1, True, C, "s2")), Waiting)
    assert isinstance(rounds.join(joined(1, B, session="s1")), Held)


@pytest.mark.parametrize("quiet_s", [1.0, 10.0])
@pytest.mark.parametrize("real_session", [True, False], ids=["our-client", "torchft-client"])
@pytest.mark.parametrize("caller_session", [NEW_SESSION, None, "guessed"])
def test_a_caller_who_claims_every_rank_at_once_takes_none_over(
    quiet_s, real_session, caller_session
) -> None:
    """Issue 40: after the real ranks (connections A and B, still open) voted, a caller on two
    new connections asks for the quorum as rank 0 and as rank 1, and the real ranks are quiet
    for ``quiet_s``. The job token is checked before a call reaches the rounds, so a token
    holder's calls are these same calls. Nothing is taken over: the held calls are refused
    when the real ranks join, whose records stay."""
    issued = iter(f"s{n}" for n in range(100))
    rounds = GroupRounds("g", world_size=2, new_session=lambda: next(issued))
    session = NEW_SESSION if real_session else None
    full = ask(rounds, joined(0, A, session=session), joined(1, B, session=session))
    rounds.finish_quorum(full.round, succeeded=[0, 1], now=0.0)
    assert isinstance(rounds.vote(Ballot(0, 0, True, A, "s0" if real_session else None)), Waiting)
    assert isinstance(rounds.vote(Ballot(1, 0, True, B, "s1" if real_session else None)), Decided)
    forged = [
        joined(r, peer, metadata="evil", session=caller_session) for r, peer in ((0, C), (1, D))
    ]
    assert [rounds.join(call) for call in forged] == [Held(1, A), Held(1, B)]
    for t in range(1, int(quiet_s) + 1):  # the guard lists the connections every so often
        assert rounds.connections_listed([A, B, C, D], listed_at=float(t)) is False
        assert [rounds.retry(call, 1) for call in forged] == [Held(1, A), Held(1, B)]
    sessions_back = ("s0", "s1") if real_session else (None, None)
    rounds.join(joined(0, A, step=1, metadata="real-0", session=sessions_back[0]))
    full = rounds.join(joined(1, B, step=1, metadata="real-1", session=sessions_back[1]))
    assert isinstance(full, Ask) and [c.peer for c in full.calls.values()] == [A, B]
    assert all(isinstance(rounds.retry(call, 1), Refused) for call in forged)
    rounds.finish_quorum(full.round, succeeded=[0, 1], now=quiet_s)
    assert [rounds.checkpoint_metadata(r) for r in (0, 1)] == [Found("real-0"), Found("real-1")]
    assert isinstance(rounds.vote(Ballot(0, 1, True, A, sessions_back[0])), Waiting)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_whole_group_restarting_at_once_takes_its_ranks_back_when_the_old_ones_close(
    world_size,
) -> None:
    """Every rank's process restarted (new connections, no sessions): each new call is held
    until a listing shows the old connections closed, then counted; the round completes
    with the new calls and they get the records and new sessions."""
    issued = iter(f"s{n}" for n in range(100))
    rounds = GroupRounds("g", world_size=world_size, new_session=lambda: next(issued))
    old = [f"ipv4:10.0.1.{r}:100" for r in range(world_size)]
    new = [f"ipv4:10.0.1.{r}:200" for r in range(world_size)]
    full = ask(rounds, *[joined(r, old[r], session=NEW_SESSION) for r in range(world_size)])
    rounds.finish_quorum(full.round, succeeded=range(world_size), now=0.0)
    calls = [joined(r, new[r], metadata=f"new-{r}", session=NEW_SESSION) for r in range(world_size)]
    assert [rounds.join(call) for call in calls] == [Held(1, peer) for peer in old]
    assert rounds.connections_listed(old + new, listed_at=0.5) is False  # not closed yet
    assert rounds.connections_listed(new, listed_at=1.0) is True
    decisions = [rounds.retry(call, 1) for call in calls]
    assert decisions[:-1] == [Waiting(1, n) for n in range(1, world_size)]
    assert isinstance(decisions[-1], Ask) and list(decisions[-1].calls.values()) == calls
    issued_now = rounds.finish_quorum(decisions[-1].round, succeeded=range(world_size), now=1.5)
    assert sorted(issued_now.values()) == sorted(f"s{n}" for n in range(world_size, 2 * world_size))
    assert [rounds.records[r].peer for r in range(world_size)] == new
    assert rounds.gone == set()


def test_a_listing_made_before_a_record_is_no_evidence_and_a_closed_rank_is_taken_at_once() -> None:
    """A listing that began before the rank was recorded may miss its connection (opened
    since); a rank whose connection closed while nobody asked for it is taken over by the
    next call at once."""
    rounds = GroupRounds("g", world_size=1)
    rounds.finish_quorum(ask(rounds, joined(0, A)).round, succeeded=[0], now=2.0)
    assert rounds.connections_listed([], listed_at=2.0) is False
    assert rounds.gone == set()
    assert rounds.connections_listed([], listed_at=2.25) is False  # news, but nothing held
    assert rounds.gone == {0}
    assert isinstance(rounds.join(joined(0, B)), Ask)


def test_a_held_call_that_gives_up_or_is_retried_is_no_longer_held() -> None:
    rounds = sessions()
    first, retry = joined(1, C), joined(1, C)
    held = rounds.join(first)
    assert rounds.join(retry) == held  # the same client: it replaces the first
    assert isinstance(rounds.retry(first, held.round), Refused)
    rounds.withdraw(held.round, retry)
    assert rounds.holding() == []


def test_a_client_that_takes_no_session_is_bound_to_its_connection() -> None:
    """torchft's client: no session in, none out; a restart takes the rank over the same way."""
    rounds = GroupRounds("g", world_size=1)
    full = ask(rounds, joined(0, A))
    assert rounds.finish_quorum(full.round, succeeded=[0], now=0.0) == {}
    assert rounds.records[0] == Record("ckpt-0", A, None)
    assert isinstance(rounds.join(joined(0, A)), Ask)
    restarted = joined(0, B)
    assert rounds.join(restarted) == Held(2, A)
    assert rounds.connections_listed([B], listed_at=1.0) is True
    assert isinstance(rounds.retry(restarted, 2), Ask)


# ------------------------------------------------------------------------------ commit round


def recorded(world_size: int, *peers: str) -> GroupRounds:
    rounds = GroupRounds("g", world_size)
    full = ask(rounds, *[joined(rank, peer) for rank, peer in enumerate(peers)])
    rounds.finish_quorum(full.round, succeeded=range(len(peers)), now=0.0)
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
