"""Entry point: ``python -m torchtitan_ft.train [TorchTitan args]`` (run_train.sh's TRAIN_FILE).

Order matters, which is why this is a separate module and not ``-m torchtitan.train``:

1. the CPU compatibility fixes (``torchtitan_ft.titan.cpu_compat``) run *at import*, before
   anything imports TorchTitan (a no-op when CUDA is available);
2. the project's corpora are registered in TorchTitan's ``DATASETS``;
3. TOML + CLI are parsed into the extended ``JobConfig`` and validated, and the tokenizer
   directory is checked, before any process group exists: a missing or malformed config file,
   an unknown key or flag, a bad value, a missing tokenizer or a ``fault_tolerance.hostname``
   that is not an address of this machine stops every rank with one line
   (``torchtitan_ft: config error: ...``, exit status ``USER_ERROR_EXIT``, 2, which
   ``torchtitan_ft.launch`` recognises so that torchrun adds no report of its own);
4. TorchTitan's own ``Trainer`` (subclassed as ``FaultTolerantTrainer``) trains. Mistakes that
   only show once the group runs stop it the same way, with one line: no quorum from the
   lighthouse (wrong URL, lighthouse down), a group inconsistent with the job (model, group
   size, duplicate replica id), the manager server's port in use.

Without ``--job.config_file`` the checkout's ``configs/debug_cpu.toml`` (llama3 debugmodel,
batch 2 x seq 256, a few steps) is used when it exists.
"""

import os
import sys
from pathlib import Path
from typing import NoReturn

from torchtitan_ft.launch import USER_ERROR_EXIT
from torchtitan_ft.titan import cpu_compat

cpu_compat.apply_before_torchtitan_import()

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "debug_cpu.toml"
"""The embedded default config (present in a source checkout / editable install)."""


def with_default_config(args: list[str]) -> list[str]:
    """``args`` plus ``--job.config_file DEFAULT_CONFIG`` if no config file was given."""
    from torchtitan_ft.titan.config import config_file_from_args

    if config_file_from_args(args) is None and DEFAULT_CONFIG.exists():
        return ["--job.config_file", str(DEFAULT_CONFIG), *args]
    return args


def _user_error(message: str) -> NoReturn:
    print(f"torchtitan_ft: {message}", file=sys.stderr, flush=True)
    # TorchTitan's @record on Trainer.train may have written the traceback for torchrun to show.
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        Path(error_file).unlink(missing_ok=True)
    raise SystemExit(USER_ERROR_EXIT)


def _config_error(message: str) -> NoReturn:
    _user_error(f"config error: {message}")


def main(argv: list[str] | None = None, trainer_class: type | None = None) -> None:
    """Parse, validate, train; mirrors ``torchtitan.train.main`` with the plugin's config.

    ``trainer_class`` defaults to ``FaultTolerantTrainer`` (tests pass a subclass).
    """
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_ft.manager_server import (
        AddressInUseError,
        QuorumTimeoutError,
        ReplicaGroupMismatchError,
    )
    from torchtitan_ft.titan.config import (
        ConfigError,
        check_local_address,
        check_local_paths,
        check_model_fragments,
        parse_job_config,
    )
    from torchtitan_ft.titan.data import register_datasets
    from torchtitan_ft.titan.trainer import FaultTolerantTrainer

    init_logger()
    register_datasets()
    args = with_default_config(list(sys.argv[1:] if argv is None else argv))
    try:
        config = parse_job_config(args)
        check_local_paths(config)
        check_local_address(config)
        check_model_fragments(config)
    except ConfigError as e:
        _config_error(str(e))

    trainer: FaultTolerantTrainer | None = None
    try:
        trainer = (trainer_class or FaultTolerantTrainer)(config)
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                _config_error("--checkpoint.create_seed_checkpoint needs one process (NGPU=1)")
            if not config.checkpoint.enable:
                _config_error("--checkpoint.create_seed_checkpoint needs --checkpoint.enable")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except (AddressInUseError, QuorumTimeoutError, ReplicaGroupMismatchError) as e:
        _user_error(str(e))
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
