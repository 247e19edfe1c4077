"""TorchTitan 0.3.0's ``Trainer`` with the FT replica axis plugged in, and its entry point;
the same hooks as 0.2.2's :class:`torchtitan_ft.titan.trainer.FaultTolerantTrainer`
(docs/titan.md, "How it plugs in"), placed where 0.3.0's Trainer calls them."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_ft.titan import cpu_compat
from torchtitan_ft.titan.checkpointing import ReplicaCheckpointer
from torchtitan_ft.titan.config_schema import JobConfig, uses_semi_sync
from torchtitan_ft.titan.healing import HealedState
from torchtitan_ft.titan.metrics import attach_ft_metrics, attach_log_prefix
from torchtitan_ft.titan.replica_axis import (
    ReplicaAxis,
    ReplicaSlice,
    build_replica_axis,
    has_fsdp,
    shard_on_single_rank,
)
from torchtitan_ft.titan.semi_sync import build_semi_sync_axis


class _SlicedDataloaderConfig:
    """A dataloader config whose ``build`` reads this replica group's slice of the data (see
    :meth:`ReplicaSlice.dataloader_shard`); anything else is the wrapped config's."""

    def __init__(self, config: Any, data: ReplicaSlice) -> None:
        self._config = config
        self._data = data

    def build(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
        world, rank = self._data.dataloader_shard(dp_world_size, dp_rank)
        return self._config.build(dp_world_size=world, dp_rank=rank, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _always_fsdp(parallelize: Any) -> Any:
    """``parallelize`` followed by a one-rank FSDP wrap of a model it left unsharded: the
    cross-group all-reduce hooks into FSDP units (see :func:`shard_on_single_rank`)."""

    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        if not has_fsdp(model):
            from torchtitan.tools.utils import device_type

            model = shard_on_single_rank(model, device_type)
        return model

    return parallelize_fn


class FaultTolerantTrainer(Trainer):
    """TorchTitan 0.3.0's Trainer, one replica group of an FT job when FT is enabled.

    Overridden: ``__init__`` (before TorchTitan's: the data slice and the FSDP wrap; after
    it: the gradient hooks, the batch ledger, the healed state, the commit gate and the
    single-writer checkpointer),
    ``init_distributed`` (builds the replica axis), ``batch_generator``, ``train_step`` (a
    discarded step is retried under its number) and ``close``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(JobConfig):
        """TorchTitan's ``Trainer.Config`` with the ``fault_tolerance`` section."""

    replica_axis: ReplicaAxis
    _pg_timeouts_lowered = False
    _start_step: int | None = None

    def __init__(self, config: Config) -> None:
        ft = config.fault_tolerance
        if ft.enable:
            data = ReplicaSlice(ft.replica_id, ft.group_size)
            config.dataloader = _SlicedDataloaderConfig(config.dataloader, data)
            spec = config.model_spec
            config.model_spec = dataclasses.replace(
                spec, parallelize_fn=_always_fsdp(spec.parallelize_fn)
            )
        super().__init__(config)  # runs init_distributed; builds and parallelizes the model
        changed = cpu_compat.force_sum_reduction(self.model_parts)
        if changed:
            logger.info(f"CPU: {changed} FSDP modules reduce with SUM (gloo has no PREMUL_SUM)")
        axis = self.replica_axis
        hooked = axis.install_gradient_sync(self.model_parts)
        if hooked:
            logger.info(f"FT: cross-replica gradient all-reduce hooked into {hooked} FSDP units")
        self.batches = axis.track_data(self.dataloader)
        ledger = self.batches if self.batches is not self.dataloader else None
        self.healed_state = HealedState(
            self.model_parts, self.optimizers, self.lr_schedulers, self, ledger
        )
        axis.register_state(self.healed_state)
        self.optimizers, self.lr_schedulers = axis.gate_step(self.optimizers, self.lr_schedulers)
        self.ft_metrics = attach_ft_metrics(self)
        if ft.enable:
            self.checkpointer = ReplicaCheckpointer.for_replica_axis(
                self.checkpointer,
                axis,
                self.batches,
                rank=torch.distributed.get_rank(),
                keep_latest_k=config.checkpoint.keep_latest_k,
            )

    @property
    def job_config(self) -> Any:
        """0.2.2's name of the config, which the release-neutral helpers read."""
        return self.config

    def init_distributed(self) -> ParallelDims:
        """TorchTitan's init, then the replica axis."""
        parallel_dims = super().init_distributed()
        attach_log_prefix(self)
        if uses_semi_sync(self.config):
            self.replica_axis = build_semi_sync_axis(self.config)
        else:
            self.replica_axis = build_replica_axis(self.config)
        return parallel_dims

    def batch_generator(self, data_iterable: Any) -> Any:
        """TorchTitan's, reading the trainer's dataloader through ``self.batches``."""
        if data_iterable is self.dataloader:
            data_iterable = self.batches
        return super().batch_generator(data_iterable)

    def train_step(self, data_iterator: Any) -> None:
        """TorchTitan's step; a discarded step is retried under the same number (as on
        0.2.2). TorchTitan's loop lowers the process-group timeouts after the first step of
        this process only when it ends at (loaded step) + 1; a group that healed further does
        it here."""
        if self._start_step is None:
            self._start_step = self.step - 1
        tokens_before = self.ntokens_seen
        super().train_step(data_iterator)
        if not self.replica_axis.step_committed():
            self.step -= 1
            self.ntokens_seen = tokens_before
        if self.step > self._start_step and not self._pg_timeouts_lowered:
            self._pg_timeouts_lowered = True
            if self.step - self._start_step != 1:
                dist_utils.set_pg_timeouts(
                    timeout=timedelta(seconds=self.config.comm.train_timeout_seconds),
                    parallel_dims=self.parallel_dims,
                )

    def close(self) -> None:
        """TorchTitan's cleanup, then the replica axis."""
        super().close()
        axis = getattr(self, "replica_axis", None)
        if axis is not None:
            axis.shutdown()


def main(argv: list[str] | None = None, trainer_class: type | None = None) -> None:
    """Parse, check, train; mirrors ``torchtitan.train.main`` with this package's config.
    ``trainer_class`` defaults to :class:`FaultTolerantTrainer` (tests pass a subclass)."""
    from torchtitan.tools.logging import init_logger

    from torchtitan_ft.titan import releases
    from torchtitan_ft.titan.compute_dtype import choose_param_dtype, probe_cpu
    from torchtitan_ft.titan.config_schema import ConfigError
    from torchtitan_ft.titan.data import register_datasets
    from torchtitan_ft.titan.known_warnings import quiet_known_warnings
    from torchtitan_ft.titan.preflight import (
        check_local_address,
        check_manager_env,
        validate_job_config,
    )
    from torchtitan_ft.titan.releases.v0_3 import titan_trainer
    from torchtitan_ft.titan.releases.v0_3.parse import group_ranks, parse, runnable_here
    from torchtitan_ft.titan.train import _config_error, _user_error, run_trainer

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        others = trainer_class is None and titan_trainer.wants_titan_trainer(args)
    except ConfigError as e:
        _config_error(str(e))
    if others:  # a config of one of TorchTitan's own trainers
        titan_trainer.main(args)
        return
    init_logger()
    quiet_known_warnings()
    register_datasets()
    cls = trainer_class or FaultTolerantTrainer
    try:
        parsed = parse(args, cls.Config)
        config = parsed.config
        validate_job_config(config)
        check_local_address(config)
        check_manager_env(config)
        for note in parsed.notes:
            logger.info(note)
        runnable_here(parsed, cpu_compat.cuda_available(), group_ranks(), logger.info)
        explicit_dtype = "training.mixed_precision_param" in parsed.explicit
        configured = config.training.mixed_precision_param if explicit_dtype else None
        device = "cuda" if cpu_compat.cuda_available() else "cpu"
        choice = choose_param_dtype(device, probe_cpu() if device == "cpu" else None, configured)
        config.training.mixed_precision_param = choice.param_dtype
        logger.info(f"Compute dtype: {choice.param_dtype} ({choice.reason})")
    except ConfigError as e:
        _config_error(str(e))
    if "LOCAL_RANK" not in os.environ:
        _user_error(
            "the trainer runs under torchrun, which sets LOCAL_RANK, RANK and WORLD_SIZE; start "
            "it with ./run_train.sh (e.g. ./run_train.sh --module llama3 --config "
            "llama3_debugmodel --fault_tolerance.enable --fault_tolerance.replica_id=0 "
            "--fault_tolerance.group_size=2)"
        )
    logger.info(releases.describe(releases.Release.V0_3))
    run_trainer(lambda: cls(config), lambda trainer: trainer.train())
