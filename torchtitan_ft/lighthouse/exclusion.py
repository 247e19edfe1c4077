"""The straggler policy: whether the lighthouse leaves a reported straggler out of the quorum,
as a pure function of its judged speed, its exclusion history and the time.

Under ``StragglerPolicy.EXCLUDE`` a group that the report (``stragglers.judge``) names a
straggler is left out: its quorum requests are answered at once with a quorum of itself alone,
marked ``excluded``; its Manager runs the step without any cross-group collective, measures it
and does not commit it (no data consumed, no weights diverge). The other groups form quorums
without it. It is taken back when the report ends (it is fast again) and it has been out at
least ``min_excluded_s``, or at once when the groups left would be fewer than
``min_replicas``; it then heals from them like any group that is behind.

Safety: a group is only left out while the groups in the quorum are at least ``min_replicas``
without it, and an excluded group never commits, so the job's committed weights are only ever
those of the quorum. Flapping is bounded: a group is out at least ``min_excluded_s`` (unless
the quorum needs it back) and is left out at most ``max_exclusions`` times per ``window_s``.
The count is per replica group (:func:`group_of`), across restarts of its processes: a
restarted group (a new per-process replica id) does not start a fresh count, or a slow host
whose group is restarted now and then could be left out and taken back without bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from torchtitan_ft.replica_ids import replica_name


class StragglerPolicy(StrEnum):
    """What the lighthouse does with a reported straggler."""

    OFF = "off"
    """Report only; every group stays in the quorum (the default)."""
    EXCLUDE = "exclude"
    """Leave the straggler out of the quorum while it is one (see the module docstring)."""


@dataclass(frozen=True)
class ExclusionOptions:
    policy: StragglerPolicy = StragglerPolicy.OFF
    """Whether reported stragglers are left out of the quorum."""
    min_excluded_s: float = 30.0
    """Seconds a left-out group stays out before it may be taken back for being fast again
    (not when the quorum needs it for ``min_replicas``). Longer damps flapping; shorter brings
    a recovered group's compute back sooner."""
    max_exclusions: int = 3
    """Times a group may be left out per ``window_s``; after that it stays in (reported, and
    slowing the job) until the window moves on."""
    window_s: float = 3600.0
    """Seconds over which ``max_exclusions`` counts."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, StragglerPolicy):
            raise ValueError(
                f"straggler policy must be one of {[p.value for p in StragglerPolicy]}, "
                f"got {self.policy!r}"
            )
        if self.min_excluded_s < 0:
            raise ValueError(f"straggler min_excluded_s must be >= 0, got {self.min_excluded_s!r}")
        if self.max_exclusions < 1:
            raise ValueError(f"straggler max_exclusions must be >= 1, got {self.max_exclusions!r}")
        if not self.window_s > 0:
            raise ValueError(f"straggler window_s must be > 0, got {self.window_s!r}")


@dataclass(frozen=True)
class Exclusion:
    """One group's exclusion state, carried from one of its requests to the next."""

    since: float | None = None
    """When it was left out (the caller's clock); None while it is in the quorum."""
    history: tuple[float, ...] = ()
    """When it was left out, within the last ``window_s`` (oldest first)."""

    @property
    def excluded(self) -> bool:
        return self.since is not None


def group_of(replica_id: str) -> str:
    """The replica group a quorum member's id names: the id without the per-process suffix
    that the Manager (as torchft's) appends after a colon (``"replica_3:<uuid>"`` ->
    ``"replica_3"``, as ``Event.replica_name``); an id without one is its own group."""
    return replica_name(replica_id)


class Action(StrEnum):
    """What a decision changed (logged by the lighthouse, an event on the trainer)."""

    EXCLUDED = "excluded"
    READMITTED = "readmitted"


def decide_exclusion(
    prior: Exclusion,
    straggler: bool,
    others: int,
    min_replicas: int,
    now: float,
    opts: ExclusionOptions,
) -> tuple[Exclusion, Action | None, str]:
    """Decides whether a group is out of the quorum, at one of its requests.

    Args:
        prior: its state before this request.
        straggler: whether the report names it a straggler now.
        others: healthy groups that would be in the quorum without it (not excluded).
        min_replicas: the lighthouse's ``min_replicas``.
        now: the caller's clock, seconds.
        opts: the policy.

    Returns the new state, the change (None: none) and why (a log line's reason).
    """
    history = tuple(t for t in prior.history if now - t < opts.window_s)
    state = Exclusion(prior.since, history)
    if prior.since is not None:
        if others < min_replicas:
            return (
                Exclusion(None, history),
                Action.READMITTED,
                f"the quorum needs it: {others} other group(s) < min_replicas={min_replicas}",
            )
        if opts.policy is StragglerPolicy.OFF:
            return Exclusion(None, history), Action.READMITTED, "the policy is off"
        out_for = now - prior.since
        if not straggler and out_for >= opts.min_excluded_s:
            return (
                Exclusion(None, history),
                Action.READMITTED,
                f"fast again after {out_for:.1f}s out",
            )
        return state, None, "still out"
    if opts.policy is StragglerPolicy.OFF or not straggler:
        return state, None, "in"
    if others < min_replicas:
        return state, None, f"kept in: {others} other group(s) < min_replicas={min_replicas}"
    if len(history) >= opts.max_exclusions:
        return (
            state,
            None,
            f"kept in: left out {len(history)} time(s) in the last {opts.window_s:.0f}s "
            f"(max_exclusions={opts.max_exclusions})",
        )
    return Exclusion(now, (*history, now)), Action.EXCLUDED, "a straggler"
