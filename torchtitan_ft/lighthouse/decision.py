"""The lighthouse's quorum decision, as pure functions of state and time.

Nothing here does I/O or reads a clock: the server passes ``now`` (seconds, any monotonic
origin) and the state, and gets back the members of the quorum to issue (or ``None``) with a
human-readable reason. The same reason string is the log line and the status-page line.

The rules, in order:

1. Healthy replicas have a heartbeat younger than the heartbeat timeout. Candidates are the
   healthy pending requesters, sorted by replica_id. The round is shrink-only if any candidate
   asks for it.
2. With a previous quorum: a shrink-only round drops candidates that were not in it. *Fast
   quorum*: when every member of the previous quorum is a healthy candidate, issue now (with any
   newcomer already waiting).
3. Otherwise the round is not ready while there are fewer than ``min_replicas`` candidates,
   while the candidates are not a strict majority of the healthy replicas (split-brain guard),
   or while some healthy replica has not asked and the earliest candidate joined less than
   ``join_timeout`` ago. It also waits while every candidate is behind the previous quorum's
   highest step and a member of that quorum that has not asked may still hold the state: it
   was heard from within ``HOLDER_WAIT_HEARTBEATS`` heartbeat timeouts, its heartbeat stream
   open or ended (state guard, not in torchft; ``state_guard``). Issued, the candidates would
   train on from an older state, a second line of steps that the member's return throws away
   (seen in the soak test: fresh replacements trained from step 0 while the one group with the
   state sat out a collective timeout, or its heartbeat lagged on a loaded machine; in
   ``benchmarks.goodput``, a holder away for a few seconds). A stream that ended is waited for
   too: a process that lives reconnects it within a heartbeat interval; a dead one never does.
   Once every such member stayed silent that long, the state is *lost*: the quorum is issued
   with a ``StateLoss`` (``Decision.state_loss``) that the lighthouse records and sends to the
   groups, which stop or train on as their operator chose, never silently. A restarted
   lighthouse knows the previous quorum from ``--state_dir`` (``last_quorum``: members it has
   not heard from since count as heard from at the restart); without one the guard cannot
   act until it has issued a quorum.
4. Issuing a quorum gets a new quorum_id when the ordered member ids differ from the previous
   quorum's or any member reports ``commit_failures > 0``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from torchtitan_ft.lighthouse.types import QuorumMember, StateLoss

HOLDER_WAIT_HEARTBEATS = 3
"""The state guard waits for a member of the previous quorum that may hold the job's state
this many heartbeat timeouts after it was last heard from, whether its heartbeat stream is
open (a lagging heartbeat, a short hang) or ended (a stream that a living process reconnects);
then the state counts as lost (15 s at the default 5 s heartbeat timeout). Shorter declares a
loss sooner after a correlated failure, at the risk of declaring one while a holder is merely
slow to come back."""


@dataclass(frozen=True)
class DecisionOptions:
    min_replicas: int
    """Fewest members a quorum may have."""
    join_timeout: float
    """Seconds to wait for healthy replicas that have not asked yet before issuing without them."""
    heartbeat_timeout: float
    """Seconds after its last heartbeat at which a replica stops counting as healthy."""


@dataclass(frozen=True)
class Pending:
    """A replica waiting for the next quorum."""

    member: QuorumMember
    joined: float
    """When it asked (seconds, same clock as ``now``)."""


class RoundKind(StrEnum):
    """How a round completed (the lighthouse's history records it with each new quorum)."""

    FAST = "fast"
    """Every member of the previous quorum asked again."""
    FULL = "full"
    """Every eligible healthy replica asked."""
    JOIN_TIMEOUT = "join timeout"
    """The join timeout passed; healthy replicas that had not asked were left out."""


@dataclass(frozen=True)
class Decision:
    members: tuple[QuorumMember, ...] | None
    """The quorum to issue, sorted by replica_id, or None when not ready."""
    reason: str
    log_key: str | None = None
    """What must change for the reason to be logged again; None: the reason itself. Set where
    the reason holds a countdown, so a wait is logged once, not at every tick."""

    round_kind: RoundKind | None = None
    """How the round completed; None when not ready."""
    state_loss: StateLoss | None = None
    """Set when the quorum is issued although the job's state is lost (``state_guard``)."""

    @property
    def log_as(self) -> str:
        return self.reason if self.log_key is None else self.log_key


def healthy_replicas(heartbeats: Mapping[str, float], now: float, timeout: float) -> set[str]:
    """Replica ids whose last heartbeat is younger than ``timeout`` seconds."""
    return {rid for rid, seen in heartbeats.items() if now - seen < timeout}


def group_last_seen(
    heartbeats: Mapping[str, float], rank_heartbeats: Mapping[str, Mapping[int, float]]
) -> Mapping[str, float]:
    """When each replica group was last heard from, as a whole: its own heartbeat (group rank
    0's ManagerServer), or the oldest last heartbeat of its other ranks' streams when that is
    older. A group rank hung inside the group (SIGSTOPped, its connections open) holds every
    peer in the collectives it is part of, as a hung group does; this makes the group gone
    after the heartbeat timeout (not in torchft, whose lighthouse hears from group rank 0
    only). Ranks of a group without a heartbeat record of its own are ignored: the group is
    gone or not yet known."""
    if not rank_heartbeats:
        return heartbeats
    seen = dict(heartbeats)
    for rid, ranks in rank_heartbeats.items():
        if rid in seen and ranks:
            seen[rid] = min(seen[rid], min(ranks.values()))
    return seen


def gone_members(
    watched: Iterable[str], heartbeats: Mapping[str, float], now: float, timeout: float
) -> tuple[str, ...]:
    """The watched replica ids the lighthouse knows to be gone, sorted: their last heartbeat
    is at least ``timeout`` seconds old (a process alive but silent, e.g. SIGSTOPped).

    An id without a heartbeat record is not reported: its stream ended (a dead process, whose
    peers' collectives fail on their own) or this lighthouse restarted and has not heard from
    it yet (it may be fine; its stream reconnects within a heartbeat interval).
    """
    return tuple(sorted({rid for rid in watched if now - heartbeats.get(rid, now) >= timeout}))


def next_gone_check(
    watched: Iterable[str], heartbeats: Mapping[str, float], now: float, timeout: float
) -> float | None:
    """Seconds from ``now`` until the first watched member with a heartbeat record is gone if
    it is not heard from again (0: one is gone already; ``gone_members``), or None when none
    has a record. A waiting ``GoneMembers`` call looks again exactly then, so that it names a
    hung member at the end of its heartbeat timeout, not up to a polling period later."""
    expiries = [heartbeats[rid] + timeout - now for rid in watched if rid in heartbeats]
    return max(min(expiries), 0.0) if expiries else None


def decide(
    pending: Mapping[str, Pending],
    heartbeats: Mapping[str, float],
    previous: tuple[QuorumMember, ...] | None,
    now: float,
    opts: DecisionOptions,
    heard: Mapping[str, float] | None = None,
    finished: frozenset[str] = frozenset(),
) -> Decision:
    """Decides whether a quorum can be issued now, and with whom.

    ``pending`` maps replica_id to its waiting request, ``heartbeats`` maps replica_id to its
    last-seen time, ``previous`` is the last issued quorum's members (None before the first).
    ``heard``: when the state guard counts each member of ``previous`` as last heard from;
    default ``heartbeats`` (a restarted lighthouse also counts its restart for members it
    restored and has not heard from yet: ``last_quorum.heard_since_restart``). ``finished``:
    members of ``previous`` whose process ended its heartbeat stream itself (the state
    guard's ``finished``).
    """
    healthy = healthy_replicas(heartbeats, now, opts.heartbeat_timeout)
    candidates = sorted(
        (p for rid, p in pending.items() if rid in healthy), key=lambda p: p.member.replica_id
    )
    shrink_only = any(p.member.shrink_only for p in candidates)

    if previous is not None:
        previous_ids = {m.replica_id for m in previous}
        if shrink_only:
            candidates = [p for p in candidates if p.member.replica_id in previous_ids]
        if (fast := _fast_quorum(candidates, previous_ids)) is not None:
            return fast

    if len(candidates) < opts.min_replicas:
        return Decision(
            None,
            f"waiting: {len(candidates)} healthy replica(s) asked, "
            f"min_replicas={opts.min_replicas}",
        )
    if 2 * len(candidates) <= len(healthy):
        return Decision(
            None,
            f"waiting: {len(candidates)} of {len(healthy)} healthy replicas asked, "
            "need a strict majority (split-brain guard)",
        )
    # Stragglers: healthy replicas that have not asked. A shrink-only round can only wait for
    # members of the previous quorum; anyone else could not join it anyway.
    stragglers = healthy - pending.keys()
    if shrink_only and previous is not None:
        stragglers &= {m.replica_id for m in previous}
    waited = now - min(p.joined for p in candidates)
    if stragglers and waited < opts.join_timeout:
        return Decision(
            None,
            f"waiting: {len(stragglers)} healthy replica(s) have not asked; issuing without "
            f"them in {opts.join_timeout - waited:.1f}s (join timeout)",
            log_key=f"waiting for {len(stragglers)} straggler(s) of {len(candidates)} asker(s)",
        )
    guard = state_guard(
        candidates,
        pending.keys(),
        heartbeats if heard is None else heard,
        previous,
        now,
        opts,
        finished,
    )
    return _after_state_guard(candidates, stragglers, guard)


def _fast_quorum(candidates: list[Pending], previous_ids: set[str]) -> Decision | None:
    """``decide``'s fast quorum: every member of the previous quorum asked again (None: not)."""
    candidate_ids = {p.member.replica_id for p in candidates}
    if not previous_ids <= candidate_ids:
        return None
    joined = len(candidate_ids) - len(previous_ids)
    extra = f" plus {joined} newcomer(s)" if joined else ""
    return Decision(
        _members(candidates),
        f"fast quorum: all {len(previous_ids)} previous members are back{extra}",
        round_kind=RoundKind.FAST,
    )


def _after_state_guard(candidates: list[Pending], stragglers: set[str], guard: Guard) -> Decision:
    """``decide``'s last step: wait for the holders of the job's state the ``guard`` names,
    or issue the quorum to ``candidates`` (without the healthy ``stragglers`` that did not
    ask), saying whether the job's state is lost."""
    if guard.waiting:
        names = ", ".join(guard.waiting)
        return Decision(
            None,
            f"waiting: the askers are behind the job's state and {len(guard.waiting)} "
            f"replica(s) that may hold it have not asked ({names}); issuing without them "
            "would train on from an older state (state guard, not in torchft)",
            log_key=f"state guard: waiting for {names}",
        )
    lost = ""
    if guard.lost is not None:
        lost = (
            f"; the job's state at step {guard.lost.lost_step} is LOST: no member holds it "
            f"and its holders ({', '.join(guard.lost.holders) or 'unknown'}) stayed away "
            f"{HOLDER_WAIT_HEARTBEATS} heartbeat timeouts"
        )
    if not stragglers:
        return Decision(
            _members(candidates),
            f"quorum: all {len(candidates)} eligible healthy replicas asked{lost}",
            round_kind=RoundKind.FULL,
            state_loss=guard.lost,
        )
    return Decision(
        _members(candidates),
        f"quorum: join timeout passed, issuing without {len(stragglers)} healthy replica(s) "
        f"that did not ask{lost}",
        round_kind=RoundKind.JOIN_TIMEOUT,
        state_loss=guard.lost,
    )


@dataclass(frozen=True)
class Guard:
    """What the state guard found (``state_guard``)."""

    waiting: tuple[str, ...] = ()
    """Members that may still hold the job's state, sorted: the quorum waits for them."""
    lost: StateLoss | None = None
    """Set when no member holds the state and none may come back with it."""


def state_guard(
    candidates: list[Pending],
    asked: Iterable[str],
    heard: Mapping[str, float],
    previous: tuple[QuorumMember, ...] | None,
    now: float,
    opts: DecisionOptions,
    finished: frozenset[str] = frozenset(),
) -> Guard:
    """The state guard: whether a quorum of ``candidates`` must wait for a member of the
    previous quorum that may hold the job's latest state, or would be issued with the state
    lost.

    It acts only when every candidate is behind the previous quorum's highest step (the job's
    highest step this lighthouse knows). The *holders* are then the members of the previous
    quorum that have not asked (one that asks behind that step lost its state: a restarted
    process). A holder *may come back* when it was heard from (``heard``: when each was last
    heard from, its heartbeat or the end of its stream) within ``HOLDER_WAIT_HEARTBEATS``
    heartbeat timeouts: the quorum waits for it. When none may come back, the state is lost:
    ``Guard.lost`` names the step and the previous quorum's members (each gone, or back
    behind that step). A holder without a ``heard`` record was silent long enough to be
    forgotten (or its stream ended before a restart of this lighthouse). A holder in
    ``finished`` ended its stream itself (its Manager shut down: the run finished, or it
    stopped on an error it reported), as a SIGKILLed process cannot: it is not waited for, and
    when no other holder may come back the quorum is issued without a loss (the state left
    with a run that ended, as before the state guard). Nothing to guard:
    no previous quorum (a fresh job, or a restarted lighthouse without ``--state_dir``), no
    candidate, or a candidate at the highest step (docs/lighthouse.md, "State guard" and
    "State loss")."""
    if previous is None or not candidates:
        return Guard()
    high = max(m.step for m in previous)
    if max(p.member.step for p in candidates) >= high:
        return Guard()
    window = HOLDER_WAIT_HEARTBEATS * opts.heartbeat_timeout
    waiting = set(asked)
    holders = sorted(m.replica_id for m in previous if m.replica_id not in waiting)
    may_return = tuple(
        rid for rid in holders if rid not in finished and rid in heard and now - heard[rid] < window
    )
    if may_return:
        return Guard(waiting=may_return)
    if any(rid in finished for rid in holders):
        return Guard()
    return Guard(lost=StateLoss(high, tuple(sorted(m.replica_id for m in previous))))


def newcomer_ahead(
    member: QuorumMember, previous_ids: frozenset[str], previous_max_step: int | None
) -> str | None:
    """A warning when a replica that was not in the previous quorum claims a step beyond it.

    The next quorum would make it the heal source of every group behind it and the primary
    (TCPStore host) of every group rank. Real groups reach a step only through this
    lighthouse's quorums, so a newcomer ahead of all of them is odd (a group resuming from a
    newer disk checkpoint, a lighthouse that restarted mid-job), and it is what a stranger who
    wants to steer the job would claim. Only a warning: refusing would also refuse those
    legitimate cases, and a stranger can claim a plausible step (tie with the maximum) and
    become a primary all the same. The job token is what keeps strangers out.
    """
    if previous_max_step is None or member.replica_id in previous_ids:
        return None
    if member.step <= previous_max_step:
        return None
    return (
        f"replica {member.replica_id!r} (address {member.address!r}) joins at step "
        f"{member.step}, ahead of the previous quorum (max step {previous_max_step}): it will "
        "be the heal source and primary store of the next quorum; if it is not one of this "
        "job's replica groups, give the lighthouse and the groups a job token (--auth_token)"
    )


def next_quorum_id(
    previous_id: int,
    previous: tuple[QuorumMember, ...] | None,
    members: tuple[QuorumMember, ...],
    floor: int,
) -> int:
    """The quorum_id for ``members``, given the previous quorum.

    The id stays the same while the ordered member ids are unchanged and no member reports
    commit failures; otherwise it becomes at least ``previous_id + 1`` and at least ``floor``.
    The server passes the wall clock in microseconds as ``floor``, so a restarted lighthouse
    (which forgot ``previous_id``) still never reissues an id a previous run has used.
    """
    unchanged = (
        previous is not None
        and [m.replica_id for m in previous] == [m.replica_id for m in members]
        and not any(m.commit_failures > 0 for m in members)
    )
    if unchanged:
        return previous_id
    return max(previous_id + 1, floor)


def _members(candidates: list[Pending]) -> tuple[QuorumMember, ...]:
    return tuple(p.member for p in candidates)
