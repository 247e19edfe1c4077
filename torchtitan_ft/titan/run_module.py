"""Runs a trainer module other than this project's own (run_train.sh's ``TRAIN_FILE``, e.g.
TorchTitan's ``torchtitan.train`` or its fault-tolerance trainer
``torchtitan.experiments.ft.train``) with the CPU fixes applied first, as
``torchtitan_ft.titan.train`` applies them (docs/titan.md, "TorchTitan on a CPU-only torch"),
and the project's local corpora registered as TorchTitan datasets.

    python -m torchtitan_ft.titan.run_module MODULE [trainer args...]
    python -m torchtitan_ft.titan.run_module --check MODULE   # run_train.sh's pre-flight

TorchTitan's fault-tolerance trainer imports the ``torchft`` package. It runs on this project
only with the opt-in torchft compatibility package installed (scripts/install_torchft_compat.sh);
without it, both forms stop with one line naming this project's own entry point.
"""

from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys

from torchtitan_ft.titan.launch import USER_ERROR_EXIT

PROJECT_TRAINER = "torchtitan_ft.titan.train"
"""This project's trainer: run_train.sh's default ``TRAIN_FILE``."""

NEEDS_TORCHFT = frozenset({"torchtitan.experiments.ft.train"})
"""Trainer modules that import the ``torchft`` package for fault tolerance."""


def torchft_problem(module: str, torchft_found: bool) -> str | None:
    """Why ``module`` cannot run here (one line), or None. Pure: ``torchft_found`` says whether
    a ``torchft`` package is importable."""
    if module not in NEEDS_TORCHFT or torchft_found:
        return None
    return (
        f"torchtitan_ft: TRAIN_FILE={module} is TorchTitan's own fault-tolerance trainer, which "
        f"imports the torchft package, and none is installed. Use this project's trainer "
        f"(leave TRAIN_FILE unset: {PROJECT_TRAINER}), or install the torchft compatibility "
        f"package (scripts/install_torchft_compat.sh) to run TorchTitan's trainer on "
        f"torchtitan_ft."
    )


def _torchft_found() -> bool:
    return importlib.util.find_spec("torchft") is not None


def _refuse(message: str) -> None:
    sys.stderr.write(f"{message}\n")  # one write: see train._user_error
    sys.stderr.flush()
    raise SystemExit(USER_ERROR_EXIT)


def check(module: str) -> None:
    """Exit with one line (status USER_ERROR_EXIT) when ``module`` cannot run here."""
    problem = torchft_problem(module, _torchft_found())
    if problem:
        _refuse(problem)
    if module in NEEDS_TORCHFT:
        # Probed in a child process: this project never imports torchft itself. The
        # compatibility package refuses (ImportError, one line) when the real torchft is
        # visible beside it.
        probe = subprocess.run(
            [sys.executable, "-c", "import torchft"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
            _refuse(f"torchtitan_ft: TRAIN_FILE={module}: cannot import torchft: {lines[-1]}")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--check"] and len(args) == 2:
        check(args[1])
        return
    if not args or args[0].startswith("-"):
        _refuse("usage: python -m torchtitan_ft.titan.run_module MODULE [trainer args...]")
    module, rest = args[0], args[1:]
    check(module)
    # Before TorchTitan is imported: its ConfigManager.parse_args takes sys.argv[1:] as a
    # default argument, fixed when torchtitan.config is first imported.
    sys.argv = [module, *rest]
    from torchtitan_ft.titan import cpu_compat

    cpu_compat.apply_before_torchtitan_import()
    # The project's local corpora (no network here), under the names its configs use.
    from torchtitan_ft.titan.data import register_datasets

    register_datasets()
    from torchtitan_ft.titan.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # a filter on TorchTitan's logger: its init_logger keeps it
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
