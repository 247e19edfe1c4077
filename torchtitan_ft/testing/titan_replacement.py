"""One rank of a ``./run_train.sh`` replica group SIGKILLed, and the time until torchrun's
replacement of the group participates again: the ``--full`` test
(``tests/titan/test_warm_replacement.py``) and ``benchmarks.recovery``'s TorchTitan row.

Two replica groups of ``ranks`` ranks train the debug model with per-step FT
(:mod:`~torchtitan_ft.testing.titan_dump` as ``TRAIN_FILE``: each rank writes its pid once
built and dumps its state at the end). Once the groups committed together, rank
``kill_rank`` of group 1 (the trainer process itself) is SIGKILLed; nobody restarts it by
hand: torchrun restarts the group (``fault_tolerance.replacement``: "cold" with
``MAX_RESTARTS=1``, or "zygote"), which heals from group 0 and trains to the end.

The kind "spare" adds a hot spare group (docs/titan.md, "A hot spare group"): a third
``./run_train.sh`` group, all three with ``world_size_mode = "fixed_with_spares"`` and
``min_replica_size = 2``, so two groups average their gradients and the third takes every
step's update without a slot, in sync. The killed group is restarted by the zygote and comes
back as the spare (or retakes its slot: the lowest replica ids participate).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.testing.titan_dump import ready_path
from torchtitan_ft.testing.titan_jobs import TrainRun, finish_all, ft_env, lighthouse, remaining

KINDS = ("cold", "zygote", "zygote_sync", "spare")
"""What is compared: ``fault_tolerance.replacement`` "cold" or "zygote" with two groups;
"zygote_sync", the same with ``quorum_mode = "sync"`` (a healing group loads the state before
its forward and takes part in that step, instead of sitting out one step); "spare": a hot
spare group beside the two (and "zygote" for the killed one)."""

PARTICIPANTS = 2
"""Groups that average their gradients in a step at full strength (every kind)."""


def timeline(
    survivor: list[Event],
    group: list[Event],
    killed_at: float,
    killed_ids: set[str],
    killed_step: int,
) -> dict[str, float | None]:
    """Seconds from the SIGKILL (Unix time ``killed_at``) to each milestone, from group 0's
    rank-0 events ``survivor`` and group 1's rank-0 events ``group`` (its replica ids before
    the kill ``killed_ids``, its last committed step then ``killed_step``); None for a
    milestone that never came. In order:

    * ``process_started_s``: group 1's new rank-0 process began (torchrun noticed the death,
      stopped the group, ran a rendezvous round and forked or started the worker);
    * ``manager_built_s``: its Manager built (the default process group; cold, the imports);
    * ``first_quorum_s``: its first quorum (TorchTitan's set-up: model, FSDP, optimizer,
      dataloader; then the wait for group 0's next step);
    * ``healed_s``: its heal done;
    * ``back_s``: its first commit at full strength;
    * ``full_quorum_s``: group 0's first quorum with :data:`PARTICIPANTS` participants after
      the kill (the first full-strength step began: with a spare, the spare took the slot);
    * ``replacement_s``: group 0's first commit at full strength of a step after
      ``killed_step`` (that step ended; with two groups, the same step as ``back_s``);
    * ``survivor_median_step_s``: group 0's median step (commit to commit).
    """

    def since(events: list[Event], kind: EventKind, full: bool = False) -> float | None:
        times = [
            e.time - killed_at
            for e in events
            if e.kind is kind
            and e.time > killed_at
            and e.replica_id not in killed_ids
            and (not full or e.data["participants"] == PARTICIPANTS)
            and (kind is not EventKind.COMMIT or e.step > killed_step)
        ]
        return round(min(times), 3) if times else None

    starts = [
        e.data["process_started"] - killed_at
        for e in group
        if e.kind is EventKind.START
        and e.replica_id not in killed_ids
        and e.data.get("process_started") is not None
    ]
    commits = [e.time for e in survivor if e.kind is EventKind.COMMIT]
    steps = sorted(b - a for a, b in itertools.pairwise(commits))
    return {
        "process_started_s": round(min(starts), 3) if starts else None,
        "manager_built_s": since(group, EventKind.START),
        "first_quorum_s": since(group, EventKind.QUORUM),
        "healed_s": since(group, EventKind.HEAL_END),
        "back_s": since(group, EventKind.COMMIT, full=True),
        "full_quorum_s": since(survivor, EventKind.QUORUM, full=True),
        "replacement_s": since(survivor, EventKind.COMMIT, full=True),
        "survivor_median_step_s": round(steps[len(steps) // 2], 3) if steps else None,
    }


@dataclass
class ReplacementRun:
    """What :func:`kill_a_rank` saw: the groups' runs and when the rank was killed."""

    survivor: TrainRun
    group: TrainRun
    """Group 1, whose rank was killed (the same torchrun job before and after)."""
    killed_at: float
    """Unix time of the SIGKILL."""
    killed_replica_ids: set[str]
    """Group 1's Manager replica ids (with their per-process suffix) before the kill."""
    killed_step: int
    """The last step group 1 committed before the kill."""
    spare: TrainRun | None = None
    """The hot spare group (kind "spare"), else None."""

    def timeline(self) -> dict[str, float | None]:
        """:func:`timeline` of this run."""
        survivor, group = (
            [e for e in read_events(run.events_dir) if e.group_rank == 0]
            for run in (self.survivor, self.group)
        )
        return timeline(
            survivor,
            group,
            self.killed_at,
            self.killed_replica_ids,
            self.killed_step,
        )

    def replacement_s(self) -> float | None:
        """Seconds from the SIGKILL to the first later step committed at full strength
        (:data:`PARTICIPANTS` groups averaging): with two groups, group 1's replacement
        beside group 0; with a spare, the spare (or group 1's replacement) beside group 0.
        None if none was."""
        return self.timeline()["replacement_s"]


def _group(work: Path, replica: int, steps: int, ranks: int, kind: str, address: str) -> TrainRun:
    env = ft_env(
        "debug_ft_cpu.toml",
        address,
        TRAIN_FILE="torchtitan_ft.testing.titan_dump",
        FT_E2E_OUT=str(work),
        FT_E2E_ALONE_SLEEP_S="0.5",
        FT_E2E_MAX_ALONE="6",
        FT_E2E_TOGETHER=str(PARTICIPANTS),
    )
    if kind == "cold":
        env["MAX_RESTARTS"] = "1"  # torchrun's own restart, fresh interpreters
    spare = (
        ("--fault_tolerance.group_size=3", "--fault_tolerance.world_size_mode=fixed_with_spares")
        if kind == "spare"
        else ()
    )
    return TrainRun(
        f"replica group {replica} ({kind})",
        steps,
        work / f"outputs{replica}",
        f"--fault_tolerance.replica_id={replica}",
        f"--fault_tolerance.replacement={'cold' if kind == 'cold' else 'zygote'}",
        f"--fault_tolerance.min_replica_size={PARTICIPANTS if spare else 1}",
        *spare,
        *(("--fault_tolerance.quorum_mode=sync",) if kind == "zygote_sync" else ()),
        f"--parallelism.data_parallel_shard_degree={ranks}",
        ngpu=ranks,
        env=env,
    )


def kill_a_rank(
    work: Path, kind: str, steps: int = 16, ranks: int = 2, kill_rank: int = 1
) -> ReplacementRun:
    """Run the job of ``kind`` (one of :data:`KINDS`; see the module docstring); every group
    must exit 0."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    work.mkdir(parents=True, exist_ok=True)
    with lighthouse(min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=2000) as address:
        count = 3 if kind == "spare" else 2
        runs = [_group(work, r, steps, ranks, kind, address) for r in range(count)]
        survivor, group = runs[:2]
        deadline = time.monotonic() + remaining(300)
        # Together: group 1 committed 2 steps at full strength, and every group 2 steps.
        while (
            sum(e.data["participants"] == PARTICIPANTS for e in group.events(EventKind.COMMIT)) < 2
            or min(len(run.events(EventKind.COMMIT)) for run in runs) < 2
        ):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {count} groups did not commit 2 steps together in time")
            if any(run.returncode is not None for run in runs):
                raise AssertionError(f"a group exited before the {count} groups trained together")
            time.sleep(0.1)
        killed_ids = {e.replica_id for e in group.events(EventKind.START)}
        pid = int(ready_path(work, 1, kill_rank).read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        killed_step = max(e.step for e in group.events(EventKind.COMMIT))
        # After FT_E2E_MAX_ALONE steps alone the survivor waits for these files, which the
        # replacement's ranks write again once built: it is still training when they join.
        for rank in range(ranks):
            ready_path(work, 1, rank).unlink(missing_ok=True)
        finish_all(runs)
    spare = runs[2] if kind == "spare" else None
    return ReplacementRun(survivor, group, killed_at, killed_ids, killed_step, spare)
