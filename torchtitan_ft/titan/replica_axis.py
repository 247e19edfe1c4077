"""The FT replica axis as TorchTitan's trainer sees it, in every trainer rank: the interface,
FT off, and per-step FT (docs/titan.md, "How it plugs in")."""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from torchtitan_ft.checkpoint import PGTransport
from torchtitan_ft.manager import Manager, WorldSizeMode, model_fingerprint
from torchtitan_ft.manager.settings import resolve_heal_interfaces, resolve_timeouts
from torchtitan_ft.process_group import (
    ProcessGroup,
    ProcessGroupGloo,
    ProcessGroupNativeGloo,
    ProcessGroupNCCL,
)
from torchtitan_ft.replica_ids import titan_replica_name
from torchtitan_ft.semi_sync.config import QuorumMode
from torchtitan_ft.titan import releases
from torchtitan_ft.titan.config_schema import manager_timeouts, quorum_mode, uses_semi_sync
from torchtitan_ft.titan.training_data import CommittedBatches

GradientReduce = Callable[[torch.Tensor], None]
"""Averages a gradient shard across replica groups, in place."""


@runtime_checkable
class ReplicaAxis(Protocol):
    """What :class:`~torchtitan_ft.titan.trainer.FaultTolerantTrainer` asks of the FT replica
    axis, in the order it asks. Implementations: :class:`NoReplicaAxis` (FT off),
    :class:`ManagedReplicaAxis` (per-step FT) and
    :class:`~torchtitan_ft.titan.semi_sync_axis.SemiSyncReplicaAxis` (LocalSGD / DiLoCo); a
    trainer's ``build_replica_axis`` may return any other."""

    enabled: bool
    """Whether FT is on: the trainer then registers :meth:`train_spec` and wraps its
    checkpointer (one writer, a reader file per group)."""
    replica_id: int
    """Index of this replica group (0 without FT)."""
    group_size: int
    """Planned number of replica groups (1 without FT)."""

    def train_spec(self, spec: Any) -> Any:
        """The TrainSpec TorchTitan builds the model and dataloader from (after
        ``init_distributed``, before TorchTitan looks the spec up)."""
        ...

    def install_gradient_sync(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Sync gradients across groups (the model is parallelized); returns FSDP units hooked."""
        ...

    def track_data(self, dataloader: Any) -> Any:
        """The iterable the trainer reads batches from instead of ``dataloader``."""
        ...

    def register_state(self, state: Any) -> None:
        """``state`` (a Stateful, :class:`~torchtitan_ft.titan.healing.HealedState`) is what a
        healing peer receives and what this group loads when it heals."""
        ...

    def gate_step(self, optimizers: Any, lr_schedulers: Any) -> tuple[Any, Any]:
        """The optimizers and lr schedulers the trainer steps instead of its own."""
        ...

    def step_committed(self) -> bool:
        """Whether the step that just ended committed (else it is retried under its number)."""
        ...

    def shutdown(self) -> None:
        """Release cross-group resources (``Trainer.close``); idempotent."""
        ...


def replica_dataloader_shard(
    dp_degree: int, dp_rank: int, replica_id: int, group_size: int
) -> tuple[int, int]:
    """(world size, rank) of this process's data slice across all replica groups.

    ``dp_degree``/``dp_rank`` are TorchTitan's batch-mesh degree and rank inside the replica
    group. Every group uses the same ``group_size`` (the planned number of groups) so slices
    never overlap, whichever groups are alive.
    """
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
    if not 0 <= replica_id < group_size:
        raise ValueError(f"replica_id={replica_id} must be in [0, group_size={group_size})")
    return dp_degree * group_size, replica_id * dp_degree + dp_rank


def _fsdp_modules(model_parts: Iterable[torch.nn.Module]) -> list[Any]:
    """Every FSDP module of ``model_parts``. Raises ``RuntimeError`` when there is none: with
    one rank per replica group TorchTitan applies no FSDP, so the model must be wrapped on a
    1-rank mesh first (:func:`shard_on_single_rank`), or nothing would be synchronised."""
    modules = [m for part in model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise RuntimeError(
            "fault tolerance found no FSDP module to hook the cross-replica all-reduce "
            "into; the model must be FSDP-wrapped (a 1-rank mesh is enough)"
        )
    return modules


def install_replica_allreduce_hook(
    model_parts: Iterable[torch.nn.Module], reduce: GradientReduce
) -> int:
    """Average every FSDP unit's gradient shard across replica groups with ``reduce``, which
    returns once the shard is averaged. Returns the number of FSDP modules hooked; raises
    ``RuntimeError`` when there is none (see :func:`_fsdp_modules`)."""
    modules = _fsdp_modules(model_parts)
    for module in modules:
        module.set_all_reduce_hook(reduce)
    return len(modules)


@dataclass(frozen=True)
class UnitReduction:
    """What FSDP does with an FSDP unit's reduced gradient shard after the all-reduce hook
    returns (torch 2.13-2.15 ``foreach_reduce``), as far as it decides whether the hook may return
    before the cross-group all-reduce has finished.

    Args:
        device_type: "cpu" (gloo) or an accelerator.
        divide_factor: the unit's ``gradient_divide_factor`` (TorchTitan sets 1.0: it divides
            the loss by the global token count instead).
        force_sum: the unit's ``force_sum_reduction_for_comms`` (set on gloo).
        reduce_dtype: dtype of the reduced shard.
        orig_dtype: dtype FSDP gives the gradients after the hook (the sharded parameters';
            on torch 2.15 their ``sharded_grad_dtype``): one that differs from
            ``reduce_dtype`` where any does.
        accumulating: a parameter of the unit already holds a gradient (gradient
            accumulation: FSDP adds the shard into it at once).
        offload: a parameter of the unit is offloaded to the CPU (FSDP copies the shard).
        grad_hooks: a parameter of the unit has a post-accumulate-grad hook (it reads the
            gradient at once, e.g. an optimizer in the backward).
    """

    device_type: str
    divide_factor: float | None
    force_sum: bool
    reduce_dtype: torch.dtype
    orig_dtype: torch.dtype
    accumulating: bool = False
    offload: bool = False
    grad_hooks: bool = False


def overlap_blocker(unit: UnitReduction) -> str | None:
    """Why the cross-group all-reduce of ``unit``'s gradient shard must finish inside FSDP's
    hook, or None when it may go on while the backward continues.

    It may go on only while nothing reads or writes the shard before the optimizer: FSDP turns
    the shard into the parameters' gradients by views, and after the hook it may divide the
    shard (a post-division other than 1), cast it (reduce dtype other than the parameters'),
    copy it (CPU offload), add it to gradients already there (gradient accumulation) or run
    the parameters' post-accumulate-grad hooks on it. On an accelerator the wait is a stream
    wait already, so nothing is gained there.
    """
    if unit.device_type != "cpu":
        return f"device {unit.device_type!r}: the all-reduce is already asynchronous there"
    overflow_risk = unit.reduce_dtype not in (torch.float32, torch.bfloat16)
    if (overflow_risk or unit.force_sum) and unit.divide_factor != 1.0:
        return (
            f"FSDP divides the shard after the hook (gradient_divide_factor={unit.divide_factor})"
        )
    if unit.reduce_dtype != unit.orig_dtype:
        return f"FSDP casts the shard after the hook ({unit.reduce_dtype} to {unit.orig_dtype})"
    if unit.offload:
        return "FSDP copies the shard to the CPU after the hook (CPU offload)"
    if unit.accumulating:
        return "FSDP adds the shard to the gradients already there (gradient accumulation)"
    if unit.grad_hooks:
        return "a post-accumulate-grad hook reads the gradient right after the hook"
    return None


def unit_reduction(module: Any, device_type: str) -> UnitReduction:
    """The :class:`UnitReduction` of FSDP module ``module`` now (read from its FSDP state)."""
    (group,) = module._get_fsdp_state()._fsdp_param_groups
    params = [p.sharded_param for p in group.fsdp_params]
    # Per parameter, as every torch from 2.13 keeps them (2.15 dropped the group's
    # ``_orig_dtype``). FSDP requires one reduce dtype per unit; torch 2.15 casts each
    # gradient to its ``sharded_grad_dtype`` after the hook (before: the parameter's dtype).
    trainable = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
    reduce_dtype = next(
        (p.reduce_dtype or p.orig_dtype for p in trainable), group.fsdp_params[0].orig_dtype
    )
    after = {getattr(p, "sharded_grad_dtype", None) or p.orig_dtype for p in trainable}
    return UnitReduction(
        device_type=device_type,
        divide_factor=group.gradient_divide_factor,
        force_sum=group.force_sum_reduction_for_comms,
        reduce_dtype=reduce_dtype,  # the parameters' own without mixed precision
        orig_dtype=next((d for d in after if d != reduce_dtype), reduce_dtype),
        accumulating=any(p.grad is not None for p in params),
        offload=any(p.offload_to_cpu for p in group.fsdp_params),
        grad_hooks=any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params),
    )


class OverlappedGradientSync:
    """Starts each FSDP unit's cross-group all-reduce as soon as FSDP hands its reduced
    gradient shard to the hook, lets the backward pass go on while it is on the wire, and
    waits for all of them when the backward pass ends (an autograd final callback, which runs
    after FSDP's own), before TorchTitan clips the gradients and steps the optimizer.

    A unit whose shard FSDP still touches after the hook (:func:`overlap_blocker`) is waited
    for inside its hook, as without overlap; the first such reason is logged once.

    Args:
        start: starts the all-reduce of a shard in place and returns its future (never
            failing: ``Manager.allreduce``, whose errors are recorded and discard the step).
        device_type: where the shards live ("cpu" for gloo).
    """

    def __init__(
        self, start: Callable[[torch.Tensor], torch.futures.Future], device_type: str
    ) -> None:
        self._start = start
        self._device_type = device_type
        self._pending: list[torch.futures.Future] = []
        self.overlapped = 0
        """All-reduces that went on while the backward continued (since construction)."""
        self.waited_in_hook = 0
        """All-reduces waited for inside their hook (since construction)."""
        self._logged = False

    def install(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Hook every FSDP unit of ``model_parts``; returns how many (raises as
        :func:`install_replica_allreduce_hook`)."""
        modules = _fsdp_modules(model_parts)
        for module in modules:
            module.set_all_reduce_hook(functools.partial(self._reduce, module))
        return len(modules)

    def _reduce(self, module: Any, shard: torch.Tensor) -> None:
        blocker = overlap_blocker(unit_reduction(module, self._device_type))
        if blocker is None and torch._C._current_graph_task_id() == -1:
            blocker = "FSDP ran the hook outside a backward pass"
        future = self._start(shard)
        if blocker is not None:
            if not self._logged:
                self._logged = True
                logger.info(f"FT: a cross-group gradient all-reduce is not overlapped: {blocker}")
            self.waited_in_hook += 1
            future.wait()
            return
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        self._pending.append(future)
        self.overlapped += 1

    def wait(self) -> None:
        """Waits for every all-reduce started and not yet waited for."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.wait()


def has_fsdp(model: torch.nn.Module) -> bool:
    """Whether any submodule of ``model`` is FSDP-wrapped."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_on_single_rank(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """Wrap ``model`` (root only) in FSDP on a 1-rank mesh so the replica hook has a home.

    With one rank per replica group TorchTitan applies no FSDP (DDP/AMP path), so there would
    be no reduce-scatter to hook the cross-replica all-reduce onto. One root unit keeps the
    numerics of that path (parameters stay fp32, AMP still autocasts since TorchTitan sees no
    FSDP in its ParallelDims) and costs one all-reduce of the full gradient per step.
    """
    if dist.get_world_size() != 1:
        raise RuntimeError(
            "fault tolerance needs FSDP inside each replica group; this group has "
            f"{dist.get_world_size()} ranks but no FSDP "
            "(set parallelism.data_parallel_shard_degree)"
        )
    mesh = init_device_mesh(device_type, (1,), mesh_dim_names=("replica_local",))
    fully_shard(model, mesh=mesh)
    return model


class NoReplicaAxis:
    """Fault tolerance off: every seam is the identity, so the trainer has no ``if ft:``."""

    enabled = False
    replica_id = 0
    group_size = 1

    def train_spec(self, spec: Any) -> Any:
        """The TrainSpec unchanged."""
        return spec

    def install_gradient_sync(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Nothing to synchronise across replica groups; returns 0."""
        return 0

    def track_data(self, dataloader: Any) -> Any:
        """The dataloader unchanged (every batch read is consumed)."""
        return dataloader

    def register_state(self, state: Any) -> None:
        """Nothing to heal from peers."""

    def gate_step(self, optimizers: Any, lr_schedulers: Any) -> tuple[Any, Any]:
        """The optimizers and lr schedulers unchanged (every step commits)."""
        return optimizers, lr_schedulers

    def step_committed(self) -> bool:
        """Whether the last step committed (always, without FT)."""
        return True

    def shutdown(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class ReplicaSlice:
    """This replica group's place on the axis: the data slice it reads and the TrainSpec that
    reads it. Shared by the per-step and the semi-sync axis.

    Args:
        replica_id: index of this replica group (``fault_tolerance.replica_id``).
        group_size: planned number of replica groups (``fault_tolerance.group_size``).
    """

    replica_id: int
    group_size: int

    def __post_init__(self) -> None:
        replica_dataloader_shard(1, 0, self.replica_id, self.group_size)  # validates the pair

    def dataloader_shard(self, dp_degree: int, dp_rank: int) -> tuple[int, int]:
        """See :func:`replica_dataloader_shard`."""
        return replica_dataloader_shard(dp_degree, dp_rank, self.replica_id, self.group_size)

    def train_spec(self, spec: Any) -> Any:
        """``spec`` whose dataloader reads this replica group's slice and whose model always
        ends up FSDP-wrapped (see :func:`shard_on_single_rank`)."""
        build, parallelize = spec.build_dataloader_fn, spec.parallelize_fn

        def build_dataloader(*, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
            world, rank = self.dataloader_shard(dp_world_size, dp_rank)
            return build(dp_world_size=world, dp_rank=rank, **kwargs)

        def parallelize_fn(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> Any:
            model = parallelize(model, parallel_dims, job_config)
            if not has_fsdp(model):
                model = shard_on_single_rank(model, utils.device_type)
            return model

        return dataclasses.replace(
            spec,
            build_dataloader_fn=build_dataloader if build is not None else None,
            parallelize_fn=parallelize_fn,
        )


class ManagerRuntime:
    """This rank's :class:`~torchtitan_ft.manager.Manager` and the cross-group process group
    it reconfigures, as :func:`build_manager_runtime` makes them from the config. Both FT axes
    (per-step and semi-sync) own one.

    Args:
        manager: the Manager.
        pg: its cross-replica-group process group.
        device: where that group's tensors live ("cpu" for gloo, "cuda:<i>" for NCCL).
    """

    def __init__(self, manager: Any, pg: Any, device: str = "cpu") -> None:
        self.manager = manager
        self.pg = pg
        self.device = device
        self._shut_down = False

    def register_state(self, state: Any) -> None:
        """What this rank offers to and loads from healing peers (``state_dict`` /
        ``load_state_dict``; see :class:`~torchtitan_ft.titan.healing.HealedState`)."""
        self.manager.register_state_dict_fn("torchtitan", state.load_state_dict, state.state_dict)

    def shutdown(self) -> None:
        """Shut the Manager and the process group down, once."""
        if not self._shut_down:
            self._shut_down = True
            self.manager.shutdown(wait=False)
            self.pg.shutdown()


class CommitGate:
    """Remembers whether the current step committed (lr schedulers step only then), and
    settles the step's batches (:class:`~torchtitan_ft.titan.training_data.CommittedBatches`)."""

    def __init__(self) -> None:
        self.committed = True
        self.batches: Any = None
        """The group's ``CommittedBatches`` once ``track_data`` ran, else None."""


class CommitGatedOptimizers:
    """TorchTitan's OptimizersContainer tied to the Manager's step protocol.

    ``zero_grad`` (first call of TorchTitan's ``train_step``) starts the quorum, overlapped
    with data loading and the forward; ``step`` applies the update only if
    ``Manager.should_commit()``. No warm-up step: the optimizer state is created by its first
    real step, so Adam's step counter matches a run without FT. Everything else is delegated.
    """

    def __init__(
        self, optimizers: Any, manager: Any, gate: CommitGate, device: str = "cpu"
    ) -> None:
        self._optimizers = optimizers
        self._manager = manager
        self._gate = gate
        self._device = device

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Start this step's quorum, then clear the gradients."""
        self._manager.start_quorum()
        self._optimizers.zero_grad(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Apply the update if the step commits; returns whether it did. The step's batches
        are settled with the step's participants and the skips they report, learnt by a tiny
        all-reduce: a participant contributes a one-hot vector over the groups followed by its
        :meth:`~torchtitan_ft.titan.training_data.CommittedBatches.skips_to_report` at its index, a
        non-participant zeros."""
        batches = self._gate.batches
        if batches is not None:
            groups = len(batches.consumed)
            vector = torch.zeros(2 * groups, device=self._device)
            vector[batches.replica_id] = 1.0
            vector[groups + batches.replica_id] = float(batches.skips_to_report())
            self._manager.allreduce(vector, reduce_op=dist.ReduceOp.SUM)
        self._gate.committed = self._manager.should_commit()
        if batches is not None:
            reduced = vector.cpu()
            participants = [int(i) for i in torch.nonzero(reduced[:groups] > 0.5).flatten()]
            reported = [round(float(c)) for c in reduced[groups:]]
            skipped = batches.end_step(self._gate.committed, participants, reported)
            if skipped:
                logger.info(
                    f"FT: replica group {batches.replica_id} skips the {skipped} batch(es) of "
                    "this step, which committed without it (healing or a spare), as "
                    "fault_tolerance.numerics='torchtitan_ft_trainer' asks; the data ledger "
                    "records them as skipped"
                )
        if self._gate.committed:
            self._optimizers.step(*args, **kwargs)
        return self._gate.committed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizers, name)


class CommitGatedLRSchedulers:
    """TorchTitan's LRSchedulersContainer that advances only after a committed step."""

    def __init__(self, lr_schedulers: Any, gate: CommitGate) -> None:
        self._lr_schedulers = lr_schedulers
        self._gate = gate

    def step(self) -> None:
        """Advance the schedule if the step committed."""
        if self._gate.committed:
            self._lr_schedulers.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lr_schedulers, name)


class ManagedReplicaAxis:
    """Per-step FT: the replica axis driven by a :class:`~torchtitan_ft.manager.Manager`.

    Gradients are averaged with ``Manager.allreduce`` (over the participants; a failure is
    recorded and the step does not commit), the step is gated by ``should_commit``, and the
    trainer's model / optimizer / lr scheduler / step counter are what a healing peer receives
    (:class:`~torchtitan_ft.titan.healing.HealedState`).

    Args:
        runtime: the Manager and its cross-group process group.
        data: this group's slice of the data.
        skip_left_out: a committed step this group was left out of skips its batches rather
            than retrying them (``fault_tolerance.numerics = "torchtitan_ft_trainer"``; see
            :class:`~torchtitan_ft.titan.training_data.CommittedBatches`). Default False.
    """

    enabled = True

    def __init__(
        self, runtime: ManagerRuntime, data: ReplicaSlice, skip_left_out: bool = False
    ) -> None:
        self._runtime = runtime
        self._data = data
        self._skip_left_out = skip_left_out
        self.manager = runtime.manager
        self.replica_id = data.replica_id
        self.group_size = data.group_size
        self._gate = CommitGate()

    def train_spec(self, spec: Any) -> Any:
        """See :meth:`ReplicaSlice.train_spec`."""
        return self._data.train_spec(spec)

    def install_gradient_sync(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Hook ``Manager.allreduce`` into every FSDP unit, overlapped with the rest of the
        backward pass (:class:`OverlappedGradientSync`); raises if nothing was hooked."""
        self.gradient_sync = OverlappedGradientSync(self._start_allreduce, self._runtime.device)
        return self.gradient_sync.install(model_parts)

    def _start_allreduce(self, shard: torch.Tensor) -> torch.futures.Future:
        return self.manager.allreduce(shard)

    def track_data(self, dataloader: Any) -> Any:
        """A :class:`~torchtitan_ft.titan.training_data.CommittedBatches` over ``dataloader``:
        batches are consumed only by committed steps this group took part in, others are
        retried (or, with ``skip_left_out``, skipped when the step committed without this
        group)."""
        self._gate.batches = CommittedBatches(
            dataloader, self.replica_id, self.group_size, skip_left_out=self._skip_left_out
        )
        return self._gate.batches

    def register_state(self, state: Any) -> None:
        """See :meth:`ManagerRuntime.register_state`."""
        self._runtime.register_state(state)

    def gate_step(self, optimizers: Any, lr_schedulers: Any) -> tuple[Any, Any]:
        """Optimizers that start the quorum and commit through the Manager; lr schedulers
        that advance only on commit."""
        return (
            CommitGatedOptimizers(optimizers, self.manager, self._gate, self._runtime.device),
            CommitGatedLRSchedulers(lr_schedulers, self._gate),
        )

    def step_committed(self) -> bool:
        """Whether the last ``optimizers.step()`` committed."""
        return self._gate.committed

    def shutdown(self) -> None:
        """See :meth:`ManagerRuntime.shutdown`."""
        self._runtime.shutdown()


def meta_model(job_config: Any) -> torch.nn.Module:
    """A meta-device copy of the model ``job_config`` describes, built the way the installed
    TorchTitan's Trainer builds it (see the release modules in
    :mod:`torchtitan_ft.titan.releases`). Cheap: no memory is allocated for the weights."""
    return releases.installed().module.meta_model(job_config)


def model_config_fingerprint(job_config: Any) -> str:
    """The model fingerprint (:func:`torchtitan_ft.manager.model_fingerprint`) of the model
    ``job_config`` describes: parameter names, global shapes and dtypes of its
    :func:`meta_model`."""
    return model_fingerprint(meta_model(job_config))


def cross_group_pg(ft: Any, group_rank: int, group_world_size: int) -> ProcessGroup:
    """The cross-group process group ``ft`` (the ``fault_tolerance`` section) asks for, for
    group rank ``group_rank`` of ``group_world_size``: the project's gloo or NCCL group, or
    with ``process_group_kind = "native"`` torch's reconfigurable gloo over
    ``process_group_store``, this rank's place there its global rank (replica id x group
    size + group rank)."""
    timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    # The heal pin (the field, else TORCHFT_HEAL_INTERFACES) picks the gloo group's link too.
    pinned = resolve_heal_interfaces(manager_timeouts(ft)["heal_interfaces"], os.environ).value
    if ft.process_group_kind == "native":
        return ProcessGroupNativeGloo(
            f"{ft.process_group_store}/torchtitan_ft_native",
            rank=ft.replica_id * group_world_size + group_rank,
            world_size=ft.group_size * group_world_size,
            timeout=timeout,
            heal_interfaces=pinned,
        )
    if ft.process_group == "gloo":
        return ProcessGroupGloo(timeout=timeout, heal_interfaces=pinned)
    return ProcessGroupNCCL(timeout=timeout)  # NCCL picks its own interface (NCCL_SOCKET_IFNAME)


def build_manager_runtime(job_config: Any) -> ManagerRuntime:
    """This rank's Manager and cross-group process group, from ``job_config.fault_tolerance``
    (mapping: :mod:`torchtitan_ft.titan.config_schema`); the one place both FT axes get theirs.
    Call after the default process group and torchrun's env exist: the Manager reads
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR/PORT``.

    ``checkpoint_transport = "pg"`` heals over the cross-group process group itself
    (:class:`~torchtitan_ft.checkpoint.PGTransport`; replica ranks are its ranks), "http" over
    each rank's checkpoint server (the Manager's default transport).
    """
    ft = job_config.fault_tolerance
    pg = cross_group_pg(ft, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    device = "cpu" if ft.process_group == "gloo" else f"cuda:{torch.cuda.current_device()}"
    timeouts = manager_timeouts(ft)
    transport = None
    if ft.checkpoint_transport == "pg":
        step_timeout = resolve_timeouts(os.environ, timeout=timeouts["timeout"])[0].value
        transport = PGTransport(pg, timeout=step_timeout, device=torch.device(device))

    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ft.min_replica_size,
        use_async_quorum=quorum_mode(ft) is QuorumMode.ASYNC,
        world_size_mode=WorldSizeMode[ft.world_size_mode.upper()],
        lighthouse_addr=ft.lighthouse_addr or None,
        replica_id=titan_replica_name(ft.replica_id),
        hostname=ft.hostname or socket.gethostname(),
        init_sync=ft.init_sync,
        checkpoint_transport=transport,
        max_retries=ft.max_retries,
        auth_token=ft.auth_token or None,
        retry_inflight_allreduce=ft.retry_inflight_allreduce,
        # Checked against the other groups at the first quorum, once the model is built.
        model_fingerprint=lambda: model_config_fingerprint(job_config),
        num_replica_groups=ft.group_size,
        **timeouts,
    )
    return ManagerRuntime(manager, pg, device)


def build_replica_axis(job_config: Any) -> ReplicaAxis:
    """The replica axis for ``job_config`` without a semi-sync method: :class:`NoReplicaAxis`
    when FT is off, else a :class:`ManagedReplicaAxis` with a new Manager (see
    :func:`build_manager_runtime`).

    Raises ``ValueError`` for a ``semi_sync_method``: that job's axis comes from
    :func:`~torchtitan_ft.titan.semi_sync_axis.build_semi_sync_axis`.
    """
    ft = job_config.fault_tolerance
    if not ft.enable:
        return NoReplicaAxis()
    if uses_semi_sync(job_config):
        raise ValueError(
            f"build_replica_axis builds the per-step axis, not one for "
            f"fault_tolerance.semi_sync_method={ft.semi_sync_method!r}; use "
            "torchtitan_ft.titan.semi_sync_axis.build_semi_sync_axis"
        )
    data = ReplicaSlice(ft.replica_id, ft.group_size)
    skip = ft.numerics == "torchtitan_ft_trainer"
    return ManagedReplicaAxis(build_manager_runtime(job_config), data, skip_left_out=skip)
