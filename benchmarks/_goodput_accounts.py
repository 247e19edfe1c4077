"""Accounting for ``benchmarks.goodput``: the workers' per-step records read back, and from them
alone (never from log wording) a method's figures: time to the target samples, faults injected
and survived, job restarts (a restart of the native job, or a loss of the per-step job's state:
``testing.goodput_accounting.state_losses``), samples lost and trained twice, identical groups,
each fault's stall and rejoin, and the trainers' resource usage."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._goodput_job import (
    LOCAL_BATCH,
    Injected,
    Method,
    Options,
    checkpoint_every,
    launched_groups,
)
from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.recoveries import Recovery, recoveries
from torchtitan_ft.testing.faults import FaultKind
from torchtitan_ft.testing.goodput_accounting import (
    faults_losing_state,
    job_samples,
    ledger_check,
    samples_per_cpu_s,
    samples_rolled_back,
    second_lines,
    state_losses,
    time_to_samples,
)


@dataclass
class Record:
    """One line of a worker's ``steps_*.jsonl`` (see ``torchtitan_ft.testing.goodput_worker``)."""

    group: int | None
    """The replica group (None: the native job)."""
    pid: int
    time: float
    step: int
    committed: bool
    consumed: list[int] | None
    participants: list[int] | None
    loss: float | None
    rss_mb: float
    fds: int
    batches_committed: int | None = None
    """torchft's count of committed batches (the torchft method; else None)."""
    participating: bool | None = None
    """This group's batch was in the step (the torchft method; else None)."""
    drawn: int | None = None
    """Batches the group's loader has given out, over its processes: TorchTitan's FT data loader
    checkpoint carries the count across a restart (the torchft method; else None)."""
    lr: float | None = None
    """The learning rate the optimizer stepped with (the torchft method; else None)."""
    param_sum: float | None = None
    """Sum of rank 0's model shards after the step (the torchft method; else None)."""
    healed: bool = False
    """This group healed in the step (this project's worker)."""
    logged_loss: float | None = None
    """The loss as TorchTitan's FT trainer logs it (the torchft method; ``loss`` is this over
    the participants)."""


class RecordReader:
    """The workers' records under ``folder``, read on from where the last call stopped (the
    benchmark polls them every 50 ms for the whole run, on the little CPU the groups' budgets
    leave it): only whole lines are taken, so a line being written is read next time, and the
    torn last line of a killed writer never."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}
        self._records: list[Record] = []

    def read(self) -> list[Record]:
        new = []
        for path in self.folder.glob("steps_*.jsonl"):
            tag, pid = path.stem.removeprefix("steps_").rsplit("_p", 1)
            group = None if tag == "job" else int(tag[1:])
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    new.append(Record(group, int(pid), **json.loads(line)))
        if new:
            self._records = sorted([*self._records, *new], key=lambda r: r.time)
        return list(self._records)


RECOVERY_TOLERANCE = 0.05
"""A recovery's phases must add up to its measured total within this share of it."""


def recovery_checks(
    found: Sequence[Recovery],
    starts: Mapping[str, tuple[int, float]],
    records: Sequence[Record],
) -> list[dict[str, Any]]:
    """Each recovery of the event stream (``torchtitan_ft.recoveries``) against the workers'
    records, which the event stream does not write: its measured total runs from the failed
    process's last committed step (a replacement: its last record, or a surviving group's
    later one of a step the group took part in before the new process started, when the kill
    came between its commit and its record; otherwise the recovery's start, its healing
    quorum's request) to the recovering process's first committed record of a step its group
    took part in (not the healing step). ``within``: the phases' sum is within
    ``RECOVERY_TOLERANCE`` of it (None: not complete, or not measured). ``starts``: replica id
    -> its group rank 0's pid and when its Manager started (``start`` events)."""
    out = []
    for r in found:
        pid, started = starts.get(r.replica_id, (None, 0.0))
        own = [x for x in records if x.pid == pid]
        group = own[0].group if own else None
        begin: float | None = r.started
        if r.failed_replica_id is not None:
            failed = starts.get(r.failed_replica_id, (None, 0.0))[0]
            alive = [
                x.time
                for x in records
                if x.pid == failed
                or (x.group != group and group in (x.participants or ()) and x.time < started)
            ]
            begin = max(alive) if alive else None
        end = next(
            (
                x.time
                for x in own
                if begin is not None
                and x.time > begin
                and x.committed
                and not x.healed
                and group in (x.participants or ())
            ),
            None,
        )
        measured = end - begin if end is not None and begin is not None else None
        phases_sum = sum(r.phases.values())
        out.append(
            {
                "group": group,
                "kind": r.kind.value,
                "replica_id": r.replica_id,
                "noticed_by": r.noticed_by.value if r.noticed_by else None,
                "phases": r.phases,
                "phases_sum_s": round(phases_sum, 3),
                "measured_s": round(measured, 3) if measured is not None else None,
                "within": (
                    abs(phases_sum - measured) <= RECOVERY_TOLERANCE * measured
                    if measured is not None and r.complete
                    else None
                ),
            }
        )
    return out


def recoveries_of(events_dir: Path, records: Sequence[Record]) -> dict[str, Any]:
    """``recoveries`` (``recovery_checks``) of the events under ``events_dir``, and
    ``recoveries_within_5pct``: whether every complete, measured one is within (None when
    there is none)."""
    events = read_events(events_dir) if events_dir.exists() else []
    starts = {e.replica_id: (int(e["pid"]), e.time) for e in events if e.kind is EventKind.START}
    checked = recovery_checks(recoveries(events), starts, records)
    judged = [c["within"] for c in checked if c["within"] is not None]
    return {
        "recoveries": checked,
        "recoveries_within_5pct": all(judged) if judged else None,
    }


def record_samples(r: Record, opts: Options) -> int:
    """Samples in the model as this record saw it: the ledger (FT), torchft's committed batches,
    or steps x world batch."""
    if r.batches_committed is not None:
        return r.batches_committed * opts.ranks * LOCAL_BATCH
    if r.consumed is not None:
        return sum(r.consumed) * opts.ranks * LOCAL_BATCH
    return r.step * opts.samples_per_step


def fill_participants(records: list[Record]) -> None:
    """The torchft method's participants of each committed step: the groups whose record of
    that step says they took part (a group knows only how many did)."""
    by_step: dict[int, set[int]] = {}
    for r in records:
        if r.committed and r.participating and r.group is not None:
            by_step.setdefault(r.step, set()).add(r.group)
    for r in records:
        if r.participating is not None:
            r.participants = sorted(by_step.get(r.step, ())) if r.committed else []


def drawn_batches_check(records: list[Record]) -> dict[str, Any]:
    """Exactly once for the torchft method, per group's slice of the data: the batch a record
    trained (or lost) is ``drawn - 1`` of the group's loader, whose position TorchTitan's FT
    data loader checkpoint carries across a restart (a new process resumes where the latest
    such checkpoint left it, not where the killed one stopped). Lost: batches of the slice below
    the last one trained that no committed step of the group took part with (read and
    discarded, or skipped by a resume ahead); duplicated: batches trained more than once (a
    resume behind). ``lost_by``: each lost batch by what its records show, ``healing`` (its
    step committed while the group healed: torchft zeroes a healing group's gradient),
    ``discarded`` (its step did not commit) or ``not_read`` (no record read it)."""
    lost = duplicated = 0
    lost_by = {"healing": 0, "discarded": 0, "not_read": 0}
    for g in sorted({r.group for r in records if r.group is not None}):
        mine = [r for r in records if r.group == g and r.drawn is not None]
        trained: dict[int, int] = {}
        for r in mine:
            if r.committed and r.participating:
                trained[r.drawn - 1] = trained.get(r.drawn - 1, 0) + 1
        if not trained:
            continue
        missing = set(range(max(trained) + 1)) - set(trained)
        lost += len(missing)
        duplicated += sum(n - 1 for n in trained.values())
        for batch in missing:
            steps = [r for r in mine if r.drawn - 1 == batch]
            if any(r.committed for r in steps):
                lost_by["healing"] += 1
            elif steps:
                lost_by["discarded"] += 1
            else:
                lost_by["not_read"] += 1
    return {
        "exactly_once": lost == duplicated == 0,
        "lost": lost,
        "duplicated": duplicated,
        "lost_by": lost_by,
    }


def first_divergence(records: list[Record]) -> dict[str, Any] | None:
    """The torchft method's first committed step after which the groups' rank 0 hold different
    model bytes (their ``param_sum`` differs), with each group's learning rate in that step and
    whether it healed in it; None when they never part. Groups that part stay apart: every
    later step applies the same averaged gradient to different weights. Only the job's first
    line of steps is read: after the job lost its state (:func:`second_lines`), the steps are
    numbered again from its first commit on."""
    again = {line["pid"] for line in second_lines(records)}
    end = min((r.time for r in records if r.pid in again and r.committed), default=float("inf"))
    by_step: dict[int, dict[int, Record]] = {}
    for r in records:
        if r.committed and r.param_sum is not None and r.group is not None and r.time < end:
            by_step.setdefault(r.step, {})[r.group] = r
    for step in sorted(by_step):
        groups = by_step[step]
        if len({r.param_sum for r in groups.values()}) > 1:
            return {
                "step": step,
                "groups": {
                    g: {"lr": r.lr, "healed": not r.participating}
                    for g, r in sorted(groups.items())
                },
            }
    return None


class Accounts:
    """One method's figures from its records: ``started`` (Unix time of the launch), ``t0``
    (seconds after it at which the job trained), ``target`` (samples; None: the ideal run,
    whose final samples set it)."""

    def __init__(self, method: Method, opts: Options, started: float) -> None:
        self.method, self.opts, self.started = method, opts, started
        self.t0: float | None = None
        self.load_at_start: float | None = None
        self.groups = launched_groups(method, opts)
        """Replica groups launched (with torchtitan_ft_spare's hot spare)."""

    @property
    def ft(self) -> bool:
        return self.method is not Method.CHECKPOINT_RESTART

    @property
    def spare(self) -> bool:
        return self.method is Method.TORCHTITAN_FT_SPARE

    def in_step_since(self, records: list[Record], since: float) -> bool:
        """Every launched group wrote a record after ``since`` (Unix time) of a commit it did
        not heal in: with a hot spare, the groups are in step (the spare, which no step's
        participants name, took the update too)."""
        return all(
            any(r.group == g and r.committed and not r.healed and r.time > since for r in records)
            for g in range(self.groups)
        )

    def samples_now(self, records: list[Record]) -> int:
        """The job's committed samples at the last record (FT: :func:`job_samples`, back to
        the checkpoint after a state loss)."""
        if not records:
            return 0
        if self.ft:
            losses = state_losses(second_lines(records))
            series = job_samples(
                [(r.time, record_samples(r, self.opts)) for r in records],
                [loss["time"] for loss in losses],
            )
            return series[-1][1]
        return record_samples(records[-1], self.opts)

    def training_started(self, records: list[Record]) -> bool:
        """Every group took part in a commit (the native job: it committed); with a hot spare,
        ``--groups`` groups did and every launched group is in step (:meth:`in_step_since`)."""
        for r in records:
            if r.committed and (r.participants is None or len(r.participants) == self.opts.groups):
                return not self.spare or self.in_step_since(records, 0.0)
        return False

    def trained_together_since(self, records: list[Record], since: float) -> bool:
        """Every group took part in a commit after ``since`` (Unix time): a commit from before
        it may predate a fault that struck as the run reached its target. With a hot spare,
        ``--groups`` groups did and every launched group is in step since."""
        together = any(
            r.committed and r.time > since and len(r.participants or ()) == self.opts.groups
            for r in records
        )
        return together and (not self.spare or self.in_step_since(records, since))

    def summary(
        self,
        records: list[Record],
        finals: dict[str, dict],
        injected: list[Injected],
        job_restarts: int,
        target: int | None,
        events_dir: Path | None = None,
    ) -> dict[str, Any]:
        """The method's JSON entry (``methods.<name>``; the module docstring of
        ``benchmarks.goodput`` says what each field means); ``events_dir``: this project's
        event stream (the recoveries, ``recoveries_of``)."""
        opts = self.opts
        t0 = self.started + (self.t0 or 0.0)
        lines = second_lines(records) if self.ft else []
        losses = state_losses(lines)
        points = [(r.time - t0, record_samples(r, opts)) for r in records if r.committed]
        if self.ft:  # a state loss undoes the steps after the state the job went on from
            points = job_samples(points, [loss["time"] - t0 for loss in losses])
        target = target if target is not None else self.samples_now(records)
        at = time_to_samples(points, target, rollback=True)
        # a healing step logs the loss of the model it replaced: not the job's
        lineage = [r for r in records if r.committed and r.loss is not None and not r.healed]
        final_loss = next(
            (r.loss for r in lineage if record_samples(r, opts) >= target),
            lineage[-1].loss if lineage else None,
        )
        for inj in injected:
            self._fault_figures(inj, records)
        fault_times = [self.started + i.time for i in injected]
        for loss in losses:
            loss["samples_rolled_back"] = self._rolled_back(loss, points, records, t0)
            for i in faults_losing_state(fault_times, [loss]):
                injected[i].state_lost = True
                injected[i].samples_rolled_back += loss["samples_rolled_back"]
        done = [i for i in injected if not i.effect.startswith("not injected")]
        survived = [
            i
            for i in done
            if i.stall_s is not None
            and (i.rejoin_s is not None or not i.groups)
            and not i.state_lost
        ]
        cpus = self.groups * opts.cpus_per_group
        per_cpu = samples_per_cpu_s(target, at, cpus)
        return {
            "target_samples": target,
            "time_to_target_s": round(at, 2) if at is not None else None,
            "launched_groups": self.groups,
            "cpus_quota": cpus,
            "cpu_s_to_target": round(at * cpus, 1) if at is not None else None,
            "samples_per_cpu_s": round(per_cpu, 4) if per_cpu is not None else None,
            "startup_s": round(self.t0, 1) if self.t0 is not None else None,
            "load_avg_1m": [self.load_at_start, os.getloadavg()[0]],
            "reached_target": at is not None,
            "checkpoint_every_steps": checkpoint_every(self.method, opts),
            "faults_injected": len(done),
            "faults_survived": len(survived),
            "job_restarts": job_restarts + len(losses),
            "samples_rolled_back": (
                sum(loss["samples_rolled_back"] for loss in losses)
                if self.ft
                else sum(i.samples_rolled_back for i in injected)
            ),
            "state_losses": [{**loss, "time": round(loss["time"] - t0, 2)} for loss in losses],
            "group_restarts": len({(r.group, r.pid) for r in records})
            - len({r.group for r in records}),
            **self._data_checks(records, finals),
            **({"divergence": first_divergence(records)} if self.method is Method.TORCHFT else {}),
            "second_lines": [{**line, "time": round(line["time"] - t0, 2)} for line in lines],
            "final_loss": final_loss,
            **(recoveries_of(events_dir, records) if events_dir is not None else {}),
            "faults": [
                {
                    **asdict(i.fault),
                    "time_s": round(i.time - (self.t0 or 0.0), 2),
                    **{k: v for k, v in asdict(i).items() if k not in ("fault", "time")},
                }
                for i in injected
            ],
            "usage": usage(records, self.started),
            "curve": [
                [
                    round(r.time - t0, 2),
                    r.loss,
                    len(r.participants) if r.participants is not None else opts.groups,
                ]
                for r in lineage
            ],
        }

    def _rolled_back(
        self,
        loss: dict[str, Any],
        series: list[tuple[float, int]],
        records: list[Record],
        t0: float,
    ) -> int:
        """Samples the per-step job's state ``loss`` rolled back (:func:`samples_rolled_back`):
        it went on from the ledger its first second-line commit held before that step."""
        first = next(r for r in records if r.committed and r.time == loss["time"])
        step = len(first.participants or ()) * self.opts.ranks * LOCAL_BATCH
        resumed = record_samples(first, self.opts) - step
        return samples_rolled_back(series, loss["time"] - t0, resumed)

    def _data_checks(self, records: list[Record], finals: dict[str, dict]) -> dict[str, Any]:
        """Samples lost and trained twice (the ledger for this project's FT, the batches drawn
        for torchft, the checkpoint lineage for checkpoint-restart) and identical groups (every
        group's rank k holds the same bytes at the end)."""
        opts = self.opts
        by_rank: dict[int, set[str]] = {}
        for tag, final in finals.items():
            by_rank.setdefault(int(tag.rsplit("rank", 1)[1]), set()).add(final["hash"])
        group_finals = {
            int(tag[1:].split("_")[0]): f
            for tag, f in finals.items()
            if tag.startswith("r") and tag.endswith("_rank0")
        }
        same = len(finals) == self.groups * opts.ranks and all(
            len(h) == 1 for h in by_rank.values()
        )
        if self.method is Method.TORCHFT:
            ledger, identical = drawn_batches_check(records), same
        elif self.ft:
            ledger = ledger_check(group_finals, self.groups)
            identical = same and len(group_finals) == self.groups
        else:
            ledger = self._checkpoint_lineage(records)
            identical = True  # one job: HSDP replicas are kept equal by its all-reduce
        per_batch = opts.ranks * LOCAL_BATCH
        return {
            "samples_lost": ledger["lost"] * per_batch,
            **(
                {"samples_lost_by": {k: n * per_batch for k, n in ledger["lost_by"].items()}}
                if "lost_by" in ledger
                else {}
            ),
            "samples_duplicated": ledger["duplicated"] * per_batch,
            "exactly_once": ledger["exactly_once"],
            "groups_identical": identical,
        }

    def _fault_figures(self, inj: Injected, records: list[Record]) -> None:
        """Stall (until the job's samples pass those at the fault), rejoin (until each victim
        group takes part again: a new process after a kill, any commit after the hang or the
        link outage ended; with a hot spare, until it is in step again, a commit it did not
        heal in, in a slot or as the spare), samples rolled back (checkpoint-restart)."""
        t = self.started + inj.time
        at_fault = self.samples_now([r for r in records if r.time <= t and r.committed])
        after = [r for r in records if r.time > t and r.committed]
        passed = next((r for r in after if record_samples(r, self.opts) > at_fault), None)
        if passed is not None:
            inj.stall_s = round(passed.time - t, 2)
        if not self.ft:
            if after:
                low = min(record_samples(r, self.opts) for r in after)
                inj.samples_rolled_back = max(0, at_fault - low + self.opts.samples_per_step)
                inj.rejoin_s = round(after[0].time - t, 2)
            return
        if not inj.groups:
            return
        kind = inj.fault.kind
        resume = t + {
            FaultKind.SIGSTOP: self.opts.hang_s,
            FaultKind.LINK_DOWN: self.opts.link_down_s,
        }.get(kind, 0.0)
        times = []
        for g in [*inj.groups, *([inj.donor] if inj.donor is not None else [])]:
            old = {r.pid for r in records if r.group == g and r.time <= t}
            back = next(
                (
                    r
                    for r in after
                    if r.group == g
                    and (
                        r.committed and not r.healed
                        if self.spare
                        else bool(r.participants) and g in r.participants
                    )
                    and r.time > resume
                    and (kind in (FaultKind.SIGSTOP, FaultKind.LINK_DOWN) or r.pid not in old)
                ),
                None,
            )
            if back is None:
                return
            times.append(back.time - t)
        inj.rejoin_s = round(max(times), 2)

    def _checkpoint_lineage(self, records: list[Record]) -> dict[str, Any]:
        """After each restart the job must resume at its last checkpoint (step multiple of
        ``--checkpoint-every``), with the data loader saved with it: then no sample is
        skipped or trained twice in the final model."""
        k = self.opts.checkpoint_every
        lost = duplicated = 0
        by_pid: dict[int, list[Record]] = {}
        for r in records:
            by_pid.setdefault(r.pid, []).append(r)
        runs = sorted(by_pid.values(), key=lambda rs: rs[0].time)
        for prev, nxt in itertools.pairwise(runs):
            expected = (max(r.step for r in prev) // k) * k
            resumed = nxt[0].step - 1
            lost += max(0, resumed - expected) * self.opts.groups
            duplicated += max(0, expected - resumed) * self.opts.groups
        return {"exactly_once": lost == duplicated == 0, "lost": lost, "duplicated": duplicated}


def usage(records: list[Record], started: float) -> dict[str, Any]:
    """Resident memory and descriptors of each trainer process that wrote records for at
    least half the run: at its first record past its third and at its last; the largest
    growth of each."""
    end = max((r.time for r in records), default=started)
    by_pid: dict[int, list[Record]] = {}
    for r in records:
        by_pid.setdefault(r.pid, []).append(r)
    rows = []
    for pid, rs in by_pid.items():
        if len(rs) < 5 or rs[-1].time - rs[0].time < (end - started) / 2:
            continue
        first, last = rs[3], rs[-1]
        rows.append(
            {
                "pid": pid,
                "group": first.group,
                "seconds": round(last.time - first.time, 1),
                "rss_mb": [first.rss_mb, last.rss_mb],
                "fds": [first.fds, last.fds],
            }
        )
    return {
        "processes": rows,
        "max_rss_growth_mb": max((r["rss_mb"][1] - r["rss_mb"][0] for r in rows), default=None),
        "max_fd_growth": max((r["fds"][1] - r["fds"][0] for r in rows), default=None),
    }
