"""Reading the job config from TOML (``--job.config_file``) and the command line, in every
trainer process before any process group exists: TorchTitan's ``ConfigManager`` (tyro) does
the merge, this module makes every mistake one :class:`ConfigError` line naming the key or
flag and what it takes, before tyro sees it (TOML: :func:`check_toml_values`, command line:
:func:`check_cli_args`). The parse changes nothing the user wrote; values the plugin derives
for the trainer are :func:`~torchtitan_ft.titan.preflight.trainer_job_config`'s.
"""

import contextlib
import difflib
import importlib
import io
import json
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

from torchtitan.config import ConfigManager

from torchtitan_ft.titan.config_schema import (
    SECTION,
    ConfigError,
    JobConfig,
    expected,
    type_matches,
)
from torchtitan_ft.titan.preflight import validate_job_config

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib


@dataclass(frozen=True)
class ParsedJob:
    """A parsed command line: the config as the user wrote it and what the parse saw of it."""

    config: JobConfig
    """TOML and command line over the defaults, validated, unchanged."""
    explicit_param_dtype: bool
    """Whether the TOML or the command line set ``training.mixed_precision_param``."""


def parse_job(args: list[str] | None = None) -> ParsedJob:
    """Parse TOML (``--job.config_file``) and CLI (default ``sys.argv[1:]``), then validate.

    Precedence CLI > TOML > defaults (TorchTitan's ``ConfigManager`` does the merge); of
    several ``--job.config_file``, the last is used. A config file that is missing or not
    TOML, an unknown key or flag, a value of the wrong type and a bad value raise
    :class:`ConfigError` with one line naming it.
    """
    args = last_config_file_only(list(sys.argv[1:] if args is None else args))
    config_file = config_file_from_args(args)
    toml_values = load_toml(config_file) if config_file is not None else {}
    custom_module = custom_config_module(args, toml_values)
    try:
        check_toml_values(toml_values, allow_unknown=custom_module is not None)
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}") from None
    args, fragments = take_fragments_flag(args)
    check_cli_args(args, _config_classes(custom_module))
    config = parse_cli(args)
    if fragments is not None:
        config.fault_tolerance.module_fqns_per_model_fragment = fragments
    # What the user set first: the timeout order holds a stall timeout only where it is set.
    config.fault_tolerance.explicit_fields = explicit_fields(SECTION, toml_values, args)
    validate_job_config(config)
    explicit_dtype = "mixed_precision_param" in explicit_fields("training", toml_values, args)
    return ParsedJob(config, explicit_dtype)


def explicit_fields(section: str, toml_values: dict, cli_args: list[str]) -> frozenset[str]:
    """The fields of ``section`` the user set: keys of its TOML table and ``--section.name``
    flags (``-`` for ``_``, and tyro's ``no_``/``no-`` form of a boolean, as tyro allows)."""
    names = set()
    for arg in cli_args:
        flag = arg.partition("=")[0].replace("-", "_")
        head, dot, name = flag.partition(".")
        if dot and head == f"__{section}":
            names.add(name)
            if name.startswith("no_"):
                names.add(name[3:])
    table = toml_values.get(section)
    if isinstance(table, dict):
        names.update(table)
    return frozenset(names)


def parse_job_config(args: list[str] | None = None) -> JobConfig:
    """:func:`parse_job`'s config: what the user wrote, validated."""
    return parse_job(args).config


# --- the config file ----------------------------------------------------------------------------

_CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
_CUSTOM_MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")


def config_file_from_args(args: list[str]) -> str | None:
    """The last ``--job.config_file`` value in ``args`` (``--flag value`` or ``--flag=value``)."""
    found = _config_file_flags(args)
    return found[-1][2] if found else None


def last_config_file_only(args: list[str]) -> list[str]:
    """``args`` without every ``--job.config_file`` but the last, so that the last one wins like
    any repeated flag (``run_train.sh`` puts ``CONFIG_FILE`` first; a user's own
    ``--job.config_file`` comes after it). TorchTitan's ``ConfigManager`` reads the first."""
    dropped = {i for start, end, _ in _config_file_flags(args)[:-1] for i in range(start, end)}
    return [arg for i, arg in enumerate(args) if i not in dropped]


def without_config_file(args: list[str]) -> list[str]:
    """``args`` without any ``--job.config_file`` (for a parser that does not know the flag)."""
    dropped = {i for start, end, _ in _config_file_flags(args) for i in range(start, end)}
    return [arg for i, arg in enumerate(args) if i not in dropped]


def _config_file_flags(args: list[str]) -> list[tuple[int, int, str]]:
    """``(start, end, value)`` of each ``--job.config_file`` in ``args``: ``args[start:end]``."""
    found = []
    for i, arg in enumerate(args):
        key, sep, value = arg.partition("=")
        if key not in _CONFIG_FILE_FLAGS:
            continue
        if sep:
            found.append((i, i + 1, value))
        elif i + 1 < len(args):
            found.append((i, i + 2, args[i + 1]))
    return found


def load_toml(path: str) -> dict[str, Any]:
    """The TOML file ``path`` as a dict, or a :class:`ConfigError` naming the file (and, for a
    syntax error, the line and column)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        where = "" if os.path.isabs(path) else f" (from the working directory {os.getcwd()})"
        raise ConfigError(
            f"--job.config_file {path!r}{where} does not exist: pass the path of a TOML file"
        ) from None
    except OSError as e:
        raise ConfigError(f"--job.config_file {path!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--job.config_file {path!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--job.config_file {path!r} is not UTF-8 text (bad byte at offset {e.start})"
        ) from None


def check_toml_values(
    values: dict[str, Any], cls: type = JobConfig, prefix: str = "", allow_unknown: bool = False
) -> None:
    """Raise :class:`ConfigError` naming the first unknown key (dotted path, with a hint) or
    the first value whose type does not fit its field (scalar fields: bool, int, float, str,
    ``Literal`` and unions of these). ``allow_unknown`` lets unknown keys through (a custom
    config module adds fields this class does not know)."""
    known = {f.name for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in known:
            if allow_unknown:
                continue
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {path!r}{hint}")
        if is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} must be a table ([{path}]), got {value!r}")
            check_toml_values(value, hints[key], f"{path}.", allow_unknown)
            continue
        ok, expected = type_matches(value, hints[key])
        if not ok:
            raise ConfigError(f"{path}={value!r} is invalid: expected {expected}")


# --- the command line ---------------------------------------------------------------------------


def custom_config_module(args: list[str], toml_values: dict[str, Any]) -> str | None:
    """The ``--job.custom_config_module`` of ``args``, else of the TOML file, if any (where
    TorchTitan's ``ConfigManager`` looks for it)."""
    for i, arg in enumerate(args):
        flag, sep, value = arg.partition("=")
        if flag in _CUSTOM_MODULE_FLAGS:
            return value if sep else (args[i + 1] if i + 1 < len(args) else None)
    job_values = toml_values.get("job")
    if isinstance(job_values, dict) and job_values.get("custom_config_module"):
        return str(job_values["custom_config_module"])
    return None


def _config_classes(custom_module: str | None) -> list[type]:
    """:class:`JobConfig`, and the ``JobConfig`` of a custom config module TorchTitan merges on
    top (its fields win); none when the module cannot be imported (nothing is checked then:
    TorchTitan's parse reports the import error)."""
    if custom_module is None:
        return [JobConfig]
    try:
        return [JobConfig, importlib.import_module(custom_module).JobConfig]
    except (ImportError, AttributeError):
        return []


def option_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every ``section.field`` of the dataclass ``cls`` (nested sections included) and its
    type."""
    hints = typing.get_type_hints(cls)
    options: dict[str, Any] = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            options.update(option_types(hints[f.name], f"{prefix}{f.name}."))
        else:
            options[f"{prefix}{f.name}"] = hints[f.name]
    return options


_HELP_FLAGS = ("-h", "--help")


def check_cli_args(args: list[str], classes: list[type]) -> None:
    """Raise :class:`ConfigError` for the first word of ``args`` the parse would reject, named
    as the user wrote it with what was expected: an unknown flag (with the closest known one),
    a value given to a bool flag, a flag without its value, a value its field's type does not
    take, a stray word.

    The grammar is tyro's as TorchTitan configures it: ``--section.field=value`` or
    ``--section.field value`` (``-`` or ``_`` in names), ``--section.flag`` /
    ``--section.no-flag`` for a bool, a list one comma-separated value. ``classes`` are the
    config classes whose flags are known (later ones win; none: nothing is checked). The check
    stops at ``--help`` and at a field of a type it does not know; what it lets through is left
    to tyro (see :func:`parse_cli`).
    """
    options: dict[str, Any] = {}
    for cls in classes:
        options.update(option_types(cls))
    if not options:
        return
    i = 0
    while i < len(args):
        word = args[i]
        if word in _HELP_FLAGS:
            return
        if not word.startswith("--"):
            after = f" after {' '.join(args[max(i - 2, 0) : i])}" if i else ""
            raise ConfigError(
                f"unexpected argument {word!r}{after}: options are --section.field=value, and "
                "a list is one comma-separated value (e.g. --compile.components=model,loss)"
            )
        flag, sep, value = word.partition("=")
        name = flag[2:].replace("-", "_")
        head, _, last = name.rpartition(".")
        annotation = options.get(name)
        negated = annotation is None and last.startswith("no_")
        if annotation is bool or (negated and options.get(f"{head}.{last[3:]}") is bool):
            if sep:
                bare = last[3:] if negated else last
                raise ConfigError(
                    f"{flag} is a flag and takes no value: write {flag[: -len(last)]}{bare} or "
                    f"{flag[: -len(last)]}no-{bare}"
                )
            i += 1
            continue
        if annotation is None:
            raise ConfigError(_unknown_flag(flag, options))
        if not sep:
            if i + 1 == len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{flag} needs a value: expected {expected(annotation)}")
            value, i = args[i + 1], i + 1
        i += 1
        fits = text_fits(value, annotation)
        if fits is None:
            return
        if not fits:
            raise ConfigError(f"{flag}={value!r} is invalid: expected {expected(annotation)}")


def text_fits(text: str, annotation: Any) -> bool | None:
    """Whether the command-line text ``text`` is a value of type ``annotation`` as tyro reads
    it (``None`` for None, a list as one comma-separated word); None for a type this does not
    know."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return text in [str(c) for c in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType):
        results = [text_fits(text, arg) for arg in typing.get_args(annotation)]
        return None if None in results else any(results)
    if annotation is type(None):
        return text == "None"
    if annotation is str or annotation == list[str]:
        return True
    for kind in (int, float):
        if annotation is kind:
            try:
                kind(text)
            except ValueError:
                return False
            return True
    return None


def _unknown_flag(flag: str, options: dict[str, Any]) -> str:
    wanted = flag.lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(wanted, list(options), n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return f"unknown flag {flag}{hint} (see --help)"


def parse_cli(args: list[str]) -> JobConfig:
    """``args`` parsed by TorchTitan's ``ConfigManager`` (tyro, with TOML under them).

    Should tyro still reject the command line (a mistake :func:`check_cli_args` does not
    know), the error box it printed is squeezed into one :class:`ConfigError` line instead of
    tyro's exit. Everything else tyro writes (``--help``, warnings) passes.
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return ConfigManager(config_cls=JobConfig).parse_args(args)
    except SystemExit as e:
        if e.code != _TYRO_ERROR_EXIT:
            raise
        box, captured = captured.getvalue(), io.StringIO()
        raise ConfigError(f"invalid command line: {_squeezed(box)}") from None
    finally:
        sys.stderr.write(captured.getvalue())


_TYRO_ERROR_EXIT = 2
"""tyro's exit status after it printed a parse error (``--help`` exits with 0)."""


def _squeezed(box: str) -> str:
    """tyro's error box as one line: no colours, frame, argument help or help footer."""
    text = re.sub(r"\x1b\[[0-9;]*m|[\u2500-\u257f]|-{3,}", " ", box)
    text = re.split(r"Argument helptext:|Perhaps you meant:|For full helptext", text)[0]
    return " ".join(text.split())


_FRAGMENTS_FLAG = f"--{SECTION}.module_fqns_per_model_fragment"


def take_fragments_flag(args: list[str]) -> tuple[list[str], list[list[str]] | None]:
    """``args`` without ``--fault_tolerance.module_fqns_per_model_fragment``, and the last
    value it had, parsed: fragments separated by ";" and module names by "," (``"a,b;c"``), or
    a JSON list of lists. tyro cannot read a list of lists from the command line."""
    kept: list[str] = []
    value: str | None = None
    i = 0
    while i < len(args):
        flag, sep, text = args[i].partition("=")
        if flag.replace("-", "_") != _FRAGMENTS_FLAG.replace("-", "_"):
            kept.append(args[i])
            i += 1
            continue
        if sep:
            value, i = text, i + 1
        elif i + 1 < len(args):
            value, i = args[i + 1], i + 2
        else:
            example = "'tok_embeddings,layers.0;layers.1,norm,output'"
            raise ConfigError(f"{_FRAGMENTS_FLAG} needs a value, e.g. {example}")
    return kept, None if value is None else parse_fragments(value)


def parse_fragments(text: str) -> list[list[str]]:
    """``"a,b;c"`` or ``'[["a", "b"], ["c"]]'`` as ``[["a", "b"], ["c"]]``."""
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{_FRAGMENTS_FLAG}={text!r} is not a JSON list of lists: {e}"
            ) from None
    return [[n.strip() for n in part.split(",") if n.strip()] for part in text.split(";")]
