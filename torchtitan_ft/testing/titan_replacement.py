"""One rank of a ``./run_train.sh`` replica group SIGKILLed, and the time until torchrun's
replacement of the group participates again: the ``--full`` test
(``tests/titan/test_warm_replacement.py``) and ``benchmarks.recovery``'s TorchTitan row.

Two replica groups of ``ranks`` ranks train the debug model with per-step FT
(:mod:`~torchtitan_ft.testing.titan_dump` as ``TRAIN_FILE``: each rank writes its pid once
built and dumps its state at the end). Once the groups committed together, rank
``kill_rank`` of group 1 (the trainer process itself) is SIGKILLed; nobody restarts it by
hand: torchrun restarts the group (``fault_tolerance.replacement``: "cold" with
``MAX_RESTARTS=1``, or "zygote"), which heals from group 0 and trains to the end.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_dump import ready_path
from torchtitan_ft.testing.titan_jobs import TrainRun, finish_all, ft_env, lighthouse, remaining

REPLACEMENTS = ("cold", "zygote")
"""The values of ``fault_tolerance.replacement`` compared."""


@dataclass
class ReplacementRun:
    """What :func:`kill_a_rank` saw: the two groups' runs and when the rank was killed."""

    survivor: TrainRun
    group: TrainRun
    """Group 1, whose rank was killed (the same torchrun job before and after)."""
    killed_at: float
    """Unix time of the SIGKILL."""
    killed_replica_ids: set[str]
    """Group 1's Manager replica ids (with their per-process suffix) before the kill."""

    def replacement_s(self) -> float | None:
        """Seconds from the SIGKILL to the first step that group 1's replacement committed
        together with group 0 (both groups participating); None if it never did."""
        commits = [
            e
            for e in self.group.events(EventKind.COMMIT)
            if e.replica_id not in self.killed_replica_ids and e.data["participants"] == 2
        ]
        return min(e.time for e in commits) - self.killed_at if commits else None

    def timeline(self) -> dict[str, float | None]:
        """Seconds from the SIGKILL to the replacement's milestones, from group 1's rank-0
        events: its Manager built (``start``: torchrun's restart, the imports, TorchTitan's
        model build), its heal done (``heal_end``), and it committing beside group 0
        (:meth:`replacement_s`); and the survivor's median step (commit to commit) meanwhile."""

        def first(kind: EventKind) -> float | None:
            times = [
                e.time - self.killed_at
                for e in self.group.events(kind)
                if e.replica_id not in self.killed_replica_ids and e.time > self.killed_at
            ]
            return round(min(times), 3) if times else None

        commits = [e.time for e in self.survivor.events(EventKind.COMMIT)]
        steps = sorted(b - a for a, b in itertools.pairwise(commits))
        seconds = self.replacement_s()
        return {
            "manager_built_s": first(EventKind.START),
            "healed_s": first(EventKind.HEAL_END),
            "participating_s": round(seconds, 3) if seconds is not None else None,
            "survivor_median_step_s": round(steps[len(steps) // 2], 3) if steps else None,
        }


def _group(
    work: Path, replica: int, steps: int, ranks: int, replacement: str, address: str
) -> TrainRun:
    env = ft_env(
        "debug_ft_cpu.toml",
        address,
        TRAIN_FILE="torchtitan_ft.testing.titan_dump",
        FT_E2E_OUT=str(work),
        FT_E2E_ALONE_SLEEP_S="0.5",
        FT_E2E_MAX_ALONE="6",
    )
    if replacement == "cold":
        env["MAX_RESTARTS"] = "1"  # torchrun's own restart, fresh interpreters
    return TrainRun(
        f"replica group {replica} ({replacement})",
        steps,
        work / f"outputs{replica}",
        f"--fault_tolerance.replica_id={replica}",
        f"--fault_tolerance.replacement={replacement}",
        f"--parallelism.data_parallel_shard_degree={ranks}",
        ngpu=ranks,
        env=env,
    )


def kill_a_rank(
    work: Path, replacement: str, steps: int = 16, ranks: int = 2, kill_rank: int = 1
) -> ReplacementRun:
    """Run the job (see the module docstring); both groups must exit 0."""
    if replacement not in REPLACEMENTS:
        raise ValueError(f"replacement={replacement!r}: expected one of {REPLACEMENTS}")
    work.mkdir(parents=True, exist_ok=True)
    with lighthouse(min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=2000) as address:
        survivor, group = (_group(work, r, steps, ranks, replacement, address) for r in range(2))
        deadline = time.monotonic() + remaining(300)
        while sum(e.data["participants"] == 2 for e in group.events(EventKind.COMMIT)) < 2:
            if time.monotonic() > deadline:
                raise AssertionError("the 2 groups did not commit 2 steps together in time")
            if survivor.returncode is not None or group.returncode is not None:
                raise AssertionError("a group exited before the 2 groups trained together")
            time.sleep(0.1)
        killed_ids = {e.replica_id for e in group.events(EventKind.START)}
        pid = int(ready_path(work, 1, kill_rank).read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        # After FT_E2E_MAX_ALONE steps alone the survivor waits for these files, which the
        # replacement's ranks write again once built: it is still training when they join.
        for rank in range(ranks):
            ready_path(work, 1, rank).unlink(missing_ok=True)
        finish_all([survivor, group])
    return ReplacementRun(survivor, group, killed_at, killed_ids)
