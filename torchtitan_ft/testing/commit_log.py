"""The tiny-MLP harness's commit logs and the chaos invariants over them.

Workers (``testing.mlp_rank.train_worker`` with ``commit_log``) append one JSON line per
iteration; the functions below read those lines back and check, as pure functions of the records:

* ``state_divergence``: replica groups that committed the same step hold bitwise-identical
  parameters and optimizer state;
* ``step_regressions``: a replica group's committed step never goes back, within one process
  and across its restarts;
* ``progress_times`` and ``longest_gap``: how long the job went without committing a new step.

Used by ``tests/test_chaos.py``, ``tests/test_soak.py`` and ``scripts/failure_demo.py --model
mlp`` (through :class:`torchtitan_ft.testing.mlp_job.MlpJob`).
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
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
