"""The goodput benchmark's accounting, as pure functions of its per-step records: the per-step FT
job's committed samples over time (:func:`job_samples`), when they reached a target
(:func:`time_to_samples`), whether every batch was trained exactly once (:func:`ledger_check`),
and when the job lost its state (:func:`second_lines`, :func:`state_losses`), which faults it
did so after (:func:`faults_losing_state`) and the samples each loss rolled back
(:func:`samples_rolled_back`); and what the samples cost in CPU (:func:`samples_per_cpu_s`).

A record here is anything with ``time`` (Unix seconds), ``pid``, ``group``, ``step`` and
``committed`` (``benchmarks.goodput.Record``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class StepRecord(Protocol):
    """What the state-loss accounting reads of one per-step record."""

    time: float
    pid: int
    group: int | None
    step: int
    committed: bool


def time_to_samples(
    points: Iterable[tuple[float, int]], target: int, *, rollback: bool
) -> float | None:
    """When the job's committed samples reached ``target`` for good, from (time, samples
    committed) observations; None if never.

    ``rollback``: observations may go back (a job restarted from a checkpoint redoes the steps
    after it): the time is that of the last crossing from below ``target``. Without it (per-step
    FT: a commit is never undone; a restarted group reports 0 until it heals) the job's
    samples are the highest observed so far.
    """
    reached: float | None = None
    best = 0
    for time, samples in sorted(points):
        current = samples if rollback else max(best, samples)
        if current >= target and best < target:
            reached = time
        best = current
    return reached


def job_samples(
    points: Iterable[tuple[float, int]], loss_times: Sequence[float]
) -> list[tuple[float, int]]:
    """The per-step FT job's committed samples at each observation, from (time, samples the
    observing process's ledger holds): the highest so far (a restarted group reports its own,
    lower count until it heals), except that each state loss (``loss_times``: the time of its
    first second-line commit, :func:`state_losses`) starts over from the count observed then:
    the job went back to a checkpoint (or to nothing) and the steps after it were undone."""
    out: list[tuple[float, int]] = []
    losses = sorted(loss_times)
    best = 0
    for time, samples in sorted(points):
        if losses and time >= losses[0]:
            while losses and time >= losses[0]:
                losses.pop(0)
            best = samples
        else:
            best = max(best, samples)
        out.append((time, best))
    return out


def samples_rolled_back(series: Sequence[tuple[float, int]], loss_time: float, resumed: int) -> int:
    """Samples a state loss at ``loss_time`` rolled back: the job's committed samples just
    before it (``series``: :func:`job_samples`) less ``resumed``, those in the state the job
    went on from (its checkpoint's; 0 without one). They are trained again, and counted so,
    not as trained twice: the final model holds each once."""
    before = [samples for time, samples in sorted(series) if time < loss_time]
    return max(0, before[-1] - resumed) if before else 0


def samples_per_cpu_s(samples: int, seconds: float | None, cpus: float) -> float | None:
    """Samples per CPU-second of quota: ``samples`` trained in ``seconds`` by replica groups
    whose CPU quotas add up to ``cpus``, every group the job launched counted whether it trained
    or stood by (a hot spare is paid for as a group is); None when the samples were never
    reached (``seconds`` None) or no time or CPU was spent."""
    if seconds is None or seconds <= 0 or cpus <= 0:
        return None
    return samples / (seconds * cpus)


def ledger_check(finals: dict[int, dict], groups: int) -> dict:
    """The data ledger at the end of a per-step FT run, from each group's final record
    (``finals[group]``: its ``consumed`` ledger and its reader ``position``).

    Every batch is trained exactly once when all groups hold the same ledger and each group's
    reader stands at its own entry. Returns ``exactly_once`` and the batches ``lost`` (the
    ledger counts them, the reader has not read them) and ``duplicated`` (read, then not in
    the ledger: they would be trained again)."""
    ledgers = {g: f["consumed"] for g, f in finals.items()}
    agree = len({tuple(c) for c in ledgers.values()}) == 1 and len(ledgers) == groups
    lost = duplicated = 0
    for g, final in finals.items():
        diff = final["position"] - final["consumed"][g]
        lost += max(0, -diff)
        duplicated += max(0, diff)
    return {
        "exactly_once": agree and lost == 0 and duplicated == 0,
        "ledgers_agree": agree,
        "lost": lost,
        "duplicated": duplicated,
    }


def second_lines(records: Iterable[StepRecord]) -> list[dict[str, Any]]:
    """Processes whose first commit is at a step below the job's highest committed step at
    that time: they trained from their own state instead of healing, a second line of steps
    (per-step FT lost the job's state: every group holding it was down together). A process
    that heals commits at the job's step. Each: ``group``, ``pid``, ``step`` (its first
    commit), ``job_step`` (the job's highest step then) and ``time`` (of that commit)."""
    out = []
    best = -1
    seen: set[int] = set()
    for r in sorted(records, key=lambda r: r.time):
        if not r.committed:
            continue
        if r.pid not in seen:
            seen.add(r.pid)
            if r.step < best:
                out.append(
                    {
                        "group": r.group,
                        "pid": r.pid,
                        "step": r.step,
                        "job_step": best,
                        "time": r.time,
                    }
                )
        best = max(best, r.step)
    return out


def state_losses(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The times the job lost its state, from :func:`second_lines`: one loss per job step the
    second lines fell back from (every process that starts below the same highest step belongs
    to the loss that started the first of them; a later loss falls back from a higher one).
    Each: ``time`` (of the loss's first second-line commit), ``job_step``, ``to_step`` (the
    lowest step a second line started from) and ``groups``."""
    losses: list[dict[str, Any]] = []
    for job_step, group in itertools.groupby(
        sorted(lines, key=lambda line: (line["job_step"], line["time"])),
        key=lambda line: line["job_step"],
    ):
        members = list(group)
        losses.append(
            {
                "time": members[0]["time"],
                "job_step": job_step,
                "to_step": min(m["step"] for m in members),
                "groups": sorted({m["group"] for m in members}),
            }
        )
    return sorted(losses, key=lambda loss: loss["time"])


def faults_losing_state(fault_times: Sequence[float], losses: Iterable[dict[str, Any]]) -> set[int]:
    """Indexes into ``fault_times`` (Unix seconds, in injection order) of the faults after
    which the job lost its state: for each loss, the last fault injected before it. A loss
    before any fault is nobody's."""
    out = set()
    for loss in losses:
        before = [i for i, t in enumerate(fault_times) if t <= loss["time"]]
        if before:
            out.add(before[-1])
    return out
