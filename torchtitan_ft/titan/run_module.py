"""Runs a trainer module other than this project's own (run_train.sh's ``TRAIN_FILE``, e.g.
TorchTitan's ``torchtitan.train`` or its fault-tolerance trainer
``torchtitan.experiments.ft.train``) with the CPU fixes applied first, as
``torchtitan_ft.titan.train`` applies them (docs/titan.md, "TorchTitan on a CPU-only torch"),
and the project's local corpora registered as TorchTitan datasets.

    python -m torchtitan_ft.titan.run_module MODULE [trainer args...]
    python -m torchtitan_ft.titan.run_module --check MODULE [trainer args...]   # pre-flight

TorchTitan's fault-tolerance trainer imports the ``torchft`` package. It runs on this project
only with the opt-in torchft compatibility package installed (scripts/install_torchft_compat.sh);
without it, both forms stop with one line naming this project's own entry point.

It reads this project's configs too: TorchTitan's parser rejects a ``[fault_tolerance]`` key it
does not know (``step_timeout_ms``, ``hostname``, ...), so the trainer is given this project's
``[fault_tolerance]`` schema as its custom config module (``--job.custom_config_module``, unless
the command line or the TOML names one of its own). TorchTitan's trainer builds torchft's
Manager from its own fields only; the pre-flight says in one line which of the fields the user
set it leaves unused, and in another when it trains DiLoCo as one fragment where the config
asks for several (the model's train spec has no ``fragment_fn``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import runpy
import subprocess
import sys
import tomllib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torchtitan_ft.titan import cpu_compat
from torchtitan_ft.titan.known_warnings import quiet_known_warnings
from torchtitan_ft.titan.launch import USER_ERROR_EXIT
from torchtitan_ft.titan.training_data import register_datasets

PROJECT_TRAINER = "torchtitan_ft.titan.train"
"""This project's trainer: run_train.sh's default ``TRAIN_FILE``."""

NEEDS_TORCHFT = frozenset({"torchtitan.experiments.ft.train"})
"""Trainer modules that import the ``torchft`` package for fault tolerance."""


OWN_CONFIG_MODULE = "torchtitan_ft.titan.config_schema"
"""This project's JobConfig (its ``[fault_tolerance]`` fields), given to TorchTitan's parser as
the custom config module."""

TITAN_FT_CONFIG_MODULE = "torchtitan.components.ft.config"
"""TorchTitan's own FT config module; this project's schema holds all its fields, so it is
replaced where a TOML names it."""

_CUSTOM_CONFIG_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")
_FT_FLAG_PREFIXES = ("--fault_tolerance.", "--fault-tolerance.")


def custom_config_args(args: Sequence[str], toml: Mapping[str, Any]) -> list[str]:
    """The flag that makes TorchTitan's parser read this project's ``[fault_tolerance]`` keys,
    or none where the command line (``args``) or the TOML names a module of the user's own."""
    if any(a.split("=", 1)[0] in _CUSTOM_CONFIG_FLAGS for a in args):
        return []
    job = toml.get("job")
    named = job.get("custom_config_module") if isinstance(job, dict) else None
    if named and named not in (TITAN_FT_CONFIG_MODULE, OWN_CONFIG_MODULE):
        return []
    return [f"--job.custom_config_module={OWN_CONFIG_MODULE}"]


def fields_set(args: Sequence[str], toml: Mapping[str, Any]) -> set[str]:
    """The ``[fault_tolerance]`` fields the TOML or the command line sets (``--fault_tolerance.x``
    and ``--fault-tolerance.x`` alike; ``--fault_tolerance.no-x`` sets ``x``)."""
    section = toml.get("fault_tolerance")
    names = set(section) if isinstance(section, dict) else set()
    for arg in args:
        for prefix in _FT_FLAG_PREFIXES:
            if arg.startswith(prefix):
                name = arg[len(prefix) :].split("=", 1)[0].replace("-", "_")
                names.add(name.removeprefix("no_"))
    return names


def unused_fields_line(
    module: str, set_names: Collection[str], titan_fields: Collection[str]
) -> str | None:
    """The line saying which fields the user set that TorchTitan's FT trainer ``module`` does
    not use (fields not in ``titan_fields``), or None when there are none."""
    unused = sorted(set(set_names) - set(titan_fields))
    if not unused:
        return None
    return (
        f"torchtitan_ft: TRAIN_FILE={module} is TorchTitan's FT trainer, which builds the "
        f"Manager from TorchTitan's fault_tolerance fields only: it accepts but does not use "
        f"fault_tolerance.{{{', '.join(unused)}}} (torchft's defaults and TORCHFT_* variables "
        f"apply instead); leave TRAIN_FILE unset ({PROJECT_TRAINER}) to train with them"
    )


def setting(args: Sequence[str], toml: Mapping[str, Any], section: str, name: str) -> Any:
    """``section.name`` as the trainer reads it: the last ``--section.name=V`` (or ``...name
    V``) of ``args``, else the TOML's value, else None. Pure."""
    value = None
    tomls = toml.get(section)
    if isinstance(tomls, dict):
        value = tomls.get(name)
    flags = {f"--{section}.{name}", f"--{section.replace('_', '-')}.{name.replace('_', '-')}"}
    for i, arg in enumerate(args):
        key, sep, given = arg.partition("=")
        if key in flags:
            value = given if sep else (args[i + 1] if i + 1 < len(args) else value)
    return value


def one_fragment_line(
    module: str, model: str, semi_sync_method: Any, num_fragments: Any, has_fragment_fn: bool
) -> str | None:
    """The line saying that TorchTitan's FT trainer ``module`` trains DiLoCo over the whole
    model where ``num_fragments`` > 1 asks for Streaming DiLoCo: it splits a model only with
    the ``fragment_fn`` of its train spec, and drops ``num_fragments`` without a word when
    there is none (llama3's; llama3_ft's has one). None when that is not the case. Pure."""
    try:
        fragments = int(num_fragments if num_fragments is not None else 1)
    except ValueError:
        return None  # the trainer's parser reports it
    if module not in NEEDS_TORCHFT or has_fragment_fn or fragments <= 1:
        return None
    if str(semi_sync_method or "").lower() != "diloco":
        return None
    return (
        f"torchtitan_ft: TRAIN_FILE={module} trains model {model!r} with DiLoCo as one "
        f"fragment, not fault_tolerance.num_fragments={fragments}: TorchTitan's FT trainer "
        f"splits a model only with its train spec's fragment_fn, and {model!r}'s has none; "
        f"leave TRAIN_FILE unset ({PROJECT_TRAINER}) to train {fragments} fragments"
    )


def _has_fragment_fn(model: str) -> bool:
    """Whether TorchTitan's train spec of ``model`` has a ``fragment_fn`` (True for a name it
    does not know: its trainer reports that)."""
    # load order: --check runs before the CPU fixes; the train specs load modules they patch
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        spec = get_train_spec(model)
    except ValueError:
        return True
    return getattr(spec, "fragment_fn", None) is not None


def _titan_ft_fields() -> set[str]:
    from torchtitan.components.ft.config import FaultTolerance  # load order: as above

    return {f.name for f in dataclasses.fields(FaultTolerance)}


def _toml_of(args: Sequence[str]) -> dict[str, Any]:
    """The TOML of the first ``--job.config_file`` in ``args`` (the one TorchTitan's parser
    reads; {} without one). A file that cannot be read is left to the trainer to report. Read
    without importing TorchTitan: its parser takes ``sys.argv`` as it is at import time."""
    for i, arg in enumerate(args):
        key, sep, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = value if sep else (args[i + 1] if i + 1 < len(args) else "")
            try:
                with open(path, "rb") as f:
                    return tomllib.load(f)
            except (OSError, tomllib.TOMLDecodeError):
                return {}
    return {}


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


def torchft_import_error() -> str | None:
    """The last line of ``import torchft``'s error, None when it imports. Probed in a child
    process: this project never imports torchft itself. The compatibility package refuses
    (ImportError, one line) when the real torchft is visible beside it."""
    if not _torchft_found():
        return "no torchft package is installed"
    probe = subprocess.run(
        [sys.executable, "-c", "import torchft"], capture_output=True, text=True, check=False
    )
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
    return lines[-1]


def check(module: str) -> None:
    """Exit with one line (status USER_ERROR_EXIT) when ``module`` cannot run here."""
    problem = torchft_problem(module, _torchft_found())
    if problem:
        _refuse(problem)
    if module in NEEDS_TORCHFT:
        error = torchft_import_error()
        if error is not None:
            _refuse(f"torchtitan_ft: TRAIN_FILE={module}: cannot import torchft: {error}")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--check"] and len(args) >= 2:
        module, rest = args[1], args[2:]
        check(module)
        # Here, once per group (run_train.sh's pre-flight), not in every rank: importing
        # TorchTitan before sys.argv is set (below) would hide the trainer's arguments.
        if module in NEEDS_TORCHFT:
            toml = _toml_of(rest)
            line = unused_fields_line(module, fields_set(rest, toml), _titan_ft_fields())
            if line:
                print(line, file=sys.stderr, flush=True)
            model = setting(rest, toml, "model", "name") or "llama3"  # TorchTitan's default
            semi_sync = setting(rest, toml, "fault_tolerance", "semi_sync_method")
            fragments = setting(rest, toml, "fault_tolerance", "num_fragments")
            if str(semi_sync or "").lower() == "diloco":  # the train spec is looked up only then
                split = _has_fragment_fn(model)
                line = one_fragment_line(module, model, semi_sync, fragments, split)
                if line:
                    print(line, file=sys.stderr, flush=True)
        return
    if not args or args[0].startswith("-"):
        _refuse("usage: python -m torchtitan_ft.titan.run_module MODULE [trainer args...]")
    module, rest = args[0], args[1:]
    check(module)
    if module in NEEDS_TORCHFT:
        rest = [*rest, *custom_config_args(rest, _toml_of(rest))]
    # Before TorchTitan is imported: its ConfigManager.parse_args takes sys.argv[1:] as a
    # default argument, fixed when torchtitan.config is first imported.
    sys.argv = [module, *rest]

    cpu_compat.apply_before_torchtitan_import()
    register_datasets()  # the project's local corpora (no network here), as its configs name them
    quiet_known_warnings()  # a filter on TorchTitan's logger: its init_logger keeps it
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
