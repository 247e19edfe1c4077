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
from pathlib import Path
from typing import Any

import torch
from torchtitan.trainer import Trainer

__all__ = [
    "FaultToleranceBase",
    "JobConfigBase",
    "local_job",
    "main",
    "meta_model",
    "trainer_class",
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
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils

    model_config = copy.deepcopy(job_config.model_spec.model)
    model_config.update_from_config(config=job_config)
    with (
        torch.device("meta"),
        utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]),
    ):
        return model_config.build()


def main(argv: list[str] | None = None, trainer_class: type | None = None) -> None:
    """See :func:`torchtitan_ft.titan.releases.v0_3.trainer.main`."""
    from torchtitan_ft.titan.releases.v0_3.trainer import main as train_main

    train_main(argv, trainer_class)


def trainer_class() -> type:
    """This release's ``FaultTolerantTrainer`` (:mod:`.trainer`)."""
    from torchtitan_ft.titan.releases.v0_3.trainer import FaultTolerantTrainer

    return FaultTolerantTrainer


LOCAL_JOB_FLAGS = (
    "--dump_folder=./outputs/debug_ft_cpu",
    "--training.seq_len=256",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--debug.seed=42",
    "--validator.no-enable",
    "--metrics.disable_color_printing",
    "--fault_tolerance.enable",
    "--fault_tolerance.min_replica_size=1",
    "--fault_tolerance.hostname=127.0.0.1",
    "--fault_tolerance.process_group_timeout_ms=10000",
    "--fault_tolerance.step_timeout_ms=30000",
    "--fault_tolerance.quorum_timeout_ms=60000",
    "--fault_tolerance.connect_timeout_ms=10000",
)
"""``configs/debug_ft_cpu.toml`` (0.2.2's local job) as flags over the registry's
``llama3_debugmodel`` (batch 8 x seq 2048, bf16 parameters): its shape, dtype, seed and
``[fault_tolerance]`` section."""


def local_job(root: Path, group_flags: list[str]) -> tuple[dict[str, str], list[str]]:
    """``./run_local.sh``'s replica group (``scripts/local_job.py``) on 0.3.0: the environment
    and the arguments of its ``run_train.sh``, the registry's ``llama3`` ``llama3_debugmodel``
    in 0.2.2's local-job shape (:data:`LOCAL_JOB_FLAGS`, no activation checkpointing) and
    ``group_flags`` (the group's and the user's flags). ``root`` (the checkout, where 0.2.2's
    config file lies) is not needed: the registry names the config."""
    # tyro reads a choice of config class as a subcommand, after every flag.
    return {"MODULE": "llama3", "CONFIG": "llama3_debugmodel"}, [
        *LOCAL_JOB_FLAGS,
        *group_flags,
        "activation-checkpoint:none",
    ]
