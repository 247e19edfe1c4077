"""What differs on TorchTitan 0.3.0 (docs/titan.md, "TorchTitan releases"): configs come from
a config registry (``--module`` / ``--config``) and are overridden by ``--section.key`` flags
(tyro); the trainer's ``Config`` dataclass builds its components.

* here: the config bases ``config_schema`` extends (the trainer's ``Config`` gets the same
  ``fault_tolerance`` section as on 0.2.2) and the meta-device model;
* :mod:`.parse`: the command line, the registry config made runnable on this machine;
* :mod:`.trainer`: ``FaultTolerantTrainer`` and the entry point ``main``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import utils
from torchtitan.trainer import Trainer

__all__ = [
    "FaultToleranceBase",
    "JobConfigBase",
    "main",
    "meta_model",
    "trainer_class",
    "wait_for_checkpoint_save",
]


@dataclass
class FaultToleranceBase:
    """0.3.0 has no ``fault_tolerance`` section outside its torchft experiment (which imports
    torchft): the section's fields are all this package's (``config_schema.FaultTolerance``)."""


JobConfigBase = Trainer.Config


def meta_model(job_config: Any) -> torch.nn.Module:
    """A meta-device copy of the model ``job_config.model_spec`` describes, built as 0.3.0's
    Trainer builds it (``update_from_config``, then ``build`` under the training dtype).
    Cheap: no memory is allocated for the weights."""
    model_config = copy.deepcopy(job_config.model_spec.model)
    model_config.update_from_config(config=job_config)
    with (
        torch.device("meta"),
        utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]),
    ):
        return model_config.build()


def main(argv: list[str] | None = None, trainer_class: type | None = None) -> None:
    """See :func:`torchtitan_ft.titan.releases.v0_3.trainer.main`."""
    # load order: .trainer's config extends this module's bases (config_schema reads them)
    from torchtitan_ft.titan.releases.v0_3.trainer import main as train_main

    train_main(argv, trainer_class)


def trainer_class() -> type:
    """This release's ``FaultTolerantTrainer`` (:mod:`.trainer`)."""
    # load order: .trainer's config extends this module's bases (config_schema reads them)
    from torchtitan_ft.titan.releases.v0_3.trainer import FaultTolerantTrainer

    return FaultTolerantTrainer


def wait_for_checkpoint_save(checkpointer: Any) -> None:
    """Block until TorchTitan's checkpoint manager finished its async save, if one runs."""
    checkpointer.maybe_wait_for_saving()
