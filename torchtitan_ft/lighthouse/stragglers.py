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
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from torchtitan_ft.lighthouse.types import GroupSpeed
from torchtitan_ft.proto import torchft_pb2 as pb


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

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"straggler factor must be > 1.0, got {self.factor!r}")
        if self.steps < 1:
            raise ValueError(f"straggler steps must be >= 1, got {self.steps!r}")
        if self.window < 1:
            raise ValueError(f"straggler window must be >= 1, got {self.window!r}")


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

    @property
    def straggler(self) -> bool:
        return self.since_step is not None


class Change(StrEnum):
    """What a judgement changed in the report (logged by the lighthouse)."""

    STARTED = "started"
    ENDED = "ended"


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
    speed = Speed(relative, slow_streak, fast_streak, prior.since_step, prior.since)
    if not prior.straggler and slow_streak >= opts.steps:
        # Since the first step of the streak.
        return Speed(relative, slow_streak, 0, step - slow_streak + 1, now), Change.STARTED
    if prior.straggler and fast_streak >= opts.steps:
        return Speed(relative, 0, fast_streak), Change.ENDED
    return speed, None


def describe(replica_id: str, before: Speed, after: Speed, change: Change, step: int) -> str:
    """The log line of a report's start or end: which group, how slow, since when."""
    if change is Change.STARTED:
        return (
            f"straggler: replica group {replica_id!r} computes at {after.relative_speed:.2f}x "
            f"the others' speed since its step {after.since_step}"
        )
    return (
        f"straggler ended: replica group {replica_id!r} is back to {after.relative_speed:.2f}x "
        f"the others' speed at its step {step} (a straggler since its step {before.since_step})"
    )


class SpeedBook:
    """The lighthouse's short history of each group's compute times and its judged speeds
    (no I/O, no clock: the caller passes ``now``).

    Args:
        opts: the report's thresholds.
        history: samples kept per group (at least ``opts.window``).
    """

    def __init__(self, opts: StragglerOptions, history: int = 16) -> None:
        self.opts = opts
        self._history = max(history, opts.window)
        self.samples: dict[str, deque[float]] = {}
        self.speeds: dict[str, Speed] = {}
        self._last: dict[str, tuple[int, float, float]] = {}
        """Each group's last timing taken: a retried quorum request carries it again."""
        self.reports_started = 0
        """Straggler reports started so far (a counter for ``/metrics``)."""

    def report(self, replica_id: str, timings: Iterable[pb.StepTiming], now: float) -> list[str]:
        """Takes a group's new step timings; returns the log lines of reports that started or
        ended. Timings without a compute measurement (``compute_seconds`` <= 0) are skipped,
        and so is a repeat of the group's last timing taken (same step and seconds: a retried
        request). Not the step alone: a discarded step (a left-out group's, a failed commit)
        is run again at the same step, and is a sample of its own."""
        lines = []
        for timing in timings:
            key = (timing.step, timing.step_seconds, timing.compute_seconds)
            if not timing.compute_seconds > 0 or self._last.get(replica_id) == key:
                continue
            self._last[replica_id] = key
            samples = self.samples.setdefault(replica_id, deque(maxlen=self._history))
            samples.append(timing.compute_seconds)
            others = {rid: s for rid, s in self.samples.items() if rid != replica_id}
            prior = self.speeds.get(replica_id, Speed())
            speed, change = judge(samples, others, prior, timing.step, now, self.opts)
            self.speeds[replica_id] = speed
            if change is not None:
                self.reports_started += change is Change.STARTED
                lines.append(describe(replica_id, prior, speed, change, timing.step))
        return lines

    def forget(self, replica_id: str) -> None:
        """The group is gone: its history no longer counts for the others."""
        self.samples.pop(replica_id, None)
        self.speeds.pop(replica_id, None)
        self._last.pop(replica_id, None)

    def views(self, excluded: Collection[str] = ()) -> list[GroupSpeed]:
        """Every judged group's speed, sorted by replica_id; ``excluded``: the groups the
        straggler policy leaves out of the quorum now."""
        return [
            GroupSpeed(
                rid, speed.relative_speed, speed.straggler, speed.since_step, rid in excluded
            )
            for rid, speed in sorted(self.speeds.items())
        ]
