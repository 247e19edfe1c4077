"""The trainer process's entry point, ``python -m torchtitan_ft.titan.train [TorchTitan args]``
(run_train.sh's ``TRAIN_FILE``), in every rank of a replica group: CPU fixes, the known
harmless CPU warnings quieted (``known_warnings``), config, then TorchTitan's Trainer
(docs/titan.md, "Running it").

Without ``--job.config_file`` the checkout's ``configs/debug_cpu.toml`` is used when it exists.
"""

import atexit
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from torchtitan_ft.titan import cpu_compat
from torchtitan_ft.titan.launch import USER_ERROR_EXIT

cpu_compat.apply_before_torchtitan_import()

# TorchTitan and what imports it, after the CPU fixes
import torch  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402

from torchtitan_ft.manager import (  # noqa: E402
    AddressInUseError,
    QuorumTimeoutError,
    ReplicaGroupMismatchError,
)
from torchtitan_ft.titan import releases  # noqa: E402
from torchtitan_ft.titan.config import (  # noqa: E402
    ConfigError,
    check_local_address,
    check_local_paths,
    check_manager_env,
    check_model_fragments,
    check_profiler_schedule,
    config_file_from_args,
    parse_job,
    trainer_job_config,
)
from torchtitan_ft.titan.known_warnings import quiet_known_warnings  # noqa: E402
from torchtitan_ft.titan.training_data import register_datasets  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_cpu.toml"
"""The embedded default config (present in a source checkout / editable install)."""


def with_default_config(args: list[str]) -> list[str]:
    """``args`` plus ``--job.config_file DEFAULT_CONFIG`` if no config file was given."""
    if config_file_from_args(args) is None and DEFAULT_CONFIG.exists():
        return ["--job.config_file", str(DEFAULT_CONFIG), *args]
    return args


def _user_error(message: str) -> NoReturn:
    # One write of the whole line: print() writes the text and the newline separately, and
    # torchrun's log tailer, reading between the two under load, split the line in two.
    sys.stderr.write(f"torchtitan_ft: {message}\n")
    sys.stderr.flush()
    # TorchTitan's @record on Trainer.train may have written the traceback for torchrun to show.
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        Path(error_file).unlink(missing_ok=True)
    raise SystemExit(USER_ERROR_EXIT)


def _config_error(message: str) -> NoReturn:
    _user_error(f"config error: {message}")


def main(argv: list[str] | None = None, trainer_class: type | None = None) -> None:
    """Parse, check, train; mirrors ``torchtitan.train.main`` with the plugin's config. On
    another TorchTitan release than 0.2.2, that release's ``main`` does it
    (:mod:`torchtitan_ft.titan.releases`).

    The trainer is given the parsed config with the values the plugin derives
    (:func:`~torchtitan_ft.titan.preflight.trainer_job_config`). ``trainer_class`` defaults to
    ``FaultTolerantTrainer`` (tests pass a subclass).
    """
    release = releases.installed()
    if release is not releases.Release.V0_2:
        release.module.main(argv, trainer_class)
        return

    # a release switch: 0.2.2's trainer, which does not import on 0.3.0
    from torchtitan_ft.titan.trainer import FaultTolerantTrainer

    init_logger()
    quiet_known_warnings()
    register_datasets()
    args = with_default_config(list(sys.argv[1:] if argv is None else argv))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        job = parse_job(args)
        config = job.config
        check_local_paths(config)
        check_profiler_schedule(config.profiling, "profiling")
        check_local_address(config)
        check_manager_env(config)
        check_model_fragments(config)
        trainer_config = trainer_job_config(
            config, explicit_param_dtype=job.explicit_param_dtype, world_size=world_size
        )
    except ConfigError as e:
        _config_error(str(e))
    if "LOCAL_RANK" not in os.environ:  # TorchTitan's Trainer reads it: a KeyError otherwise
        _user_error(
            "the trainer runs under torchrun, which sets LOCAL_RANK, RANK and WORLD_SIZE; start "
            "it with ./run_train.sh (e.g. ./run_train.sh --fault_tolerance.enable "
            "--fault_tolerance.replica_id=0 --fault_tolerance.group_size=2)"
        )

    logger.info(releases.describe(releases.Release.V0_2))

    def run(trainer: Any) -> None:
        if config.checkpoint.create_seed_checkpoint:
            if world_size != 1:
                _config_error("--checkpoint.create_seed_checkpoint needs one process (NGPU=1)")
            if not config.checkpoint.enable:
                _config_error("--checkpoint.create_seed_checkpoint needs --checkpoint.enable")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()

    run_trainer(lambda: (trainer_class or FaultTolerantTrainer)(trainer_config), run)


def run_trainer(build: Callable[[], Any], run: Callable[[Any], None]) -> None:
    """Builds the trainer, runs it, closes it whatever happened, then destroys the default
    process group and ends the process (:func:`end_finished_process`); the Manager's user
    errors (a taken port, no quorum, a group of another size) end the process with one line
    (every release's ``main``)."""
    trainer = None
    try:
        trainer = build()
        run(trainer)
    except (AddressInUseError, QuorumTimeoutError, ReplicaGroupMismatchError) as e:
        _user_error(str(e))
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")
    end_finished_process()


def end_finished_process() -> NoReturn:
    """Ends a trainer process whose run finished without interpreter finalization: its
    non-daemon threads are joined and its exit handlers run, as at any exit, the standard
    streams are flushed, then ``os._exit(0)``.

    A gloo worker thread of torch's own process groups (FSDP's, native HSDP's) can outlive
    ``destroy_process_group``. If it needs the GIL once finalization has begun (to free a
    tensor of a work it has just completed), CPython ends it inside C++ code and the process
    aborts ("terminate called without an active exception", exit status -6) after training
    finished, and torchrun reports the job failed. It happened to a rank > 0 of a native
    HSDP 2x2 run in the test suite (such a rank exits right after its last collective;
    TorchTitan's rank 0 first sleeps 2 s). The plugin's own groups are freed before
    finalization (``process_group.lifecycle``); torch's are referenced by objects the plugin
    does not own.
    """
    threading._shutdown()  # what Py_FinalizeEx does first: join the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
