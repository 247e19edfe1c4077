"""The faults the project's chaos tests, soak tests, failure demo and goodput benchmark inject:
one vocabulary (:class:`FaultKind`), one seeded schedule (:func:`fault_schedule`) and one rule
for which groups a fault may take so that the job keeps its state (:func:`fault_victims`,
:func:`donor_may_die`).

Per-step FT keeps the job's state only in live replica groups: the *holders* are the groups that
took part in the job's newest commit and have not been struck since. A fault that takes every
holder does not test recovery, it ends the job's state. So every kind but
:attr:`FaultKind.CORRELATED` may only take victims that leave at least one holder, and waits (the
rule answers None) until enough groups hold the state. :attr:`FaultKind.CORRELATED` is the one
kind meant to take every group at once (a rack, a power domain or a switch failing): it is
scheduled rarely (:data:`CORRELATED_PROBABILITY`, :data:`CORRELATED_SPACING`) and only where the
caller names it in ``kinds``.

Adding a kind: one member here (with its entry in :data:`STATE_VICTIMS`), its injector in each
harness that supports it, and its test.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum


class FaultKind(StrEnum):
    """What a scheduled fault does to the job."""

    SIGKILL = "sigkill"
    """SIGKILL one rank of a replica group; its launcher (torchrun, or the test) replaces it."""
    SIGSTOP = "sigstop"
    """SIGSTOP one rank for longer than the job's timeouts allow, then SIGCONT."""
    LINK_DOWN = "link_down"
    """A replica group's network link down for a while (its host's cable pulled)."""
    LIGHTHOUSE = "lighthouse"
    """SIGKILL the lighthouse and start it again on the same address; no group is touched."""
    LIGHTHOUSE_GROUP_AWAY = "lighthouse_group_away"
    """SIGKILL the lighthouse and a group together; the group's replacement asks the restarted
    lighthouse first (its ``--state_dir`` must make it heal, not start a second line)."""
    DONOR_KILL = "donor_kill"
    """SIGKILL a rank of one group, then a rank of the group it heals from, while it heals
    (the donor only while another group holds the state: :func:`donor_may_die`)."""
    TWO_GROUPS = "two_groups"
    """SIGKILL a rank of two groups within one step."""
    CORRELATED = "correlated"
    """SIGKILL a rank of every group at once: the job's state is lost (its newest checkpoint is
    all that is left). Scheduled rarely, and only when named in ``kinds``."""


STATE_VICTIMS: dict[FaultKind, int] = {
    FaultKind.SIGKILL: 1,
    FaultKind.SIGSTOP: 1,
    FaultKind.LINK_DOWN: 1,
    FaultKind.LIGHTHOUSE: 0,
    FaultKind.LIGHTHOUSE_GROUP_AWAY: 1,
    FaultKind.DONOR_KILL: 2,
    FaultKind.TWO_GROUPS: 2,
}
"""Holders a fault takes away from the job's state, at once or (``DONOR_KILL``: the victim,
then its donor) while it plays out; it fires only while a holder more than this survives it.
``CORRELATED`` is not here: it takes every group."""
DEFAULT_KINDS: tuple[FaultKind, ...] = tuple(k for k in FaultKind if k is not FaultKind.CORRELATED)
"""Every kind but the correlated one: what a run that must keep its state draws from."""
CORRELATED_PROBABILITY = 0.02
"""Chance that a scheduled fault is the correlated one, where ``kinds`` names it (about one in
50 faults: a 60-minute run at a fault every 30 s sees one or two)."""
CORRELATED_SPACING = 25
"""At least this many other faults between two correlated ones (and before the first), so a
run never loses its state back to back."""


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule: what, when (seconds after the job trains), to whom."""

    at_s: float
    kind: FaultKind
    groups: tuple[int, ...]
    """The victim groups it asks for (two for ``TWO_GROUPS``, every group for ``CORRELATED``,
    else one); :func:`fault_victims` decides which it may take when it is due."""
    rank: int
    """The victim rank inside each victim group."""


def fault_schedule(
    seed: int,
    *,
    start_s: float,
    end_s: float,
    mean_interval_s: float,
    min_interval_s: float,
    groups: int,
    ranks: int,
    kinds: Sequence[FaultKind],
) -> list[Fault]:
    """Faults from ``start_s`` to ``end_s``: exponential intervals of mean ``mean_interval_s``
    (at least ``min_interval_s``), kinds in shuffled rounds (every kind once per round, so a
    short run still mixes them), victims drawn uniformly. ``CORRELATED``, when in ``kinds``, is
    not in the rounds: each fault is it with probability :data:`CORRELATED_PROBABILITY`, at
    least :data:`CORRELATED_SPACING` faults after the previous one (and after the start); when
    ``kinds`` names it alone, every fault is it. The same arguments give the same schedule
    (without ``CORRELATED``, the schedule of the kinds before it existed)."""
    if not kinds:
        raise ValueError("kinds must name at least one FaultKind, got none")
    two = {FaultKind.TWO_GROUPS, FaultKind.DONOR_KILL, FaultKind.CORRELATED}
    if groups < 2 and two & set(kinds):
        raise ValueError(
            f"two_groups, donor_kill and correlated need >= 2 groups, got groups={groups}"
        )
    if not 0 < min_interval_s <= mean_interval_s:
        raise ValueError(
            f"need 0 < min_interval_s <= mean_interval_s, got {min_interval_s}, {mean_interval_s}"
        )
    rng = random.Random(seed)
    rounds = [k for k in kinds if k is not FaultKind.CORRELATED]
    correlated = FaultKind.CORRELATED in kinds
    since_correlated = 0
    faults: list[Fault] = []
    order: list[FaultKind] = []
    at = start_s
    while True:
        at += max(rng.expovariate(1.0 / mean_interval_s), min_interval_s)
        if at > end_s:
            return faults
        if correlated and (
            not rounds
            or (rng.random() < CORRELATED_PROBABILITY and since_correlated >= CORRELATED_SPACING)
        ):
            since_correlated = 0
            faults.append(Fault(round(at, 3), FaultKind.CORRELATED, tuple(range(groups)), 0))
            continue
        since_correlated += 1
        if not order:
            order = list(rounds)
            rng.shuffle(order)
        kind = order.pop()
        victims = tuple(rng.sample(range(groups), 2 if kind is FaultKind.TWO_GROUPS else 1))
        faults.append(Fault(round(at, 3), kind, victims, rng.randrange(ranks)))


def fault_victims(
    kind: FaultKind, wanted: Sequence[int], holders: Collection[int], groups: int
) -> tuple[int, ...] | None:
    """The groups ``kind`` may take now, given the ``holders`` of the job's newest committed
    state among ``groups`` groups; None while it must wait (fewer than ``STATE_VICTIMS[kind] +
    1`` holders: the job would lose its state). Each wanted group that does not hold the state
    is replaced by the next one (in group order, wrapping) that does and is not taken yet; the
    lighthouse kind takes none; ``CORRELATED`` takes every group whatever the holders."""
    if kind is FaultKind.CORRELATED:
        return tuple(range(groups))
    if len(set(holders)) < STATE_VICTIMS[kind] + 1:
        return None
    out: list[int] = []
    for g in wanted if STATE_VICTIMS[kind] else ():
        order = [(g + i) % groups for i in range(groups)]
        out.append(next(v for v in order if v in holders and v not in out))
    return tuple(out)


def donor_may_die(donor: int, holders: Collection[int]) -> bool:
    """Whether a ``DONOR_KILL``'s pending watch may kill ``donor`` (the group a victim heals
    from) now: only while some other group holds the job's state. A watch that fires late (the
    victim's heal came long after its fault) checks the holders of that moment."""
    return any(g != donor for g in holders)
