"""run_train.sh's choice of trainer module on TorchTitan 0.3.0, before torchrun starts
(docs/titan.md, "TorchTitan's FT doc, command by command", and "TorchTitan's own FT trainer
on 0.3.0"). Imports neither torch nor TorchTitan.

    python -m torchtitan_ft.titan.releases.commands TRAIN_FILE [trainer args...]

(run_train.sh's arguments; ``MODULE``/``MODEL``, ``CONFIG``, ``NGPU`` and
``CUDA_VISIBLE_DEVICES`` are read from the environment, as run_train.sh reads them)

prints the module torchrun runs, or exits 2 with one line that says why the command cannot run
here and what runs instead:

* ``TRAIN_FILE=torchtitan.experiments.ft.train`` (TorchTitan 0.2.x's FT trainer, the FT doc's
  commands): 0.3.0 has no such module; it names its FT trainer by config
  (``--module torchft.llama3 --config llama3_torchft_debugmodel``). The line gives the 0.3.0
  form of the same command, as 0.3.0's own FT doc writes it;
* ``TRAIN_FILE=torchtitan.train`` (0.3.0's one entry point) runs, through
  :mod:`.v0_3.titan_trainer` (the config made runnable here); another ``torchtitan.*`` module
  is not a 0.3.0 entry point;
* ``MODEL=llama3_ft`` (or ``ft.llama3``), 0.2.x's name of the FT debug model, which 0.3.0 has
  no config module for: the line gives the two 0.3.0 commands of that job (this project's
  trainer with configs/llama3_ft_debug_cpu.toml, or TorchTitan's FT trainer by its config);
* a config of TorchTitan's FT trainer (``--module torchft.llama3``) needs a ``torchft``: with
  none importable (or the real torchft beside the compatibility package) the line says how to
  run it, or this project's trainer instead.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from torchtitan_ft.titan.launch import USER_ERROR_EXIT
from torchtitan_ft.titan.run_module import torchft_import_error

TITAN_FT_TRAIN_0_2 = "torchtitan.experiments.ft.train"
"""TorchTitan 0.2.x's fault-tolerance trainer module (its FT doc's ``TRAIN_FILE``)."""

TITAN_ENTRY_0_3 = "torchtitan.train"
"""TorchTitan 0.3.0's entry point (its own run_train.sh runs it): the config names the trainer."""

TITAN_TRAINER_0_3 = "torchtitan_ft.titan.releases.v0_3.titan_trainer"
"""What runs TorchTitan 0.3.0's own trainers here (``torchtitan.train`` made runnable here)."""

TITAN_FT_REGISTRY_0_3 = ("torchft.llama3", "llama3_torchft_debugmodel")
"""TorchTitan 0.3.0's config of its FT trainer: ``--module``, ``--config`` (its only one)."""

DILOCO_NAMES = frozenset(
    {
        "llama3_ft",
        "ft.llama3",
        "torchft.llama3",
        "llama3_ft_debugmodel",
        "llama3_torchft_debugmodel",
    }
)
"""0.2.x's names of the FT debug model with Streaming DiLoCo (MODEL/MODULE or CONFIG), the
configuration 0.3.0's ``llama3_torchft_debugmodel`` has; 0.2.x's other configs are per-step."""

_DEBUG_CONFIGS = frozenset({"", "llama3_debugmodel", *DILOCO_NAMES})

MODULES_0_2_ONLY = frozenset({"llama3_ft", "ft.llama3"})
"""0.2.x's ``MODEL`` names of the FT debug model that TorchTitan 0.3.0 has no config module
for (its FT trainer's is ``torchft.llama3``): 0.3.0's parser stops a worker on them with
"Cannot import module"."""

FT_DEBUG_CONFIG_FILE = "configs/llama3_ft_debug_cpu.toml"
"""This project's CPU form of the FT debug model (what those 0.2.x names select on 0.2.2)."""

OUR_TRAINER_0_3 = (
    "./run_train.sh --module llama3 --config llama3_debugmodel --fault_tolerance.enable "
    "--fault_tolerance.replica_id=0 --fault_tolerance.group_size=2"
)
"""An example of this project's trainer on 0.3.0 (the ``fault_tolerance`` section is its)."""


def config_module(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The config registry module of run_train.sh's arguments ``args`` (the last
    ``--module``) and environment ``env`` (``MODULE``, else ``MODEL``), or None."""
    found = env.get("MODULE") or env.get("MODEL") or None
    for i, arg in enumerate(args):
        if arg.startswith("--module="):
            found = arg.partition("=")[2]
        elif arg == "--module" and i + 1 < len(args):
            found = args[i + 1]
    return found


def needs_torchft(module: str | None) -> bool:
    """Whether the config registry ``module`` (``--module``) is TorchTitan 0.3.0's FT
    experiment, whose trainer imports ``torchft``."""
    if not module:
        return False
    return module.split(".")[0] == "torchft" or module.startswith("torchtitan.experiments.torchft")


def form_on_0_3(env: Mapping[str, str], args: Sequence[str]) -> str:
    """The TorchTitan 0.3.0 form of ``[env] ./run_train.sh args`` with
    ``TRAIN_FILE=torchtitan.experiments.ft.train``: TorchTitan's FT trainer named by its
    config, the other variables the doc sets (``NGPU``, ``CUDA_VISIBLE_DEVICES``) and the
    arguments kept. 0.2.x's per-step configs become per-step FT of that config
    (``--fault_tolerance.semi_sync_method None``: 0.3.0's registry config is DiLoCo)."""
    module, config = TITAN_FT_REGISTRY_0_3
    words = [f"MODULE={module}", f"CONFIG={config}"]
    words += [f"{var}={env[var]}" for var in ("NGPU", "CUDA_VISIBLE_DEVICES") if var in env]
    words += ["./run_train.sh", *args]
    named = {env.get("MODEL", ""), env.get("MODULE", ""), env.get("CONFIG", "")}
    if not named & DILOCO_NAMES:
        words += ["--fault_tolerance.semi_sync_method", "None"]
    return shlex.join(words)


def train_file_problem(train_file: str, env: Mapping[str, str], args: Sequence[str]) -> str | None:
    """Why ``TRAIN_FILE=train_file`` cannot run on TorchTitan 0.3.0 (one line), or None."""
    if train_file == TITAN_FT_TRAIN_0_2:
        config = env.get("CONFIG", "")
        model = ""
        if config.lower() not in _DEBUG_CONFIGS:
            model = f"; that config has the debug model, not {config}"
        return (
            f"torchtitan_ft: TRAIN_FILE={train_file} is TorchTitan 0.2.x's FT trainer; TorchTitan "
            f"0.3.0 has no such module and names its FT trainer by config (--module "
            f"{TITAN_FT_REGISTRY_0_3[0]}, its only FT config{model}): the 0.3.0 form of this "
            f"command is `{form_on_0_3(env, args)}`"
        )
    if train_file.startswith("torchtitan.") and train_file != TITAN_ENTRY_0_3:
        return (
            f"torchtitan_ft: TRAIN_FILE={train_file} is not a TorchTitan 0.3.0 entry point: "
            f"0.3.0 has one, {TITAN_ENTRY_0_3}, and the config names the trainer (--module M "
            "--config C); leave TRAIN_FILE unset (torchtitan_ft's trainer, which also runs "
            f"TorchTitan's own FT trainer for --module {TITAN_FT_REGISTRY_0_3[0]})"
        )
    return None


def _without_registry_flags(args: Sequence[str]) -> list[str]:
    """``args`` without their ``--module`` and ``--config`` flags (with their values)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--module", "--config"):
            skip = True
        elif not arg.startswith(("--module=", "--config=")):
            kept.append(arg)
    return kept


def old_name_problem(module: str | None, env: Mapping[str, str], args: Sequence[str]) -> str | None:
    """Why the config module ``module`` cannot run on TorchTitan 0.3.0 when it is one of
    0.2.x's names of the FT debug model (:data:`MODULES_0_2_ONLY`, e.g. the start command in
    the header of configs/llama3_ft_debug_cpu.toml), with the two commands that train it on
    0.3.0 (one line); None for any other module."""
    if module is None or module.lower() not in MODULES_0_2_ONLY:
        return None
    rest = _without_registry_flags(args)
    config_file = env.get("CONFIG_FILE") or FT_DEBUG_CONFIG_FILE
    ours = [f"CONFIG_FILE={config_file}", "./run_train.sh", "--module", "llama3"]
    ours += ["--config", "llama3_debugmodel", *rest]
    titans = [f"MODULE={TITAN_FT_REGISTRY_0_3[0]}", f"CONFIG={TITAN_FT_REGISTRY_0_3[1]}"]
    titans += ["./run_train.sh", *rest]
    return (
        f"torchtitan_ft: config module {module!r} is TorchTitan 0.2.x's name of its FT debug "
        f"model; TorchTitan 0.3.0 has no such module. On 0.3.0 the same job is "
        f"`{shlex.join(ours)}` (torchtitan_ft's trainer, {config_file} over the registry's "
        f"llama3 debugmodel), or with TorchTitan's own FT trainer `{shlex.join(titans)}`"
    )


def torchft_problem(module: str, import_error: str | None) -> str | None:
    """Why the config registry ``module``'s trainer cannot run (one line), or None.
    ``import_error`` is the last line of ``import torchft``'s error (None: it imports)."""
    if not needs_torchft(module) or import_error is None:
        return None
    return (
        f"torchtitan_ft: --module {module} is a config of TorchTitan's own FT trainer (its "
        f"FaultTolerantTrainer), which imports torchft: {import_error}. Install the torchft "
        "compatibility package (scripts/install_torchft_compat.sh) to run it on torchtitan_ft, "
        f"or train with torchtitan_ft's trainer, e.g. `{OUR_TRAINER_0_3}`"
    )


def trainer_module(train_file: str) -> str:
    """The module torchrun runs for ``TRAIN_FILE=train_file`` (one without a problem)."""
    return TITAN_TRAINER_0_3 if train_file == TITAN_ENTRY_0_3 else train_file


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write("usage: python -m torchtitan_ft.titan.releases.commands TRAIN_FILE ...\n")
        raise SystemExit(USER_ERROR_EXIT)
    train_file, rest = args[0], args[1:]
    module = config_module(rest, os.environ)
    problem = train_file_problem(train_file, os.environ, rest)
    if problem is None:
        problem = old_name_problem(module, os.environ, rest)
    if problem is None and needs_torchft(module):
        problem = torchft_problem(module or "", torchft_import_error())
    if problem:
        sys.stderr.write(f"{problem}\n")  # one write: see train._user_error
        raise SystemExit(USER_ERROR_EXIT)
    print(trainer_module(train_file))


if __name__ == "__main__":
    main()
