"""What both releases' ``FaultTolerantTrainer`` add to TorchTitan's ``Trainer``, written once
(docs/titan.md, "How it plugs in"): :class:`ReplicaAxisHooks`, mixed in before TorchTitan's
``Trainer`` by :mod:`torchtitan_ft.titan.trainer` (0.2.2) and
:mod:`torchtitan_ft.titan.releases.v0_3.trainer` (0.3.0). What differs per release (how the
data slice and the FSDP wrap reach TorchTitan's build, where the profiler folder is passed,
the step at which TorchTitan's loop lowers the process-group timeouts) stays in those modules.

Release-neutral: reads the config through ``trainer.job_config`` (0.3.0's trainer names its
``config`` so too) and only the TorchTitan names both releases have.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from torchtitan_ft.titan import cpu_compat
from torchtitan_ft.titan.checkpointing import ReplicaCheckpointer
from torchtitan_ft.titan.config_schema import uses_semi_sync
from torchtitan_ft.titan.healing import HealedState, TrainStateAtStepStart
from torchtitan_ft.titan.metrics import attach_ft_metrics, attach_log_prefix
from torchtitan_ft.titan.replica_axis import ReplicaAxis, build_replica_axis
from torchtitan_ft.titan.semi_sync_axis import build_semi_sync_axis


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
    for model, optimizer in zip(model_parts, optimizers.optimizers, strict=True):
        get_optimizer_state_dict(model, optimizer)


def replica_leaf_folder(axis: ReplicaAxis) -> str:
    """The folder of this replica group's profiler traces and memory snapshots inside each
    ``iteration_<n>`` folder: ``replica_<id>`` with FT (as TorchTitan's FT trainer), else none."""
    return f"replica_{axis.replica_id}" if axis.enabled else ""


def lowers_pg_timeouts_here(step: int, titan_lowers_at: int) -> bool | None:
    """Whether this trainer lowers the process-group timeouts after a train step that left
    ``self.step == step``, given that TorchTitan's loop lowers them itself after the step that
    leaves ``titan_lowers_at``: None while no step reached it yet (ask again after the next),
    False when TorchTitan's loop does it at this step, True when it never will (a group that
    healed further on, a resumed run on 0.2.2, whose loop lowers them at step 1 only)."""
    if step < titan_lowers_at:
        return None
    return step != titan_lowers_at


class ReplicaAxisHooks:
    """The FT replica axis in TorchTitan's ``Trainer``: mixed in before it (``class
    FaultTolerantTrainer(ReplicaAxisHooks, Trainer)``), each method runs TorchTitan's own
    through ``super()``. TorchTitan's ``train_step`` runs the FT step through the objects the
    axis hands it (identities when FT is off)::

        optimizers.zero_grad()   the quorum starts (async: overlapped with data and forward)
        forward, backward        each FSDP unit's gradient shard is averaged across groups
        optimizers.step()        should_commit (a heal is applied here); the update on commit
        lr_schedulers.step()     advances on commit

    A release's trainer calls :meth:`attach_replica_axis` at the end of its ``__init__`` and
    says where TorchTitan's loop lowers the timeouts (:meth:`titan_lowers_pg_timeouts_at`).
    """

    replica_axis: ReplicaAxis
    _titan_lowers_at: int | None = None
    """The step after which TorchTitan's loop lowers the process-group timeouts (set at this
    process's first train step)."""
    _pg_timeouts_lowered = False
    """Set once they are lowered, by this trainer or by TorchTitan's loop."""

    def init_distributed(self) -> ParallelDims:
        """TorchTitan's init, then the log-line prefix and the replica axis (its Manager's
        start-up lines carry the prefix)."""
        parallel_dims = super().init_distributed()  # type: ignore[misc]
        attach_log_prefix(self)
        self.replica_axis = self.build_replica_axis()
        return parallel_dims

    def build_replica_axis(self) -> ReplicaAxis:
        """The replica axis of this process; called once the default process group exists.

        Override point: return any :class:`~torchtitan_ft.titan.replica_axis.ReplicaAxis`
        (e.g. a static cross-group gloo group to debug numerics without the Manager).
        """
        config = self.job_config  # type: ignore[attr-defined]
        if uses_semi_sync(config):
            return build_semi_sync_axis(config)
        return build_replica_axis(config)

    def attach_replica_axis(self) -> None:
        """Wire the replica axis into the trainer TorchTitan's ``__init__`` built, in this
        order: FSDP reducing with SUM on gloo, the numerics (its line; a zero-lr Adam step under
        ``torchtitan_ft_trainer``), the cross-group gradient hooks, the batch ledger, the
        healed state, the commit gate of the optimizers and lr schedulers, the FT metrics, and
        the single-writer checkpointer."""
        trainer: Any = self
        config = trainer.job_config
        changed = cpu_compat.force_sum_reduction(trainer.model_parts)
        if changed:
            logger.info(f"CPU: {changed} FSDP modules reduce with SUM (gloo has no PREMUL_SUM)")
        axis = self.replica_axis
        if axis.enabled:
            numerics = config.fault_tolerance.numerics
            logger.info(numerics_line(numerics, uses_semi_sync(config)))
            if numerics == "torchtitan_ft_trainer":
                init_optimizer_state(trainer.model_parts, trainer.optimizers)
        hooked = axis.install_gradient_sync(trainer.model_parts)
        if hooked:
            logger.info(
                f"FT: cross-replica gradient all-reduce hooked into {hooked} FSDP units; each "
                "runs while the backward continues and is waited for when the backward ends "
                "(TorchTitan's FT hook waits for it inside the hook)"
            )
        trainer.batches = axis.track_data(trainer.dataloader)
        ledger = trainer.batches if trainer.batches is not trainer.dataloader else None
        trainer.ntokens_at_step_start = trainer.ntokens_seen
        # A semi-sync donor sends its state from its sync point, at the end of its step, whole.
        train_state = trainer if uses_semi_sync(config) else TrainStateAtStepStart(trainer)
        trainer.healed_state = HealedState(
            trainer.model_parts, trainer.optimizers, trainer.lr_schedulers, train_state, ledger
        )
        axis.register_state(trainer.healed_state)
        trainer.optimizers, trainer.lr_schedulers = axis.gate_step(
            trainer.optimizers, trainer.lr_schedulers
        )
        trainer.ft_metrics = attach_ft_metrics(trainer)
        if axis.enabled:
            trainer.checkpointer = ReplicaCheckpointer.for_replica_axis(
                trainer.checkpointer,
                axis,
                trainer.batches,
                rank=torch.distributed.get_rank(),
                keep_latest_k=config.checkpoint.keep_latest_k,
            )

    def titan_lowers_pg_timeouts_at(self, start_step: int) -> int:
        """The ``self.step`` after whose train step TorchTitan's loop lowers the process-group
        timeouts, for a process whose first step starts after ``start_step`` (the step it
        loaded: 0, or a checkpoint's). Each release's trainer says."""
        raise NotImplementedError(f"{type(self).__name__} must say where its loop lowers them")

    def batch_generator(self, data_iterable: Any) -> Any:
        """TorchTitan's, reading the trainer's dataloader through ``self.batches`` (with FT,
        batches of a discarded step are retried; see ``CommittedBatches``)."""
        trainer: Any = self
        if data_iterable is trainer.dataloader:
            data_iterable = trainer.batches
        return super().batch_generator(data_iterable)  # type: ignore[misc]

    def train_step(self, data_iterator: Any) -> None:
        """TorchTitan's step; a discarded step is retried under the same number, so
        ``self.step`` counts committed steps (as the Manager, lr schedule and checkpoints do),
        and ``self.ntokens_seen`` counts the tokens of committed steps only (the retry reads
        the same batches again).

        TorchTitan's loop lowers the process-group timeouts to ``comm.train_timeout_seconds``
        after one particular step (:meth:`titan_lowers_pg_timeouts_at`: lazy init and
        compilation are done by then). A process whose first step ends further on -- a
        replacement group that healed to step N, on 0.2.2 also a run resumed from a checkpoint
        -- never gets there and would keep the long init timeout, so that first step lowers
        them here (:func:`lowers_pg_timeouts_here`). Every rank of a replica group has the same
        step (commits and heals are group-wide), so all meet at the barrier.
        """
        trainer: Any = self
        if self._titan_lowers_at is None:
            self._titan_lowers_at = self.titan_lowers_pg_timeouts_at(trainer.step - 1)
        trainer.ntokens_at_step_start = trainer.ntokens_seen
        super().train_step(data_iterator)  # type: ignore[misc]
        if not self.replica_axis.step_committed():
            trainer.step -= 1
            trainer.ntokens_seen = trainer.ntokens_at_step_start  # a heal may have set it
        if self._pg_timeouts_lowered:
            return
        here = lowers_pg_timeouts_here(trainer.step, self._titan_lowers_at)
        if here is None:
            return
        self._pg_timeouts_lowered = True
        if here:
            dist_utils.set_pg_timeouts(
                timeout=timedelta(seconds=trainer.job_config.comm.train_timeout_seconds),
                parallel_dims=trainer.parallel_dims,
            )

    def close(self) -> None:
        """TorchTitan's cleanup, then the replica axis."""
        super().close()  # type: ignore[misc]
        axis = getattr(self, "replica_axis", None)
        if axis is not None:
            axis.shutdown()
