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
   ``join_timeout`` ago.
4. Issuing a quorum gets a new quorum_id when the ordered member ids differ from the previous
   quorum's or any member reports ``commit_failures > 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchtitan_ft.lighthouse.types import QuorumMember


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


@dataclass(frozen=True)
class Decision:
    members: tuple[QuorumMember, ...] | None
    """The quorum to issue, sorted by replica_id, or None when not ready."""
    reason: str


def healthy_replicas(heartbeats: Mapping[str, float], now: float, timeout: float) -> set[str]:
    """Replica ids whose last heartbeat is younger than ``timeout`` seconds."""
    return {rid for rid, seen in heartbeats.items() if now - seen < timeout}


def decide(
    pending: Mapping[str, Pending],
    heartbeats: Mapping[str, float],
    previous: tuple[QuorumMember, ...] | None,
    now: float,
    opts: DecisionOptions,
) -> Decision:
    """Decides whether a quorum can be issued now, and with whom.

    ``pending`` maps replica_id to its waiting request, ``heartbeats`` maps replica_id to its
    last-seen time, ``previous`` is the last issued quorum's members (None before the first).
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
        candidate_ids = {p.member.replica_id for p in candidates}
        if previous_ids <= candidate_ids:
            joined = len(candidate_ids) - len(previous_ids)
            extra = f" plus {joined} newcomer(s)" if joined else ""
            return Decision(
                _members(candidates),
                f"fast quorum: all {len(previous_ids)} previous members are back{extra}",
            )

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
    if not stragglers:
        return Decision(
            _members(candidates), f"quorum: all {len(candidates)} eligible healthy replicas asked"
        )
    waited = now - min(p.joined for p in candidates)
    if waited < opts.join_timeout:
        return Decision(
            None,
            f"waiting: {len(stragglers)} healthy replica(s) have not asked; issuing without "
            f"them in {opts.join_timeout - waited:.1f}s (join timeout)",
        )
    return Decision(
        _members(candidates),
        f"quorum: join timeout passed, issuing without {len(stragglers)} healthy replica(s) "
        "that did not ask",
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
