"""TorchTitan's own ``Trainer`` with the FT replica axis plugged in; runs in every trainer rank
(docs/titan.md, "How it plugs in")."""

import contextlib
import functools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torchtitan.train as titan_train
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchtitan_ft.titan import cpu_compat
from torchtitan_ft.titan.checkpointing import ReplicaCheckpointer
from torchtitan_ft.titan.config_schema import uses_semi_sync
from torchtitan_ft.titan.healing import HealedState
from torchtitan_ft.titan.metrics import attach_ft_metrics, attach_log_prefix
from torchtitan_ft.titan.replica_axis import ReplicaAxis, build_replica_axis
from torchtitan_ft.titan.semi_sync import build_semi_sync_axis

_original_specs: dict[str, Any] = {}


def original_train_spec(name: str) -> Any:
    """The TrainSpec ``name`` had before any override by this module."""
    if name not in _original_specs:
        _original_specs[name] = train_spec_module.get_train_spec(name)
    return _original_specs[name]


def register_train_spec_override(name: str, spec: Any) -> None:
    """Make TorchTitan's ``get_train_spec(name)`` return ``spec``.

    User-registered specs take priority over built-in models in TorchTitan 0.2.2; the public
    ``register_train_spec`` refuses to replace an entry, so the registry dict is set directly.
    """
    original_train_spec(name)
    train_spec_module._extra_train_specs[name] = spec


_PROFILERS = ("maybe_enable_profiling", "maybe_enable_memory_snapshot")
"""What ``torchtitan.train.Trainer.train`` opens with the dump folder and no leaf folder."""


def replica_leaf_folder(axis: ReplicaAxis) -> str:
    """The folder of this replica group's profiler traces and memory snapshots inside each
    ``iteration_<n>`` folder: ``replica_<id>`` with FT (as TorchTitan's FT trainer), else none."""
    return f"replica_{axis.replica_id}" if axis.enabled else ""


def numerics_line(numerics: str, semi_sync: bool) -> str:
    """The start-up line of an FT job that says how its numbers differ from TorchTitan's FT
    trainer under ``fault_tolerance.numerics`` (``semi_sync``: a LocalSGD / DiLoCo job, which
    has no ledger retry or skip)."""
    if numerics == "torchtitan_ft_trainer":
        what = (
            "Adam starts with a zero-lr step"
            if semi_sync
            else "Adam starts with a zero-lr step and a replica group left out of a committed "
            "step skips its batches (the data ledger records them as skipped)"
        )
        return (
            f"FT numerics 'torchtitan_ft_trainer': {what}, as TorchTitan's FT trainer does; "
            "unlike it, a discarded step is retried under its number rather than counted"
        )
    what = (
        "Adam's first update equals a run without FT"
        if semi_sync
        else "Adam's first update equals a run without FT and a replica group left out of a "
        "committed step retries its batches"
    )
    return (
        f"FT numerics 'torchtitan' (default): {what}; TorchTitan's FT trainer starts Adam with "
        "a zero-lr step"
        + ("" if semi_sync else " and skips those batches")
        + ", so its loss differs from step 2 (fault_tolerance.numerics='torchtitan_ft_trainer'"
        " reproduces it)"
    )


def init_optimizer_state(model_parts: list[torch.nn.Module], optimizers: Any) -> None:
    """Create the optimizers' state with one zero-lr step, as TorchTitan's FT optimizer
    container does when it is built (``get_optimizer_state_dict`` initialises the state that
    way): Adam's step counter then runs one ahead of a run without FT."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for model, optimizer in zip(model_parts, optimizers.optimizers, strict=True):
        get_optimizer_state_dict(model, optimizer)


@contextlib.contextmanager
def profiling_leaf_folder(leaf_folder: str) -> Iterator[None]:
    """While open, TorchTitan's ``Trainer.train`` writes its profiler traces and memory
    snapshots to ``<folder>/iteration_<n>/<leaf_folder>/rank<r>_...``, so that replica groups
    sharing a ``dump_folder`` do not overwrite each other's (TorchTitan's FT trainer passes
    the same ``leaf_folder``; its base loop passes none)."""
    originals = {name: getattr(titan_train, name) for name in _PROFILERS}
    for name, function in originals.items():
        setattr(titan_train, name, functools.partial(function, leaf_folder=leaf_folder))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(titan_train, name, function)


class FaultTolerantTrainer(Trainer):
    """TorchTitan's Trainer on CPU or GPU, one replica group of an FT job when FT is enabled.

    It copies none of TorchTitan's loop: TorchTitan's ``train_step`` runs the FT step through
    the objects the replica axis hands it (identities when FT is off)::

        optimizers.zero_grad()   the quorum starts (async: overlapped with data and forward)
        forward, backward        each FSDP unit's gradient shard is averaged across groups
        optimizers.step()        should_commit (a heal is applied here); the update on commit
        lr_schedulers.step()     advances on commit

    Overridden, in the order TorchTitan calls them: ``__init__`` / ``init_distributed`` (build
    the axis and plug it in), ``train`` (profiler output per replica group),
    ``batch_generator`` (read through the axis's batch ledger), ``train_step`` (a discarded
    step is retried under its number) and ``close``.
    """

    replica_axis: ReplicaAxis
    _pg_timeouts_lowered = False
    """Set once this process lowered (or left TorchTitan to lower) the process-group timeouts."""

    def __init__(self, job_config: JobConfig) -> None:
        super().__init__(job_config)  # runs init_distributed; builds and parallelizes the model
        changed = cpu_compat.force_sum_reduction(self.model_parts)
        if changed:
            logger.info(f"CPU: {changed} FSDP modules reduce with SUM (gloo has no PREMUL_SUM)")
        axis = self.replica_axis
        if axis.enabled:
            numerics = job_config.fault_tolerance.numerics
            logger.info(numerics_line(numerics, uses_semi_sync(job_config)))
            if numerics == "torchtitan_ft_trainer":
                init_optimizer_state(self.model_parts, self.optimizers)
        hooked = axis.install_gradient_sync(self.model_parts)
        if hooked:
            logger.info(
                f"FT: cross-replica gradient all-reduce hooked into {hooked} FSDP units; each "
                "runs while the backward continues and is waited for when the backward ends "
                "(TorchTitan's FT hook waits for it inside the hook)"
            )
        self.batches = axis.track_data(self.dataloader)
        ledger = self.batches if self.batches is not self.dataloader else None
        self.healed_state = HealedState(
            self.model_parts, self.optimizers, self.lr_schedulers, self, ledger
        )
        axis.register_state(self.healed_state)
        self.optimizers, self.lr_schedulers = axis.gate_step(self.optimizers, self.lr_schedulers)
        self.ft_metrics = attach_ft_metrics(self)
        if axis.enabled:
            self.checkpointer = ReplicaCheckpointer.for_replica_axis(
                self.checkpointer,
                axis,
                self.batches,
                rank=torch.distributed.get_rank(),
                keep_latest_k=job_config.checkpoint.keep_latest_k,
            )

    def init_distributed(self) -> ParallelDims:
        """TorchTitan's init, then the replica axis; with FT the model's TrainSpec is
        re-registered with this group's data slice before TorchTitan looks it up."""
        parallel_dims = super().init_distributed()
        attach_log_prefix(self)
        self.replica_axis = self.build_replica_axis()
        if self.replica_axis.enabled:
            name = self.job_config.model.name
            spec = self.replica_axis.train_spec(original_train_spec(name))
            register_train_spec_override(name, spec)
        return parallel_dims

    def build_replica_axis(self) -> ReplicaAxis:
        """The replica axis of this process; called once the default process group exists.

        Override point: return any :class:`~torchtitan_ft.titan.replica_axis.ReplicaAxis`
        (e.g. a static cross-group gloo group to debug numerics without the Manager).
        """
        if uses_semi_sync(self.job_config):
            return build_semi_sync_axis(self.job_config)
        return build_replica_axis(self.job_config)

    def train(self) -> None:
        """TorchTitan's loop, with profiler traces and memory snapshots in a folder per
        replica group (:func:`profiling_leaf_folder`)."""
        with profiling_leaf_folder(replica_leaf_folder(self.replica_axis)):
            super().train()

    def batch_generator(self, data_iterable: Any) -> Any:
        """TorchTitan's, reading the trainer's dataloader through ``self.batches`` (with FT,
        batches of a discarded step are retried; see ``CommittedBatches``)."""
        if data_iterable is self.dataloader:
            data_iterable = self.batches
        return super().batch_generator(data_iterable)

    def train_step(self, data_iterator: Any) -> None:
        """TorchTitan's step; a discarded step is retried under the same number, so
        ``self.step`` counts committed steps (as the Manager, lr schedule and checkpoints do),
        and ``self.ntokens_seen`` counts the tokens of committed steps only (the retry reads
        the same batches again).

        TorchTitan's loop lowers the process-group timeouts to ``comm.train_timeout_seconds``
        after a step that leaves ``self.step == 1`` (lazy init and compilation are done by
        then). A process whose first step ends further on -- a replacement group that healed
        to step N, a run resumed from a checkpoint -- never gets there and would keep the long
        init timeout, so that first step lowers them here. Every rank of a replica group has
        the same step (commits and heals are group-wide), so all meet at the barrier.
        """
        tokens_before = self.ntokens_seen
        super().train_step(data_iterator)
        if not self.replica_axis.step_committed():
            self.step -= 1
            self.ntokens_seen = tokens_before
        if self.step >= 1 and not self._pg_timeouts_lowered:
            self._pg_timeouts_lowered = True
            if self.step > 1:  # at step 1 TorchTitan's loop lowers them itself
                dist_utils.set_pg_timeouts(
                    timeout=timedelta(seconds=self.job_config.comm.train_timeout_seconds),
                    parallel_dims=self.parallel_dims,
                )

    def close(self) -> None:
        """TorchTitan's cleanup, then the replica axis."""
        super().close()
        axis = getattr(self, "replica_axis", None)
        if axis is not None:
            axis.shutdown()
