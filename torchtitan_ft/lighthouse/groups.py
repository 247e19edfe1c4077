"""What the replica groups tell the lighthouse about their progress, and the job's figures
made from it, for the status page and ``torchft_lighthouse status``.

Each group's quorum request may carry a ``GroupProgress`` (our Manager sends one; torchft
0.2.0's sends none, and its group then shows only its membership): recent step times, the
job's committed batches as the group counts them, and its committed samples when its trainer
said how many samples a batch holds (the Manager's ``samples_per_batch``), its discarded
steps, the heals and the recoveries that ended since its last request, and the launcher's
name for the job its process runs in (a Slurm job id, a TorchX app id and role, a pod name;
the Manager's ``launcher_job`` setting). :class:`GroupBook`
keeps, per group, a short series of steps per second, its heals, its recoveries' breakdowns
(``lighthouse.recoveries``, with the departures of processes the state saw go), and its time
in and out of the quorum; and for
the job, the rate of its committed samples (or batches, when no group reports samples) and its
membership over time.

The job's figures are pure functions of those series (``window_rate``, ``availability``); no
function here reads a clock: the caller passes wall times (seconds).

Restarts (``GroupsFile``, under the lighthouse's ``--state_dir``): the figures that add up over
the job (time in the quorum and away, heals, discarded steps, committed counts and their rate
window, the best rate, the membership changes behind availability) are saved in
``groups.json`` and restored by a restarted lighthouse (``GroupBook.to_json``/``from_json``).
The time the lighthouse was down counts for no group as in the quorum or away, and for the job
as time without a quorum (not at full membership) in which nothing was committed. The
steps-per-second sparklines start again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchtitan_ft.launcher_job import LAUNCHER_JOB_MAX
from torchtitan_ft.lighthouse.history import HistoryKind
from torchtitan_ft.lighthouse.recoveries import (
    DEPARTURES_KEPT,
    RECOVERIES_KEPT,
    Departure,
    departure_before,
    group_name,
    recovery,
)
from torchtitan_ft.lighthouse.timeline import clock
from torchtitan_ft.proto import torchft_pb2 as pb

logger = logging.getLogger(__name__)

SPARK_POINTS = 60
"""Steps-per-second samples kept per group (its sparkline)."""
HEALS_KEPT = 20
"""Heals kept per group (the newest)."""
GROUPS_KEPT = 1000
"""Groups kept (the most recently seen); a restarted torchft group comes back under a new id."""
SAMPLE_EVERY_S = 1.0
"""The job's committed counts are sampled at most this often."""
CHANGES_KEPT = 24 * 3600
"""Membership changes kept for the job's availability (the newest)."""
SUSTAINED_WINDOW_S = 30.0
"""The window of the job's sustained rate: its best is the best such window seen."""
GROUPS_FILE = "groups.json"
"""The groups' figures under ``--state_dir`` (``GroupsFile``)."""
SAVE_EVERY_S = 1.0
"""``groups.json`` is rewritten this often while the lighthouse runs (its time figures move
on): a SIGKILLed lighthouse loses at most this much of them."""
SAVE_CHANGED_S = 0.2
"""... and this soon after a heal, a discarded step or a membership change."""
SAVE_SHARE = 0.02
"""... but saving takes at most this share of the lighthouse's event loop: a big job's file is
saved less often (``benchmarks/history_memory.py``: 1,000 groups with 20 heals each write
1.8 MB in about 0.35 s at load average 21, so every 17 s or so)."""
Unit = Literal["samples", "batches"]
"""What the job's committed figures count: samples when a group reports them, else batches."""


@dataclass
class Heal:
    time: float
    """When the lighthouse heard of it (wall seconds)."""
    to_step: int
    source: str
    bytes: int
    seconds: float
    outcome: str
    started: float = 0.0
    """When it started (wall seconds; 0: not reported)."""


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
    samples_committed: int | None = None
    """None: the group does not report samples (no ``samples_per_batch``)."""
    discarded_steps: int = 0
    """Discarded steps it reported, summed over its process restarts."""
    last_discarded: int = 0
    heals: deque[Heal] = field(default_factory=lambda: deque(maxlen=HEALS_KEPT))
    heal_count: int = 0
    recoveries: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECOVERIES_KEPT))
    """Its recoveries' breakdowns (``Recovery.to_json``), oldest first."""
    in_quorum_s: float = 0.0
    away_s: float = 0.0
    """Time out of the quorum since it first joined one."""
    in_quorum_since: float | None = None
    away_since: float | None = None
    reports: bool = False
    """Whether it sends ``GroupProgress`` (our Manager) or not (torchft 0.2.0's)."""
    launcher_job: str | None = None
    """The launcher's name for the job its process runs in (``GroupProgress.launcher_job``);
    None: not said."""

    def in_quorum_now(self, now: float) -> float:
        since = self.in_quorum_since
        return self.in_quorum_s + (now - since if since is not None else 0.0)

    def away_now(self, now: float) -> float:
        return self.away_s + (now - self.away_since if self.away_since is not None else 0.0)


def heal_reason(heal: pb.HealReport) -> str:
    started = f" (started {clock(heal.started)})" if heal.started > 0 else ""
    return (
        f"healed to step {heal.to_step} from {heal.source_address or '?'}{started}: "
        f"{heal.bytes} bytes in {heal.seconds:.3f} s, {heal.outcome or 'outcome not reported'}"
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


@dataclass
class Rate:
    """One of the job's committed counts (samples or batches), its rate over the last
    ``SUSTAINED_WINDOW_S`` and the best such rate."""

    count: int | None = None
    """The newest count; None before any group reported one."""
    sampled_at: float = -math.inf
    window: deque[tuple[float, int]] = field(default_factory=deque)
    """(wall time, count) samples, at most one per ``SAMPLE_EVERY_S`` (``window_rate``)."""
    rate: float | None = None
    best: float | None = None

    def sample(self, now: float, count: int) -> None:
        """Takes the count at ``now``."""
        self.count = count
        if now - self.sampled_at < SAMPLE_EVERY_S:
            return
        self.sampled_at = now
        self.rate = window_rate(self.window, (now, count), SUSTAINED_WINDOW_S)
        if self.rate is not None:
            self.best = max(self.rate, self.best or 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sampled_at": self.sampled_at if self.window else None,
            "window": list(self.window),
            "rate": self.rate,
            "best": self.best,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rate:
        """As saved: the window goes on after a restart, so the rate over it counts the time
        the lighthouse was down (the job committed nothing then)."""
        count, best, rate, sampled_at = d["count"], d["best"], d["rate"], d["sampled_at"]
        return cls(
            count=None if count is None else int(count),
            sampled_at=-math.inf if sampled_at is None else float(sampled_at),
            window=deque((float(t), int(n)) for t, n in d["window"]),
            rate=None if rate is None else float(rate),
            best=None if best is None else float(best),
        )


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
        self.membership: deque[tuple[float, int]] = deque(maxlen=CHANGES_KEPT)
        """(wall time, members) at each change of the quorum's size; 0 while the lighthouse was
        down."""
        self.full = 0
        """The most members a quorum had: the job's full membership."""
        self.batches = Rate()
        """The job's committed batches per second."""
        self.samples = Rate()
        """The job's committed samples per second (groups with ``samples_per_batch``)."""
        self.departures: OrderedDict[str, Departure] = OrderedDict()
        """The newest departure per group name (``lighthouse.recoveries``): a start of the
        group after it is a replacement."""
        self.changed = False
        """A figure that adds up (heals, discarded steps, membership) changed since the last
        ``to_json``: ``GroupsFile`` saves it soon."""

    def _group(self, rid: str, now: float) -> Group:
        group = self.groups.get(rid)
        if group is None:
            group = self.groups[rid] = Group(first_seen=now, last_seen=now)
            while len(self.groups) > GROUPS_KEPT:
                self.groups.popitem(last=False)
            self.changed = True
        else:
            self.groups.move_to_end(rid)
            group.last_seen = now
        return group

    def report(
        self, rid: str, progress: pb.GroupProgress, now: float
    ) -> list[tuple[HistoryKind, str, str]]:
        """Takes a group's ``GroupProgress``; returns the events of the heals it reports."""
        group = self._group(rid, now)
        group.reports = True
        for timing in progress.steps:
            if timing.step_seconds > 0:
                group.steps_per_s.append((now, 1.0 / timing.step_seconds))
        group.batches_committed = progress.batches_committed
        if progress.launcher_job:
            group.launcher_job = progress.launcher_job[:LAUNCHER_JOB_MAX]  # a longer one: cut
        if progress.HasField("samples_committed"):
            group.samples_committed = progress.samples_committed
        discarded = group.discarded_steps
        group.discarded_steps, group.last_discarded = discarded_total(
            group.discarded_steps, group.last_discarded, progress.discarded_steps
        )
        self.changed |= group.discarded_steps != discarded
        self.batches.sample(now, max(g.batches_committed for g in self.groups.values()))
        samples = [g.samples_committed for g in self.groups.values()]
        if any(n is not None for n in samples):
            self.samples.sample(now, max(n for n in samples if n is not None))
        events = []
        for heal in progress.heals:
            group.heals.append(
                Heal(
                    now,
                    heal.to_step,
                    heal.source_address,
                    heal.bytes,
                    heal.seconds,
                    heal.outcome,
                    heal.started,
                )
            )
            group.heal_count += 1
            self.changed = True
            events.append((HistoryKind.HEAL, rid, heal_reason(heal)))
        for report in progress.recoveries:
            self._recovered(rid, group, report)
        return events

    def departed(self, departure: Departure) -> None:
        """A group's process went away (the first notice of it counts)."""
        name = group_name(departure.replica_id)
        known = self.departures.get(name)
        if known is not None and known.replica_id == departure.replica_id:
            return
        self.departures[name] = departure
        self.departures.move_to_end(name)
        while len(self.departures) > DEPARTURES_KEPT:
            self.departures.popitem(last=False)

    def _recovered(self, rid: str, group: Group, report: pb.RecoveryReport) -> None:
        """Keeps the breakdown of a recovery ``rid`` reported; a replacement uses up its
        group's departure."""
        departure = departure_before(self.departures, rid)
        heal_bytes = next(
            (h.bytes for h in reversed(group.heals) if h.to_step == report.heal_to_step), None
        )
        found = recovery(rid, report, departure, heal_bytes if report.heal_outcome else None)
        if found is None:
            return
        if found.failed_replica_id is not None:
            del self.departures[group_name(rid)]
        group.recoveries.append(found.to_json())
        self.changed = True

    def were_members(self, ids: Iterable[str]) -> set[str]:
        """Those of ``ids`` that were in a quorum before (also before a lighthouse restart,
        under ``--state_dir``)."""
        return {
            rid
            for rid in ids
            if (g := self.groups.get(rid)) is not None
            and (g.in_quorum_since is not None or g.away_since is not None)
        }

    def quorum(self, members: Iterable[str], now: float) -> None:
        """A quorum with a new id was issued."""
        ids = set(members)
        for rid in ids:
            departure = self.departures.get(group_name(rid))
            if departure is not None and departure.replica_id == rid:  # it is back
                del self.departures[group_name(rid)]
            group = self._group(rid, now)
            if group.in_quorum_since is None:
                group.in_quorum_since = now
                self.changed = True
            if group.away_since is not None:
                group.away_s += now - group.away_since
                group.away_since = None
        for rid, group in self.groups.items():
            if rid not in ids and group.in_quorum_since is not None:
                group.in_quorum_s += now - group.in_quorum_since
                group.in_quorum_since = None
                group.away_since = now
                self.changed = True
        self.full = max(self.full, len(ids))
        if not self.membership or self.membership[-1][1] != len(ids):
            self.membership.append((now, len(ids)))
            self.changed = True

    def unit(self) -> Unit:
        """Samples once a group reports them (its trainer said ``samples_per_batch``), else
        batches (torchft's clients, or a trainer that did not say its batch size)."""
        return "samples" if self.samples.count is not None else "batches"

    def job(self, now: float) -> dict:
        """The job's figures: committed samples (or batches: ``unit``) and their rate now and at
        best, the same in batches, availability, discarded steps."""
        avail = availability(self.membership, self.full, now)
        unit = self.unit()
        figures: dict[str, Any] = {"unit": unit}
        if unit == "batches":
            figures["unit_reason"] = (
                "no replica group reports its samples per batch (Manager samples_per_batch or "
                "TORCHFT_SAMPLES_PER_BATCH; torchft's clients cannot): committed batches shown"
            )
        for name, rate in (("batches", self.batches), ("samples", self.samples)):
            figures[f"{name}_committed"] = rate.count
            figures[f"{name}_per_s"] = None if rate.rate is None else round(rate.rate, 3)
            figures[f"best_{name}_per_s"] = None if rate.best is None else round(rate.best, 3)
        figures["batches_committed"] = figures["batches_committed"] or 0
        return {
            **figures,
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
            "launcher_job": group.launcher_job,
            "steps_per_s": series[-1] if series else None,
            "steps_per_s_series": series,
            "batches_committed": group.batches_committed,
            "samples_committed": group.samples_committed,
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
                    "started": round(h.started, 3) if h.started else None,
                }
                for h in group.heals
            ],
            "recoveries": list(group.recoveries),
        }

    def views(self, now: float) -> list[dict]:
        """Every group that was ever in a quorum or reported progress, sorted by id."""
        return [self.view(rid, g, now) for rid, g in sorted(self.groups.items())]

    # -- across restarts ------------------------------------------------------------------

    def to_json(self, now: float) -> dict[str, Any]:
        """What a restarted lighthouse restores (``from_json``), as of ``now``: open spells in
        and out of the quorum are counted up to ``now``."""
        self.changed = False
        groups = {}
        for rid, g in self.groups.items():
            groups[rid] = {
                "first_seen": g.first_seen,
                "last_seen": g.last_seen,
                "reports": g.reports,
                "launcher_job": g.launcher_job,
                "batches_committed": g.batches_committed,
                "samples_committed": g.samples_committed,
                "discarded_steps": g.discarded_steps,
                "last_discarded": g.last_discarded,
                "heal_count": g.heal_count,
                "heals": [
                    [h.time, h.to_step, h.source, h.bytes, h.seconds, h.outcome, h.started]
                    for h in g.heals
                ],
                "recoveries": list(g.recoveries),
                "in_quorum_s": g.in_quorum_now(now),
                "away_s": g.away_now(now),
                "spell": _spell(g),
            }
        return {
            "version": 1,
            "saved_at": now,
            "full": self.full,
            "membership": list(self.membership),
            "batches": self.batches.to_json(),
            "samples": self.samples.to_json(),
            "groups": groups,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], now: float) -> GroupBook:
        """The book ``to_json`` saved, for a lighthouse restarted at ``now``: a group in the
        quorum (or away) then is so again from ``now`` until the next quorum says otherwise;
        the job had no quorum from ``saved_at`` to ``now``.

        Raises:
            ValueError, KeyError, TypeError: ``d`` is not what ``to_json`` writes.
        """
        if d.get("version") != 1:
            raise ValueError(f"version {d.get('version')!r}, expected 1")
        book = cls()
        for rid, gd in d["groups"].items():
            g = book.groups[str(rid)] = Group(
                first_seen=float(gd["first_seen"]), last_seen=float(gd["last_seen"])
            )
            g.reports = bool(gd["reports"])
            job = gd.get("launcher_job")  # older files: none
            g.launcher_job = None if job is None else str(job)
            g.batches_committed = int(gd["batches_committed"])
            samples = gd["samples_committed"]
            g.samples_committed = None if samples is None else int(samples)
            g.discarded_steps = int(gd["discarded_steps"])
            g.last_discarded = int(gd["last_discarded"])
            g.heal_count = int(gd["heal_count"])
            g.heals.extend(
                Heal(float(t), int(step), str(src), int(n), float(sec), str(out), float(start))
                for t, step, src, n, sec, out, start in gd["heals"]
            )
            g.recoveries.extend(dict(r) for r in gd.get("recoveries", ()))  # older files: none
            g.in_quorum_s = float(gd["in_quorum_s"])
            g.away_s = float(gd["away_s"])
            spell = gd["spell"]
            if spell not in ("in", "away", None):
                raise ValueError(f"group {rid!r}: spell {spell!r}, expected in, away or null")
            g.in_quorum_since = now if spell == "in" else None
            g.away_since = now if spell == "away" else None
        book.full = int(d["full"])
        book.membership.extend((float(t), int(n)) for t, n in d["membership"])
        if book.membership:
            book.membership.append((float(d["saved_at"]), 0))
        book.batches = Rate.from_json(d["batches"])
        book.samples = Rate.from_json(d["samples"])
        return book


def _spell(group: Group) -> str | None:
    """Whether the group is in the quorum ("in"), out of it since it was in one ("away"), or
    neither yet (None)."""
    if group.in_quorum_since is not None:
        return "in"
    return "away" if group.away_since is not None else None


def save_due(since_s: float, changed: bool, last_save_s: float) -> bool:
    """Whether ``groups.json`` is saved now: ``since_s`` after the last save, which took
    ``last_save_s``; ``changed``: a figure that adds up changed since (``GroupBook.changed``)."""
    if since_s < last_save_s / SAVE_SHARE:
        return False
    return since_s >= SAVE_EVERY_S or (changed and since_s >= SAVE_CHANGED_S)


class GroupsFile:
    """The groups' figures under ``state_dir`` (``GROUPS_FILE``), replaced atomically: a
    restarted lighthouse shows the same per-group and job figures as before.

    ``timer`` measures how long a save takes (``save_due`` spaces saves by it); tests that
    drive ``now`` by hand pass a timer of their own so that a slow disk does not move them.

    Raises:
        OSError: ``state_dir`` cannot be created, naming it.
    """

    def __init__(self, state_dir: str, timer: Callable[[], float] = time.perf_counter) -> None:
        self._timer = timer
        self.path = Path(state_dir) / GROUPS_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(
                f"cannot keep the groups' figures in {self.path}: {e.strerror or e}; "
                "pick another --state_dir"
            ) from None
        self._saved_at = -math.inf
        self._save_s = 0.0
        """How long the last save took."""
        self._broken = False

    def load(self, now: float) -> GroupBook:
        """The saved book (restored at ``now``), or an empty one when there is none or it
        cannot be read (said in one line)."""
        try:
            d = json.loads(self.path.read_text(encoding="utf-8"))
            return GroupBook.from_json(d, now)
        except FileNotFoundError:
            return GroupBook()
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning(
                "lighthouse: cannot restore the groups' figures from %s (%s: %s); they start "
                "again from zero (the event history is separate)",
                self.path,
                type(e).__name__,
                e,
            )
            return GroupBook()

    def save_due(self, book: GroupBook, now: float) -> None:
        """Saves ``book`` when it is due (``save_due``)."""
        if book.groups and save_due(now - self._saved_at, book.changed, self._save_s):
            self.save(book, now)

    def save(self, book: GroupBook, now: float) -> None:
        if self._broken:
            return
        self._saved_at = now
        started = self._timer()
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(book.to_json(now)), encoding="utf-8")
            os.replace(tmp, self.path)
            self._save_s = self._timer() - started
        except OSError as e:
            # The job goes on; the figures are then lost on restart: say it once.
            self._broken = True
            logger.warning(
                "lighthouse: cannot write %s (%s); the groups' figures will not survive a restart",
                self.path,
                e.strerror or e,
            )
