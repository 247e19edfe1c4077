"""Config names as TorchTitan's launch commands spell them (``MODEL=... CONFIG=...
./run_train.sh``), resolved by run_train.sh before it starts torchrun (docs/titan.md, "Config
by name")::

    python -m torchtitan_ft.titan.named_configs   # reads MODEL, MODULE, CONFIG; prints the file
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from torchtitan_ft.titan.launch import USER_ERROR_EXIT

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

TITAN_CONFIGS = {
    "llama3_debugmodel": "debug_cpu.toml",
    "llama3_8b": "llama3_8b_ft.toml",
    "llama3_ft_debugmodel": "llama3_ft_debug_cpu.toml",
    "llama3_torchft_debugmodel": "llama3_ft_debug_cpu.toml",
}
"""TorchTitan's config names (lowercase) -> this project's equivalent in ``configs/``: the same
fault-tolerance settings as TorchTitan's config of that name (the two ``*_ft_debugmodel`` are
Streaming DiLoCo, ``llama3_8b`` per-step with ``min_replica_size`` 1), scaled to a CPU where the
file's header says."""

MODEL_FAMILIES = {
    "llama3": "llama3_debugmodel",
    "llama3_ft": "llama3_ft_debugmodel",
    "ft.llama3": "llama3_ft_debugmodel",
    "torchft.llama3": "llama3_torchft_debugmodel",
}
"""``MODEL`` / ``MODULE`` values (lowercase) this project's configs are for -> the config the
name selects alone. Every config here is TorchTitan's llama3."""


class UnknownConfigName(ValueError):
    """``MODEL``/``MODULE``/``CONFIG`` name nothing known; the message lists what is."""


def _own_configs(configs_dir: Path) -> dict[str, str]:
    return {p.stem.lower(): p.name for p in sorted(configs_dir.glob("*.toml"))}


def resolve(
    model: str | None,
    config: str | None,
    configs_dir: Path = CONFIGS_DIR,
    model_var: str = "MODEL",
) -> tuple[Path, str]:
    """The config file ``model`` / ``config`` select, and the line that says so (naming the
    model as ``model_var``, the variable it was given in: ``MODEL`` or ``MODULE``)."""
    own = _own_configs(configs_dir)
    if model is not None and model.lower() not in MODEL_FAMILIES:
        raise UnknownConfigName(
            f"MODEL/MODULE={model!r} is not a model of this project's configs; known: "
            f"{', '.join(MODEL_FAMILIES)}"
        )
    name = config if config else MODEL_FAMILIES[model.lower()] if model else None
    if name is None:
        raise UnknownConfigName("set CONFIG (or MODEL) to select a config by name")
    file = TITAN_CONFIGS.get(name.lower()) or own.get(name.lower())
    if file is None:
        raise UnknownConfigName(
            f"CONFIG={name!r} is not a known config; TorchTitan's names: "
            f"{', '.join(TITAN_CONFIGS)}; this project's: {', '.join(own)} "
            f"(or give a file with CONFIG_FILE)"
        )
    path = configs_dir / file
    given = " ".join(f"{k}={v}" for k, v in ((model_var, model), ("CONFIG", config)) if v)
    return path, f"run_train.sh: {given} -> {path.relative_to(configs_dir.parent)}"


def resolve_env(env: Mapping[str, str]) -> tuple[Path, str]:
    """:func:`resolve` of ``MODEL`` (or ``MODULE``) and ``CONFIG`` in ``env``."""
    model, module = env.get("MODEL") or None, env.get("MODULE") or None
    if model and module and model.lower() != module.lower():
        raise UnknownConfigName(f"MODEL={model!r} and MODULE={module!r} disagree; set one")
    return resolve(
        model or module,
        env.get("CONFIG") or None,
        model_var="MODEL" if model or not module else "MODULE",
    )


def main() -> None:
    try:
        path, line = resolve_env(os.environ)
    except UnknownConfigName as e:
        print(f"torchtitan_ft: config error: {e}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT) from None
    print(line, file=sys.stderr)
    print(path)


if __name__ == "__main__":
    main()
