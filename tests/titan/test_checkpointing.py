"""Disk checkpoints of an FT job: one full-checkpoint writer, per-group reader files, resume."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.testing.titan_dump import dump_path
from torchtitan_ft.testing.titan_jobs import (
    TrainRun,
    assert_identical,
    finish_all,
    ft_env,
    lighthouse,
)
from torchtitan_ft.titan.checkpointing import (
    DATALOADER_KEY,
    REPLICA_AXIS_KEY,
    TRAIN_STATE_KEY,
    ReplicaCheckpointer,
    best_reader_state,
    newest_complete_checkpoint,
    reader_dir,
    reader_files,
    stale_reader_files,
)
from torchtitan_ft.titan.training_data import CommittedBatches

STEP_LINE = re.compile(r"\[rank0\]:.*step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+)")

# --- pure pieces ---------------------------------------------------------------------------------


def test_retention_keeps_the_newest_reader_files(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        (tmp_path / f"step-{step}.pt").write_bytes(b"")
    (tmp_path / "step-9.tmp").write_bytes(b"")  # an interrupted write is not a checkpoint
    files = reader_files(tmp_path)
    assert sorted(files) == [2, 4, 6, 8]
    assert stale_reader_files(files, 2) == [files[2], files[4]]
    assert stale_reader_files(files, 0) == []
    assert reader_files(tmp_path / "missing") == {}


def test_the_newest_complete_checkpoint_is_one_with_dcp_metadata(tmp_path: Path) -> None:
    assert newest_complete_checkpoint(tmp_path / "absent") is None
    assert newest_complete_checkpoint(tmp_path) is None
    for step, complete in ((4, True), (8, True), (10, False), (12, False)):
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "step-12" / "__0_0.distcp").write_bytes(b"")  # being written
    (tmp_path / "step-99.tmp").mkdir()
    assert newest_complete_checkpoint(tmp_path) == 8


def test_a_per_step_group_tells_its_manager_where_the_newest_checkpoint_is(tmp_path: Path):
    _, axis, _, _ = _group(tmp_path, 0, 0)
    assert axis.manager.checkpoint_step() is None
    (tmp_path / "step-6").mkdir()
    (tmp_path / "step-6" / ".metadata").write_bytes(b"")
    assert axis.manager.checkpoint_step() == 6


def test_resume_uses_the_newest_reader_file_not_beyond_the_ledger() -> None:
    states = [{"position": 4}, {"position": 9}, {"position": 6}]
    assert best_reader_state(states, 7) == {"position": 6}
    assert best_reader_state(states, 3) is None  # start the slice over, read forward
    assert best_reader_state([], 5) is None


# --- ReplicaCheckpointer with stand-ins ----------------------------------------------------------


class _Loader:
    def __init__(self) -> None:
        self.next_index = 0

    def __iter__(self) -> _Loader:
        return self

    def __next__(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_index = state["next_index"]


class _TrainState:
    step = 0


class _Inner:
    """Stands in for TorchTitan's CheckpointManager (interval 2)."""

    def __init__(self, folder: Path) -> None:
        self.enable = True
        self.folder = str(folder)
        self.states: dict[str, Any] = {
            DATALOADER_KEY: object(),
            "model": object(),
            TRAIN_STATE_KEY: _TrainState(),
        }
        self.saved: list[int] = []
        self.purged = 0
        self.closed = False

    def _should_save(self, step: int, last_step: bool = False) -> bool:
        return last_step or step % 2 == 0

    def save(self, step: int, last_step: bool = False) -> None:
        self.saved.append(step)

    def _purge_stale_checkpoints(self) -> None:
        self.purged += 1

    def load(self, step: int = -1) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


class _Manager:
    def __init__(self, participating_rank: int | None) -> None:
        self.rank = participating_rank
        self.checkpoint_step: Any = None

    def set_checkpoint_step(self, newest: Any) -> None:
        self.checkpoint_step = newest

    def participating_rank(self) -> int | None:
        return self.rank

    def state_dict(self) -> dict[str, int]:
        return {"step": 0, "batches_committed": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass

    def current_step(self) -> int:
        return 0


class _Axis:
    def __init__(self, replica_id: int, participating_rank: int | None) -> None:
        self.replica_id = replica_id
        self.manager = _Manager(participating_rank)
        self.committed = True

    def step_committed(self) -> bool:
        return self.committed


def _group(folder: Path, replica_id: int, participating_rank: int | None):
    inner, axis = _Inner(folder), _Axis(replica_id, participating_rank)
    batches = CommittedBatches(_Loader(), replica_id, 2)
    checkpointer = ReplicaCheckpointer.for_replica_axis(inner, axis, batches, 0, keep_latest_k=2)
    return inner, axis, batches, checkpointer


def _train(batches: CommittedBatches, steps: int, participants: list[int]) -> None:
    for _ in range(steps):
        next(batches)
        batches.end_step(True, participants)


def test_only_the_lowest_participating_group_writes_the_full_checkpoint(tmp_path: Path) -> None:
    groups = [_group(tmp_path, r, rank) for r, rank in ((0, 0), (1, 1))]
    for inner, _, _, _ in groups:
        assert DATALOADER_KEY not in inner.states  # the full checkpoint has no reader
        assert REPLICA_AXIS_KEY in inner.states
    for step in range(1, 7):
        for _, _, batches, checkpointer in groups:
            _train(batches, 1, [0, 1])
            checkpointer.save(step, last_step=step == 6)
    assert groups[0][0].saved == [2, 4, 6]
    assert groups[1][0].saved == []
    assert (groups[0][0].purged, groups[1][0].purged) == (1, 0)  # retention after the last
    for replica in (0, 1):  # every group keeps its reader files, the newest 2
        files = reader_files(reader_dir(tmp_path, replica, 0))
        assert sorted(files) == [4, 6]
        assert torch.load(files[6], weights_only=False)["position"] == 6


def test_a_discarded_step_is_not_saved_and_a_retried_number_only_once(tmp_path: Path) -> None:
    inner, axis, batches, checkpointer = _group(tmp_path, 0, 0)
    _train(batches, 2, [0])
    axis.committed = False
    checkpointer.save(2)
    axis.committed = True
    checkpointer.save(2)
    checkpointer.save(2)
    assert inner.saved == [2]


def test_load_restarts_the_reader_at_the_ledger_position(tmp_path: Path) -> None:
    _, _, batches, checkpointer = _group(tmp_path, 1, 1)
    _train(batches, 4, [0, 1])
    checkpointer.save(4)
    _train(batches, 2, [0, 1])
    checkpointer.save(6)  # newer than the full checkpoint we resume from

    _, _, resumed, resumed_checkpointer = _group(tmp_path, 1, 1)
    resumed.load_state_dict({"consumed": [5, 5]})  # what the full checkpoint's ledger says
    assert resumed_checkpointer.load()
    assert next(resumed) == 5  # from the step-4 reader file, read forward one batch


# --- whole jobs -----------------------------------------------------------------------------------

CHECKPOINT_ARGS = (
    "--checkpoint.enable",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=2",
    # The last checkpoint is a full one (TorchTitan's default exports the model only there).
    "--checkpoint.no-last_save_model_only",
)


def run_groups_sharing(
    dump: Path,
    lighthouse: str,
    steps: int,
    *args: str,
    config: str = "debug_ft_cpu.toml",
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> list[str] | list[TrainRun]:
    """Two replica groups (1 rank each) of ``configs/<config>`` sharing the dump folder
    ``dump``, with ``CHECKPOINT_ARGS`` and ``args``; their outputs (each exited 0), or with
    ``wait=False`` the runs."""
    runs = [
        TrainRun(
            f"replica group {replica}",
            steps,
            dump,
            f"--fault_tolerance.replica_id={replica}",
            *CHECKPOINT_ARGS,
            *args,
            env={**ft_env(config, lighthouse), **(env or {})},
        )
        for replica in range(2)
    ]
    return finish_all(runs) if wait else runs


def _losses(output: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in STEP_LINE.finditer(output)}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_single_writer_and_full_job_resume(tmp_path: Path) -> None:
    """Two groups share a dump folder: only group 0 writes the full checkpoint, both keep
    their reader files (retention 2). A job whose every process (lighthouse, agents, workers)
    is SIGKILLed mid-run and started again continues after its latest full checkpoint with
    the losses of the uninterrupted run, in both groups."""
    with lighthouse(min_replicas=2) as address:
        whole = run_groups_sharing(tmp_path / "whole", address, 6)
    folder = tmp_path / "whole" / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4", "step-6"]
    for replica in (0, 1):
        assert sorted(reader_files(reader_dir(folder, replica, 0))) == [4, 6]
    assert whole[0].count("Saving the checkpoint") == 3  # steps 2, 4, 6
    assert "Saving" not in whole[1]
    assert whole[1].count("leaves step") == 3

    dump = tmp_path / "stopped"
    with lighthouse(min_replicas=2) as address:
        groups = run_groups_sharing(dump, address, 6, wait=False)
        try:
            groups[0].wait_for(r"step:\s*3\s+loss")
        finally:
            for group in groups:
                group.sigkill()
    saved = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*"))
    assert saved and saved[-1] < 6, saved
    last = saved[-1]

    with lighthouse(min_replicas=2) as address:
        resumed = run_groups_sharing(dump, address, 6)
    for replica in (0, 1):
        assert f"Training starts at step {last + 1}" in resumed[replica], resumed[replica][-4000:]
        expected = _losses(whole[replica])
        assert _losses(resumed[replica]) == {s: expected[s] for s in range(last + 1, 7)}


LOSS_STEPS, LOSS_INTERVAL = 8, 3
"""The lost-state job: steps, and its checkpoint interval (checkpoints at 3 and 6)."""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_state_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    """Two groups train under one lighthouse, checkpointing every 3 steps; both are SIGKILLed
    past step 3 and started again while the lighthouse runs on. The restarted processes load
    the step-3 checkpoint, the lighthouse declares the state at the lost step lost, and each
    group (``on_state_loss`` left at its default, ``checkpoint``) says so and trains on from
    step 3: the rolled-back steps are retrained with the same losses, the groups end bitwise
    identical, and the ledger counts each batch once (the rolled-back ones included)."""
    dump = tmp_path / "job"
    env = {
        "TRAIN_FILE": "torchtitan_ft.testing.titan_dump",
        "FT_E2E_OUT": str(tmp_path / "out"),
        "TORCHFT_EVENTS_DIR": str(tmp_path / "events"),
    }
    (tmp_path / "out").mkdir()
    interval = f"--checkpoint.interval={LOSS_INTERVAL}"
    with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000) as address:
        groups = run_groups_sharing(dump, address, LOSS_STEPS, interval, env=env, wait=False)
        try:
            groups[0].wait_for(rf"step:\s*{LOSS_INTERVAL + 1}\s+loss")
        finally:
            for group in groups:
                group.sigkill()
        checkpoint = newest_complete_checkpoint(dump / "checkpoint")
        killed = [_losses(group.output) for group in groups]
        reached = max(max(losses) for losses in killed)
        assert checkpoint == LOSS_INTERVAL < reached, (checkpoint, reached)
        resumed = run_groups_sharing(dump, address, LOSS_STEPS, interval, env=env)

    losses = {
        e.replica_id: e for e in read_events(tmp_path / "events") if e.kind is EventKind.STATE_LOST
    }
    assert len(losses) == 2, losses
    for event in losses.values():
        assert event["on_state_loss"] == "checkpoint" and event["action"] == "train_on"
        assert event["checkpoint_step"] == event["max_step"] == checkpoint
        assert reached - 1 <= event["lost_step"] <= reached
    lost_step = next(iter(losses.values()))["lost_step"]
    for replica in (0, 1):
        out = resumed[replica]
        assert f"Training starts at step {checkpoint + 1}" in out, out[-4000:]
        steps = _losses(out)
        assert sorted(steps) == list(range(checkpoint + 1, LOSS_STEPS + 1))
        # The rolled-back steps, trained again from the checkpoint: the same losses.
        for step in range(checkpoint + 1, lost_step + 1):
            assert steps[step] == killed[replica][step], (replica, step)

    states = [torch.load(dump_path(tmp_path / "out", r, 0), weights_only=False) for r in (0, 1)]
    assert_identical(states[0]["healed"], states[1]["healed"], "rank0")
    consumed = states[0]["healed"]["data"]["consumed"]
    # Each group's reader stands at its ledger entry (no batch lost, none read twice), the
    # ledger adds up to the Manager's count, and no group consumed more than one batch per
    # step of the final line: the batches of the rolled-back steps count once, not twice.
    # (A group may miss a step before the checkpoint: the one it healed in at the start.)
    assert [s["position"] for s in states] == consumed
    assert states[0]["manager"] == {"step": LOSS_STEPS, "batches_committed": sum(consumed)}
    assert all(LOSS_STEPS - checkpoint < c <= LOSS_STEPS for c in consumed), consumed


# --- the strategy state in DCP, under FSDP across 2 ranks ---------------------------------------


STRATEGY_VARIANTS = ("diloco-sgd", "diloco-adamw", "local_sgd")


def _strategy_checkpoint_worker(rank: int, port: int, folder: str) -> None:
    """Rank ``rank`` of a 2-rank FSDP group, for each of ``STRATEGY_VARIANTS``: trains the
    strategy (Streaming DiLoCo with 2 fragments, or LocalSGD; one simulated replica group) for
    5 steps, saves ``StrategyState`` with DCP, loads it into a strategy built afresh from
    another seed (whose outer optimizer never stepped) and checks its global parameters,
    outer-optimizer state and schedule bitwise; writes "ok" or the traceback to
    ``<folder>/rank<r>.txt``."""
    import traceback

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.semi_sync._helpers import make_model, train_steps
    from tests.semi_sync._simulated import SimulatedReplicaGroups
    from torchtitan_ft.semi_sync import DiLoCo, LocalSGD, OuterOptimizerConfig, split_model
    from torchtitan_ft.semi_sync.strategy import local_tensor
    from torchtitan_ft.titan import cpu_compat
    from torchtitan_ft.titan.semi_sync_axis import StrategyState

    def build(variant: str, seed: int) -> tuple[Any, Any, Any]:
        model = make_model(seed)
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        cpu_compat.force_sum_reduction([model])
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = SimulatedReplicaGroups(1).manager("0")
        if variant == "local_sgd":
            return model, inner, LocalSGD(manager, model, inner, 2)
        config = OuterOptimizerConfig(type=variant.split("-")[1], lr=0.7)
        return model, inner, DiLoCo(manager, split_model(model, 2), inner, config, 4)

    def tensors(strategy: Any) -> list[torch.Tensor]:
        """The strategy's own global copies and outer state, in order (local shards)."""
        out = [local_tensor(t) for _, t in strategy.global_parameters()]
        if isinstance(strategy, DiLoCo):
            for _, state in strategy.outer_optimizer_state():
                out += [local_tensor(state[k]) for k in sorted(state)]
        return out

    result = "ok"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for variant in STRATEGY_VARIANTS:
            model, inner, strategy = build(variant, 0)
            train_steps(strategy, model, inner, rank, range(1, 6))  # ends mid-cycle
            checkpoint = f"{folder}/{variant}"
            dcp.save({"ft_strategy": StrategyState(strategy, model)}, checkpoint_id=checkpoint)

            fresh_model, _, fresh = build(variant, 1)
            if not all(p.to_local().numel() < p.numel() for p, _ in fresh.global_parameters()[:1]):
                raise AssertionError("the parameters are not sharded")
            dcp.load({"ft_strategy": StrategyState(fresh, fresh_model)}, checkpoint_id=checkpoint)
            expected, got = tensors(strategy), tensors(fresh)
            has_outer = len(expected) > len(list(model.parameters()))
            if len(got) != len(expected) or has_outer != variant.startswith("diloco"):
                raise AssertionError(f"{variant}: {len(got)} tensors loaded, {len(expected)} saved")
            for i, (a, b) in enumerate(zip(expected, got, strict=True)):
                if not torch.equal(a, b):
                    raise AssertionError(f"{variant}: tensor {i} differs after load")
            if fresh.schedule_state() != strategy.schedule_state():
                raise AssertionError(f"{variant}: {fresh.schedule_state()} after load")
    except Exception:  # reported to the parent through the file
        result = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.txt").write_text(result)


@pytest.mark.multiprocess
def test_strategy_state_round_trips_through_dcp_under_fsdp(tmp_path: Path) -> None:
    """DiLoCo's (SGD and AdamW outer) and LocalSGD's state, saved by DCP from a 2-rank FSDP
    group: global parameters (DTensors sharing the backups' storage), outer-optimizer state
    (created before the load, which fills it) and schedule, loaded into a fresh strategy,
    every local shard bitwise equal."""
    from torchtitan_ft.testing.mlp import mp_context
    from torchtitan_ft.testing.processes import free_port

    ctx = mp_context()
    port = free_port()
    procs = [
        ctx.Process(
            target=_strategy_checkpoint_worker, args=(rank, port, str(tmp_path)), daemon=True
        )
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    for rank in range(2):
        report = tmp_path / f"rank{rank}.txt"
        assert report.exists(), f"rank {rank} exited {procs[rank].exitcode} without a report"
        assert report.read_text() == "ok", report.read_text()
