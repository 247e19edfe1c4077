"""When LocalSGD and (Streaming) DiLoCo form the quorum, start a fragment's sync and apply it:
one pure function of the inner step and the configuration, in the trainer of every rank.

With ``sync_every = H``, ``num_fragments = F`` and ``fragment_sync_delay = tau``, a cycle is
``H / F`` inner steps and one fragment is synced per cycle (so each fragment every ``H`` steps):

- after inner step ``cycle - tau`` of the cycle: form the quorum (a replica behind heals here)
  and start the sync of fragment ``syncs_committed % F`` (its allreduce runs while the next tau
  inner steps do);
- after inner step ``cycle``: wait for that sync, apply it (or discard it), and start a new
  cycle (the inner-step counter goes back to 0).

The fragment index moves on only when a sync commits, so a failed fragment is retried in the
next cycle, and every replica (healed with the same count) picks the same one. LocalSGD and
plain DiLoCo are the case ``F = 1, tau = 0``: quorum, sync and apply after step ``H``.

``SyncSchedule.actions`` answers "what now?" for any position, and the strategies in
``local_sgd.py`` carry the answer out, except with DiLoCo's ``outer_overlap`` (the outer round
applied one cycle late): then ``overlap.delayed_actions`` answers instead, from the cycle length
of this schedule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncActions:
    """What a semi-sync strategy does after an inner step, in this order.

    ``SyncActions()`` (every field at its default) is "nothing": a plain inner step.
    """

    form_quorum: bool = False
    """Form the quorum (and heal, if this replica is behind its peers)."""
    start_fragment: int | None = None
    """Fragment whose sync starts: its pseudo-gradients (DiLoCo) or parameters (LocalSGD) go
    into an allreduce. None: no sync starts."""
    apply_fragment: int | None = None
    """Fragment whose sync (the one in flight) is waited for and applied, or discarded if it
    does not commit; the cycle ends and the inner-step counter restarts at 0. None: nothing is
    applied."""

    def after_quorum(self) -> SyncActions:
        """The same actions without the quorum: what a replica that healed into its peers'
        quorum still has to do to take part in their sync."""
        return SyncActions(start_fragment=self.start_fragment, apply_fragment=self.apply_fragment)


@dataclass(frozen=True)
class SyncSchedule:
    """The sync schedule of LocalSGD (one fragment, no delay) and (Streaming) DiLoCo.

    Raises ``ValueError`` at construction for a schedule that cannot run, naming the bad value
    and the constraint it breaks.
    """

    sync_every: int
    """H, inner steps between two syncs of the same parameters (>= 1)."""
    num_fragments: int = 1
    """F, fragments synced in turn, one per ``sync_every / F`` steps (H must be a multiple)."""
    fragment_sync_delay: int = 0
    """tau, inner steps between starting a fragment's sync and applying it
    (``0 <= tau < sync_every / F``)."""

    def __post_init__(self) -> None:
        if self.num_fragments < 1:
            raise ValueError(f"DiLoCo needs at least one fragment, got {self.num_fragments}")
        if self.sync_every < self.num_fragments:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be >= the number of fragments "
                f"({self.num_fragments}): at most one fragment is synced per step"
            )
        if self.sync_every % self.num_fragments != 0:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be a multiple of the number of fragments "
                f"({self.num_fragments})"
            )
        if not 0 <= self.fragment_sync_delay < self.cycle:
            raise ValueError(
                "fragment_sync_delay must be in [0, sync_every / num_fragments = "
                f"{self.cycle}), got {self.fragment_sync_delay}: a fragment's sync must finish "
                "before the next one starts"
            )

    @property
    def cycle(self) -> int:
        """Inner steps between the starts of two fragment syncs (``sync_every / F``)."""
        return self.sync_every // self.num_fragments

    @property
    def quorum_step(self) -> int:
        """The inner step of a cycle after which the quorum is formed (``cycle - tau``)."""
        return self.cycle - self.fragment_sync_delay

    def actions(self, local_step: int, syncs_committed: int) -> SyncActions:
        """What to do after inner step ``local_step`` of the cycle (1-based: the count of inner
        steps since the cycle started, this one included), with ``syncs_committed`` fragment
        syncs committed so far. Steps other than ``quorum_step`` and ``cycle`` do nothing."""
        fragment = syncs_committed % self.num_fragments
        starts = local_step == self.quorum_step
        return SyncActions(
            form_quorum=starts,
            start_fragment=fragment if starts else None,
            apply_fragment=fragment if local_step == self.cycle else None,
        )
