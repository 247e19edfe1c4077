"""Multi-process fault-tolerance tests: real lighthouse, Manager, ProcessGroupGloo, HTTPTransport.

Each replica-group rank is its own process running ``tests._mp.train_worker`` (a tiny MLP with
DistributedDataParallel + OptimizerWrapper + Adam). The parent runs the lighthouse, SIGKILLs
nothing itself unless it plays torchrun tearing down a group, and compares what the workers
saved: the same step, and bitwise-identical parameters and optimizer state.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._mp import WorkerConfig, free_port, spawn_rank
from torchtitan_ft.lighthouse import LighthouseServer

pytestmark = pytest.mark.multiprocess


def _lighthouse(min_replicas: int) -> LighthouseServer:
    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=3000,
    )


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:  # only our own children, by pid
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)


def _wait_exit(proc: Any, timeout_s: float) -> int:
    proc.join(timeout_s)
    if proc.is_alive():
        raise AssertionError(f"worker pid {proc.pid} still running after {timeout_s}s")
    return proc.exitcode


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def _assert_identical(results: list[dict[str, Any]]) -> None:
    first = results[0]
    for other in results[1:]:
        assert other["step"] == first["step"]
        assert first["model"].keys() == other["model"].keys()
        for name, tensor in first["model"].items():
            assert torch.equal(tensor, other["model"][name]), name
        state_a, state_b = first["optim"]["state"], other["optim"]["state"]
        assert state_a.keys() == state_b.keys()
        for index, per_param in state_a.items():
            for key, value in per_param.items():
                assert torch.equal(value, state_b[index][key]), (index, key)


def test_sigkill_mid_allreduce_survivors_commit_and_replacement_heals(
    tmp_path: Path, procs: list[Any]
) -> None:
    lighthouse = _lighthouse(min_replicas=2)
    try:
        common = dict(
            lighthouse_addr=lighthouse.address(),
            stop_step=12,
            stop_participants=3,
            step_sleep_s=0.02,
            max_iterations=1500,
        )
        outs = [tmp_path / f"r{i}.pt" for i in range(3)]
        for i in range(3):
            kill = dict(kill_at_step=4, kill_participants=3) if i == 2 else {}
            procs.append(
                spawn_rank(WorkerConfig(replica=i, out_path=str(outs[i]), **common, **kill))
            )
        victim = procs[2]
        assert _wait_exit(victim, 90) == -signal.SIGKILL
        killed_at = time.monotonic()

        replacement_out = tmp_path / "r2_replacement.pt"
        procs.append(spawn_rank(WorkerConfig(replica=2, out_path=str(replacement_out), **common)))
        for proc in (procs[0], procs[1], procs[3]):
            assert _wait_exit(proc, 120) == 0
        elapsed = time.monotonic() - killed_at
    finally:
        lighthouse.shutdown()

    survivors = [_load(outs[0]), _load(outs[1])]
    replacement = _load(replacement_out)
    _assert_identical([*survivors, replacement])
    assert replacement["step"] >= 12
    for result in survivors:
        commits = result["commits"]
        # The step of the kill is discarded, unless the victim's bytes were already sent when
        # it died: then the survivors' collective completed with every contribution and the
        # step is rightly committed. Either way at most a few steps are lost, and the two
        # survivors go on committing without the victim.
        # (One survivor's collective may complete while the other's fails; that one then
        # discards and heals from the first.)
        joined = next(i for i, (_, _, n, _, _) in enumerate(commits) if n == 3)
        dropped = next(
            i for i, (_, ok, n, _, _) in enumerate(commits) if i > joined and (n < 3 or not ok)
        )
        window = commits[dropped:]
        alone = next(i for i, (_, ok, n, p, _) in enumerate(window) if ok and n == 2 and p)
        assert sum(not ok for _, ok, _, _, _ in window[:alone]) <= 3, commits
    # the replacement healed (first step not participating) and then participated
    first_step, first_ok, _, first_participating, _ = replacement["commits"][0]
    assert first_ok and not first_participating and first_step > 1
    assert replacement["commits"][-1][3]
    assert elapsed < 100


def test_two_ranks_per_group_kill_and_replace_group(tmp_path: Path, procs: list[Any]) -> None:
    lighthouse = _lighthouse(min_replicas=1)
    try:
        common = dict(
            lighthouse_addr=lighthouse.address(),
            group_world_size=2,
            stop_step=10,
            stop_participants=2,
            step_sleep_s=0.02,
            max_iterations=1500,
        )
        outs: dict[tuple[int, int], Path] = {}

        def start_group(replica: int, tag: str, **extra: Any) -> list[Any]:
            port = free_port()
            group = []
            for rank in range(2):
                outs[(replica, rank)] = tmp_path / f"{tag}_r{replica}_g{rank}.pt"
                cfg = WorkerConfig(
                    replica=replica,
                    group_rank=rank,
                    store_port=port,
                    out_path=str(outs[(replica, rank)]),
                    **common,
                    **extra,
                )
                group.append(spawn_rank(cfg))
            procs.extend(group)
            return group

        survivor = start_group(0, "first")
        victim = start_group(1, "first", kill_at_step=3, kill_participants=2)
        # torchrun tears a group down when one of its ranks dies: kill the rest of it
        deadline = time.monotonic() + 90
        while all(p.is_alive() for p in victim) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in victim:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        assert any(p.exitcode == -signal.SIGKILL for p in victim)

        replacement = start_group(1, "second")
        for proc in survivor + replacement:
            assert _wait_exit(proc, 120) == 0
    finally:
        lighthouse.shutdown()

    steps = set()
    for rank in range(2):
        a = _load(outs[(0, rank)])
        b = _load(outs[(1, rank)])
        _assert_identical([a, b])
        steps.add(a["step"])
        assert any(ok and n == 1 for _, ok, n, _, _ in a["commits"])  # survivor alone
        assert not b["commits"][0][3]  # the replacement's rank healed first
    assert len(steps) == 1  # both group ranks of both groups end at the same step


def test_group_heals_all_or_nothing_when_one_rank_fetch_fails(
    tmp_path: Path, procs: list[Any]
) -> None:
    """A joining 2-rank group whose rank 1 loses its first transfer: the group votes no,
    neither rank applies a healed state, the next quorum heals both ranks."""
    lighthouse = _lighthouse(min_replicas=1)
    try:
        outs: dict[tuple[int, int], Path] = {}
        group_procs = []
        for replica in (0, 1):
            port = free_port()
            for rank in range(2):
                outs[(replica, rank)] = tmp_path / f"r{replica}_g{rank}.pt"
                cfg = WorkerConfig(
                    lighthouse_addr=lighthouse.address(),
                    replica=replica,
                    group_rank=rank,
                    group_world_size=2,
                    store_port=port,
                    out_path=str(outs[(replica, rank)]),
                    stop_step=8,
                    stop_participants=2,
                    step_sleep_s=0.02,
                    max_iterations=1500,
                    fail_first_heal=replica == 1 and rank == 1,
                )
                group_procs.append(spawn_rank(cfg))
            if replica == 0:  # the second group joins a group that is already training
                time.sleep(2.0)
        procs.extend(group_procs)
        for proc in group_procs:
            assert _wait_exit(proc, 120) == 0
    finally:
        lighthouse.shutdown()

    joiner = [_load(outs[(1, rank)]) for rank in range(2)]
    for rank in range(2):
        _assert_identical([_load(outs[(0, rank)]), joiner[rank]])
    # The first attempt was discarded on both ranks (rank 0's fetch succeeded but was not
    # applied alone), and both ranks went on to commit steps in lockstep.
    for result in joiner:
        assert result["commits"][0][1] is False
    assert [c[:2] for c in joiner[0]["commits"]] == [c[:2] for c in joiner[1]["commits"]]


def test_fixed_with_spares_spare_stays_in_sync(tmp_path: Path, procs: list[Any]) -> None:
    lighthouse = _lighthouse(min_replicas=2)
    try:
        outs = [tmp_path / f"r{i}.pt" for i in range(2)]
        for i in range(2):
            cfg = WorkerConfig(
                lighthouse_addr=lighthouse.address(),
                replica=i,
                out_path=str(outs[i]),
                world_size_mode="FIXED_WITH_SPARES",
                min_replica_size=1,
                stop_step=6,
                stop_participants=1,
            )
            procs.append(spawn_rank(cfg))
        for proc in procs:
            assert _wait_exit(proc, 90) == 0
    finally:
        lighthouse.shutdown()
    results = [_load(p) for p in outs]
    _assert_identical(results)
    participating = [[c[3] for c in r["commits"] if c[1]] for r in results]
    # exactly one participant per committed step (step 0 may be the init_sync heal)
    for a, b in zip(participating[0][1:], participating[1][1:], strict=True):
        assert a != b
    assert results[0]["batches_committed"] == results[0]["step"]
