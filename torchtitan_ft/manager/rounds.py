"""The ManagerServer's rounds as a state machine, with no I/O, no clock and no event loop.

``GroupRounds`` holds everything the server remembers between calls: the quorum round the
group's ranks are joining, the quorum rounds the lighthouse is deciding, the commit rounds (one
per step) the ranks are voting in, and what each rank's last quorum left behind (its checkpoint
metadata, the connection of its call, and its session). The server feeds each call into it,
with the current time where a rule needs one, and acts on the decision it gets back: every
decision is made and applied in one synchronous method, so no other call can change a round
half-way through.

The rules (docs/operations.md, "Security", for why a rank is bound to its client):

- **Who a call is.** A call *matches* a rank's record if it comes from the record's connection
  or presents the record's session. A session is a random secret the rank's client receives
  when its first quorum round succeeds and presents on every later call, so it survives a
  reconnect; torchft's client takes none (it presents no session at all), so it is bound to its
  connection alone.
- **Quorum round.** ``join`` counts one call per group rank. A second call for a rank already
  counted is refused (``Refused``) unless it comes from the same client (connection, or a
  session it presented), where it replaces the first (a client's retry). A call for a recorded
  rank that does not match the record is *held* (``Held``), not counted: if the rank's holder
  joins the round, the held call is refused (``retry``). The earliest held call for the rank
  *takes it over* (a restarted process: a new connection and no session) only on evidence
  that the holder is gone: ``connections_listed`` reports that the record's connection has
  closed (a process that exits or is killed closes its connections). Nothing a caller does
  itself is such evidence: claiming every rank of the group at once takes none over while the
  ranks' clients stay connected. A call that takes a rank over is counted, and if the round
  succeeds it gets the record and a new session. The call that makes the round full gets
  ``Ask``: the server asks the lighthouse once for the whole group (the highest step,
  shrink-only if any rank asks, the most commit failures), and a new round opens for the next
  calls. Every other counted call gets ``Waiting``. A call that gives up before its round is
  full is taken back (``withdraw``), so the round no longer counts or holds it; once full, a
  round cannot lose a rank.
- **Finishing a quorum round.** ``finish_quorum`` names the ranks whose answer succeeded: their
  checkpoint metadata, connection and session are recorded at that moment, before any waiting
  call is answered. A call that presented its rank's session keeps it; any other call that
  takes sessions gets a new one, and the old one is dead. A failed round, a failed rank and a
  replaced call record nothing, so a stray call never rewrites where healers fetch from.
- **Checkpoint metadata.** ``checkpoint_metadata`` answers with the rank's record. A rank with no
  record yet that is in a round the lighthouse is deciding makes the caller wait for that round
  (``Waiting``): a healer that got the quorum before this group's server did asks here first.
  Otherwise the answer is ``Unknown``.
- **Commit round.** ``vote`` is refused unless it matches the rank's record (a rank with no
  record matches any call). A rank's "no" sticks if it votes again in the same round. The vote
  that makes the round full gets ``Decided``: the AND of all votes. ``withdraw_vote`` takes back
  the vote of a call that gave up before the round was full.

Tested by hand-built tables in ``tests/manager/test_rounds.py``.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from torchtitan_ft.manager.decisions import impostor_refusal
from torchtitan_ft.proto import torchft_pb2 as pb

SESSION_METADATA = "torchtitan-ft-session"
"""The gRPC metadata key of a rank's session: sent by the ManagerServer in a Quorum answer's
trailing metadata, presented by the rank's ``ManagerClient`` on its Quorum and ShouldCommit
calls. torchft's client neither reads nor sends it."""
NEW_SESSION = "new"
"""What a client that takes sessions presents before it has one (never a session itself)."""


def random_session() -> str:
    """A fresh random session (192 bits)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True, eq=False)
class Joined:
    """One Quorum call as the round counts it (compared by identity: one per call)."""

    group_rank: int
    peer: str
    """The call's connection (gRPC's ``context.peer()``)."""
    session: str | None
    """The session it presented: ``NEW_SESSION`` from a client that has none yet, None from a
    client that takes none (torchft's)."""
    step: int
    shrink_only: bool
    commit_failures: int
    checkpoint_metadata: str
    """Where healers fetch this rank's state, recorded if the round succeeds for it."""
    init_sync: bool
    """Whether the rank heals at step 0 (its answer depends on it; the round does not)."""
    progress: pb.GroupProgress | None = None
    """The rank's recent step timings, passed on to the lighthouse (straggler report)."""
    reconfigure_handle: str = ""
    """The rank's process-group handle (torchft-nightly's clients); "" for none."""


@dataclass(frozen=True, eq=False)
class Ballot:
    """One ShouldCommit call (compared by identity: one per call)."""

    group_rank: int
    step: int
    should_commit: bool
    peer: str
    """The call's connection (gRPC's ``context.peer()``)."""
    session: str | None = None
    """The session it presented, if any."""


@dataclass(frozen=True)
class Record:
    """What a group rank's last successful quorum left behind."""

    checkpoint_metadata: str
    peer: str
    """The connection of its Quorum call."""
    session: str | None = None
    """The rank's session; None if its client takes none (it is then bound to ``peer``)."""
    recorded_at: float = 0.0
    """When it was recorded (the server's monotonic clock): a listing of the open connections
    made later that lacks ``peer`` shows the connection closed."""

    def matches(self, peer: str, session: str | None) -> bool:
        """Whether a call from connection ``peer`` presenting ``session`` is this rank's."""
        return peer == self.peer or _same_session(self.session, session)


def _same_session(a: str | None, b: str | None) -> bool:
    if a is None or b is None or NEW_SESSION in (a, b):
        return False
    return hmac.compare_digest(a.encode(), b.encode())


def _handles(calls: Mapping[int, Joined]) -> tuple[str, ...]:
    """``Ask.reconfigure_handles`` of a full round's ``calls``."""
    handles = tuple(calls[rank].reconfigure_handle for rank in sorted(calls))
    return handles if all(handles) else ()


def _same_client(a: Joined, b: Joined) -> bool:
    """Whether two Quorum calls come from one client (a retry): one connection or session."""
    return a.peer == b.peer or _same_session(a.session, b.session)


# ------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Refused:
    """The call may not act as its group rank (PERMISSION_DENIED)."""

    reason: str
    bound_peer: str
    """The connection the rank is bound to."""


@dataclass(frozen=True)
class Held:
    """The call is for a rank recorded to another client: it is not counted. Call ``retry``
    when the forming round changes (a call joins or gives up) or ``connections_listed``
    reports a holder gone."""

    round: int
    bound_peer: str
    """The connection of the rank's record."""


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
    reconfigure_handles: tuple[str, ...] = ()
    """The ranks' process-group handles in group-rank order, sent to the lighthouse as the
    member's; empty unless every rank sent one (a partial list would seat the wrong ranks)."""


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
    held: list[Joined] = field(default_factory=list)
    """Calls for recorded ranks that do not match the record, in the order they came."""


@dataclass
class _CommitRound:
    number: int
    votes: dict[int, tuple[bool, Ballot]] = field(default_factory=dict)
    """group rank -> (its vote so far, the call that cast it last)."""


class GroupRounds:
    """The quorum and commit rounds of one replica group's ``world_size`` ranks (see the
    module doc). ``replica_id`` only names the group in reasons; ``new_session`` makes each new
    session (default ``random_session``)."""

    def __init__(
        self,
        replica_id: str,
        world_size: int,
        new_session: Callable[[], str] = random_session,
    ) -> None:
        self._replica_id = replica_id
        self._world_size = world_size
        self._new_session = new_session
        self._numbers = itertools.count()
        self._forming = _QuorumRound(next(self._numbers))
        self._asked: dict[int, _QuorumRound] = {}
        """Full quorum rounds the lighthouse is deciding, by number."""
        self._commits: dict[int, _CommitRound] = {}
        """Commit rounds not yet full, by step."""
        self.records: dict[int, Record] = {}
        """group rank -> what its last successful quorum left behind."""
        self.gone: set[int] = set()
        """The recorded ranks whose record's connection has closed (``connections_listed``)."""

    def rank_error(self, group_rank: int) -> str | None:
        """Why ``group_rank`` is no rank of this group (None: it is one)."""
        if 0 <= group_rank < self._world_size:
            return None
        return (
            f"group_rank {group_rank} is out of range for replica {self._replica_id!r} "
            f"with world_size {self._world_size} (expected 0..{self._world_size - 1})"
        )

    # ---------------------------------------------------------------------------- quorum

    def join(self, call: Joined) -> Refused | Held | Waiting | Ask:
        """Counts or holds ``call`` in the forming quorum round (see the module doc)."""
        rnd, rank = self._forming, call.group_rank
        waiting = rnd.calls.get(rank)
        if waiting is not None and not _same_client(waiting, call):
            return self._refused("join the quorum", rank, waiting.peer, call.peer)
        record = self.records.get(rank)
        if waiting is None and record is not None and not record.matches(call.peer, call.session):
            for i, held in enumerate(rnd.held):
                if held.group_rank == rank and _same_client(held, call):
                    rnd.held[i] = call  # a retry keeps its place
                    break
            else:
                rnd.held.append(call)
            return self.retry(call, rnd.number)
        rnd.held = [held for held in rnd.held if held.group_rank != rank]  # now refused
        return self._count(call)

    def retry(self, call: Joined, round: int) -> Refused | Held | Waiting | Ask:
        """Decides again about ``call``, held in quorum round ``round``."""
        rnd, rank = self._forming, call.group_rank
        record = self.records[rank]
        if rnd.number != round or not any(held is call for held in rnd.held):
            # The rank's holder joined (or the call gave up, or a retry replaced it).
            return self._refused("join the quorum", rank, record.peer, call.peer)
        first = next(held for held in rnd.held if held.group_rank == rank)
        if rank not in self.gone or first is not call:
            return Held(round, record.peer)
        rnd.held = [held for held in rnd.held if held.group_rank != rank]
        return self._count(call)

    def connections_listed(self, open_peers: Collection[str], listed_at: float) -> bool:
        """The server's open connections at time ``listed_at``: a rank recorded before then
        whose connection is not among them has lost its holder. Returns whether that is news
        for a rank the forming round holds a call for (the held calls should ``retry``)."""
        still_open = set(open_peers)
        news = False
        for rank, record in self.records.items():
            if rank in self.gone or record.recorded_at >= listed_at:
                continue
            if record.peer not in still_open:
                self.gone.add(rank)
                news = news or any(held.group_rank == rank for held in self._forming.held)
        return news

    def _count(self, call: Joined) -> Waiting | Ask:
        rnd = self._forming
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
            reconfigure_handles=_handles(rnd.calls),
        )

    def joining(self) -> list[int]:
        """The group ranks the forming quorum round counts so far, ascending."""
        return sorted(self._forming.calls)

    def holding(self) -> list[int]:
        """The group ranks the forming quorum round holds calls for, ascending."""
        return sorted({call.group_rank for call in self._forming.held})

    def withdraw(self, round: int, call: Joined) -> None:
        """``call`` gave up: it no longer counts, nor is held, if its round is still forming."""
        rnd = self._forming
        if rnd.number != round:
            return
        if rnd.calls.get(call.group_rank) is call:
            del rnd.calls[call.group_rank]
        rnd.held = [held for held in rnd.held if held is not call]

    def finish_quorum(self, round: int, succeeded: Collection[int], now: float) -> dict[int, str]:
        """The lighthouse part of quorum round ``round`` is over at time ``now``; the ranks in
        ``succeeded`` got their answer, and their records are now the calls the round counted
        (recorded at ``now``). Returns the
        session of each of those ranks whose call takes sessions, for its answer."""
        rnd = self._asked.pop(round)
        sessions: dict[int, str] = {}
        for rank in succeeded:
            call = rnd.calls[rank]
            old = self.records.get(rank)
            session = None
            if call.session is not None:
                kept = old.session if old is not None else None
                session = kept if _same_session(kept, call.session) else self._new_session()
                sessions[rank] = session
            self.records[rank] = Record(call.checkpoint_metadata, call.peer, session, now)
            self.gone.discard(rank)
        return sessions

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
        if record is not None and not record.matches(ballot.peer, ballot.session):
            return self._refused("vote", rank, record.peer, ballot.peer)
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

    def _refused(self, action: str, rank: int, bound: str, peer: str) -> Refused:
        return Refused(impostor_refusal(action, self._replica_id, rank, bound, peer), bound)
