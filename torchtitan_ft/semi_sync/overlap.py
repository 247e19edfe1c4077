"""The one-step-delayed ("eager") outer update of DiLoCo and Streaming DiLoCo: an outer round's
allreduce runs while the next inner steps do, and is applied when it arrives, one outer step
late, keeping the inner progress made meanwhile. The mode and the math; when each step happens
is ``schedule.SyncSchedule``'s answer (it takes the mode), and ``local_sgd.DiLoCo`` carries
both out.

**The math** (one fragment; plain DiLoCo is F = 1). ``G`` is the fragment's global parameters
(the backup every replica group agrees on), ``theta`` the group's local parameters. At each
sync point of the fragment (every ``sync_every / F`` inner steps one fragment has one):

1. *finish* the sync in flight (the one started at the previous sync point), if any: wait for
   the averaged pseudo-gradient ``D``, vote (``should_commit``), and set

       G'    = outer_step(G, D)      if the sync committed, else G   (the round is discarded)
       theta = G' + (theta - S)                                     (:func:`delayed_parameters`)

   where ``S`` is the fragment's local parameters when that sync was started. ``theta - S``
   is exactly the inner progress made while the allreduce was on the wire: it is kept, on top
   of the new global parameters, instead of being thrown away (which is what Streaming DiLoCo's
   ``fragment_sync_delay`` does with ``fragment_update_alpha = 0``);
2. form the quorum (a replica behind heals here, to ``G'``);
3. *start* the next sync: the pseudo-gradient ``G' - theta`` (the local progress since the
   last send, about ``-(theta - S)``) goes into an allreduce, ``S = theta`` is kept, and
   training goes on at once.

So the outer update of round k lands at the end of round k + 1 (one outer step late), and every
inner step of round k + 1 runs while round k's pseudo-gradient is on the wire: with H inner
steps of compute longer than the allreduce, the link costs no wait. The price is staleness:
round k + 1's inner steps start from ``theta`` (round k's local result) rather than from the
averaged ``G'``, so groups drift apart for up to two rounds instead of one, and each outer
step applies a pseudo-gradient measured from parameters that have moved on. How much that
costs in loss depends on H and the outer learning rate; ``benchmarks.semi_sync`` and
``benchmarks.wan`` measure it beside the same strategy without overlap (docs/performance.md).

When the sync in flight does not commit (a group failed during the overlapped round, or the
vote fails), ``G`` stays and the failed round's progress is dropped while the progress made
since its start is kept (``theta = G + (theta - S)``); the same fragment is retried at the
next sync point, as without overlap. Every group computes ``G'`` from the same ``G``, ``D``
and vote, so the global parameters stay bitwise identical across groups; the local parameters
differ by each group's in-flight progress, and become ``G'`` exactly (``theta - S = 0``) when
:meth:`DiLoCo.flush <torchtitan_ft.semi_sync.DiLoCo.flush>` finishes the last sync with no
inner step after it.

**Healing.** The sync in flight is finished before the quorum (step 1 before step 2), so at
the moment a donor offers its state nothing is in flight: a healer receives ``G'``, the outer
optimizer state and the position, sets ``theta = G'`` and joins step 3 with a zero
pseudo-gradient (it brings no progress). A state loaded at any other time (a checkpoint taken
while a sync was in flight) drops that sync in every group resumed from it alike; the local
progress in the checkpointed model is then folded into the next pseudo-gradient.

**The eager update** (``OuterOverlap.EAGER``; the idea of Kale, Douillard and Donchev 2025,
"Eager updates for overlapped communication and computation in DiLoCo", written here from its
description). The delayed update starts the next round from ``G' + (theta - S)``: this
group's own inner progress at full weight, whereas the average that will replace it,
``outer_step(G', D)``, weights that progress 1/N and applies the outer learning rate and
momentum. The eager update starts it from the outer step this group can already take: at
step 3, once its fresh pseudo-gradient ``d`` is on the wire,

    theta = outer_step(G', d / N)     (:func:`own_share`; the optimizer's state is not kept)

so its own share of the average in flight stands in for that average, the other groups'
shares counting as zero until they arrive. (The paper's per-group form adds the other groups'
stale shares and removes its own stale one at every outer step; summed over rounds that is the
same: each share is applied once, a group's own one round early.) When the average arrives
(step 1 of the next sync point) the exact ``G'' = outer_step(G', D)`` replaces the estimate
and the progress made since is kept, as in the delayed update: ``theta = G'' + (theta - S)``
with ``S`` the eager starting point. The global parameters, the outer optimizer's state, the
vote, failures, healing and checkpoints are therefore exactly the delayed update's: the eager
step is recomputed from ``G'``, the optimizer's state and ``d``, which exist anyway, and adds
no state. Only each round's starting point differs. A healer sends ``d = 0`` and starts from
``outer_step(G', 0)`` (the momentum alone).
"""

from __future__ import annotations

from enum import StrEnum

import torch


class OuterOverlap(StrEnum):
    """Whether DiLoCo's outer round overlaps the next inner steps."""

    NONE = "none"
    """The outer round blocks: its allreduce (or, with ``fragment_sync_delay = tau``, the rest
    of it after tau inner steps) is waited for at the sync point and applied at once; all
    groups continue from the same global parameters."""
    DELAYED = "delayed"
    """One-step-delayed ("eager") outer update: the allreduce runs during the whole next
    round (``sync_every / num_fragments`` inner steps) and is applied at the next sync point
    with the inner progress made meanwhile kept (module docstring). Hides the link behind
    compute; costs some loss (staleness). Needs ``fragment_sync_delay = 0`` and
    ``fragment_update_alpha = 0``."""
    EAGER = "eager"
    """As ``DELAYED``, but each round starts from the outer step taken with this group's own
    share of the average in flight (its pseudo-gradient / the number of groups) rather than
    from its raw inner progress; the exact average replaces that estimate when it arrives
    (module docstring). Same constraints and state as ``DELAYED``."""

    @property
    def overlapped(self) -> bool:
        """Whether an outer round's allreduce runs during the next inner steps."""
        return self is not OuterOverlap.NONE


@torch.no_grad()
def delayed_parameters(
    new_global: torch.Tensor, local: torch.Tensor, sent: torch.Tensor
) -> torch.Tensor:
    """The parameters after a delayed outer update: ``new_global + (local - sent)``, the
    global parameters after the round (updated or, when it was discarded, unchanged) plus the
    inner progress made since the round's pseudo-gradient was sent (``sent`` = the local
    parameters then). Exactly ``new_global`` when no inner step ran since (``local == sent``)."""
    return new_global + (local - sent)


def own_share(pseudo_gradient: torch.Tensor, participants: int) -> torch.Tensor:
    """This group's share of the average in flight: ``pseudo_gradient / participants``.

    Raises:
        ValueError: ``participants`` < 1.
    """
    if participants < 1:
        raise ValueError(f"an average needs at least 1 participant, got {participants}")
    return pseudo_gradient / participants


def check_outer_overlap(
    overlap: OuterOverlap | str, fragment_sync_delay: int, fragment_update_alpha: float
) -> OuterOverlap:
    """Returns ``overlap`` as an ``OuterOverlap``.

    Raises:
        ValueError: an unknown name, or an overlap with a ``fragment_sync_delay`` or a
            ``fragment_update_alpha`` (it replaces both: the sync is in flight for the whole
            cycle, and the local progress is kept exactly rather than mixed).
    """
    try:
        mode = OuterOverlap(overlap)
    except ValueError:
        names = ", ".join(repr(m.value) for m in OuterOverlap)
        raise ValueError(f"outer_overlap must be one of {names}, got {overlap!r}") from None
    if mode.overlapped:
        if fragment_sync_delay != 0:
            raise ValueError(
                f"outer_overlap={mode.value!r} keeps every sync in flight for a whole cycle; "
                f"fragment_sync_delay must be 0 with it, got {fragment_sync_delay}"
            )
        if fragment_update_alpha != 0.0:
            raise ValueError(
                f"outer_overlap={mode.value!r} keeps the in-flight local progress exactly; "
                f"fragment_update_alpha must be 0 with it, got {fragment_update_alpha}"
            )
    return mode
