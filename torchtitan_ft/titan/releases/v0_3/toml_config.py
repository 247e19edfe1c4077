"""A TOML file over a registry config on TorchTitan 0.3.0 (``--job.config_file F``; 0.3.0 itself
reads no TOML): precedence command line > TOML > registry config (docs/titan.md, "TorchTitan
releases").

The TOML's keys are the 0.3.0 config's fields (``[training] seq_len``, ``[dataloader] dataset``,
top-level ``dump_folder``), and the ``[fault_tolerance]`` section is checked by the same reader
as on 0.2.2 (:func:`~torchtitan_ft.titan.config_cli.check_toml_values`: the same one-line
errors). A 0.2.2 TOML (this repository's ``configs/*.toml``) is read too:

* keys that moved are read at their 0.3.0 place (:data:`MOVED`, :data:`MOVED_SECTIONS`), said
  in one line;
* ``[model] name``/``flavor`` choose the registry config (``--module name --config
  name_flavor``) when the command line names none;
* ``[optimizer] name, lr, eps, beta1, beta2, weight_decay`` set the registry config's one
  parameter group;
* ``[activation_checkpoint] mode`` picks the policy class;
* ``[job] description`` is ignored (0.3.0 has no such field), said in one line;
* the rest of 0.2.2's keys stop with one line naming the key and its 0.3.0 equivalent
  (:data:`REFUSED`).

:func:`translate` (pure, no TorchTitan) does the renames; :func:`apply` checks and writes the
values onto the loaded registry config.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any

from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

from torchtitan_ft.titan.config_cli import check_toml_values
from torchtitan_ft.titan.config_schema import SECTION, ConfigError, FaultTolerance, type_matches

MOVED = {
    "job.dump_folder": "dump_folder",
    "model.hf_assets_path": "hf_assets_path",
    "training.dataset": "dataloader.dataset",
    "training.dataset_path": "dataloader.dataset_path",
    "validation.dataset": "validator.dataloader.dataset",
    "validation.dataset_path": "validator.dataloader.dataset_path",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": (
        "activation_checkpoint.force_recompute_mm_shapes_by_fqns"
    ),
}
"""0.2.2 key -> the 0.3.0 field it is read as."""

MOVED_SECTIONS = {"profiling": "profiler", "validation": "validator"}
"""0.2.2 section -> 0.3.0 section with the same field names (keys not in :data:`MOVED`)."""

IGNORED = {"job.description": "0.3.0 has no run description"}
"""0.2.2 keys read and ignored (one line each), and why."""

REFUSED = {
    "model": "the registry config's model_spec (choose it with --module/--config)",
    "model.tokenizer_path": "hf_assets_path (a directory with the tokenizer files)",
    "model.converters": "a registry config with the converters (e.g. --config "
    "llama3_debugmodel_float8)",
    "float8": "a registry config with float8 converters (e.g. --config llama3_debugmodel_float8)",
    "mx": "a registry config with MX converters (e.g. --config llama3_8b_mxfp8)",
    "job": "0.3.0 has no [job] section (dump_folder is top-level; the rest: debug.*, "
    "--module/--config)",
    "job.custom_config_module": "--module (a module with a config_registry)",
    "job.print_args": "debug.print_config",
    "experimental": "override.imports (modules imported before the config is built)",
    "optimizer.param_groups": "a registry config's param groups (Python); TOML sets name, lr, "
    "eps, beta1, beta2, weight_decay of a config with one group",
    "activation_checkpoint.selective_ac_option": "0.3.0's selective policy is per-op only "
    '(selective_ac_option = "op", or mode = "full")',
    "memory_estimation": "none in 0.3.0",
    "model_spec": "--module/--config (a registry config)",
}
"""0.2.2 keys (or whole sections) with no place in the 0.3.0 config -> their 0.3.0 equivalent,
in words. A key is looked up before its section."""

OPTIMIZER_KEYS = {
    "name": "optimizer_name",
    "lr": "lr",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "beta1": "betas",
    "beta2": "betas",
}
"""0.2.2's ``[optimizer]`` keys -> where they go in 0.3.0's parameter group."""

AC_MODES = ("none", "selective", "full", "memory_budget")
"""0.2.2's ``activation_checkpoint.mode`` values, each a 0.3.0 policy class (or none)."""


@dataclass(frozen=True)
class Translated:
    """A TOML file in 0.3.0's shape (:func:`translate`)."""

    values: dict[str, Any]
    """Tables and values at their 0.3.0 places; ``optimizer`` and ``activation_checkpoint.mode``
    are left for :func:`apply`."""
    registry: tuple[str, str] | None = None
    """``(module, config)`` named by ``[model] name``/``flavor``."""
    moved: tuple[tuple[str, str], ...] = ()
    """``(0.2.2 key, 0.3.0 field)`` of every key read at another place."""
    ignored: tuple[str, ...] = field(default=())
    """One line for each key read and ignored."""


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        *sections, key = path.split(".")
        table = nested
        for section in sections:
            table = table.setdefault(section, {})
        table[key] = value
    return nested


def _refusal(path: str) -> str | None:
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        found = REFUSED.get(".".join(parts[:end]))
        if found is not None:
            return found
    return None


def translate(values: dict[str, Any]) -> Translated:
    """``values`` (a TOML file) in 0.3.0's shape: 0.2.2 keys moved or refused (see the module
    docstring). Raises :class:`ConfigError` naming the first refused key and its 0.3.0
    equivalent."""
    flat = _flatten(values)
    model = {k: flat.pop(f"model.{k}") for k in ("name", "flavor") if f"model.{k}" in flat}
    registry = None
    if model:
        if set(model) != {"name", "flavor"}:
            raise ConfigError(
                "[model] name and flavor go together on TorchTitan 0.3.0: they name the registry "
                f"config --module <name> --config <name>_<flavor>; got only {sorted(model)}"
            )
        for key, value in model.items():
            if not isinstance(value, str):
                raise ConfigError(f"model.{key}={value!r} is invalid: expected a string")
        registry = (model["name"], f"{model['name']}_{model['flavor'].lower()}")
    kept: dict[str, Any] = {}
    moved: list[tuple[str, str]] = []
    ignored: list[str] = []
    for path, value in flat.items():
        if path in IGNORED:
            ignored.append(f"{path} is ignored: {IGNORED[path]}")
            continue
        if path == "activation_checkpoint.selective_ac_option" and value == "op":
            ignored.append(f"{path}='op' is ignored: 0.3.0's selective policy is per-op")
            continue
        section, _, rest = path.partition(".")
        if section == "optimizer" and path != "optimizer.param_groups":
            kept[path] = value
            continue
        new = MOVED.get(path)
        if new is None and rest and section in MOVED_SECTIONS:
            new = f"{MOVED_SECTIONS[section]}.{rest}"
        if new is not None:
            moved.append((path, new))
            kept[new] = value
            continue
        instead = _refusal(path)
        if instead is not None:
            raise ConfigError(f"config key {path!r} is TorchTitan 0.2.2's; on 0.3.0 use {instead}")
        kept[path] = value
    return Translated(_nest(kept), registry, tuple(moved), tuple(ignored))


def _set_optimizer(config: Any, values: dict[str, Any]) -> None:
    """0.2.2's ``[optimizer]`` keys onto the registry config's one parameter group."""
    if "implementation" in values:
        check_values({"implementation": values["implementation"]}, config.optimizer, "optimizer.")
        config.optimizer.implementation = values.pop("implementation")
    unknown = [k for k in values if k not in OPTIMIZER_KEYS]
    if unknown:
        known = [*OPTIMIZER_KEYS, "implementation"]
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean optimizer.{close[0]}?" if close else ""
        raise ConfigError(
            f"unknown config key 'optimizer.{unknown[0]}'{hint} (TOML sets {', '.join(known)} "
            "of the registry config's parameter group; anything else: optimizer.param_groups "
            "in a registry config)"
        )
    if not values:
        return
    groups = config.optimizer.param_groups
    if len(groups) != 1:
        raise ConfigError(
            f"[optimizer] {', '.join(values)}: the registry config has {len(groups)} parameter "
            "groups; TOML sets the one group of a registry config that has one (set "
            "optimizer.param_groups in a registry config instead)"
        )
    group = groups[0]
    for key, value in values.items():
        want = str if key == "name" else float
        ok, words = type_matches(value, want)
        if not ok:
            raise ConfigError(f"optimizer.{key}={value!r} is invalid: expected {words}")
    kwargs = dict(group.optimizer_kwargs)
    if "name" in values:
        group.optimizer_name = values["name"]
    for key in ("lr", "eps", "weight_decay"):
        if key in values:
            kwargs[key] = float(values[key])
    if "beta1" in values or "beta2" in values:
        beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
        kwargs["betas"] = (float(values.get("beta1", beta1)), float(values.get("beta2", beta2)))
    group.optimizer_kwargs = kwargs


def _activation_checkpoint(mode: Any) -> Any:
    """0.3.0's policy config for 0.2.2's ``activation_checkpoint.mode``."""
    classes = {"selective": SelectiveAC, "full": FullAC, "memory_budget": MemoryBudgetAC}
    if mode == "none":
        return None
    if mode not in classes:
        choices = ", ".join(repr(m) for m in AC_MODES)
        raise ConfigError(
            f"activation_checkpoint.mode={mode!r} is invalid: expected one of {choices}"
        )
    return classes[mode].Config()


def check_values(values: dict[str, Any], instance: Any, prefix: str = "") -> None:
    """Raise :class:`ConfigError` for the first key of ``values`` that is not a field of the
    config ``instance`` (with the closest one) or whose value its field's type does not take,
    in the words of 0.2.2's reader. Sections are checked against the class of the value the
    registry config holds (a subclass of the declared one, e.g. the HuggingFace dataloader's
    config with its ``dataset`` field); ``fault_tolerance`` by 0.2.2's reader itself."""
    known = [f.name for f in dataclasses.fields(instance)]
    hints = typing.get_type_hints(type(instance))
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            instead = _refusal(path)
            if instead is not None:
                raise ConfigError(
                    f"config key {path!r} is TorchTitan 0.2.2's; on 0.3.0 use {instead}"
                )
            raise ConfigError(f"unknown config key {path!r}{hint}")
        current = getattr(instance, key)
        if path == SECTION:
            if not isinstance(value, dict):
                raise ConfigError(f"{path} must be a table ([{path}]), got {value!r}")
            check_toml_values(value, FaultTolerance, f"{path}.")
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} must be a table ([{path}]), got {value!r}")
            check_values(value, current, f"{path}.")
            continue
        if isinstance(value, dict) and current is None:
            raise ConfigError(
                f"[{path}] sets fields of what the config leaves unset (None here); set it "
                f"first (e.g. {path}.mode where it picks a class)"
            )
        if isinstance(value, dict):
            raise ConfigError(f"{path} is a value, not a table: write {path} = ...")
        ok, words = type_matches(value, hints[key])
        if not ok:
            raise ConfigError(f"{path}={value!r} is invalid: expected {words}")


def _write(values: dict[str, Any], instance: Any) -> None:
    for key, value in values.items():
        current = getattr(instance, key)
        if isinstance(value, dict) and (dataclasses.is_dataclass(current)):
            _write(value, current)
        else:
            setattr(instance, key, value)


def apply(translated: Translated, config: Any) -> frozenset[str]:
    """Write ``translated`` onto ``config`` (the registry config, in place) after checking every
    key and value; returns the ``section.key`` paths set (what the user chose)."""
    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in translated.values.items()}
    ac = values.get("activation_checkpoint")
    if isinstance(ac, dict) and "mode" in ac:
        config.activation_checkpoint = _activation_checkpoint(ac.pop("mode"))
        if not ac:
            values.pop("activation_checkpoint")
    optimizer = values.pop("optimizer", None)
    if optimizer is not None:
        if not isinstance(optimizer, dict):
            raise ConfigError(f"optimizer must be a table ([optimizer]), got {optimizer!r}")
        _set_optimizer(config, optimizer)
    check_values(values, config)
    _write(values, config)
    return frozenset(_flatten(translated.values))
