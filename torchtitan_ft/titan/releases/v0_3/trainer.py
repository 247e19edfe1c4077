"""TorchTitan 0.3.0's ``Trainer`` with the FT replica axis plugged in, and its entry point;
the same hooks as 0.2.2's :class:`torchtitan_ft.titan.trainer.FaultTolerantTrainer`
(docs/titan.md, "How it plugs in"), placed where 0.3.0's Trainer calls them."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.tools import utils
from torchtitan.tools.logging import init_logger, logger
from torchtitan.trainer import Trainer

from torchtitan_ft.titan import cpu_compat, releases
from torchtitan_ft.titan.compute_dtype import choose_param_dtype, probe_cpu
from torchtitan_ft.titan.config_schema import ConfigError, JobConfig
from torchtitan_ft.titan.known_warnings import quiet_known_warnings
from torchtitan_ft.titan.preflight import (
    check_local_address,
    check_manager_env,
    check_profiler_schedule,
    validate_job_config,
)
from torchtitan_ft.titan.releases.v0_3 import titan_trainer
from torchtitan_ft.titan.releases.v0_3.parse import group_ranks, parse, runnable_here
from torchtitan_ft.titan.replica_axis import ReplicaSlice, has_fsdp, shard_on_single_rank
from torchtitan_ft.titan.trainer_hooks import ReplicaAxisHooks, replica_leaf_folder
from torchtitan_ft.titan.training_data import register_datasets


class _BuiltWith:
    """A component config whose ``build`` also passes ``extra`` keyword arguments (what 0.3.0's
    ``Trainer`` leaves out and its FT trainer passes); anything else is the wrapped config's."""

    def __init__(self, config: Any, **extra: Any) -> None:
        self._config = config
        self._extra = extra

    def build(self, **kwargs: Any) -> Any:
        return self._config.build(**kwargs, **self._extra)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class _SlicedDataloaderConfig(_BuiltWith):
    """A dataloader config whose ``build`` reads this replica group's slice of the data (see
    :meth:`ReplicaSlice.dataloader_shard`)."""

    def __init__(self, config: Any, data: ReplicaSlice) -> None:
        super().__init__(config)
        self._data = data

    def build(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
        world, rank = self._data.dataloader_shard(dp_world_size, dp_rank)
        return super().build(dp_world_size=world, dp_rank=rank, **kwargs)


def _always_fsdp(parallelize: Any) -> Any:
    """``parallelize`` followed by a one-rank FSDP wrap of a model it left unsharded: the
    cross-group all-reduce hooks into FSDP units (see :func:`shard_on_single_rank`)."""

    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        if not has_fsdp(model):
            model = shard_on_single_rank(model, utils.device_type)
        return model

    return parallelize_fn


class FaultTolerantTrainer(ReplicaAxisHooks, Trainer):
    """TorchTitan 0.3.0's Trainer, one replica group of an FT job when FT is enabled:
    TorchTitan's loop with the FT replica axis plugged in by
    :class:`~torchtitan_ft.titan.trainer_hooks.ReplicaAxisHooks`, as on 0.2.2.

    Overridden here: ``__init__`` (before TorchTitan's: what 0.3.0 builds from the config --
    the data slice, the FSDP wrap, TensorBoard and wandb under ``tb/<time>/replica_<id>``;
    after it: :meth:`attach_replica_axis`, and profiler traces and memory snapshots in
    ``iteration_<n>/replica_<id>``; the same folders as on 0.2.2, passed as TorchTitan's FT
    trainer passes them); the hooks add ``init_distributed``, ``batch_generator``,
    ``train_step`` and ``close``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(JobConfig):
        """TorchTitan's ``Trainer.Config`` with the ``fault_tolerance`` section."""

    def __init__(self, config: Config) -> None:
        ft = config.fault_tolerance
        if ft.enable:
            data = ReplicaSlice(ft.replica_id, ft.group_size)
            config.dataloader = _SlicedDataloaderConfig(config.dataloader, data)
            spec = config.model_spec
            config.model_spec = dataclasses.replace(
                spec, parallelize_fn=_always_fsdp(spec.parallelize_fn)
            )
            config.metrics = _BuiltWith(config.metrics, ft_enable=True, ft_replica_id=ft.replica_id)
        super().__init__(config)  # runs init_distributed; builds and parallelizes the model
        self.attach_replica_axis()
        # Built by train(): each group's traces and snapshots in their own folder.
        leaf_folder = replica_leaf_folder(self.replica_axis)
        self.config.profiler = _BuiltWith(self.config.profiler, leaf_folder=leaf_folder)

    @property
    def job_config(self) -> Any:
        """0.2.2's name of the config, which the release-neutral helpers read."""
        return self.config

    def titan_lowers_pg_timeouts_at(self, start_step: int) -> int:
        """TorchTitan 0.3.0's loop lowers them after the first step past the one the process
        loaded (``start_step``)."""
        return start_step + 1


def main(argv: list[str] | None = None, trainer_class: type | None = None) -> None:
    """Parse, check, train; mirrors ``torchtitan.train.main`` with this package's config.
    ``trainer_class`` defaults to :class:`FaultTolerantTrainer` (tests pass a subclass)."""
    # load order: importing titan.train fails where TorchTitan came first unfixed (a test's)
    from torchtitan_ft.titan.train import _config_error, _user_error, run_trainer

    args = list(sys.argv[1:] if argv is None else argv)
    quiet_known_warnings()  # before the first config is built: its checks warn
    try:
        others = trainer_class is None and titan_trainer.wants_titan_trainer(args)
    except ConfigError as e:
        _config_error(str(e))
    if others:  # a config of one of TorchTitan's own trainers
        titan_trainer.main(args)
        return
    init_logger()
    register_datasets()
    cls = trainer_class or FaultTolerantTrainer
    try:
        parsed = parse(args, cls.Config)
        config = parsed.config
        validate_job_config(config)
        check_local_address(config)
        check_manager_env(config)
        check_profiler_schedule(config.profiler, "profiler")
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
