"""Chaos invariants over per-step logs of the tiny-MLP harness.

Workers (``torchtitan_ft.testing.mlp.train_worker`` with ``commit_log``) append one JSON line per
iteration; the functions below read those lines back and check, as pure functions of the records:

* ``state_divergence``: replica groups that committed the same step hold bitwise-identical
  parameters and optimizer state;
* ``step_regressions``: a replica group's committed step never goes back, within one process
  and across its restarts;
* ``progress_gaps``: how long the job went without committing a new step.

Used by ``tests/test_chaos.py`` and by ``scripts/failure_demo.py --model mlp``.

And the fault schedule of ``benchmarks.goodput`` and the soak tests (:func:`fault_schedule`:
seeded, the same for every recovery method compared) with the pure accounting over its
per-step records (:func:`time_to_samples`, :func:`ledger_check`).
"""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


@dataclass(frozen=True)
class Record:
    """One training iteration of one replica-group process (a line of its commit log)."""

    replica: int
    incarnation: int
    """0 for the first process of the replica group, +1 per restart."""
    pid: int
    step: int
    """Committed steps after this iteration."""
    committed: bool
    participants: int
    participating: bool
    hash: str
    loss: float
    eval_loss: float
    time: float


def commit_log_path(directory: Path, replica: int, incarnation: int) -> Path:
    return directory / f"r{replica}_i{incarnation}.jsonl"


def read_commit_log(path: Path, replica: int, incarnation: int) -> list[Record]:
    """The records of one log; a torn last line (the writer was SIGKILLed) is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        records.append(Record(replica=replica, incarnation=incarnation, **raw))
    return records


def read_commit_logs(directory: Path) -> list[Record]:
    """Every record under ``directory`` (files named by ``commit_log_path``), time-ordered."""
    records = []
    for path in sorted(directory.glob("r*_i*.jsonl")):
        replica, incarnation = (int(part[1:]) for part in path.stem.split("_"))
        records.extend(read_commit_log(path, replica, incarnation))
    return sorted(records, key=lambda r: r.time)


def state_divergence(records: Iterable[Record]) -> list[str]:
    """Committed steps at which replica groups hold different states (one line each)."""
    by_step: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.committed:
            by_step[r.step][r.hash].append(f"replica {r.replica}#{r.incarnation}")
    return [
        f"step {step}: {len(hashes)} different states: "
        + "; ".join(f"{h[:10]} held by {', '.join(who)}" for h, who in hashes.items())
        for step, hashes in sorted(by_step.items())
        if len(hashes) > 1
    ]


def step_regressions(records: Iterable[Record]) -> list[str]:
    """Places where a replica group's step went back (iterations in time order per process;
    a restarted process may not commit a step lower than its predecessor's last)."""
    problems = []
    last_iteration: dict[tuple[int, int], Record] = {}
    last_own_commit: dict[tuple[int, int], Record] = {}
    last_commit: dict[int, Record] = {}
    for r in sorted(records, key=lambda r: (r.replica, r.incarnation, r.time)):
        process = (r.replica, r.incarnation)
        prev = last_iteration.get(process)
        own = last_own_commit.get(process)
        if (prev is not None and r.step < prev.step) or (
            r.committed and own is not None and r.step <= own.step
        ):
            before = prev.step if prev is not None else own.step
            problems.append(f"replica {r.replica}#{r.incarnation}: step {before} then {r.step}")
        last_iteration[process] = r
        if r.committed:
            last_own_commit[process] = r
            before = last_commit.get(r.replica)
            if before is not None and before.incarnation < r.incarnation and r.step < before.step:
                problems.append(
                    f"replica {r.replica}: restarted process committed step {r.step} after "
                    f"its predecessor had committed step {before.step}"
                )
            last_commit[r.replica] = r
    return problems


def progress_times(records: Iterable[Record]) -> list[tuple[float, int]]:
    """(time, step) each time the job's highest committed step went up."""
    out: list[tuple[float, int]] = []
    best = -1
    for r in sorted(records, key=lambda r: r.time):
        if r.committed and r.step > best:
            best = r.step
            out.append((r.time, r.step))
    return out


def longest_gap(progress: list[tuple[float, int]], start: float, end: float) -> float:
    """Longest time without a new committed step within [start, end]."""
    times = [start, *(t for t, _ in progress if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


# ------------------------------------------------------------------------ the fault schedule


class FaultKind(StrEnum):
    """What a scheduled fault does to the job."""

    SIGKILL = "sigkill"
    """SIGKILL one rank of a replica group; the group's launcher (torchrun) replaces it."""
    SIGSTOP = "sigstop"
    """SIGSTOP one rank for longer than the job's timeouts allow, then SIGCONT."""
    LINK_DOWN = "link_down"
    """A replica group's network link down for a while (its host's cable pulled)."""
    LIGHTHOUSE = "lighthouse"
    """SIGKILL the lighthouse and start it again on the same address."""
    DONOR_KILL = "donor_kill"
    """SIGKILL a rank of one group, then a rank of the group it heals from, while it heals."""
    TWO_GROUPS = "two_groups"
    """SIGKILL a rank of two groups within one step."""


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule: what, when (seconds after the job's launch), to whom."""

    at_s: float
    kind: FaultKind
    groups: tuple[int, ...]
    """The victim groups (two for ``TWO_GROUPS``; the first for the other kinds)."""
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
    short run still mixes them), victims drawn uniformly. The same arguments give the same
    schedule."""
    if not kinds:
        raise ValueError("kinds must name at least one FaultKind, got none")
    if groups < 2 and (FaultKind.TWO_GROUPS in kinds or FaultKind.DONOR_KILL in kinds):
        raise ValueError(f"two_groups and donor_kill need >= 2 groups, got groups={groups}")
    if not 0 < min_interval_s <= mean_interval_s:
        raise ValueError(
            f"need 0 < min_interval_s <= mean_interval_s, got {min_interval_s}, {mean_interval_s}"
        )
    rng = random.Random(seed)
    faults: list[Fault] = []
    order: list[FaultKind] = []
    at = start_s
    while True:
        at += max(rng.expovariate(1.0 / mean_interval_s), min_interval_s)
        if at > end_s:
            return faults
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        kind = order.pop()
        victims = tuple(rng.sample(range(groups), 2 if kind is FaultKind.TWO_GROUPS else 1))
        faults.append(Fault(round(at, 3), kind, victims, rng.randrange(ranks)))


# ------------------------------------------------------------------------ accounting


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
