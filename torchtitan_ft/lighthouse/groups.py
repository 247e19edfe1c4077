"""What the replica groups tell the lighthouse about their progress, and the job's figures
made from it, for the status page and ``torchft_lighthouse status``.

Each group's quorum request may carry a ``GroupProgress`` (our Manager sends one; torchft
0.2.0's sends none, and its group then shows only its membership): recent step times, the
job's committed batches as the group counts them, its discarded steps, and the heals that
ended since its last request. :class:`GroupBook` keeps, per group, a short series of steps per
second, its heals, and its time in and out of the quorum; and for the job, its committed
batches over time and its membership over time.

The job's figures are pure functions of those series (``window_rate``, ``availability``); no
function here reads a clock: the caller passes wall times (seconds).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torchtitan_ft.lighthouse.history import EventKind
from torchtitan_ft.proto import torchft_pb2 as pb

SPARK_POINTS = 60
"""Steps-per-second samples kept per group (its sparkline)."""
HEALS_KEPT = 20
"""Heals kept per group (the newest)."""
GROUPS_KEPT = 1000
"""Groups kept (the most recently seen); a restarted torchft group comes back under a new id."""
SAMPLE_EVERY_S = 1.0
"""The job's committed batches are sampled at most this often."""
SAMPLES_KEPT = 24 * 3600
"""Samples of the job's committed batches and membership changes kept (a day at 1 per s)."""
SUSTAINED_WINDOW_S = 30.0
"""The window of the job's sustained rate: its best is the best such window seen."""


@dataclass
class Heal:
    time: float
    """When the lighthouse heard of it (wall seconds)."""
    to_step: int
    source: str
    bytes: int
    seconds: float
    outcome: str


@dataclass
class Group:
    """One replica group as the lighthouse saw it."""

    first_seen: float
    last_seen: float
    steps_per_s: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=SPARK_POINTS)
    )
    """(wall time, steps per second) of its recent steps, oldest first."""
    batches_committed: int = 0
    discarded_steps: int = 0
    """Discarded steps it reported, summed over its process restarts."""
    last_discarded: int = 0
    heals: deque[Heal] = field(default_factory=lambda: deque(maxlen=HEALS_KEPT))
    heal_count: int = 0
    in_quorum_s: float = 0.0
    away_s: float = 0.0
    """Time out of the quorum since it first joined one."""
    in_quorum_since: float | None = None
    away_since: float | None = None
    reports: bool = False
    """Whether it sends ``GroupProgress`` (our Manager) or not (torchft 0.2.0's)."""

    def in_quorum_now(self, now: float) -> float:
        return self.in_quorum_s + (now - self.in_quorum_since if self.in_quorum_since else 0.0)

    def away_now(self, now: float) -> float:
        return self.away_s + (now - self.away_since if self.away_since else 0.0)


def heal_reason(heal: pb.HealReport) -> str:
    return (
        f"healed to step {heal.to_step} from {heal.source_address or '?'}: {heal.bytes} bytes "
        f"in {heal.seconds:.3f} s, {heal.outcome or 'outcome not reported'}"
    )


def discarded_total(total: int, last: int, reported: int) -> tuple[int, int]:
    """A group's discarded steps summed over restarts: ``(total, last)`` after it reports
    ``reported`` (its process's own count, which restarts at 0 with the process)."""
    added = reported - last if reported >= last else reported
    return total + added, reported


def window_rate(
    window: deque[tuple[float, int]], sample: tuple[float, int], window_s: float
) -> float | None:
    """Appends ``sample`` (wall time, the job's committed batches) to ``window`` and returns
    the committed batches per second over the last ``window_s`` (None until ``window`` spans
    that long). ``window`` keeps the samples since one at or before ``window_s`` ago."""
    window.append(sample)
    t_end, b_end = sample
    while len(window) > 2 and t_end - window[1][0] >= window_s:
        window.popleft()
    t_start, b_start = window[0]
    if t_end - t_start < window_s:
        return None
    return (b_end - b_start) / (t_end - t_start)


def availability(changes: Sequence[tuple[float, int]], full: int, now: float) -> float | None:
    """Share of the time since the first quorum during which it had ``full`` members (or
    more). ``changes``: (wall time, members) at each new quorum, oldest first; None before
    the first."""
    if not changes or full < 1 or now <= changes[0][0]:
        return None
    at_full = 0.0
    ends = [t for t, _ in changes]
    ends = [*ends[1:], now]
    for (t, members), t_next in zip(changes, ends, strict=True):
        if members >= full:
            at_full += t_next - t
    return at_full / (now - changes[0][0])


class GroupBook:
    """The groups' figures and the job's series (event-loop only, no clock of its own)."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.batches: deque[tuple[float, int]] = deque(maxlen=SAMPLES_KEPT)
        """(wall time, the job's committed batches), at most one per ``SAMPLE_EVERY_S``."""
        self.membership: deque[tuple[float, int]] = deque(maxlen=SAMPLES_KEPT)
        """(wall time, members) of each quorum with a new membership."""
        self.full = 0
        """The most members a quorum had: the job's full membership."""
        self._window: deque[tuple[float, int]] = deque()
        self.rate: float | None = None
        """The job's committed batches per second over the last ``SUSTAINED_WINDOW_S``."""
        self.best_rate: float | None = None
        """The best such rate so far."""

    def _group(self, rid: str, now: float) -> Group:
        group = self.groups.get(rid)
        if group is None:
            group = self.groups[rid] = Group(first_seen=now, last_seen=now)
            while len(self.groups) > GROUPS_KEPT:
                self.groups.popitem(last=False)
        else:
            self.groups.move_to_end(rid)
            group.last_seen = now
        return group

    def report(
        self, rid: str, progress: pb.GroupProgress, now: float
    ) -> list[tuple[EventKind, str, str]]:
        """Takes a group's ``GroupProgress``; returns the events of the heals it reports."""
        group = self._group(rid, now)
        group.reports = True
        for timing in progress.steps:
            if timing.step_seconds > 0:
                group.steps_per_s.append((now, 1.0 / timing.step_seconds))
        group.batches_committed = progress.batches_committed
        group.discarded_steps, group.last_discarded = discarded_total(
            group.discarded_steps, group.last_discarded, progress.discarded_steps
        )
        if not self.batches or now - self.batches[-1][0] >= SAMPLE_EVERY_S:
            sample = (now, max(g.batches_committed for g in self.groups.values()))
            self.batches.append(sample)
            self.rate = window_rate(self._window, sample, SUSTAINED_WINDOW_S)
            if self.rate is not None:
                self.best_rate = max(self.rate, self.best_rate or 0.0)
        events = []
        for heal in progress.heals:
            group.heals.append(
                Heal(now, heal.to_step, heal.source_address, heal.bytes, heal.seconds, heal.outcome)
            )
            group.heal_count += 1
            events.append((EventKind.HEAL, rid, heal_reason(heal)))
        return events

    def were_members(self, ids: Iterable[str]) -> set[str]:
        """Those of ``ids`` that were in a quorum before (since this lighthouse started)."""
        return {
            rid
            for rid in ids
            if (g := self.groups.get(rid)) is not None
            and (g.in_quorum_since is not None or g.away_since is not None)
        }

    def quorum(self, members: Iterable[str], now: float) -> None:
        """A quorum with a new membership was issued."""
        ids = set(members)
        for rid in ids:
            group = self._group(rid, now)
            if group.in_quorum_since is None:
                group.in_quorum_since = now
            if group.away_since is not None:
                group.away_s += now - group.away_since
                group.away_since = None
        for rid, group in self.groups.items():
            if rid not in ids and group.in_quorum_since is not None:
                group.in_quorum_s += now - group.in_quorum_since
                group.in_quorum_since = None
                group.away_since = now
        self.full = max(self.full, len(ids))
        self.membership.append((now, len(ids)))

    def job(self, now: float) -> dict:
        """The job's figures: committed batches and their rate now and at best, availability,
        discarded steps."""
        rate, best = self.rate, self.best_rate
        avail = availability(self.membership, self.full, now)
        return {
            "batches_committed": self.batches[-1][1] if self.batches else 0,
            "batches_per_s": None if rate is None else round(rate, 3),
            "best_batches_per_s": None if best is None else round(best, 3),
            "sustained_window_s": SUSTAINED_WINDOW_S,
            "full_membership": self.full,
            "availability": None if avail is None else round(avail, 4),
            "discarded_steps": sum(g.discarded_steps for g in self.groups.values()),
        }

    def view(self, rid: str, group: Group, now: float) -> dict:
        series = [round(v, 3) for _, v in group.steps_per_s]
        return {
            "replica_id": rid,
            "reports": group.reports,
            "steps_per_s": series[-1] if series else None,
            "steps_per_s_series": series,
            "batches_committed": group.batches_committed,
            "discarded_steps": group.discarded_steps,
            "in_quorum": group.in_quorum_since is not None,
            "in_quorum_s": round(group.in_quorum_now(now), 1),
            "away_s": round(group.away_now(now), 1),
            "heal_count": group.heal_count,
            "heals": [
                {
                    "time": round(h.time, 3),
                    "to_step": h.to_step,
                    "source": h.source,
                    "bytes": h.bytes,
                    "seconds": round(h.seconds, 3),
                    "outcome": h.outcome,
                }
                for h in group.heals
            ],
        }

    def views(self, now: float) -> list[dict]:
        """Every group that was ever in a quorum or reported progress, sorted by id."""
        return [self.view(rid, g, now) for rid, g in sorted(self.groups.items())]
