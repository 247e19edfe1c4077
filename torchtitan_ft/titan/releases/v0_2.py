"""What differs on TorchTitan 0.2.2: the config bases that ``config_schema`` extends and how a
meta-device copy of the configured model is built. The rest of ``titan/`` (the TOML and
command-line parse, ``FaultTolerantTrainer``, ``train.main``) is 0.2.2's own shape."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config import FaultTolerance as FaultToleranceBase
from torchtitan.config import JobConfig as JobConfigBase
from torchtitan.tools import utils

__all__ = [
    "FaultToleranceBase",
    "JobConfigBase",
    "meta_model",
    "trainer_class",
    "wait_for_checkpoint_save",
]


def meta_model(job_config: Any) -> torch.nn.Module:
    """A meta-device copy of the model ``job_config`` describes, built the way TorchTitan's
    Trainer builds it (model args updated from the config; model converters not applied).
    Cheap: no memory is allocated for the weights."""
    # load order: the train specs import the modules cpu_compat patches, and config_schema
    # imports this module in processes that never apply it (the torchrun agent's preflight)
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    model_args.update_from_config(job_config)
    with (
        torch.device("meta"),
        utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]),
    ):
        return spec.model_cls(model_args)


def trainer_class() -> type:
    """This release's ``FaultTolerantTrainer`` (:mod:`torchtitan_ft.titan.trainer`)."""
    # load order: the trainer's config extends this module's bases (config_schema reads them)
    from torchtitan_ft.titan.trainer import FaultTolerantTrainer

    return FaultTolerantTrainer


def wait_for_checkpoint_save(checkpointer: Any) -> None:
    """Block until TorchTitan's ``CheckpointManager`` finished its async save, if one runs."""
    if checkpointer.enable and getattr(checkpointer, "save_future", None) is not None:
        checkpointer._async_wait()
