"""The command line on TorchTitan 0.3.0: ``--module M --config C`` picks a config from M's
config registry, ``--section.key`` flags override it (tyro, with TorchTitan's own rules), and
the trainer's ``Config`` carries this package's ``fault_tolerance`` section, shown by
``--help`` with the same fields and meanings as on 0.2.2 (docs/configuration.md).

A TOML file may override the registry config: ``--job.config_file F`` (as on 0.2.2), with
the command line still winning (:mod:`.toml_config` says which keys it takes).

A registry config names files of TorchTitan's source tree (the test tokenizer and the
``c4_test`` corpus), which a pip install does not have, FlexAttention, which has no backward on
a CPU, and the ``spmd_types`` SPMD backend, which stops FSDP over 2+ ranks on a CPU:
:func:`runnable_here` swaps in this package's tokenizer and corpus, SDPA and
``partial_dtensor``, one line each, only where the original cannot run and the user did not
choose. Both trainers that train a registry config call it (this project's and TorchTitan's
own, :mod:`.titan_trainer`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tyro
from torchtitan.config.manager import ConfigManager, custom_registry
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.trainer import Trainer

from torchtitan_ft.titan.config_cli import (
    config_file_from_args,
    last_config_file_only,
    load_toml,
    without_config_file,
)
from torchtitan_ft.titan.config_schema import SECTION, ConfigError
from torchtitan_ft.titan.releases.v0_3 import toml_config
from torchtitan_ft.titan.training_data import TOKENIZER_DIR

DEFAULT_MODULE, DEFAULT_CONFIG = "llama3", "llama3_debugmodel"
"""The registry config used when the command line names none (0.2.2's embedded default is
the same model, configs/debug_cpu.toml)."""

_DATASET_SWAPS = {"c4_test": "ft_corpus", "c4_validation": "ft_corpus_validation"}
"""TorchTitan's in-tree test corpora and the generated corpora that stand in for them."""


@dataclass(frozen=True)
class ParsedJob:
    """The parsed config and what the user set on the command line."""

    config: Any
    explicit: frozenset[str]
    """``section.key`` of every flag given (``--a.b=x`` and ``--a.b x`` and ``--a.b`` alike) and
    of every value the TOML file set (at its 0.3.0 place)."""
    notes: tuple[str, ...] = ()
    """Lines to log: where the config came from, and what of the TOML was moved or ignored."""


def explicit_flags(args: list[str]) -> frozenset[str]:
    """The ``section.key`` names the flags of ``args`` set (tyro's ``--a.no-b`` is ``a.b``)."""
    names = set()
    for arg in args:
        if not arg.startswith("--") or "." not in arg:
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        section, _, key = name.rpartition(".")
        names.add(f"{section}.{key.removeprefix('no_')}")
    return frozenset(names)


def with_default_config(
    args: list[str], default: tuple[str, str] = (DEFAULT_MODULE, DEFAULT_CONFIG)
) -> list[str]:
    """``args`` plus ``--module``/``--config`` of ``default`` (the TOML file's ``[model]``, else
    :data:`DEFAULT_MODULE`/:data:`DEFAULT_CONFIG`) for whichever of the two is missing."""
    names = {a.split("=", 1)[0] for a in args}
    added = [] if "--module" in names else ["--module", default[0]]
    added += [] if "--config" in names else ["--config", default[1]]
    return [*added, *args]


def registry_names(args: list[str]) -> tuple[str, str]:
    """The ``--module`` and ``--config`` values of ``args`` (both present, see
    :func:`with_default_config`)."""
    found = {}
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name in ("--module", "--config"):
            found[name] = value if sep else (args[i + 1] if i + 1 < len(args) else "")
    return found["--module"], found["--config"]


def as_config_of(config_class: type, registry_config: Any) -> Any:
    """``registry_config`` (a ``Trainer.Config`` from a config registry) as an instance of
    ``config_class`` (its subclass with the ``fault_tolerance`` section, at its defaults).

    Raises :class:`ConfigError` for a registry config of another trainer: its fields would be
    lost."""
    if type(registry_config) is not Trainer.Config:
        raise ConfigError(
            f"the registry config is a {type(registry_config).__qualname__}, another trainer's "
            "config; torchtitan_ft trains configs of torchtitan.trainer.Trainer (expected a "
            "Trainer.Config)"
        )
    values = {f.name: getattr(registry_config, f.name) for f in dataclasses.fields(registry_config)}
    return config_class(**values)


def load_registry_config(
    args: list[str], default: tuple[str, str] = (DEFAULT_MODULE, DEFAULT_CONFIG)
) -> tuple[Any, list[str]]:
    """The registry config ``--module``/``--config`` of ``args`` name (``default`` for whichever
    is missing) and the other arguments. Raises :class:`ConfigError` for a bad name."""
    manager = ConfigManager()
    try:
        return manager._load_config(with_default_config(args, default))
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def parse(args: list[str], config_class: type | None) -> ParsedJob:
    """Parse ``args`` as TorchTitan 0.3.0's ``ConfigManager`` does, into ``config_class`` (with
    the ``fault_tolerance`` section), or into the registry config's own class when None (a
    config of TorchTitan's own trainers, :mod:`.titan_trainer`), with a ``--job.config_file``
    TOML file (the last one given) between the registry config and the flags.

    Raises :class:`ConfigError` for a bad ``--module``/``--config`` and for a TOML file that
    cannot be read or has a bad key or value (named with the file, as on 0.2.2); tyro itself
    exits 2 with its usage message for a bad flag, as TorchTitan's trainer does."""
    args = last_config_file_only(args)
    config_file = config_file_from_args(args)
    args = without_config_file(args)
    translated = None
    default = (DEFAULT_MODULE, DEFAULT_CONFIG)
    if config_file is not None:
        try:
            translated = toml_config.translate(load_toml(config_file))
        except ConfigError as e:
            raise ConfigError(f"{config_file}: {e}") from None
        default = translated.registry or default
    loaded, rest = load_registry_config(args, default)
    config = loaded if config_class is None else as_config_of(config_class, loaded)
    from_toml: frozenset[str] = frozenset()
    notes: list[str] = []
    if translated is not None:
        try:
            from_toml = toml_config.apply(translated, config)
        except ConfigError as e:
            raise ConfigError(f"{config_file}: {e}") from None
        notes = _toml_notes(
            config_file, registry_names(with_default_config(args, default)), translated
        )
    config = tyro.cli(type(config), args=rest, default=config, registry=custom_registry)
    explicit = explicit_flags(rest) | from_toml
    if config_class is not None:
        config.fault_tolerance.explicit_fields = frozenset(
            name.partition(".")[2] for name in explicit if name.startswith(f"{SECTION}.")
        )
    return ParsedJob(config, explicit, tuple(notes))


def _toml_notes(
    config_file: str, registry: tuple[str, str], translated: toml_config.Translated
) -> list[str]:
    module, name = registry
    notes = [
        f"torchtitan_ft: config: registry config {module}/{name}, overridden by {config_file} "
        "(TorchTitan 0.3.0 reads no TOML; torchtitan_ft adds it), then by the command line"
    ]
    if translated.moved:
        moves = ", ".join(f"{old} as {new}" for old, new in translated.moved)
        notes.append(
            f"torchtitan_ft: {config_file}: TorchTitan 0.2.2 keys read at their 0.3.0 place: "
            + moves
        )
    notes += [f"torchtitan_ft: {config_file}: {line}" for line in translated.ignored]
    return notes


def _swap_dataset(section: Any, where: str, log: Callable[[str], None]) -> None:
    name = section.dataset
    if name not in _DATASET_SWAPS or section.dataset_path is not None:
        return

    if os.path.exists(DATASETS[name].path):
        return
    section.dataset = _DATASET_SWAPS[name]
    log(
        f"torchtitan_ft: {where}.dataset={name!r} reads {DATASETS[name].path!r}, which "
        f"TorchTitan's source tree has and this install does not; using {section.dataset!r}, "
        "the generated corpus (set the flag to choose)"
    )


def group_ranks() -> int:
    """The processes of this replica group (torchrun's ``WORLD_SIZE``; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def runnable_here(parsed: ParsedJob, cuda: bool, ranks: int, log: Callable[[str], None]) -> None:
    """Make ``parsed.config`` (in place) run on this machine (``cuda``: whether it has a GPU;
    ``ranks``: the processes of the replica group, torchrun's ``WORLD_SIZE``) where the
    registry's values cannot and the user did not set them (see the module docstring); each
    change is logged as one line."""
    config, explicit = parsed.config, parsed.explicit
    path = config.hf_assets_path
    if "hf_assets_path" not in {n.rpartition(".")[2] for n in explicit} and not os.path.isdir(path):
        config.hf_assets_path = str(TOKENIZER_DIR)
        log(
            f"torchtitan_ft: hf_assets_path={path!r} is not a directory here (it is in "
            f"TorchTitan's source tree); using the project's tokenizer {config.hf_assets_path} "
            "(set --hf_assets_path to choose)"
        )
    if "dataloader.dataset" not in explicit:
        _swap_dataset(config.dataloader, "dataloader", log)
    if "validator.dataloader.dataset" not in explicit:
        _swap_dataset(config.validator.dataloader, "validator.dataloader", log)
    if not cuda:
        _sdpa_for_flex(config, log)
    partial_dtensor_for_spmd_types(parsed, cuda, ranks, log)


def _sdpa_for_flex(config: Any, log: Callable[[str], None]) -> None:
    swapped = 0
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        if parent is None:
            continue
        if isinstance(attr, int):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
        swapped += 1
    if swapped:
        log(
            f"torchtitan_ft: CPU: FlexAttention has no backward on a CPU; {swapped} attention "
            "module(s) use SDPA instead (causal over the whole sequence, not per document, as "
            "TorchTitan 0.2.2's llama3 did)"
        )


SPMD_TYPES_ON_CPU = (
    "torchtitan_ft: CPU: parallelism.spmd_backend='spmd_types' (TorchTitan 0.3.0's default) "
    "stops FSDP over {ranks} ranks on this torch ('all parameters must be DTensors on the full "
    "SPMD mesh', without fault tolerance too); using 'partial_dtensor', which shards as "
    "TorchTitan 0.2.2 did (set --parallelism.spmd_backend to choose)"
)
SPMD_TYPES_CHOSEN = (
    "torchtitan_ft: CPU: parallelism.spmd_backend='spmd_types' kept as set; with {ranks} ranks "
    "FSDP is expected to stop on this torch ('all parameters must be DTensors on the full SPMD "
    "mesh'), which --parallelism.spmd_backend=partial_dtensor avoids"
)


def partial_dtensor_for_spmd_types(
    parsed: ParsedJob, cuda: bool, ranks: int, log: Callable[[str], None]
) -> None:
    """On a CPU with ``ranks`` > 1, ``parallelism.spmd_backend="partial_dtensor"`` where the
    config says ``"spmd_types"`` (in place; one line). A ``spmd_types`` the user set (flag or
    TOML) is kept, with one line saying what to expect: another torch may train with it."""
    parallelism = parsed.config.parallelism
    if cuda or ranks < 2 or parallelism.spmd_backend != "spmd_types":
        return
    if "parallelism.spmd_backend" in parsed.explicit:
        log(SPMD_TYPES_CHOSEN.format(ranks=ranks))
        return
    parallelism.spmd_backend = "partial_dtensor"
    log(SPMD_TYPES_ON_CPU.format(ranks=ranks))
