"""Training through a lighthouse outage on the group's previous quorum (group rank 0's
ManagerServer): whether a quorum round may go on without the lighthouse, and on which quorum.

Pure: every function takes what it judges and the time as arguments. Why this cannot commit a
step that the lighthouse would have refused is docs/lighthouse.md, "A lighthouse outage";
tested without servers in ``tests/manager/test_outage.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from torchtitan_ft.lighthouse.types import Quorum

OUTAGE_GRACE_S = 0.2
"""While an outage is known (a round already went on without the lighthouse, and the
lighthouse has answered none since), a round whose lighthouse request is not answered within
this many seconds goes on without it too. A restarted lighthouse answers a round as soon as
every group of the job asked (milliseconds, the groups step in lockstep), but a group whose
connection is still in gRPC's reconnect backoff (up to 1 s) trains on the previous quorum
meanwhile, and its peers must not wait for it at the lighthouse while it waits for them in the
collective. Longer gives a slow restarted lighthouse more time; shorter costs less per step
while the groups find it again."""


class LighthouseOutage(Enum):
    """What a replica group does when its lighthouse cannot be reached."""

    WAIT = "wait"
    """Wait for the lighthouse (until ``quorum_timeout``): every group stalls for the whole
    outage. torchft 0.2.0's behaviour."""
    PREVIOUS_QUORUM = "previous_quorum"
    """Go on committing steps on the group's previous quorum while that is sound
    (``previous_quorum_round``); wait as above otherwise. Not in torchft 0.2.0."""


@dataclass(frozen=True)
class OutageRound:
    """Whether a quorum round may go on without the lighthouse (``quorum`` set), and why."""

    quorum: Quorum | None
    """The quorum to answer the group's ranks with; None: wait for the lighthouse."""
    reason: str
    """Why, in words (logged when it changes)."""


def previous_quorum_round(
    mode: LighthouseOutage,
    previous: Quorum | None,
    previous_excluded: bool,
    replica_id: str,
    steps: Sequence[int],
    commit_failures: int,
    now: datetime,
) -> OutageRound:
    """The quorum this group's round may use while the lighthouse is unreachable.

    Args:
        mode: the group's ``lighthouse_outage`` setting.
        previous: the last quorum this group's ranks were answered with (from the lighthouse,
            or an earlier outage round); None before the first.
        previous_excluded: whether the straggler policy had left this group out of it.
        replica_id: this group's id.
        steps: every rank's step in this round.
        commit_failures: the most consecutive failed commits a rank of the group reports.
        now: when the round is answered (the quorum's ``created``).

    Returns the previous quorum with every member's step advanced to this round's step, under
    the same ``quorum_id`` (no rank reconfigures), when every rank of this group committed the
    previous quorum's step (they are all at its highest step + 1, and none reports a failed
    commit): every member that did the same is then at that step, and a member that did not
    fails the step's collective, which discards it everywhere.
    """
    if mode is LighthouseOutage.WAIT:
        return OutageRound(None, "lighthouse_outage is 'wait' (torchft 0.2.0's behaviour)")
    if previous is None:
        return OutageRound(None, "this group has had no quorum yet")
    members = [m.replica_id for m in previous.participants]
    if replica_id not in members:
        return OutageRound(None, f"this group is not a member of its last quorum {members}")
    if previous_excluded:
        return OutageRound(None, "the straggler policy left this group out of its last quorum")
    if commit_failures > 0:
        return OutageRound(
            None, f"a rank of this group failed its last {commit_failures} commit(s)"
        )
    if not steps:
        raise ValueError("steps must name the step of at least one rank, got none")
    step = max(m.step for m in previous.participants) + 1
    if any(s != step for s in steps):
        return OutageRound(
            None,
            f"the group's ranks are at steps {sorted(set(steps))}, not all at {step} (the step "
            f"after quorum {previous.quorum_id}'s): it did not commit that step",
        )
    participants = tuple(
        dataclasses.replace(m, step=step, commit_failures=0, shrink_only=False)
        for m in previous.participants
    )
    quorum = Quorum(previous.quorum_id, participants, now)
    return OutageRound(
        quorum, f"training on quorum {previous.quorum_id} ({len(members)} members) at step {step}"
    )


def go_on_without_lighthouse(unreachable: bool, outage_known: bool, waited_s: float) -> bool:
    """Whether a round waiting for the lighthouse's answer stops waiting and goes on with its
    ``previous_quorum_round``: the lighthouse is unreachable now (a connection attempt
    failed), or an outage is known and the lighthouse has not answered within
    ``OUTAGE_GRACE_S`` (see there)."""
    return unreachable or (outage_known and waited_s >= OUTAGE_GRACE_S)


class OutageState:
    """What group rank 0's ManagerServer knows of a lighthouse outage, for the rules above:
    the last quorum its ranks were answered with, and the rounds answered without the
    lighthouse since it last answered. No I/O; the server feeds it what happened.

    Args:
        mode: the group's ``lighthouse_outage`` setting.
    """

    def __init__(self, mode: LighthouseOutage) -> None:
        self._mode = mode
        self._previous: Quorum | None = None
        self._previous_excluded = False
        self.steps: int | None = None
        """Rounds answered without the lighthouse since it last answered; None: no outage."""
        self.cause = ""
        """Why the last round went on without the lighthouse, in words."""
        self._breaks_seen = 0
        """The heartbeat stream's breaks when the lighthouse last answered a round: more now
        means the lighthouse went away since."""

    def round(
        self, replica_id: str, steps: Sequence[int], commit_failures: int, now: datetime
    ) -> OutageRound:
        """``previous_quorum_round`` for a round of this group's ranks at ``steps``."""
        return previous_quorum_round(
            self._mode,
            self._previous,
            self._previous_excluded,
            replica_id,
            steps,
            commit_failures,
            now,
        )

    def answered_with(self, quorum: Quorum, excluded: bool) -> None:
        """The group's ranks were answered with ``quorum`` (the straggler policy ``excluded``
        the group from it, or not)."""
        self._previous, self._previous_excluded = quorum, excluded

    def known(self, breaks: int) -> bool:
        """Whether an outage is known (``go_on_without_lighthouse``): a round went on without
        the lighthouse since it last answered, or the heartbeat stream broke since
        (``breaks``: how many times it has broken so far)."""
        return self.steps is not None or breaks != self._breaks_seen

    def went_on(self) -> bool:
        """Counts a round answered without the lighthouse; True when it starts an outage."""
        started = self.steps is None
        self.steps = (self.steps or 0) + 1
        return started

    def lighthouse_answered(self, breaks: int) -> int | None:
        """The lighthouse answered a round (the heartbeat stream has broken ``breaks`` times
        so far): ends a known outage and returns how many rounds went on without the
        lighthouse during it; None when there was none."""
        self._breaks_seen = breaks
        steps, self.steps = self.steps, None
        return steps
