"""The FT replica axis as seen by TorchTitan's trainer: the seam between TorchTitan and the Manager.

In native HSDP the replica axis is a DeviceMesh dimension. With fault tolerance it is not in
the mesh: each replica group is its own torchrun job whose mesh is the inner (FSDP) mesh, and
the replica axis is a *managed* process group that may shrink and grow every step. The trainer
talks to that axis only through a :class:`NoReplicaAxis` (FT off: every helper is an identity,
so the trainer has no ``if ft:`` branches) or a :class:`ManagedReplicaAxis` (FT on). Touch points:

1. **Data** (:func:`replica_dataloader_shard`): the dataset is split into
   ``inner dp degree x group_size`` slices; replica group ``r``'s inner dp rank ``d`` reads slice
   ``r x inner_degree + d`` -- the same slice as native HSDP's batch rank. Applied by wrapping
   the TrainSpec's ``build_dataloader_fn`` (:meth:`ReplicaAxis.train_spec`), registered under
   the model's name so TorchTitan's ``get_train_spec`` returns it; TorchTitan is not changed.
2. **Gradients** (:func:`install_replica_allreduce_hook`): after FSDP's reduce-scatter inside a
   replica group, each FSDP unit's gradient shard is averaged across replica groups in place by
   ``FSDPModule.set_all_reduce_hook`` through ``Manager.allreduce`` (mean over participants; a
   failure is recorded and the commit vote says no). A 1-rank replica group gets FSDP on a
   1-rank mesh (:func:`shard_on_single_rank`) so the hook has a home.
3. **Step** (:meth:`ManagedReplicaAxis.gate_step`): the quorum starts in
   ``optimizers.zero_grad`` (TorchTitan's first call of a step, so the quorum overlaps data
   loading and the forward); the update and the lr schedule advance only if ``should_commit``.
   A one-hot participation all-reduce tells every group which groups' gradients were in the
   step's average; with it, :meth:`ManagedReplicaAxis.track_data`'s
   :class:`~torchtitan_ft.titan.data.CommittedBatches` consumes a batch only in a committed
   step its group took part in and retries the others (docs/titan.md, "Data").
4. **Healing** (:meth:`ManagedReplicaAxis.register_state`): the trainer's model, optimizer,
   lr-scheduler and train state (:class:`~torchtitan_ft.titan.healing.HealedState`) are what a
   recovering peer receives.
5. **Lifetime**: :meth:`ReplicaAxis.shutdown` in ``Trainer.close``.

Semi-sync strategies are not built here: they need a context around TorchTitan's loop
(``titan/semi_sync.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_ft.semi_sync.config import QuorumMode, SyncMethod
from torchtitan_ft.titan.config import quorum_mode, sync_method

GradientReduce = Callable[[torch.Tensor], None]
"""Averages a gradient shard across replica groups, in place."""


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


def install_replica_allreduce_hook(
    model_parts: Iterable[torch.nn.Module], reduce: GradientReduce
) -> int:
    """Average every FSDP unit's gradient shard across replica groups with ``reduce``.

    Returns the number of FSDP modules hooked; 0 means the model is not FSDP-wrapped (with one
    rank per replica group TorchTitan applies no FSDP, so the model must then be wrapped on a
    1-rank mesh first, or nothing would be synchronised).
    """
    from torch.distributed.fsdp import FSDPModule

    hooked = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(reduce)
                hooked += 1
    return hooked


def has_fsdp(model: torch.nn.Module) -> bool:
    """Whether any submodule of ``model`` is FSDP-wrapped."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_on_single_rank(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """Wrap ``model`` (root only) in FSDP on a 1-rank mesh so the replica hook has a home.

    With one rank per replica group TorchTitan applies no FSDP (DDP/AMP path), so there would
    be no reduce-scatter to hook the cross-replica all-reduce onto. One root unit keeps the
    numerics of that path (parameters stay fp32, AMP still autocasts since TorchTitan sees no
    FSDP in its ParallelDims) and costs one all-reduce of the full gradient per step.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

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
    """Fault tolerance off: every helper is the identity."""

    enabled = False
    replica_id = 0
    group_size = 1

    def dataloader_shard(self, dp_degree: int, dp_rank: int) -> tuple[int, int]:
        """Unchanged TorchTitan dp degree and rank."""
        return dp_degree, dp_rank

    def train_spec(self, spec: Any) -> Any:
        """The TrainSpec unchanged."""
        return spec

    def install_gradient_sync(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Nothing to synchronise across replica groups; returns 0."""
        return 0

    def register_state(self, state: Any) -> None:
        """Nothing to heal from peers (``state`` is a Stateful, e.g. ``HealedState``)."""

    def gate_step(self, optimizers: Any, lr_schedulers: Any) -> tuple[Any, Any]:
        """The optimizers and lr schedulers unchanged (every step commits)."""
        return optimizers, lr_schedulers

    def track_data(self, dataloader: Any) -> Any:
        """The dataloader unchanged (every batch read is consumed)."""
        return dataloader

    def step_committed(self) -> bool:
        """Whether the last step committed (always, without FT)."""
        return True

    def shutdown(self) -> None:
        """Nothing to release."""


class ReplicaAxis(NoReplicaAxis):
    """This process's place on the FT replica axis, and how gradients cross it.

    Args:
        replica_id: index of this replica group (``fault_tolerance.replica_id``).
        group_size: planned number of replica groups (``fault_tolerance.group_size``).
        reduce: averages a gradient shard across the participating replica groups in place
            (the Manager's all-reduce, or any in-place mean, e.g. in tests).
        on_shutdown: called once by :meth:`shutdown` (e.g. ``Manager.shutdown``).
    """

    enabled = True

    def __init__(
        self,
        replica_id: int,
        group_size: int,
        reduce: GradientReduce,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        replica_dataloader_shard(1, 0, replica_id, group_size)  # validates the pair
        self.replica_id = replica_id
        self.group_size = group_size
        self._reduce = reduce
        self._on_shutdown = on_shutdown

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
                from torchtitan.tools.utils import device_type

                model = shard_on_single_rank(model, device_type)
            return model

        return dataclasses.replace(
            spec,
            build_dataloader_fn=build_dataloader if build is not None else None,
            parallelize_fn=parallelize_fn,
        )

    def install_gradient_sync(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Hook the cross-group average into every FSDP unit; raises if nothing was hooked."""
        hooked = install_replica_allreduce_hook(model_parts, self._reduce)
        if hooked == 0:
            raise RuntimeError(
                "fault tolerance found no FSDP module to hook the cross-replica all-reduce "
                "into; the model must be FSDP-wrapped (a 1-rank mesh is enough)"
            )
        return hooked

    def shutdown(self) -> None:
        """Release the cross-group resources once."""
        if self._on_shutdown is not None:
            callback, self._on_shutdown = self._on_shutdown, None
            callback()


class CommitGate:
    """Remembers whether the current step committed (lr schedulers step only then), and
    settles the step's batches (:class:`~torchtitan_ft.titan.data.CommittedBatches`)."""

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
        are settled with the step's participants (learnt by a tiny all-reduce: each
        participant contributes a one-hot vector, non-participants zeros)."""
        batches = self._gate.batches
        if batches is not None:
            vector = torch.zeros(len(batches.consumed), device=self._device)
            vector[batches.replica_id] = 1.0
            self._manager.allreduce(vector, reduce_op=dist.ReduceOp.SUM)
        self._gate.committed = self._manager.should_commit()
        if batches is not None:
            participants = [int(i) for i in torch.nonzero(vector.cpu() > 0.5).flatten()]
            batches.end_step(self._gate.committed, participants)
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


class ManagedReplicaAxis(ReplicaAxis):
    """The replica axis driven by a :class:`torchtitan_ft.manager.Manager`.

    Gradients are averaged with ``Manager.allreduce`` (over the participants; a failure is
    recorded and the step does not commit), the step is gated by ``should_commit``, and the
    trainer's model / optimizer / lr scheduler / step counter are what a healing peer receives
    (:class:`torchtitan_ft.titan.healing.HealedState`).
    """

    def __init__(
        self, manager: Any, pg: Any, replica_id: int, group_size: int, device: str = "cpu"
    ) -> None:
        super().__init__(replica_id, group_size, self._allreduce, self._shutdown)
        self.manager = manager
        self._pg = pg
        self._device = device
        self._gate = CommitGate()

    def _allreduce(self, grad: torch.Tensor) -> None:
        self.manager.allreduce(grad).wait()

    def register_state(self, state: Any) -> None:
        """What this rank offers to and loads from healing peers (``state_dict`` /
        ``load_state_dict``; see :class:`torchtitan_ft.titan.healing.HealedState`)."""
        self.manager.register_state_dict_fn("torchtitan", state.load_state_dict, state.state_dict)

    def gate_step(self, optimizers: Any, lr_schedulers: Any) -> tuple[Any, Any]:
        """Optimizers that start the quorum and commit through the Manager; lr schedulers
        that advance only on commit."""
        return (
            CommitGatedOptimizers(optimizers, self.manager, self._gate, self._device),
            CommitGatedLRSchedulers(lr_schedulers, self._gate),
        )

    def track_data(self, dataloader: Any) -> Any:
        """A :class:`~torchtitan_ft.titan.data.CommittedBatches` over ``dataloader``: batches
        are consumed only by committed steps this group took part in, others are retried."""
        from torchtitan_ft.titan.data import CommittedBatches

        self._gate.batches = CommittedBatches(dataloader, self.replica_id, self.group_size)
        return self._gate.batches

    def step_committed(self) -> bool:
        """Whether the last ``optimizers.step()`` committed."""
        return self._gate.committed

    def _shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self._pg.shutdown()


def meta_model(job_config: Any) -> torch.nn.Module:
    """A meta-device copy of the model ``job_config`` describes, built the way TorchTitan's
    Trainer builds it (model args updated from the config; model converters not applied).
    Cheap: no memory is allocated for the weights."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils

    spec = get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    model_args.update_from_config(job_config)
    with (
        torch.device("meta"),
        utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]),
    ):
        return spec.model_cls(model_args)


def model_config_fingerprint(job_config: Any) -> str:
    """The model fingerprint (:func:`torchtitan_ft.manager.model_fingerprint`) of the model
    ``job_config`` describes: parameter names, global shapes and dtypes of its
    :func:`meta_model`."""
    from torchtitan_ft.manager import model_fingerprint

    return model_fingerprint(meta_model(job_config))


def build_replica_axis(job_config: Any) -> NoReplicaAxis:
    """The replica axis for ``job_config``: :class:`NoReplicaAxis` when FT is off, else a
    :class:`ManagedReplicaAxis` with a new Manager (call after the default process group and
    torchrun's env exist: the Manager reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR/PORT``).

    Raises ``ValueError`` for a ``semi_sync_method``: that job's axis comes from
    :func:`~torchtitan_ft.titan.semi_sync.build_semi_sync_axis` (which builds its Manager
    through this function with the method unset).

    ``checkpoint_transport = "pg"`` heals over the cross-group process group itself
    (:class:`~torchtitan_ft.checkpoint.PGTransport`; replica ranks are its ranks), "http" over
    each rank's checkpoint server (the Manager's default transport).
    """
    ft = job_config.fault_tolerance
    if not ft.enable:
        return NoReplicaAxis()
    if sync_method(ft) is not SyncMethod.PER_STEP:
        raise ValueError(
            f"build_replica_axis builds the per-step axis, not one for "
            f"fault_tolerance.semi_sync_method={ft.semi_sync_method!r}; use "
            "torchtitan_ft.titan.semi_sync.build_semi_sync_axis"
        )
    import socket

    from torchtitan_ft.manager import Manager, WorldSizeMode
    from torchtitan_ft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    pg_class = ProcessGroupGloo if ft.process_group == "gloo" else ProcessGroupNCCL
    pg = pg_class(timeout=timedelta(milliseconds=ft.process_group_timeout_ms))
    device = "cpu" if ft.process_group == "gloo" else f"cuda:{torch.cuda.current_device()}"
    transport = None
    if ft.checkpoint_transport == "pg":
        from torchtitan_ft.checkpoint import PGTransport

        step_timeout = timedelta(milliseconds=ft.step_timeout_ms)
        transport = PGTransport(pg, timeout=step_timeout, device=torch.device(device))

    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ft.min_replica_size,
        use_async_quorum=quorum_mode(ft) is QuorumMode.ASYNC,
        timeout=timedelta(milliseconds=ft.step_timeout_ms),
        quorum_timeout=timedelta(milliseconds=ft.quorum_timeout_ms),
        connect_timeout=timedelta(milliseconds=ft.connect_timeout_ms),
        world_size_mode=WorldSizeMode[ft.world_size_mode.upper()],
        lighthouse_addr=ft.lighthouse_addr or None,
        replica_id=f"torchtitan_ft_{ft.replica_id}",
        hostname=ft.hostname or socket.gethostname(),
        init_sync=ft.init_sync,
        checkpoint_transport=transport,
        max_retries=ft.max_retries,
        quorum_retries=ft.quorum_retries,
        auth_token=ft.auth_token or None,
        # Checked against the other groups at the first quorum, once the model is built.
        model_fingerprint=lambda: model_config_fingerprint(job_config),
        num_replica_groups=ft.group_size,
    )
    return ManagedReplicaAxis(manager, pg, ft.replica_id, ft.group_size, device)
