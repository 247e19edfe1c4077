"""TorchTitan 0.3.0's own trainers on this machine (docs/titan.md, "TorchTitan's own FT trainer
on 0.3.0"). On 0.3.0 a registry config names its trainer (``config.build()``): ``--module
torchft.llama3 --config llama3_torchft_debugmodel`` is a config of TorchTitan's
``FaultTolerantTrainer`` (``torchtitan.experiments.torchft``), which imports ``torchft``. Such a
config, or any config under ``TRAIN_FILE=torchtitan.train`` (0.3.0's one entry point), trains
with TorchTitan's trainer, as ``torchtitan.train`` starts it, with what this machine needs first:

* the registry values a pip install or a CPU cannot use, where the user did not set them
  (:func:`.parse.runnable_here`, as for this project's trainer: the tokenizer, the corpora,
  SDPA for FlexAttention, and with several ranks ``parallelism.spmd_backend="partial_dtensor"``
  for 0.3.0's default ``"spmd_types"``), and, on a CPU, ``fault_tolerance.process_group="gloo"``
  for the registry's ``"nccl"``; one line each;
* FSDP reducing with a plain SUM on gloo (:func:`.cpu_compat.force_sum_reduction`);
* this project's corpora registered as TorchTitan datasets.

TorchTitan's FT trainer builds torchft's ``Manager``, ``ProcessGroupGloo``, ``Optimizer`` and
``local_sgd.DiLoCo``/``LocalSGD``: with the opt-in torchft compatibility package (compat/) they
are torchtitan_ft's. The pre-flight (:func:`torchtitan_ft.titan.releases.commands.main`)
refuses with one line before torchrun when no torchft is importable.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torchtitan.tools.logging import init_logger, logger
from torchtitan.trainer import Trainer

from torchtitan_ft.titan import cpu_compat, releases
from torchtitan_ft.titan.config_schema import ConfigError
from torchtitan_ft.titan.known_warnings import quiet_known_warnings
from torchtitan_ft.titan.releases.v0_3.parse import (
    ParsedJob,
    group_ranks,
    load_registry_config,
    parse,
    runnable_here,
)
from torchtitan_ft.titan.training_data import register_datasets

NCCL_ON_CPU = (
    "torchtitan_ft: CPU: fault_tolerance.process_group='nccl' (the registry's) needs a GPU; "
    "using 'gloo' (set --fault_tolerance.process_group to choose)"
)


def is_other_trainers_config(config: Any) -> bool:
    """Whether a registry config builds another trainer than ``torchtitan.trainer.Trainer``
    (whose configs this project's trainer trains)."""
    return type(config) is not Trainer.Config


def trainer_line(config: Any) -> str:
    """The one line that says which trainer a registry config of another trainer runs with."""
    trainer = type(config).__qualname__.rsplit(".", 1)[0]
    return (
        f"torchtitan_ft: the registry config is one of TorchTitan's {trainer} "
        f"({type(config).__module__}), so that trainer trains, not torchtitan_ft's; its "
        "fault tolerance runs on torchtitan_ft through the torchft compatibility package"
    )


def gloo_for_nccl(parsed: ParsedJob, cuda: bool, log: Callable[[str], None]) -> None:
    """On a CPU, ``fault_tolerance.process_group="gloo"`` where the registry says ``"nccl"``
    and the user did not choose (in place; one line)."""
    ft = getattr(parsed.config, "fault_tolerance", None)
    if cuda or ft is None or ft.process_group != "nccl":
        return
    if "fault_tolerance.process_group" in parsed.explicit:
        return
    ft.process_group = "gloo"
    log(NCCL_ON_CPU)


def mccl_problem(parsed: ParsedJob, torchcomms: bool, torchft_torchcomms: bool) -> str | None:
    """Why ``fault_tolerance.process_group="mccl"`` cannot run (one line), or None. TorchTitan's
    FT trainer builds it as ``torchft.torchcomms.ProcessGroupTorchComms`` over a
    ``torchcomms`` communicator: it needs both modules (``torchcomms``, ``torchft_torchcomms``:
    whether each is importable). The compatibility package has no ``torchft.torchcomms``."""
    ft = getattr(parsed.config, "fault_tolerance", None)
    if ft is None or ft.process_group != "mccl":
        return None
    missing = [
        what
        for what, found in (
            ("the torchcomms package (not installed)", torchcomms),
            (
                "torchft.torchcomms (the torchft compatibility package does not provide it)",
                torchft_torchcomms,
            ),
        )
        if not found
    ]
    if not missing:
        return None
    return (
        "fault_tolerance.process_group='mccl' builds torchft.torchcomms.ProcessGroupTorchComms "
        f"over torchcomms, which needs {' and '.join(missing)}; values that work here: 'gloo' "
        "(CPU or GPU) or 'nccl' (GPU)"
    )


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported (a submodule: its packages first)."""
    parts = module.split(".")
    return all(
        importlib.util.find_spec(".".join(parts[: i + 1])) is not None for i in range(len(parts))
    )


def _sum_reduction(parallelize: Any) -> Any:
    """``parallelize`` followed by :func:`cpu_compat.force_sum_reduction` (gloo has no
    PREMUL_SUM)."""

    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        cpu_compat.force_sum_reduction([model])
        return model

    return parallelize_fn


def main(argv: list[str] | None = None) -> None:
    """Parse as ``torchtitan.train`` does, make the config runnable here, train with the
    trainer the config builds (closing it and the process group as ``torchtitan.train``)."""
    # load order: importing titan.train fails where TorchTitan came first unfixed (a test's)
    from torchtitan_ft.titan.train import _config_error, run_trainer

    init_logger()
    quiet_known_warnings()
    register_datasets()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        parsed = parse(args, None)
    except ConfigError as e:
        _config_error(str(e))
    config = parsed.config
    if is_other_trainers_config(config):
        logger.info(trainer_line(config))
    cuda = cpu_compat.cuda_available()
    runnable_here(parsed, cuda, group_ranks(), logger.info)
    gloo_for_nccl(parsed, cuda, logger.info)
    if problem := mccl_problem(
        parsed, _importable("torchcomms"), _importable("torchft.torchcomms")
    ):
        _config_error(problem)
    if not cuda:
        spec = config.model_spec
        config.model_spec = dataclasses.replace(
            spec, parallelize_fn=_sum_reduction(spec.parallelize_fn)
        )
    logger.info(releases.describe(releases.Release.V0_3))
    run_trainer(config.build, lambda trainer: trainer.train())


def wants_titan_trainer(args: list[str]) -> bool:
    """Whether the registry config ``args`` name is another trainer's (:func:`main` trains
    it), not one this project's trainer trains."""
    loaded, _ = load_registry_config(args)
    return is_other_trainers_config(loaded)


if __name__ == "__main__":
    main()
