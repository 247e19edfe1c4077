"""Step timings for the straggler report: what each rank measures, and how a group's ranks'
timings become the group's.

A rank's step starts when it asks for the step's quorum (``Manager.start_quorum``) and ends
when it asks for the next one. Its compute part ends at the step's first cross-group
collective (``Manager.allreduce``): forward and backward run while the quorum forms, and are
what the trainer does on its own, without waiting for the other groups. So the Manager measures
both without the trainer's help. A step without a collective (a spare, an error before it) has
no compute measurement (``compute_seconds`` 0) and does not count for the report.

The group's ManagerServer sends the lighthouse, per step, the slowest of its ranks' timings:
the group is as slow as its slowest rank.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchtitan_ft.proto import torchft_pb2 as pb


class StepTimer:
    """One rank's step timings; the caller passes the clock's readings (seconds, monotonic)."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._started = 0.0
        self._first_collective: float | None = None

    def collective(self, now: float) -> None:
        """A cross-group collective starts; the first of a step ends its compute part."""
        if self._first_collective is None:
            self._first_collective = now

    def start(self, step: int, now: float) -> pb.GroupProgress | None:
        """A new step starts at committed step ``step``; returns the previous step's timing
        (None before the first step)."""
        progress = None
        if self._step is not None:
            compute = 0.0
            if self._first_collective is not None:
                compute = self._first_collective - self._started
            progress = pb.GroupProgress(
                steps=[
                    pb.StepTiming(
                        step=self._step,
                        step_seconds=now - self._started,
                        compute_seconds=compute,
                    )
                ]
            )
        self._step, self._started, self._first_collective = step, now, None
        return progress


def group_progress(progresses: Iterable[pb.GroupProgress | None]) -> pb.GroupProgress | None:
    """A group's progress from its ranks' (None when no rank sent any): the slowest timing per
    step (``slowest_per_step``), the highest committed batches, samples (when any rank sent
    them) and discarded steps, the first launcher job name a rank sent (all ranks of a group
    run in one launcher job), and each heal (by the step it healed to) with the ranks' bytes
    summed, the earliest start, the slowest rank's seconds and the worst outcome; the
    recoveries as sent (group rank 0 sends them)."""
    sent = [p for p in progresses if p is not None]
    if not sent:
        return None
    merged = slowest_per_step(sent) or pb.GroupProgress()
    merged.batches_committed = max(p.batches_committed for p in sent)
    merged.discarded_steps = max(p.discarded_steps for p in sent)
    samples = [p.samples_committed for p in sent if p.HasField("samples_committed")]
    if samples:
        merged.samples_committed = max(samples)
    merged.launcher_job = next((p.launcher_job for p in sent if p.launcher_job), "")
    heals: dict[int, pb.HealReport] = {}
    for p in sent:
        for heal in p.heals:
            mine = heals.get(heal.to_step)
            if mine is None:
                heals[heal.to_step] = pb.HealReport()
                heals[heal.to_step].CopyFrom(heal)
                continue
            mine.bytes += heal.bytes
            mine.seconds = max(mine.seconds, heal.seconds)
            if heal.started and (not mine.started or heal.started < mine.started):
                mine.started = heal.started
            if _OUTCOME_RANK.get(heal.outcome, 0) > _OUTCOME_RANK.get(mine.outcome, 0):
                mine.outcome = heal.outcome
    merged.heals.extend(heals[step] for step in sorted(heals))
    merged.recoveries.extend(r for p in sent for r in p.recoveries)  # group rank 0's only
    return merged


def with_link_probes(
    progress: pb.GroupProgress | None, probes: list[pb.LinkProbeResult]
) -> pb.GroupProgress | None:
    """The group's progress with its ManagerServer's link probes (``manager.linkprobe``)
    added; a progress of the probes alone when the ranks sent none."""
    if not probes:
        return progress
    if progress is None:
        progress = pb.GroupProgress()
    progress.link_probes.extend(probes)
    return progress


_OUTCOME_RANK = {"applied": 0, "not_applied": 1, "failed": 2}
"""Which outcome a group's heal takes when its ranks differ: the worst."""


def slowest_per_step(progresses: Iterable[pb.GroupProgress | None]) -> pb.GroupProgress | None:
    """A group's timings from its ranks': per step, the longest step and compute times, oldest
    step first; None when no rank sent any."""
    merged: dict[int, pb.StepTiming] = {}
    for progress in progresses:
        if progress is None:
            continue
        for timing in progress.steps:
            mine = merged.setdefault(timing.step, pb.StepTiming(step=timing.step))
            mine.step_seconds = max(mine.step_seconds, timing.step_seconds)
            mine.compute_seconds = max(mine.compute_seconds, timing.compute_seconds)
    if not merged:
        return None
    return pb.GroupProgress(steps=[merged[step] for step in sorted(merged)])
