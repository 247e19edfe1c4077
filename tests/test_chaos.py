"""Chaos: three replica groups train through random SIGKILLs, a SIGSTOP hang and a lighthouse
restart, and the numerics come out as if nothing had happened.

Each replica group is one rank of the tiny-MLP harness
(``torchtitan_ft.testing.mlp_rank.train_worker``: Manager +
DDP + OptimizerWrapper + Adam, gloo, HTTP healing) with ``shared_batches`` (the batch depends
on the step only, so equal progress means equal samples) and a commit log (one JSON line per
iteration: step, committed, participants, state hash, losses), in the project's one MLP job
(``testing.mlp_job.MlpJob``, which also injects the faults). The lighthouse is a
subprocess on a fixed port so it can be SIGKILLed and restarted there.

The faults' order and victims are one round of ``testing.faults.fault_schedule`` (seeded:
:data:`KINDS`), their trigger steps and downtimes from a seeded RNG; failures are triggered by
progress (the job's committed step), one at a time, each once every group is back and
participating (``faults.fault_victims`` keeps a holder of the state), so at least
``MIN_REPLICAS`` groups are always alive.

Invariants, checked while the job runs (every 0.1 s, over every iteration logged so far) and
again at the end, over every iteration of every process (including killed ones):
same committed step => bitwise-identical state; a group's step never goes back; the job never
stalls longer than ``STALL_BOUND_S`` (watched live too); and the final evaluation loss is
within 2% of a fault-free run on the same data (one group, same step count, run afterwards).

It runs twice: with the Manager's ``min_replica_size`` 1 (the TorchTitan config's default) and
2 (= the lighthouse's ``min_replicas``). The second once exposed a livelock: after a kill
right after an allreduce, fewer than min_replica_size groups were at the max step, no step
could commit, and the groups behind never applied their healed state (then applied only on
commit; now applied once every rank of the group has it, whatever the vote).
Each run takes 20-30 s on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from torchtitan_ft.testing.commit_log import (
    Record,
    longest_gap,
    progress_times,
    read_commit_log,
    state_divergence,
    step_regressions,
)
from torchtitan_ft.testing.faults import FaultKind, fault_schedule, fault_victims
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank
from torchtitan_ft.testing.mlp_job import FaultPauses, MlpJob
from torchtitan_ft.testing.processes import LighthouseProcess

SEED = int(os.environ.get("CHAOS_SEED", "20261121"))
"""Fixed for reproducibility (victims, trigger steps, downtimes, order); CHAOS_SEED overrides."""
GROUPS = 3
MIN_REPLICAS = 2
STALL_BOUND_S = 15.0
"""Longest the job may go without committing while >= MIN_REPLICAS groups live. A hang costs
the collective timeout (``TIMEOUT_S``) plus the heartbeat timeout; the rest is slack for a
loaded 2-core machine."""
TIMEOUT_S = 5.0
"""Manager/collective timeout of the workers: bounds the stall of a hang."""
RUN_BUDGET_S = 150.0
STEPS_AFTER_LAST_EVENT = 8
KINDS = [FaultKind.SIGKILL] * 3 + [FaultKind.SIGSTOP, FaultKind.LIGHTHOUSE]
"""One round of the schedule: three kills, a hang and a lighthouse restart, in a seeded order."""


@dataclass
class Chaos:
    """The job of one chaos run and what was done to it: (time, kind, victims) per fault."""

    job: MlpJob
    faults: list[tuple[float, FaultKind, tuple[int, ...]]] = field(default_factory=list)


@pytest.fixture(params=[1, MIN_REPLICAS], ids=lambda n: f"min_replica_size={n}")
def chaos(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Chaos]:
    log = open(tmp_path / "lighthouse.log", "w")  # noqa: SIM115 (closed by the job)
    job = MlpJob(
        tmp_path,
        LighthouseProcess(MIN_REPLICAS, log=log),
        stop_participants=GROUPS,
        min_replica_size=request.param,
        step_sleep_s=0.0,
        timeout_s=TIMEOUT_S,
        shared_batches=True,
    )
    with job:
        yield Chaos(job)


def _all_participating(job: MlpJob) -> int | None:
    """The step at which every current process last committed with all groups taking part,
    if each one's latest iteration is such a commit."""
    steps = set()
    for replica in range(GROUPS):
        latest = job.latest(replica)
        if not latest:
            return None
        last = latest[-1]
        if not (last.committed and last.participating and last.participants == GROUPS):
            return None
        steps.add(last.step)
    return min(steps)


def _run_chaos(chaos: Chaos, rng: random.Random) -> int:
    """Runs the schedule; returns the last step all groups committed together."""
    job = chaos.job
    for replica in range(GROUPS):
        job.start(replica)
    # only the order and the victims: the times are the trigger steps below (end_s bounds the
    # draw at about 70 faults, of which the first round is taken)
    schedule = fault_schedule(
        SEED,
        start_s=0.0,
        end_s=100.0,
        mean_interval_s=1.0,
        min_interval_s=1.0,
        groups=GROUPS,
        ranks=1,
        kinds=KINDS,
    )[: len(KINDS)]
    started = time.monotonic()
    last_progress = (time.monotonic(), -1)

    def wait_for(predicate: Any, what: str) -> Any:
        nonlocal last_progress
        while True:
            value = predicate()
            if value is not None and value is not False:
                return value
            now = time.monotonic()
            records = job.records()
            # the invariants, live (re-checked over everything at the end)
            broken = state_divergence(records) + step_regressions(records)
            assert not broken, f"{broken}; faults: {chaos.faults}"
            progress = progress_times(records)
            best = progress[-1][1] if progress else -1
            if best > last_progress[1]:
                last_progress = (now, best)
            elif progress and now - last_progress[0] > STALL_BOUND_S:
                raise AssertionError(
                    f"no step committed for {STALL_BOUND_S}s (step {best}) while waiting "
                    f"for {what}; faults: {chaos.faults}"
                )
            if now - started > RUN_BUDGET_S:
                raise AssertionError(f"run over budget waiting for {what}; faults: {chaos.faults}")
            time.sleep(0.1)

    step = wait_for(lambda: _all_participating(job), "all groups to train together")
    for fault in schedule:
        target = step + rng.randint(3, 8)
        wait_for(lambda t=target: (s := _all_participating(job)) is not None and s >= t, fault.kind)
        victims = fault_victims(fault.kind, fault.groups, job.participating(), GROUPS)
        assert victims is not None, f"every group takes part, yet {fault} may not fire"
        chaos.faults.append((time.time(), fault.kind, victims))
        # a hang longer than the collective and heartbeat timeouts: survivors stuck in an
        # allreduce with it time out, and the lighthouse evicts it
        pauses = FaultPauses(
            hang_s=TIMEOUT_S + 1.5,
            restart_delay_s=rng.uniform(0.2, 1.0),
            lighthouse_down_s=rng.uniform(0.3, 1.0),
        )
        job.inject(fault.kind, victims, pauses)
        step = wait_for(lambda: _all_participating(job), f"recovery from {fault.kind}")
    final = step + STEPS_AFTER_LAST_EVENT

    def reached_final() -> int | None:
        s = _all_participating(job)
        return s if s is not None and s >= final else None

    return wait_for(reached_final, "the final steps")


def _baseline_eval_loss(tmp_path: Path, steps: int) -> float:
    """Fault-free: one group, the same per-step batches, ``steps`` commits."""
    lighthouse = LighthouseProcess(1)
    lighthouse.start()
    log = tmp_path / "baseline.jsonl"
    try:
        cfg = WorkerConfig(
            lighthouse_addr=lighthouse.address,
            replica=0,
            out_path=str(tmp_path / "baseline.pt"),
            stop_step=steps,
            stop_participants=1,
            max_iterations=steps + 50,
            shared_batches=True,
            commit_log=str(log),
        )
        proc = spawn_rank(cfg)
        proc.join(120)
        assert proc.exitcode == 0, f"baseline worker exit code {proc.exitcode}"
    finally:
        lighthouse.stop()
    records = [r for r in read_commit_log(log, 0, 0) if r.committed]
    assert [r.step for r in records] == list(range(1, steps + 1))
    return records[-1].eval_loss


@pytest.mark.multiprocess
def test_chaos_kill_hang_lighthouse_restart_keeps_replicas_identical(
    tmp_path: Path, chaos: Chaos
) -> None:
    rng = random.Random(SEED)
    t0 = time.time()
    final_step = _run_chaos(chaos, rng)
    t_end = time.time()
    job = chaos.job
    job.close()
    records = job.records()

    assert state_divergence(records) == []
    assert step_regressions(records) == []
    progress = progress_times(records)
    stalls = []
    for i, (at, kind, victims) in enumerate(chaos.faults):
        until = chaos.faults[i + 1][0] if i + 1 < len(chaos.faults) else t_end
        stalls.append((f"{kind} {victims}", round(longest_gap(progress, at, until), 2)))
    print(
        f"chaos: {progress[-1][1]} steps committed in {t_end - t0:.0f}s; stall per event: {stalls}"
    )
    assert all(stall < STALL_BOUND_S for _, stall in stalls), stalls
    assert longest_gap(progress, progress[0][0], t_end) < STALL_BOUND_S
    # every kind of failure happened, and restarted groups healed and committed again
    assert sum(1 for _, kind, _ in chaos.faults if kind is FaultKind.SIGKILL) == 3
    for replica, last in job.incarnations.items():
        for inc in range(1, last + 1):  # every replacement healed, then took part
            mine = [r for r in records if (r.replica, r.incarnation) == (replica, inc)]
            # Its first step heals (it sits out that step's average); a fault may discard that
            # step, and its next one is then its first commit, as a participant.
            assert mine and not mine[0].participating and mine[0].step > 1, mine[:3]
            commits = [r for r in mine if r.committed]
            assert commits and commits[-1].participating, mine[:3]
    (stopped_at, (victim,)) = next((at, v) for at, k, v in chaos.faults if k is FaultKind.SIGSTOP)
    survivors_alone = [
        r
        for r in records
        if r.committed and r.replica != victim and r.time > stopped_at and r.participants == 2
    ]
    assert survivors_alone, "the hung group was never evicted from the quorum"

    final = [r for r in records if r.committed and r.step == final_step]
    assert {r.replica for r in final} == set(range(GROUPS))
    baseline = _baseline_eval_loss(tmp_path, final_step)
    chaos_loss = final[0].eval_loss
    print(f"final step {final_step}: eval loss {chaos_loss:.6f}, fault-free {baseline:.6f}")
    assert abs(chaos_loss - baseline) <= 0.02 * baseline


# --- the invariant checks themselves, on hand-built records ---------------------------------


def _rec(
    replica: int, step: int, at: float, *, inc: int = 0, ok: bool = True, h: str = "a"
) -> Record:
    return Record(replica, inc, 1, step, ok, 3, True, h, 0.0, 0.0, at)


def test_state_divergence_names_the_step_and_holders() -> None:
    same = [_rec(0, 1, 0.0), _rec(1, 1, 0.1), _rec(0, 2, 1.0, h="b"), _rec(1, 2, 1.1, h="b")]
    assert state_divergence(same) == []
    (problem,) = state_divergence([*same, _rec(2, 2, 1.2, h="c")])
    assert problem.startswith("step 2: 2 different states") and "replica 2#0" in problem
    # an uncommitted iteration's state is not compared
    assert state_divergence([*same, _rec(2, 2, 1.2, h="c", ok=False)]) == []


def test_step_regressions_within_and_across_restarts() -> None:
    fine = [_rec(0, 1, 0.0), _rec(0, 1, 0.5, ok=False), _rec(0, 2, 1.0), _rec(0, 9, 5.0, inc=1)]
    assert step_regressions(fine) == []
    assert step_regressions([_rec(0, 3, 0.0), _rec(0, 2, 1.0)]) == ["replica 0#0: step 3 then 2"]
    assert step_regressions([_rec(0, 3, 0.0), _rec(0, 3, 1.0)])  # committed twice
    (problem,) = step_regressions([_rec(0, 5, 0.0), _rec(0, 4, 2.0, inc=1)])
    assert "restarted process committed step 4" in problem


def test_progress_and_longest_gap() -> None:
    records = [_rec(0, 1, 1.0), _rec(1, 1, 1.1), _rec(0, 2, 2.0), _rec(0, 3, 7.0)]
    progress = progress_times(records)
    assert progress == [(1.0, 1), (2.0, 2), (7.0, 3)]
    assert longest_gap(progress, 0.0, 8.0) == 5.0
    assert longest_gap(progress, 2.5, 3.0) == 0.5
