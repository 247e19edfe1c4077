"""The ManagerServer's rounds as a state machine, with no I/O, no clock and no event loop.

``GroupRounds`` holds everything the server remembers between calls: the quorum round the
group's ranks are joining, the quorum rounds the lighthouse is deciding, the commit rounds (one
per step) the ranks are voting in, and what each rank's last quorum left behind (its checkpoint
metadata, and the connection it is bound to). The server feeds each call into it and acts on
the decision it gets back: every decision is made and applied in one synchronous method, so no
other call can change a round half-way through.

The rules (docs/operations.md, "Security", for why a rank is bound to a connection):

- **Quorum round.** ``join`` counts one call per group rank. A second call for a rank already
  waiting is refused (``Refused``) unless it comes from the same connection, where it replaces
  the first (a client's retry). The call that makes the round full gets ``Ask``: the server asks
  the lighthouse once for the whole group (the highest step, shrink-only if any rank asks, the
  most commit failures), and a new round opens for the next calls. Every other call gets
  ``Waiting``. A call that gives up before its round is full is taken back (``withdraw``), so
  the round no longer counts it; once full, a round cannot lose a rank.
- **Finishing a quorum round.** ``finish_quorum`` names the ranks whose answer succeeded: their
  checkpoint metadata and connection are recorded at that moment, before any waiting call is
  answered. A failed round, a failed rank and a replaced call record nothing, so a stray call
  never rewrites where healers fetch from.
- **Checkpoint metadata.** ``checkpoint_metadata`` answers with the rank's record. A rank with no
  record yet that is in a round the lighthouse is deciding makes the caller wait for that round
  (``Waiting``): a healer that got the quorum before this group's server did asks here first.
  Otherwise the answer is ``Unknown``.
- **Commit round.** ``vote`` is refused from any connection but the one the rank's record is
  bound to (a rank with no record is bound to none). A rank's "no" sticks if it votes again in
  the same round. The vote that makes the round full gets ``Decided``: the AND of all votes.
  ``withdraw_vote`` takes back the vote of a call that gave up before the round was full.

Tested by hand-built tables in ``tests/manager/test_rounds.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from torchtitan_ft.manager.decisions import impostor_refusal


@dataclass(frozen=True, eq=False)
class Joined:
    """One Quorum call as the round counts it (compared by identity: one per call)."""

    group_rank: int
    peer: str
    """The call's connection (gRPC's ``context.peer()``)."""
    step: int
    shrink_only: bool
    commit_failures: int
    checkpoint_metadata: str
    """Where healers fetch this rank's state, recorded if the round succeeds for it."""
    init_sync: bool
    """Whether the rank heals at step 0 (its answer depends on it; the round does not)."""


@dataclass(frozen=True, eq=False)
class Ballot:
    """One ShouldCommit call (compared by identity: one per call)."""

    group_rank: int
    step: int
    should_commit: bool
    peer: str
    """The call's connection (gRPC's ``context.peer()``)."""


@dataclass(frozen=True)
class Record:
    """What a group rank's last successful quorum left behind."""

    checkpoint_metadata: str
    peer: str
    """The connection of its Quorum call; its votes must come from it too."""


# ------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Refused:
    """The call may not act as its group rank (PERMISSION_DENIED)."""

    reason: str
    bound_peer: str
    """The connection the rank is bound to."""


@dataclass(frozen=True)
class Waiting:
    """The call waits for round ``round`` to finish."""

    round: int
    count: int = 0
    """How many ranks the round has counted so far (for the log)."""


@dataclass(frozen=True)
class Ask:
    """The quorum round ``round`` is full: ask the lighthouse for the whole group, then call
    ``finish_quorum``. The call that made it full waits for it like the others."""

    round: int
    calls: Mapping[int, Joined]
    """group rank -> the call the round counted."""
    step: int
    """The highest step of the ranks."""
    shrink_only: bool
    """Whether any rank asked for a shrink-only quorum."""
    commit_failures: int
    """The most consecutive commit failures any rank reported."""


@dataclass(frozen=True)
class Decided:
    """The commit round ``round`` is full: ``should_commit`` is the AND of ``votes``."""

    round: int
    should_commit: bool
    votes: Mapping[int, bool]
    """group rank -> its vote."""


@dataclass(frozen=True)
class Found:
    """The rank's checkpoint metadata."""

    checkpoint_metadata: str


@dataclass(frozen=True)
class Unknown:
    """The rank has no checkpoint metadata and none is on its way (NOT_FOUND)."""

    reason: str


# ------------------------------------------------------------------------------ the rounds


@dataclass
class _QuorumRound:
    number: int
    calls: dict[int, Joined] = field(default_factory=dict)


@dataclass
class _CommitRound:
    number: int
    votes: dict[int, tuple[bool, Ballot]] = field(default_factory=dict)
    """group rank -> (its vote so far, the call that cast it last)."""


class GroupRounds:
    """The quorum and commit rounds of one replica group's ``world_size`` ranks (see the
    module doc). ``replica_id`` only names the group in reasons."""

    def __init__(self, replica_id: str, world_size: int) -> None:
        self._replica_id = replica_id
        self._world_size = world_size
        self._numbers = itertools.count()
        self._forming = _QuorumRound(next(self._numbers))
        self._asked: dict[int, _QuorumRound] = {}
        """Full quorum rounds the lighthouse is deciding, by number."""
        self._commits: dict[int, _CommitRound] = {}
        """Commit rounds not yet full, by step."""
        self.records: dict[int, Record] = {}
        """group rank -> what its last successful quorum left behind."""

    # ---------------------------------------------------------------------------- quorum

    def join(self, call: Joined) -> Refused | Waiting | Ask:
        """Counts ``call`` in the forming quorum round (see the module doc)."""
        rnd = self._forming
        waiting = rnd.calls.get(call.group_rank)
        bound = waiting.peer if waiting is not None else None
        if refused := self._refusal("join the quorum", call.group_rank, bound, call.peer):
            return refused
        rnd.calls[call.group_rank] = call
        if len(rnd.calls) < self._world_size:
            return Waiting(rnd.number, len(rnd.calls))
        self._asked[rnd.number] = rnd
        self._forming = _QuorumRound(next(self._numbers))
        calls = rnd.calls.values()
        return Ask(
            round=rnd.number,
            calls=dict(rnd.calls),
            step=max(c.step for c in calls),
            shrink_only=any(c.shrink_only for c in calls),
            commit_failures=max(c.commit_failures for c in calls),
        )

    def joining(self) -> list[int]:
        """The group ranks the forming quorum round counts so far, ascending."""
        return sorted(self._forming.calls)

    def withdraw(self, round: int, call: Joined) -> None:
        """``call`` gave up: it no longer counts if its round is still forming."""
        rnd = self._forming
        if rnd.number == round and rnd.calls.get(call.group_rank) is call:
            del rnd.calls[call.group_rank]

    def finish_quorum(self, round: int, succeeded: Collection[int]) -> None:
        """The lighthouse part of quorum round ``round`` is over; the ranks in ``succeeded``
        got their answer, and their records are now the calls the round counted."""
        rnd = self._asked.pop(round)
        for rank in succeeded:
            call = rnd.calls[rank]
            self.records[rank] = Record(call.checkpoint_metadata, call.peer)

    def checkpoint_metadata(self, group_rank: int) -> Found | Waiting | Unknown:
        """Where healers fetch ``group_rank``'s state; ``Waiting``: ask again when that
        round has finished."""
        record = self.records.get(group_rank)
        if record is not None:
            return Found(record.checkpoint_metadata)
        asked = [n for n, rnd in self._asked.items() if group_rank in rnd.calls]
        if asked:
            return Waiting(max(asked))
        return Unknown(
            f"no checkpoint metadata for group rank {group_rank} of replica "
            f"{self._replica_id!r}: it has not completed a Quorum call yet "
            f"(known ranks: {sorted(self.records)})"
        )

    # ---------------------------------------------------------------------------- commit

    def vote(self, ballot: Ballot) -> Refused | Waiting | Decided:
        """Counts ``ballot`` in the commit round of its step (see the module doc)."""
        rank = ballot.group_rank
        record = self.records.get(rank)
        bound = record.peer if record is not None else None
        if refused := self._refusal("vote", rank, bound, ballot.peer):
            return refused
        rnd = self._commits.get(ballot.step)
        if rnd is None:
            rnd = self._commits[ballot.step] = _CommitRound(next(self._numbers))
        previous = rnd.votes.get(rank)
        yes = ballot.should_commit and (previous is None or previous[0])  # a "no" sticks
        rnd.votes[rank] = (yes, ballot)
        if len(rnd.votes) < self._world_size:
            return Waiting(rnd.number, len(rnd.votes))
        del self._commits[ballot.step]
        votes = {r: v for r, (v, _) in sorted(rnd.votes.items())}
        return Decided(rnd.number, all(votes.values()), votes)

    def withdraw_vote(self, round: int, ballot: Ballot) -> bool:
        """``ballot``'s call gave up: its vote no longer counts if its round is not full.
        Returns whether that left the round empty, and so forgotten."""
        rnd = self._commits.get(ballot.step)
        if rnd is None or rnd.number != round:
            return False
        cast = rnd.votes.get(ballot.group_rank)
        if cast is not None and cast[1] is ballot:
            del rnd.votes[ballot.group_rank]
        if rnd.votes:
            return False
        del self._commits[ballot.step]
        return True

    def _refusal(self, action: str, rank: int, bound: str | None, peer: str) -> Refused | None:
        reason = impostor_refusal(action, self._replica_id, rank, bound, peer)
        if reason is None or bound is None:
            return None
        return Refused(reason, bound)
