"""Multi-process fault-tolerance tests: real lighthouse, Manager, ProcessGroupGloo, HTTPTransport.

Each replica-group rank is its own process running ``torchtitan_ft.testing.mlp_rank.train_worker``
(a tiny MLP with
DistributedDataParallel + OptimizerWrapper + Adam). The parent runs the lighthouse, SIGKILLs
nothing itself unless it plays torchrun tearing down a group, and compares what the workers
saved: the same step, and bitwise-identical parameters and optimizer state.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank
from torchtitan_ft.testing.processes import free_port

pytestmark = pytest.mark.multiprocess


def _lighthouse(min_replicas: int, auth_token: str | None = None) -> LighthouseServer:
    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=3000,
        auth_token=auth_token,
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


def test_a_job_with_a_token_trains_and_a_late_group_heals(tmp_path: Path, procs: list[Any]) -> None:
    """Lighthouse, ManagerServers and checkpoint servers all require the job token: every rank
    presents it (quorum, vote), and a 2-rank group that joins late heals through them (the
    donor group's CheckpointMetadata, the transfer) to the same state as the first group."""
    token = "s3cret-job-token"
    lighthouse = _lighthouse(min_replicas=1, auth_token=token)
    try:
        outs: dict[tuple[int, int], Path] = {}
        progress = tmp_path / "r0_g0.jsonl"
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
                    auth_token=token,
                    commit_log=str(progress) if (replica, rank) == (0, 0) else None,
                )
                procs.append(spawn_rank(cfg))
            if replica == 0:  # the second group joins a group that has committed steps
                _wait_for(
                    lambda: sum(line["committed"] for line in _lines(progress)) >= 2,
                    90,
                    "the first group to commit 2 steps",
                )
        for proc in procs:
            assert _wait_exit(proc, 120) == 0
    finally:
        lighthouse.shutdown()

    for rank in range(2):
        first, joiner = _load(outs[(0, rank)]), _load(outs[(1, rank)])
        _assert_identical([first, joiner])
        step, _, _, participating, _ = joiner["commits"][0]
        assert step >= 2 and not participating, joiner["commits"][:3]  # healed, then joined
        assert joiner["commits"][-1][3]


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


@pytest.mark.slow  # three MLP groups and a kill: tens of seconds on 2 shared cores
def test_a_hot_spare_takes_a_killed_groups_slot_at_the_next_quorum(
    tmp_path: Path, procs: list[Any]
) -> None:
    """FIXED_WITH_SPARES with one group more than ``min_replica_size`` (a hot spare group,
    docs/titan.md): the spare took every update without a slot, so the quorum after a
    participant's SIGKILL gives it the slot and the job commits at full strength again at once,
    without waiting for a replacement."""
    lighthouse = _lighthouse(min_replicas=2)
    try:
        common = dict(
            lighthouse_addr=lighthouse.address(),
            world_size_mode="FIXED_WITH_SPARES",
            min_replica_size=2,
            stop_step=10,
            stop_participants=2,
            step_sleep_s=0.02,
            max_iterations=1500,
        )
        outs = [tmp_path / f"r{i}.pt" for i in range(3)]
        for i in range(3):
            kill = dict(kill_at_step=4, kill_participants=2) if i == 1 else {}
            procs.append(
                spawn_rank(WorkerConfig(replica=i, out_path=str(outs[i]), **common, **kill))
            )
        assert _wait_exit(procs[1], 90) == -signal.SIGKILL
        for proc in (procs[0], procs[2]):
            assert _wait_exit(proc, 120) == 0
    finally:
        lighthouse.shutdown()
    survivor, spare = _load(outs[0]), _load(outs[2])
    _assert_identical([survivor, spare])
    commits = spare["commits"]  # (step, committed, participants, participating, time)
    last_spare = max(i for i, (_, ok, n, p, _) in enumerate(commits) if ok and n == 2 and not p)
    assert commits[last_spare][0] >= 3, commits  # a spare in sync until the kill
    taken = next(i for i, (_, ok, n, p, _) in enumerate(commits) if i > last_spare and ok and p)
    # the step in flight at the kill may be discarded (and a heal may follow when only one
    # survivor's collective failed), then the spare commits in the slot
    assert taken - last_spare <= 3, commits
    assert all(n == 2 and p for _, ok, n, p, _ in commits[taken:] if ok), commits


# ------------------------------------------------------------------------- group identity


@dataclass
class IdentityWorker:
    """A replica group of one rank training a ``Linear(16, width)`` until ``stop_path`` exists."""

    lighthouse_addr: str
    replica_id: str
    width: int
    out_path: str
    """JSON lines: one per iteration (commit, time), then the outcome (error, logged errors)."""
    stop_path: str


def identity_worker(cfg: IdentityWorker) -> None:
    import json
    import logging

    from torchtitan_ft.checkpoint import HTTPTransport
    from torchtitan_ft.manager import Manager, ReplicaGroupMismatchError, model_fingerprint
    from torchtitan_ft.process_group import ProcessGroupGloo

    logged: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_ft").addHandler(handler)
    model = torch.nn.Linear(16, cfg.width)
    timeout = timedelta(seconds=3)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        lighthouse_addr=cfg.lighthouse_addr,
        replica_id=cfg.replica_id,
        hostname="127.0.0.1",
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0, hostname="127.0.0.1"),
        model_fingerprint=lambda: model_fingerprint(model),
        num_replica_groups=2,
    )
    error = None
    with open(cfg.out_path, "a") as out:
        try:
            while not os.path.exists(cfg.stop_path):
                manager.start_quorum()
                manager.allreduce(torch.ones(4)).wait()
                committed = manager.should_commit()
                out.write(json.dumps({"committed": committed, "time": time.time()}) + "\n")
                out.flush()
                time.sleep(0.05)
        except ReplicaGroupMismatchError as e:
            error = str(e)
        out.write(json.dumps({"error": error, "logged": logged}) + "\n")
    manager.shutdown(wait=False)


def _lines(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _newcomer_scenario(
    tmp_path: Path, procs: list[Any], newcomer_id: str, newcomer_width: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """ft_0 (Linear(16, 4)) trains; then a newcomer joins; returns both outputs once ft_0
    committed steps without it again."""
    from torchtitan_ft.testing.mlp import mp_context

    lighthouse = _lighthouse(min_replicas=1)
    stop = tmp_path / "stop"
    running_out, newcomer_out = tmp_path / "running.jsonl", tmp_path / "newcomer.jsonl"

    def spawn(replica_id: str, width: int, out: Path) -> Any:
        cfg = IdentityWorker(lighthouse.address(), replica_id, width, str(out), str(stop))
        proc = mp_context().Process(target=identity_worker, args=(cfg,), daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    try:
        running = spawn("ft_0", 4, running_out)
        _wait_for(lambda: len(_lines(running_out)) >= 3, 60, "ft_0 to train")
        newcomer = spawn(newcomer_id, newcomer_width, newcomer_out)
        assert _wait_exit(newcomer, 60) == 0
        left = time.time()
        _wait_for(
            lambda: (
                sum(r.get("committed", False) and r["time"] > left for r in _lines(running_out))
                >= 3
            ),
            60,
            "ft_0 to commit without the newcomer",
        )
        stop.touch()
        assert _wait_exit(running, 30) == 0
    finally:
        lighthouse.shutdown()
    return _lines(running_out), _lines(newcomer_out)


def test_newcomer_with_another_model_fails_in_one_line(tmp_path: Path, procs: list[Any]) -> None:
    running, newcomer = _newcomer_scenario(tmp_path, procs, "ft_1", newcomer_width=5)
    (outcome,) = newcomer  # failed at its first quorum, before any step
    assert outcome["error"] == (
        "replica group 'ft_1' runs a different model than 'ft_0' (fingerprint "
        f"{_fingerprint(5)} vs {_fingerprint(4)}); start every group with the same model config"
    )
    # the running group logged it once and went on (at most the shared step discarded)
    assert running[-1]["error"] is None
    lines = [line for line in running[-1]["logged"] if "different model" in line]
    assert len(lines) == 1 and "carries on" in lines[0]
    assert sum(not r["committed"] for r in running[:-1]) <= 2


def test_second_group_with_the_same_replica_id_fails(tmp_path: Path, procs: list[Any]) -> None:
    running, newcomer = _newcomer_scenario(tmp_path, procs, "ft_0", newcomer_width=4)
    assert newcomer[-1]["error"] == (
        "replica_id 'ft_0' is already used by a live replica group; give each group a "
        "distinct --fault_tolerance.replica_id (Manager replica_id / REPLICA_GROUP_ID)"
    )
    assert running[-1]["error"] is None
    assert len([line for line in running[-1]["logged"] if "already used" in line]) == 1


def _fingerprint(width: int) -> str:
    from torchtitan_ft.manager import model_fingerprint

    return model_fingerprint(torch.nn.Linear(16, width))


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_sigstopped_group_survivors_abort_and_the_group_rejoins(
    tmp_path: Path, procs: list[Any]
) -> None:
    """A group SIGSTOPped mid-allreduce keeps its connections open. Its peers abort the
    collective once the lighthouse's heartbeat timeout (1 s) names it gone, long before the
    process group's timeout (60 s), and commit without it; SIGCONTed, it discards its step,
    heals and ends bitwise identical."""
    from torchtitan_ft.events import EventKind, read_events

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=1000,
    )
    events = tmp_path / "events"
    try:
        common = dict(
            lighthouse_addr=lighthouse.address(),
            stop_step=14,
            stop_participants=3,
            step_sleep_s=0.02,
            max_iterations=1500,
            timeout_s=60.0,
            events_dir=str(events),
        )
        outs = [tmp_path / f"r{i}.pt" for i in range(3)]
        for i in range(3):
            hang = dict(hang_at_step=4, kill_participants=3) if i == 2 else {}
            procs.append(
                spawn_rank(WorkerConfig(replica=i, out_path=str(outs[i]), **common, **hang))
            )
        hung = procs[2]
        deadline = time.monotonic() + 90
        while not _stopped(hung.pid):
            assert time.monotonic() < deadline and hung.is_alive(), "the group never stopped"
            time.sleep(0.02)
        stopped_at = time.time()
        time.sleep(5.0)  # longer than the heartbeat timeout
        os.kill(hung.pid, signal.SIGCONT)
        for proc in procs:
            assert _wait_exit(proc, 120) == 0
    finally:
        lighthouse.shutdown()

    results = [_load(out) for out in outs]
    _assert_identical(results)
    got = read_events(events)
    for survivor in ("replica_0", "replica_1"):
        mine = [e for e in got if e.replica_name == survivor]
        faults = [e for e in mine if e.kind is EventKind.FAULT and e.time > stopped_at]
        assert faults and faults[0]["error"] == "HungPeerError", faults
        resumed = next(e for e in mine if e.kind is EventKind.COMMIT and e.time > stopped_at)
        # Not the process group's 60 s: the heartbeat timeout, a quorum and a step (load).
        assert resumed.time - stopped_at < 15.0, resumed
        assert resumed["participants"] == 2
    back = [e for e in got if e.replica_name == "replica_2" and e.time > stopped_at + 5.0]
    kinds = [e.kind for e in back]
    assert EventKind.COMMIT not in kinds[: kinds.index(EventKind.HEAL_END)], kinds
    assert EventKind.DISCARD in kinds[: kinds.index(EventKind.HEAL_END)], kinds


@pytest.mark.slow
def test_a_sigstopped_rank_inside_a_group_costs_its_peers_no_more_than_a_hung_group(
    tmp_path: Path, procs: list[Any]
) -> None:
    """3 groups of 2 ranks; group rank 1 of group 2 is SIGSTOPped before its allreduce. Group
    2's rank 0 goes on heartbeating for the group, so only rank 1's own heartbeat stream tells
    the lighthouse (heartbeat timeout 1 s): rank 1 of groups 0 and 1, stuck in the collective
    with it, abort long before the process group's timeout (60 s), and groups 0 and 1 commit
    without group 2. SIGCONTed, group 2 discards its step, heals and all six ranks end bitwise
    identical, rank by rank."""
    from torchtitan_ft.events import EventKind, read_events

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=1000,
    )
    events = tmp_path / "events"
    outs: dict[tuple[int, int], Path] = {}
    try:
        common = dict(
            lighthouse_addr=lighthouse.address(),
            group_world_size=2,
            stop_step=14,
            stop_participants=3,
            step_sleep_s=0.02,
            max_iterations=1500,
            timeout_s=60.0,
            events_dir=str(events),
        )
        for replica in range(3):
            port = free_port()
            for rank in range(2):
                outs[(replica, rank)] = tmp_path / f"r{replica}_g{rank}.pt"
                hang = (
                    dict(hang_at_step=4, kill_participants=3) if (replica, rank) == (2, 1) else {}
                )
                cfg = WorkerConfig(
                    replica=replica,
                    group_rank=rank,
                    store_port=port,
                    out_path=str(outs[(replica, rank)]),
                    **common,
                    **hang,
                )
                procs.append(spawn_rank(cfg))
        hung = procs[5]
        deadline = time.monotonic() + 120
        while not _stopped(hung.pid):
            assert time.monotonic() < deadline and hung.is_alive(), "the rank never stopped"
            time.sleep(0.02)
        stopped_at = time.time()
        time.sleep(5.0)  # longer than the heartbeat timeout
        os.kill(hung.pid, signal.SIGCONT)
        for proc in procs:
            assert _wait_exit(proc, 150) == 0
    finally:
        lighthouse.shutdown()

    for rank in range(2):
        _assert_identical([_load(outs[(replica, rank)]) for replica in range(3)])
    got = read_events(events)
    for survivor in ("replica_0", "replica_1"):
        mine = [e for e in got if e.replica_name == survivor and e.time > stopped_at]
        faults = [e for e in mine if e.kind is EventKind.FAULT and e.group_rank == 1]
        assert faults and faults[0]["error"] == "HungPeerError", faults
        for rank in range(2):
            resumed = next(e for e in mine if e.kind is EventKind.COMMIT and e.group_rank == rank)
            # Not the process group's 60 s: the heartbeat timeout, a quorum and a step (load).
            assert resumed.time - stopped_at < 15.0, resumed
            assert resumed["participants"] == 2
    for rank in range(2):
        back = [
            e
            for e in got
            if e.replica_name == "replica_2" and e.group_rank == rank and e.time > stopped_at
        ]
        kinds = [e.kind for e in back]
        healed = kinds.index(EventKind.HEAL_END)
        assert EventKind.COMMIT not in kinds[:healed], kinds
        assert EventKind.DISCARD in kinds[:healed], kinds
