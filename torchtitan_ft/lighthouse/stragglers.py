"""Straggler reports: which replica group's compute is slower than the others', as pure
functions of the reported step timings.

Every group sends its recent step timings with its quorum request (``GroupProgress``); the
lighthouse keeps a short history of each group's compute seconds and, for each new step a group
reports, calls :func:`judge`. Nothing here does I/O or reads a clock.

The rule:

1. A group's *typical* compute time is the median of its last ``window`` samples (one slow
   step, a page fault or a busy neighbour, does not move it).
2. Its *reference* is the median of the other groups' typical times (groups with at least
   ``window`` samples); with no such other group, the group is not judged.
3. ``relative_speed = reference / typical``: 1.0 typical, 0.25 four times slower.
4. A sample is *slow* when ``typical >= factor * reference``. A group becomes a straggler after
   ``steps`` slow samples in a row, and stops being one after ``steps`` samples in a row that
   are not slow. Reports change nothing for the job; they are logged once when a straggler
   starts and once when it ends.

Detection therefore takes ``steps + window // 2`` steps of the slowdown (the median turns
after half the window): 7 with the defaults.

**A slow link** does not show in compute or step times: the cross-group all-reduce holds every
group to the slowest link's pace, so every group's step is equally long and its compute equally
short. Each group's ManagerServer therefore times a round trip of a fixed payload to the
lighthouse now and then (``LinkProbe``, ``manager/linkprobe.py``) and reports it with its next
quorum request. The same rule judges those probes, each probe's seconds per byte standing for
a step's compute seconds, with ``link_factor``, ``link_probes`` and ``link_window``: a group is a
*link straggler* when its link is ``link_factor`` times slower than the other groups' median
for ``link_probes`` probes in a row. Every probe crosses the lighthouse's link too, which all
groups share, so a slow lighthouse link slows everyone alike and names nobody. A group is a
straggler when its compute or its link is judged slow (``Cause``); the exclusion policy treats
both alike. Detection of a slow link takes ``link_probes + link_window // 2`` probes (5 with
the defaults), one per quorum at most, and at most one per
``link_probe_interval_s`` (``--straggler_link_probe_interval_ms``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from torchtitan_ft.lighthouse.types import GroupSpeed
from torchtitan_ft.proto import torchft_pb2 as pb

MAX_LINK_PROBE_BYTES = 512 * 1024
"""Largest link probe payload: a probe request must stay under the lighthouse's request limit
(``rpc_server.MAX_REQUEST_BYTES``, 1 MiB)."""


@dataclass(frozen=True)
class StragglerOptions:
    factor: float = 2.0
    """How many times slower than the others' median compute a group must be for a step to
    count as slow. Lower catches milder slowdowns; on a loaded machine it risks false reports
    (1.5 reported groups of a clean run on this project's busy 2-core machine)."""
    steps: int = 5
    """Consecutive slow steps before a group is reported (and fast steps before the report
    ends). Higher is steadier, lower reports sooner."""
    window: int = 5
    """Samples of a group's recent compute time whose median is its typical time."""
    link_factor: float = 4.0
    """How many times slower than the others' median link probe (seconds per byte) a group's
    must be for a probe to count as slow. Higher than ``factor``: a probe of a fast link takes
    milliseconds, and a busy machine's scheduling moves that by several times."""
    link_probes: int = 3
    """Consecutive slow probes before a group is reported for its link (and fast probes before
    that report ends)."""
    link_window: int = 5
    """Probes of a group's link whose median is its typical link time."""
    link_probe_bytes: int = 256 * 1024
    """Payload of a link probe, bytes, sent each way (so twice this crosses the group's link
    per probe); 0 asks the groups for no probes (no link report). Larger measures a fast link
    better (a small payload measures its latency); smaller costs less. At most
    ``MAX_LINK_PROBE_BYTES``."""
    link_probe_interval_s: float = 5.0
    """Least seconds between the starts of two probes of a group (a group probes at most
    once per quorum, right after it, while it computes). Shorter detects a slow link in fewer
    steps; longer costs less."""

    def __post_init__(self) -> None:
        for name, factor, steps, window in (
            ("", self.factor, self.steps, self.window),
            ("link_", self.link_factor, self.link_probes, self.link_window),
        ):
            if not factor > 1.0:
                raise ValueError(f"straggler {name}factor must be > 1.0, got {factor!r}")
            if steps < 1:
                what = "link_probes" if name else "steps"
                raise ValueError(f"straggler {what} must be >= 1, got {steps!r}")
            if window < 1:
                raise ValueError(f"straggler {name}window must be >= 1, got {window!r}")

        if not 0 <= self.link_probe_bytes <= MAX_LINK_PROBE_BYTES:
            raise ValueError(
                f"straggler link_probe_bytes must be in [0, {MAX_LINK_PROBE_BYTES}], "
                f"got {self.link_probe_bytes!r}"
            )
        if not self.link_probe_interval_s >= 0:
            raise ValueError(
                f"straggler link_probe_interval_s must be >= 0, got {self.link_probe_interval_s!r}"
            )

    def for_link(self) -> StragglerOptions:
        """The thresholds that judge link probes, as ``judge`` reads them."""
        return dataclasses.replace(
            self, factor=self.link_factor, steps=self.link_probes, window=self.link_window
        )


@dataclass(frozen=True)
class Speed:
    """One group's judged speed, carried from one of its samples to the next."""

    relative_speed: float = 0.0
    """Others' typical compute time / this group's; 0.0 until judged."""
    slow_streak: int = 0
    fast_streak: int = 0
    since_step: int | None = None
    """The group's step when it became a straggler; None while it is not one."""
    since: float | None = None
    """When it became a straggler (the caller's clock); None while it is not one."""
    slow_from: int | None = None
    """The step of the current slow streak's first sample (None: no streak). Link probes are
    not one per step, so the streak's length does not give it."""

    @property
    def straggler(self) -> bool:
        return self.since_step is not None


class Change(StrEnum):
    """What a judgement changed in the report (logged by the lighthouse)."""

    STARTED = "started"
    ENDED = "ended"


class Cause(StrEnum):
    """What a straggler is slow at."""

    COMPUTE = "compute"
    """Its step's compute part (``StepTiming.compute_seconds``)."""
    LINK = "link"
    """Its link's probes (``LinkProbeResult``)."""


def typical(samples: Sequence[float], window: int) -> float | None:
    """Median of the last ``window`` samples; None with fewer."""
    if len(samples) < window:
        return None
    return statistics.median(list(samples)[-window:])


def judge(
    samples: Sequence[float],
    others: Mapping[str, Sequence[float]],
    prior: Speed,
    step: int,
    now: float,
    opts: StragglerOptions,
) -> tuple[Speed, Change | None]:
    """Judges a group after it reported a new compute sample (the last of ``samples``, oldest
    first) at ``step``; ``others`` maps the other groups to their samples."""
    own = typical(samples, opts.window)
    references = [t for s in others.values() if (t := typical(s, opts.window)) is not None]
    if own is None or not references:
        return prior, None
    reference = statistics.median(references)
    relative = reference / own if own > 0 else 1.0
    slow = own >= opts.factor * reference
    slow_streak = prior.slow_streak + 1 if slow else 0
    fast_streak = 0 if slow else prior.fast_streak + 1
    slow_from = None
    if slow:
        # A hand-made prior may have a streak without its first step: one sample a step.
        kept = prior.slow_streak > 0 and prior.slow_from is not None
        slow_from = prior.slow_from if kept else step - prior.slow_streak
    speed = Speed(relative, slow_streak, fast_streak, prior.since_step, prior.since, slow_from)
    if not prior.straggler and slow_streak >= opts.steps:
        # Since the first step of the streak.
        return Speed(relative, slow_streak, 0, slow_from, now, slow_from), Change.STARTED
    if prior.straggler and fast_streak >= opts.steps:
        return Speed(relative, 0, fast_streak), Change.ENDED
    return speed, None


def describe(
    replica_id: str, before: Speed, after: Speed, change: Change, step: int, cause: Cause
) -> str:
    """The log line of a report's start or end: which group, how slow at what, since when."""
    what = "computes at" if cause is Cause.COMPUTE else "has a link at"
    others = "the others' speed" if cause is Cause.COMPUTE else "the others' rate (link probes)"
    if change is Change.STARTED:
        return (
            f"straggler ({cause}): replica group {replica_id!r} {what} "
            f"{after.relative_speed:.2f}x {others} since its step {after.since_step}"
        )
    return (
        f"straggler ended ({cause}): replica group {replica_id!r} is back to "
        f"{after.relative_speed:.2f}x {others} at its step {step} (a straggler since its step "
        f"{before.since_step})"
    )


def probe_seconds_per_byte(probe: pb.LinkProbeResult) -> float | None:
    """A link probe as a sample of the link's slowness; None for one that moved nothing."""
    if probe.bytes <= 0 or not probe.seconds > 0:
        return None
    return probe.seconds / probe.bytes


class SpeedBook:
    """The lighthouse's short history of each group's compute times and link probes, and
    their judged speeds (no I/O, no clock: the caller passes ``now``).

    Args:
        opts: the report's thresholds.
        history: samples kept per group (at least ``opts.window`` and ``opts.link_window``).
    """

    def __init__(self, opts: StragglerOptions, history: int = 16) -> None:
        self.opts = opts
        self._link_opts = opts.for_link()
        self._history = max(history, opts.window, opts.link_window)
        self.samples: dict[str, deque[float]] = {}
        """Each group's compute seconds, oldest first."""
        self.speeds: dict[str, Speed] = {}
        """Each group's judged compute speed."""
        self.link_samples: dict[str, deque[float]] = {}
        """Each group's link probes, as seconds per byte, oldest first."""
        self.link_speeds: dict[str, Speed] = {}
        """Each group's judged link speed."""
        self._last: dict[str, tuple[int, float, float]] = {}
        """Each group's last timing taken: a retried quorum request carries it again."""
        self._last_probe: dict[str, int] = {}
        """Each group's last probe taken (its ``seq``): a retried request carries it again."""
        self.reports_started = 0
        """Straggler reports started so far, of either cause (a counter for ``/metrics``)."""

    def report(
        self, replica_id: str, timings: Iterable[pb.StepTiming], now: float
    ) -> list[tuple[Change, str]]:
        """Takes a group's new step timings; returns the reports that started or ended (and
        their log lines). Timings without a compute measurement (``compute_seconds`` <= 0)
        are skipped, and so is a repeat of the group's last timing taken (same step and
        seconds: a retried request). Not the step alone: a discarded step (a left-out group's,
        a failed commit) is run again at the same step, and is a sample of its own."""
        changes = []
        for timing in timings:
            key = (timing.step, timing.step_seconds, timing.compute_seconds)
            if not timing.compute_seconds > 0 or self._last.get(replica_id) == key:
                continue
            self._last[replica_id] = key
            change = self._judge(
                Cause.COMPUTE, replica_id, timing.compute_seconds, timing.step, now
            )
            if change is not None:
                changes.append(change)
        return changes

    def report_link(
        self, replica_id: str, probes: Iterable[pb.LinkProbeResult], step: int, now: float
    ) -> list[tuple[Change, str]]:
        """Takes a group's new link probes, reported with its request at ``step``; returns
        the reports that started or ended. A probe already taken (its ``seq`` not above the
        group's last) is skipped: a retried request carries it again."""
        changes = []
        for probe in probes:
            sample = probe_seconds_per_byte(probe)
            if sample is None or probe.seq <= self._last_probe.get(replica_id, 0):
                continue
            self._last_probe[replica_id] = probe.seq
            change = self._judge(Cause.LINK, replica_id, sample, step, now)
            if change is not None:
                changes.append(change)
        return changes

    def _judge(
        self, cause: Cause, replica_id: str, sample: float, step: int, now: float
    ) -> tuple[Change, str] | None:
        link = cause is Cause.LINK
        book, speeds = (
            (self.link_samples, self.link_speeds) if link else (self.samples, self.speeds)
        )
        samples = book.setdefault(replica_id, deque(maxlen=self._history))
        samples.append(sample)
        others = {rid: s for rid, s in book.items() if rid != replica_id}
        prior = speeds.get(replica_id, Speed())
        opts = self._link_opts if link else self.opts
        speed, change = judge(samples, others, prior, step, now, opts)
        speeds[replica_id] = speed
        if change is None:
            return None
        self.reports_started += change is Change.STARTED
        return change, describe(replica_id, prior, speed, change, step, cause)

    def straggler(self, replica_id: str) -> bool:
        """Whether the group is a straggler now, for its compute or its link."""
        return any(
            speed is not None and speed.straggler
            for speed in (self.speeds.get(replica_id), self.link_speeds.get(replica_id))
        )

    def forget(self, replica_id: str) -> None:
        """The group is gone: its history no longer counts for the others."""
        self.samples.pop(replica_id, None)
        self.speeds.pop(replica_id, None)
        self.link_samples.pop(replica_id, None)
        self.link_speeds.pop(replica_id, None)
        self._last.pop(replica_id, None)
        self._last_probe.pop(replica_id, None)

    def views(self, excluded: Collection[str] = ()) -> list[GroupSpeed]:
        """Every judged group's speed, sorted by replica_id; ``excluded``: the groups the
        straggler policy leaves out of the quorum now."""
        views = []
        for rid in sorted(self.speeds.keys() | self.link_speeds.keys()):
            compute, link = self.speeds.get(rid, Speed()), self.link_speeds.get(rid, Speed())
            slow = [
                (c, s) for c, s in ((Cause.COMPUTE, compute), (Cause.LINK, link)) if s.straggler
            ]
            since = min((s.since_step for _, s in slow if s.since_step is not None), default=None)
            views.append(
                GroupSpeed(
                    rid,
                    compute.relative_speed,
                    bool(slow),
                    since,
                    rid in excluded,
                    link_relative_speed=link.relative_speed,
                    cause=",".join(c.value for c, _ in slow),
                )
            )
        return views
