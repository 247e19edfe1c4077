"""When LocalSGD and (Streaming) DiLoCo form the quorum, start a fragment's sync and apply it:
one pure function of the position in the cycle and the configuration (the outer overlap
included), in the trainer of every rank.

With ``sync_every = H``, ``num_fragments = F`` and ``fragment_sync_delay = tau``, a cycle is
``H / F`` inner steps and one fragment is synced per cycle (so each fragment every ``H`` steps).
Without an outer overlap (``OuterOverlap.NONE``):

- after inner step ``cycle - tau`` of the cycle: form the quorum (a replica behind heals here)
  and start the sync of fragment ``syncs_committed % F`` (its allreduce runs while the next tau
  inner steps do);
- after inner step ``cycle``: the cycle ends (the inner-step counter goes back to 0); wait for
  that sync and apply it (or discard it).

With an outer overlap (``DELAYED`` or ``EAGER``, DiLoCo only; ``tau = 0``) a sync is in flight
for a whole cycle (``overlap.py``): after inner step ``cycle``, finish the sync in flight (wait,
vote, apply or discard), form the quorum, start the next fragment's sync and end the cycle.

The fragment index moves on only when a sync commits, so a failed fragment is retried in the
next cycle, and every replica (healed with the same count) picks the same one. LocalSGD and
plain DiLoCo are the case ``F = 1, tau = 0``: quorum, sync and apply after step ``H``.

``SyncSchedule.actions`` answers "what now?" for any position and overlap mode; the strategies
in ``local_sgd.py`` only carry the answer out.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_ft.semi_sync.overlap import OuterOverlap


@dataclass(frozen=True)
class SyncActions:
    """What a semi-sync strategy does after an inner step, in the order of the fields.

    ``SyncActions()`` (every field at its default) is "nothing": a plain inner step. Fragments
    are named from the counts the schedule was asked with; a finish or a quorum (which can
    commit a sync or heal this replica) changes them, so a strategy asks again after the
    quorum and takes ``start_fragment``, ``end_cycle`` and ``apply_fragment`` from that answer.
    """

    finish_fragment: int | None = None
    """Fragment whose sync, in flight since the last sync point (an outer overlap), is waited
    for, voted on and applied (or discarded), before the quorum. None: nothing to finish."""
    form_quorum: bool = False
    """Form the quorum (and heal, if this replica is behind its peers)."""
    start_fragment: int | None = None
    """Fragment whose sync starts: its pseudo-gradients (DiLoCo) or parameters (LocalSGD) go
    into an allreduce. None: no sync starts."""
    end_cycle: bool = False
    """The cycle ends: the inner-step counter restarts at 0."""
    apply_fragment: int | None = None
    """Fragment whose sync (started at this cycle's quorum, no overlap) is waited for and
    applied, or discarded if it does not commit. None: nothing is applied."""


@dataclass(frozen=True)
class SyncSchedule:
    """The sync schedule of LocalSGD (one fragment, no delay, no overlap) and (Streaming)
    DiLoCo.

    Raises ``ValueError`` at construction for a schedule that cannot run, naming the bad value
    and the constraint it breaks.
    """

    sync_every: int
    """H, inner steps between two syncs of the same parameters (>= 1)."""
    num_fragments: int = 1
    """F, fragments synced in turn, one per ``sync_every / F`` steps (H must be a multiple)."""
    fragment_sync_delay: int = 0
    """tau, inner steps between starting a fragment's sync and applying it
    (``0 <= tau < sync_every / F``; 0 with an outer overlap)."""
    overlap: OuterOverlap = OuterOverlap.NONE
    """Whether a sync's allreduce runs during the whole next cycle and is applied at the next
    sync point (``overlap.py``; DiLoCo's ``outer_overlap``)."""

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
        if self.overlap.overlapped and self.fragment_sync_delay != 0:
            raise ValueError(
                f"outer_overlap={self.overlap.value!r} keeps every sync in flight for a whole "
                f"cycle; fragment_sync_delay must be 0 with it, got {self.fragment_sync_delay}"
            )

    @property
    def cycle(self) -> int:
        """Inner steps between the starts of two fragment syncs (``sync_every / F``)."""
        return self.sync_every // self.num_fragments

    @property
    def quorum_step(self) -> int:
        """The inner step of a cycle after which the quorum is formed (``cycle - tau``)."""
        return self.cycle - self.fragment_sync_delay

    def actions(
        self, local_step: int, syncs_committed: int, in_flight: int | None = None
    ) -> SyncActions:
        """What to do after inner step ``local_step`` of the cycle (1-based: the count of inner
        steps since the cycle started, this one included), with ``syncs_committed`` fragment
        syncs committed so far and fragment ``in_flight``'s sync on the wire (None: none).

        Without an overlap, steps other than ``quorum_step`` and ``cycle`` do nothing (the sync
        started at ``quorum_step`` is the one applied at ``cycle``); with one, only ``cycle``
        acts, finishing ``in_flight`` (None at the first sync point, or after a state was
        loaded)."""
        fragment = syncs_committed % self.num_fragments
        ends = local_step == self.cycle
        if self.overlap.overlapped:
            if not ends:
                return SyncActions()
            return SyncActions(
                finish_fragment=in_flight, form_quorum=True, start_fragment=fragment, end_cycle=True
            )
        starts = local_step == self.quorum_step
        return SyncActions(
            form_quorum=starts,
            start_fragment=fragment if starts else None,
            end_cycle=ends,
            apply_fragment=fragment if ends else None,
        )
