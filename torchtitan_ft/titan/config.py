"""The ``[fault_tolerance]`` config section (TorchTitan 0.2.2's, extended) and the reading and
checking of TOML and command line, run by the entry point in every trainer process before any
process group exists (docs/configuration.md; how fields map onto the Manager: docs/titan.md).

:class:`FaultTolerance` subclasses TorchTitan's own section, which outside code reads (e.g.
TensorBoard logs go under ``replica_<id>``): its seven fields keep their names, the new ones
follow. :class:`JobConfig` is TorchTitan's with this section type; the entry point owns the
parse, so no ``--job.custom_config_module`` is needed and methods and ``isinstance`` survive
(a custom config module still merges on top). No ``from __future__ import annotations`` here:
TorchTitan's TOML loader reads ``dataclasses.Field.type`` and needs real classes there.
"""

import contextlib
import difflib
import io
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from torchtitan.config import ConfigManager
from torchtitan.config import FaultTolerance as TitanFaultTolerance
from torchtitan.config import JobConfig as TitanJobConfig

from torchtitan_ft.manager.settings import (
    DEFAULT_LIGHTHOUSE_ADDR,
    LIGHTHOUSE_ENV,
    is_lighthouse_url,
)
from torchtitan_ft.semi_sync.config import QuorumMode, SyncMethod, check_quorum_mode
from torchtitan_ft.titan.compute_dtype import (
    DtypeChoice,
    choose_param_dtype,
    probe_cpu,
    set_explicitly,
)

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

try:  # tyro's parse-error events and hook, private in tyro 1.0 (without: see parse_cli)
    from tyro import _errors as tyro_errors
except ImportError:  # pragma: no cover
    tyro_errors = None

ProcessGroupBackend = Literal["gloo", "nccl"]
QuorumModeName = Literal[tuple(sorted(m.value for m in QuorumMode))]  # QuorumMode, as TOML text
WorldSizeModeName = Literal["dynamic", "fixed_with_spares"]
CheckpointTransportName = Literal["http", "pg"]
OuterOptimizerName = Literal["sgd", "adamw"]


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and what is expected."""


@dataclass
class FaultTolerance(TitanFaultTolerance):
    """Per-step fault tolerance across replica groups (TorchTitan's section, extended)."""

    enable: bool = False
    """
    Turn on fault tolerance. Default off: the job is then plain TorchTitan (no lighthouse, no
    Manager). When on, this torchrun job is one replica group among ``group_size``; the FT
    replica axis is managed (it may shrink and grow every step), so
    ``parallelism.data_parallel_replicate_degree`` must stay 1 (the inner mesh shards).
    """

    process_group: ProcessGroupBackend = "gloo"
    """
    Backend of the cross-replica-group process group ("gloo" or "nccl"). Default "gloo", the
    only one testable on CPU. "nccl" is faster on GPUs but its failure detection relies on
    timeouts. Applies when ``enable``.
    """

    process_group_timeout_ms: int = 10000
    """
    Timeout of one cross-replica collective, in milliseconds. Default 10000. A dead peer that
    is not detected by a connection error is detected after this long, and the step is
    discarded. Lower = faster failover, but too low aborts slow healthy steps. Must not exceed
    ``step_timeout_ms``. Applies when ``enable``.
    """

    replica_id: int = 0
    """
    Index of this replica group, 0 <= replica_id < group_size. Default 0. Used as the Manager's
    replica id (a per-process suffix is added so a restart is a new member) and to pick this
    group's slice of the data. Applies when ``enable``.
    """

    group_size: int = 0
    """
    Number of replica groups the job is planned with (at most this many train at once).
    Default 0 = unset, which is an error when ``enable``. The dataset is split into
    ``group_size`` x (data-parallel degree inside a group) slices, so all groups must agree on it.
    """

    min_replica_size: int = 1
    """
    Minimum number of replica groups in a quorum for a step to commit. Default 1: train on as
    long as one group is alive. Higher values protect against training on too few replicas at
    the cost of stalling when more fail. 1 <= min_replica_size <= group_size when ``enable``.
    """

    semi_sync_method: str | None = None
    """
    How replica groups synchronise. None (default, also "none") = every step's gradients are
    averaged across groups and committed together (FT-HSDP); "local_sgd" = each group steps
    alone and parameters are averaged every ``sync_steps``; "diloco" = each group runs the
    inner optimizer and an outer optimizer applies averaged pseudo-gradients every
    ``sync_steps`` (Streaming DiLoCo when ``num_fragments`` > 1). Case-insensitive, as in
    TorchTitan (which lowercases it). Semi-sync trades convergence per step for far less
    communication, and implies a synchronous quorum (see ``quorum_mode``). Applies when
    ``enable``.
    """

    lighthouse_addr: str = ""
    """
    Lighthouse URL, e.g. "http://lighthouse-host:29510". Default "" = the ``TORCHFT_LIGHTHOUSE``
    env var, else "http://localhost:29510". An explicit value always wins over the env var.
    Only group rank 0 talks to the lighthouse. Applies when ``enable``.
    """

    hostname: str = ""
    """
    The host name other replica groups dial to reach this group's servers. They are the
    ManagerServer (group rank 0, advertised as ``http://<hostname>:<port>`` to the lighthouse
    and to healing peers) and, with ``checkpoint_transport = "http"``, every rank's checkpoint
    server (also the group's TCPStore host when ``MASTER_ADDR`` is unset). Default "" =
    ``socket.gethostname()``, which must resolve to an address the other machines reach. It also
    decides where the servers listen: a loopback name ("127.0.0.1", "localhost", "::1") keeps
    the ManagerServer on loopback (otherwise it listens on all interfaces); the checkpoint
    server listens on the address ``hostname`` resolves to. Use "127.0.0.1" for single-machine
    runs and tests; with groups on several machines, each machine's address on the network
    they share. It must be an address of this machine (checked at start-up), and a loopback
    one stops this group at its first quorum with a group on another machine (even if it
    trained before, alone or beside groups of its own machine), naming the address to set.
    Applies when ``enable``.
    """

    step_timeout_ms: int = 60000
    """
    Timeout of the Manager's per-step operations (gradient all-reduce future, commit vote,
    checkpoint send/receive when healing), in milliseconds. Default 60000 (torchft's
    ``timeout``). Must be >= ``process_group_timeout_ms``; raise it when healing large states
    over slow links. Applies when ``enable``.
    """

    quorum_timeout_ms: int = 60000
    """
    How long one quorum request may wait for the lighthouse to issue a quorum, in
    milliseconds. Default 60000 (torchft's ``quorum_timeout``). It should exceed the
    lighthouse's ``--join_timeout_ms`` when replacements must be waited for. Must be
    >= ``connect_timeout_ms``. Applies when ``enable``.
    """

    connect_timeout_ms: int = 60000
    """
    Timeout of the connections made at start-up and when healing, in milliseconds. They are:
    ranks > 0 waiting for group rank 0 to publish its ManagerServer address in the group's
    TCPStore, connecting to that TCPStore and to the group's ManagerServer, and, when healing,
    connecting to the donor's ManagerServer. Default 60000 (torchft's ``connect_timeout``). It
    does not bound a quorum request to a lighthouse that cannot be reached: that waits
    ``quorum_timeout_ms``. Lower = a group rank 0 that never comes up is reported sooner; too
    low fails a slow start-up of rank 0. Must be <= ``quorum_timeout_ms``. Applies when
    ``enable``.
    """

    quorum_mode: QuorumModeName | None = None
    """
    "async": the quorum is requested on a background thread, overlapped with the forward
    pass; "sync": the step waits for the quorum before the forward. Default None = "sync"
    with a ``semi_sync_method`` (which only asks at sync points and must heal before it
    trains, as TorchTitan's FT does), else "async" (hides the quorum latency). Setting
    "async" with a semi-sync method is an error. Applies when ``enable``.
    """

    world_size_mode: WorldSizeModeName = "dynamic"
    """
    "dynamic" (default): every healthy group in the quorum participates; "fixed_with_spares":
    exactly ``min_replica_size`` groups participate and the rest are hot spares (keeps the
    global batch size constant, wastes the spares' compute). Applies when ``enable``.
    """

    init_sync: bool = True
    """
    At step 0, make every replica group load the weights of the primary group (default True),
    so all start identical even if initialised differently. Turn off only when every group
    initialises deterministically from the same seed, to skip the start-up transfer. Applies
    when ``enable``.
    """

    max_retries: int | None = None
    """
    Maximum number of consecutive failed commits before the Manager raises and the process
    exits. Default None = unlimited (set it on the CLI with ``None``; omit it in TOML). A limit
    turns a permanently broken group into a restart. Applies when ``enable``.
    """

    quorum_retries: int = 0
    """
    Extra attempts of a quorum request that failed with an error, within the same
    ``quorum_timeout_ms``. Group rank 0's ManagerServer asks the lighthouse again after an
    error (e.g. the lighthouse rejected the request or the call broke), after a backoff of
    0.1 s doubling up to 1 s. Default 0. All attempts share the one
    ``quorum_timeout_ms`` deadline, so retries never lengthen the wait; an unreachable
    lighthouse (down or restarting) is retried until that deadline whatever this value is.
    When the quorum finally fails, ``should_commit`` raises and the process exits (torchrun
    may restart it). Raise it to ride out transient lighthouse errors. Applies when
    ``enable``.
    """

    checkpoint_transport: CheckpointTransportName = "http"
    """
    How a recovering replica group receives live state from a healthy one: "http" (default) or
    "pg". Each rank receives its own FSDP shards. "http": every rank runs a checkpoint server;
    the donor snapshots its state into memory and keeps training while the healer downloads it.
    "pg": the donor sends it with send/recv on the cross-group process group (``process_group``;
    no extra server or port, fast between GPUs with "nccl"), and stalls until the healer
    received it. Each tensor must arrive within ``process_group_timeout_ms``. Applies when
    ``enable``.
    """

    auth_token: str = ""
    """
    Job-wide secret, the same in every replica group and in the lighthouse. Default "" = none:
    the ManagerServer refuses every Kill request (the lighthouse's kill action cannot stop this
    group) and the HTTP checkpoint server answers anyone who reaches its port. When set, group
    rank 0 presents it to the lighthouse (a lighthouse with a token refuses groups without
    it), every call to the group's ManagerServer must carry it (each rank's quorum, vote and
    Kill, and a healing group's CheckpointMetadata; its ranks send it), and with
    ``checkpoint_transport = "http"`` so must every checkpoint request, so groups with
    different tokens cannot heal from each other (401). What it does not protect: see the
    security section of docs/operations.md. It travels in clear text (no TLS) and
    is not read from ``TORCHFT_AUTH_TOKEN``. A token in a TOML file is visible to whoever
    reads the file, one on the command line in the process list. Applies when ``enable``.
    """

    sync_steps: int = 5
    """
    Inner steps between two synchronisations, for "local_sgd" and "diloco". Default 5. More
    steps = less communication, more drift between groups. Must be >= 1.
    """

    num_fragments: int = 1
    """
    Number of model fragments synchronised in turn by "diloco" (Streaming DiLoCo when > 1).
    Default 1. More fragments spread the communication over the ``sync_steps`` window. Must be
    >= 1, divide ``sync_steps``, and be at most the number of transformer layers.
    """

    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """
    The Streaming DiLoCo fragments by module name, "diloco" only (TorchTitan's field): one
    list of module names per fragment, e.g. ``[["tok_embeddings", "layers.0"], ["layers.1",
    "norm", "output"]]``; every parameter must be in exactly one fragment. Default empty =
    ``num_fragments`` contiguous ranges of ``layers`` (embeddings with the first, norm and
    output with the last). In TOML a list of lists; on the command line fragments separated
    by ";" and names by ",", e.g. ``--fault_tolerance.module_fqns_per_model_fragment=
    "tok_embeddings,layers.0;layers.1,norm,output"``. Unknown names are an error listing the
    model's top-level modules. When set, ``num_fragments`` must be 1 or its length.
    """

    fragment_sync_delay: int = 0
    """
    Inner steps to wait before blocking on a fragment's synchronisation (tau in Streaming
    DiLoCo), "diloco" only. Default 0 = block at once. A delay overlaps communication with
    compute at some cost in model quality. Must be < ``sync_steps / num_fragments``.
    """

    fragment_update_alpha: float = 0.0
    """
    Mixing factor between the local and the synchronised parameters of a fragment, "diloco"
    only: new = alpha * local + (1 - alpha) * global. Default 0.0 = take the global parameters
    (all groups identical after a sync). In [0, 1].
    """

    should_quantize: bool = False
    """
    Quantize pseudo-gradients before the cross-group all-reduce, "diloco" only. Default False.
    Less bandwidth, some precision and extra compute.
    """

    outer_optimizer: OuterOptimizerName = "sgd"
    """
    Outer optimizer of "diloco": "sgd" (default; with ``outer_momentum`` and
    ``outer_nesterov``, the DiLoCo paper's choice) or "adamw". Its state is part of the healed
    state.
    """

    outer_lr: float = 0.7
    """Learning rate of the outer optimizer ("diloco" only). Default 0.7. Must be > 0."""

    outer_momentum: float = 0.9
    """Momentum of the "sgd" outer optimizer ("diloco" only). Default 0.9. In [0, 1)."""

    outer_nesterov: bool = True
    """Use Nesterov momentum in the "sgd" outer optimizer ("diloco" only). Default True."""


@dataclass
class JobConfig(TitanJobConfig):
    """TorchTitan 0.2.2's JobConfig with the extended ``fault_tolerance`` section."""

    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)


# --- what the raw fields mean ---------------------------------------------------------------------

_SEMI_SYNC_NAMES = {m.value: m for m in SyncMethod if m is not SyncMethod.PER_STEP}


def sync_method(ft: Any) -> SyncMethod:
    """The sync strategy ``ft.semi_sync_method`` names: None or "none" (any case) is per-step
    FT, else "local_sgd" or "diloco" in any case (TorchTitan lowercases the name)."""
    raw = ft.semi_sync_method
    if raw is None or str(raw).lower() == "none":
        return SyncMethod.PER_STEP
    method = _SEMI_SYNC_NAMES.get(str(raw).lower())
    if method is None:
        raise ConfigError(
            f"{SECTION}.semi_sync_method={raw!r} is invalid: expected one of "
            f"{', '.join(repr(n) for n in _SEMI_SYNC_NAMES)} (any case), or None / 'none' "
            "for per-step FT"
        )
    return method


def quorum_mode(ft: Any) -> QuorumMode:
    """``ft.quorum_mode``, or when unset the one the sync method needs: "sync" for LocalSGD
    and DiLoCo, "async" for per-step FT."""
    if ft.quorum_mode is not None:
        return QuorumMode(ft.quorum_mode)
    return QuorumMode.ASYNC if sync_method(ft) is SyncMethod.PER_STEP else QuorumMode.SYNC


def fragment_fqns(ft: Any) -> list[list[str]] | None:
    """The explicit Streaming DiLoCo fragments, or None (``num_fragments`` ranges of layers)."""
    return [list(names) for names in ft.module_fqns_per_model_fragment] or None


def num_fragments(ft: Any) -> int:
    """How many fragments DiLoCo syncs in turn: the explicit fragments', else
    ``num_fragments``."""
    fqns = fragment_fqns(ft)
    return len(fqns) if fqns else ft.num_fragments


def uses_semi_sync(job_config: Any) -> bool:
    """Whether ``job_config`` asks for FT with LocalSGD or DiLoCo."""
    ft = job_config.fault_tolerance
    return bool(ft.enable) and sync_method(ft) is not SyncMethod.PER_STEP


# --- validation -------------------------------------------------------------------------------

SECTION = "fault_tolerance"


def _type_matches(value: Any, annotation: Any) -> tuple[bool, str]:
    """Whether ``value`` fits ``annotation`` (bool/int/float/str/Literal/Optional only)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        return value in choices, f"one of {', '.join(repr(c) for c in choices)}"
    if origin in (typing.Union, types.UnionType):
        results = [_type_matches(value, arg) for arg in typing.get_args(annotation)]
        return any(ok for ok, _ in results), " or ".join(what for _, what in results)
    if origin is list:
        (item,) = typing.get_args(annotation)
        _, item_kind = _type_matches(None, item)
        ok = isinstance(value, list) and all(_type_matches(v, item)[0] for v in value)
        return ok, f"a list of ({item_kind})"
    if annotation is type(None):
        return value is None, "None"
    if annotation is bool:
        return isinstance(value, bool), "a boolean"
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), "an integer"
    if annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, "a number"
    if annotation is str:
        return isinstance(value, str), "a string"
    return True, ""


def _check_types(section: Any) -> None:
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        value = getattr(section, f.name)
        ok, expected = _type_matches(value, hints[f.name])
        if not ok:
            raise ConfigError(f"{SECTION}.{f.name}={value!r} is invalid: expected {expected}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000
"""Upper bound of every ``*_timeout_ms``: far beyond any real wait, far below what overflows a
``timedelta`` or a thread wait."""
_TIMEOUTS_MS = (
    "process_group_timeout_ms",
    "step_timeout_ms",
    "quorum_timeout_ms",
    "connect_timeout_ms",
)


def validate_fault_tolerance(ft: Any, job_config: Any = None) -> None:
    """Raise :class:`ConfigError` for the first bad ``fault_tolerance`` value, else return.

    Types and ranges are always checked; relations between fields (replica id vs. group size,
    timeout order, semi-sync settings) only when ``ft.enable``, since they only matter then.
    """
    _check_types(ft)
    for name in _TIMEOUTS_MS:
        value = getattr(ft, name)
        _require(
            0 < value <= MAX_TIMEOUT_MS,
            f"{SECTION}.{name}={value} must be > 0 and <= {MAX_TIMEOUT_MS} (7 days)",
        )
    _require(ft.replica_id >= 0, f"{SECTION}.replica_id={ft.replica_id} must be >= 0")
    _require(ft.group_size >= 0, f"{SECTION}.group_size={ft.group_size} must be >= 0")
    _require(ft.min_replica_size >= 1, f"{SECTION}.min_replica_size must be >= 1")
    _require(
        ft.max_retries is None or ft.max_retries >= 0,
        f"{SECTION}.max_retries={ft.max_retries} must be >= 0 (or None = unlimited)",
    )
    _require(ft.quorum_retries >= 0, f"{SECTION}.quorum_retries must be >= 0")
    sync_method(ft)
    _require(ft.sync_steps >= 1, f"{SECTION}.sync_steps={ft.sync_steps} must be >= 1")
    _require(ft.num_fragments >= 1, f"{SECTION}.num_fragments must be >= 1")
    check_fragment_fqns(ft)
    _require(ft.fragment_sync_delay >= 0, f"{SECTION}.fragment_sync_delay must be >= 0")
    _require(
        0.0 <= ft.fragment_update_alpha <= 1.0,
        f"{SECTION}.fragment_update_alpha={ft.fragment_update_alpha} must be in [0, 1]",
    )
    _require(
        math.isfinite(ft.outer_lr) and ft.outer_lr > 0,
        f"{SECTION}.outer_lr={ft.outer_lr} must be a finite number > 0",
    )
    _require(
        0.0 <= ft.outer_momentum < 1.0,
        f"{SECTION}.outer_momentum={ft.outer_momentum} must be in [0, 1)",
    )
    if not ft.enable:
        return
    _check_enabled_relations(ft, job_config)


def _check_enabled_relations(ft: Any, job_config: Any) -> None:
    _require(
        ft.group_size >= 1,
        f"{SECTION}.group_size must be set (>= 1, the number of replica groups) when "
        f"{SECTION}.enable is on",
    )
    _require(
        ft.replica_id < ft.group_size,
        f"{SECTION}.replica_id={ft.replica_id} must be < {SECTION}.group_size={ft.group_size}",
    )
    _require(
        ft.min_replica_size <= ft.group_size,
        f"{SECTION}.min_replica_size={ft.min_replica_size} must be <= "
        f"{SECTION}.group_size={ft.group_size}",
    )
    check_timeout_order(ft)
    check_lighthouse_addr(ft)
    if sync_method(ft) is not SyncMethod.PER_STEP:
        try:
            name = f"{SECTION}.semi_sync_method={ft.semi_sync_method!r}"
            check_quorum_mode(sync_method(ft), quorum_mode(ft), name)
        except ValueError as e:
            raise ConfigError(f"{e}; set {SECTION}.quorum_mode='sync' or leave it unset") from None
        check_semi_sync_schedule(ft)
    if job_config is not None:
        replicate = job_config.parallelism.data_parallel_replicate_degree
        _require(
            replicate == 1,
            f"parallelism.data_parallel_replicate_degree={replicate} must be 1 when "
            f"{SECTION}.enable is on: the replica axis is managed by fault tolerance "
            f"(use {SECTION}.group_size)",
        )


def check_fragment_fqns(ft: Any) -> None:
    """``module_fqns_per_model_fragment``: lists of non-empty module names, and
    ``num_fragments`` left at 1 or equal to their number. Whether the names exist in the model
    is :func:`check_model_fragments`' job (it needs the model)."""
    fqns = ft.module_fqns_per_model_fragment
    where = f"{SECTION}.module_fqns_per_model_fragment={fqns!r}"
    if not isinstance(fqns, list) or not all(
        isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)
        for names in fqns
    ):
        raise ConfigError(
            f"{where} is invalid: expected a list of non-empty lists of module names, e.g. "
            '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]'
        )
    if fqns and ft.num_fragments not in (1, len(fqns)):
        raise ConfigError(
            f"{where} defines {len(fqns)} fragments but {SECTION}.num_fragments="
            f"{ft.num_fragments}; leave num_fragments at 1 or set it to {len(fqns)}"
        )


def check_semi_sync_schedule(ft: Any) -> None:
    """The semi-sync settings as the strategies check them (``SyncConfig.validate``, e.g.
    DiLoCo's ``validate_diloco_schedule``: ``sync_steps`` a multiple of ``num_fragments`` and
    ``fragment_sync_delay < sync_steps / num_fragments``), as one :class:`ConfigError`."""
    from torchtitan_ft.titan.semi_sync import sync_config

    try:
        sync_config(ft).validate()
    except ValueError as e:
        raise ConfigError(
            f"{SECTION}.semi_sync_method={ft.semi_sync_method!r} (sync_steps={ft.sync_steps}, "
            f"num_fragments={num_fragments(ft)}, fragment_sync_delay={ft.fragment_sync_delay}): "
            f"{e}"
        ) from None


def check_lighthouse_addr(ft: Any, env: Mapping[str, str] | None = None) -> None:
    """The lighthouse address the Manager will use (``lighthouse_addr``, else the
    ``TORCHFT_LIGHTHOUSE`` env var of ``env``, default ``os.environ``) must be
    ``http://host:port``. Whether a lighthouse answers there is only known at the first quorum."""
    env = os.environ if env is None else env
    if ft.lighthouse_addr:
        url, origin = ft.lighthouse_addr, f"{SECTION}.lighthouse_addr"
    elif env.get(LIGHTHOUSE_ENV):
        url, origin = (
            env[LIGHTHOUSE_ENV],
            f"env {LIGHTHOUSE_ENV} (as {SECTION}.lighthouse_addr is empty)",
        )
    else:
        return
    if not is_lighthouse_url(url):
        raise ConfigError(
            f"{origin}={url!r} is not a lighthouse URL: expected http://host:port, "
            f"e.g. {DEFAULT_LIGHTHOUSE_ADDR}"
        )


def check_timeout_order(ft: Any) -> None:
    """Timeouts must nest: a collective fails before the step gives up, a connection attempt
    before the quorum request does. The error says which value to raise."""
    if ft.process_group_timeout_ms > ft.step_timeout_ms:
        raise ConfigError(
            f"{SECTION}.process_group_timeout_ms={ft.process_group_timeout_ms} exceeds "
            f"{SECTION}.step_timeout_ms={ft.step_timeout_ms}: a failed collective must be "
            f"detected before the step times out; raise {SECTION}.step_timeout_ms to at least "
            f"{ft.process_group_timeout_ms} (or lower process_group_timeout_ms)"
        )
    if ft.connect_timeout_ms > ft.quorum_timeout_ms:
        raise ConfigError(
            f"{SECTION}.connect_timeout_ms={ft.connect_timeout_ms} exceeds "
            f"{SECTION}.quorum_timeout_ms={ft.quorum_timeout_ms}: connecting is part of a "
            f"quorum request; raise {SECTION}.quorum_timeout_ms to at least "
            f"{ft.connect_timeout_ms} (or lower connect_timeout_ms)"
        )


def validate_job_config(job_config: Any) -> None:
    """Validate the parts of ``job_config`` this plugin owns (see module docstring)."""
    validate_fault_tolerance(job_config.fault_tolerance, job_config)


# --- parsing ----------------------------------------------------------------------------------

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
        ok, expected = _type_matches(value, hints[key])
        if not ok:
            raise ConfigError(f"{path}={value!r} is invalid: expected {expected}")


def parse_cli(args: list[str]) -> JobConfig:
    """``args`` parsed by TorchTitan's ``ConfigManager`` (tyro, with TOML under them).

    A command line tyro rejects raises one :class:`ConfigError` instead of tyro's multi-line
    box and exit: tyro's error event, reworded to name the flag or word and what was expected
    (:func:`cli_error_message`). Should tyro reject it some other way (an event this module does
    not reword, or a tyro without the hook, which is private), the box it printed is squeezed
    into the one line instead. Everything else tyro writes (``--help``, warnings) passes.
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), _tyro_errors_reworded(args):
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


@contextlib.contextmanager
def _tyro_errors_reworded(args: list[str]) -> Iterator[None]:
    """Turns tyro's parse-error events into :class:`ConfigError` (tyro's own hook, called
    before it prints anything); an event :func:`cli_error_message` cannot word is left to
    tyro, as is everything on a tyro without the hook (:func:`parse_cli` squeezes its box)."""
    on_parse_error = getattr(tyro_errors, "on_parse_error", None)
    if on_parse_error is None:
        yield
        return

    def reword(event: Any) -> None:
        try:
            message = cli_error_message(event, args)
        except AttributeError:  # an event of another shape (private API): tyro's box, squeezed
            return
        if message is not None:
            raise ConfigError(message)

    with on_parse_error(reword):
        yield


def cli_error_message(event: Any, args: list[str]) -> str | None:
    """One line for tyro's parse-error ``event`` on ``args``, naming the flag or word as the
    user wrote it and what was expected, e.g. ``--fault_tolerance.quorum_mode='bogus' is
    invalid: expected one of 'async', 'sync' or None``; None for an event it cannot word."""
    if isinstance(event, tyro_errors.UnrecognizedArgs):
        return _unrecognized(event.tokens[0], args)
    argument = getattr(event, "argument", None)
    if argument is None:
        return None
    flag, value = _as_given(argument.display_name(), args)
    expected = _expected(argument.field.type_stripped)
    if isinstance(event, tyro_errors.BadValue) and event.reason == "too_few_values":
        return f"{flag} needs a value: expected {expected}"
    if isinstance(event, tyro_errors.InvalidChoice):
        return f"{flag}={event.value!r} is invalid: expected {expected}"
    if isinstance(event, tyro_errors.InstantiationFailure) and value is not None:
        return f"{flag}={value!r} is invalid: expected {expected}"
    return None


def _unrecognized(token: str, args: list[str]) -> str | None:
    """A word tyro did not take: an unknown flag, a value given to a flag that takes none
    (tyro splits ``--flag=value`` and leaves the value), or a stray word."""
    if token.startswith("-"):
        return _unknown_flag(token.partition("=")[0])
    if token in args:
        i = args.index(token)
        after = f" after {' '.join(args[max(i - 2, 0) : i])}" if i else ""
        return (
            f"unexpected argument {token!r}{after}: options are --section.field=value, and a "
            "list is one comma-separated value (e.g. --compile.components=model,loss)"
        )
    for arg in args:
        flag, sep, value = arg.partition("=")
        if sep and value == token:
            head, _, name = flag.rpartition(".")
            name = name[3:] if name[:3] in ("no-", "no_") else name
            return f"{flag} is a flag and takes no value: write {head}.{name} or {head}.no-{name}"
    return None


def _unknown_flag(flag: str) -> str:
    wanted = flag.lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(wanted, _option_names(JobConfig), n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return f"unknown flag {flag}{hint} (see --help)"


def _option_names(cls: type, prefix: str = "") -> list[str]:
    """Every ``section.field`` of the dataclass ``cls``, nested sections included."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            names += _option_names(hints[f.name], f"{prefix}{f.name}.")
        else:
            names.append(f"{prefix}{f.name}")
    return names


def _as_given(name: str, args: list[str]) -> tuple[str, str | None]:
    """The flag tyro calls ``name`` (``--a-b.c-d``) as ``args`` spell it (``-`` or ``_``), at
    its last occurrence, and the value given there (``=value`` or the next word), if any."""
    canonical = name.split("/")[0].replace("_", "-")
    for i in reversed(range(len(args))):
        flag, sep, value = args[i].partition("=")
        if flag.replace("_", "-") == canonical:
            if sep:
                return flag, value
            return flag, args[i + 1] if i + 1 < len(args) else None
    return name, None


def _expected(annotation: Any) -> str:
    """What a field of type ``annotation`` takes, in words (as the TOML check says it)."""
    _, expected = _type_matches(None, annotation)
    return expected or f"a {getattr(annotation, '__name__', annotation)}"


def _squeezed(box: str) -> str:
    """tyro's error box as one line: no colours, frame, argument help or help footer."""
    text = re.sub(r"\x1b\[[0-9;]*m|[\u2500-\u257f]|-{3,}", " ", box)
    text = re.split(r"Argument helptext:|Perhaps you meant:|For full helptext", text)[0]
    return " ".join(text.split())


def parse_job_config(args: list[str] | None = None) -> JobConfig:
    """Parse TOML (``--job.config_file``) and CLI into :class:`JobConfig`, then validate.

    Precedence CLI > TOML > defaults (TorchTitan's ``ConfigManager`` does the merge); of
    several ``--job.config_file``, the last is used. A config file that is missing or not
    TOML, an unknown key or flag, a value of the wrong type and a bad value raise
    :class:`ConfigError` with one line naming it (the TOML file is checked before tyro
    parses, the command line by rewording tyro's errors: :func:`parse_cli`).
    """
    args = last_config_file_only(list(sys.argv[1:] if args is None else args))
    config_file = config_file_from_args(args)
    toml_values = load_toml(config_file) if config_file is not None else {}
    job_values = toml_values.get("job")
    custom = any(a.partition("=")[0] in _CUSTOM_MODULE_FLAGS for a in args) or (
        isinstance(job_values, dict) and bool(job_values.get("custom_config_module"))
    )
    try:
        check_toml_values(toml_values, allow_unknown=custom)
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}") from None
    args, fragments = take_fragments_flag(args)
    config = parse_cli(args)
    if fragments is not None:
        config.fault_tolerance.module_fqns_per_model_fragment = fragments
    validate_job_config(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _log_once(
        resolve_sync_settings(config.fault_tolerance),
        split_global_batch(config, world_size),
    )
    resolve_compute_dtype(config, set_explicitly(toml_values, args))
    return config


def _log_once(*notices: str | None) -> None:
    from torchtitan.tools.logging import logger

    for notice in notices:
        if notice:
            logger.info(notice)


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


def resolve_sync_settings(ft: Any) -> str | None:
    """Write the sync method and quorum mode as they apply: ``semi_sync_method`` None or
    lowercase "local_sgd" / "diloco" (see :func:`sync_method`), an unset ``quorum_mode`` the
    one the method needs (see :func:`quorum_mode`). Returns the notice to log when that made a
    semi-sync job synchronous."""
    method = sync_method(ft)
    derived = ft.quorum_mode is None
    ft.semi_sync_method = None if method is SyncMethod.PER_STEP else method.value
    ft.quorum_mode = quorum_mode(ft).value
    if not (ft.enable and derived and method is not SyncMethod.PER_STEP):
        return None
    return (
        f"FT: semi_sync_method={method.value!r} implies a synchronous quorum "
        f"({SECTION}.quorum_mode='sync', as in TorchTitan): quorums and heals happen at sync "
        "points, before the step trains"
    )


def inner_dp_degree(parallelism: Any, world_size: int) -> int:
    """The data-parallel degree inside one replica group (TorchTitan's batch degree there):
    ``data_parallel_shard_degree``, or what -1 makes of it from the world size."""
    if parallelism.data_parallel_shard_degree > 0:
        return parallelism.data_parallel_replicate_degree * parallelism.data_parallel_shard_degree
    others = (
        parallelism.data_parallel_replicate_degree
        * parallelism.tensor_parallel_degree
        * parallelism.pipeline_parallel_degree
        * parallelism.context_parallel_degree
    )
    return parallelism.data_parallel_replicate_degree * max(world_size // others, 1)


def split_global_batch(config: Any, world_size: int) -> str | None:
    """With FT, ``training.global_batch_size`` is the batch of all replica groups together
    (TorchTitan's FT doc): each group takes ``global_batch_size / group_size``, which sets its
    gradient accumulation steps. Rewrites the field to the per-group batch TorchTitan's
    Trainer uses; returns the notice to log. Raises :class:`ConfigError` when it does not
    divide."""
    ft, training = config.fault_tolerance, config.training
    total = training.global_batch_size
    if not ft.enable or total <= 0:
        return None
    if total % ft.group_size:
        raise ConfigError(
            f"training.global_batch_size={total} covers all {ft.group_size} replica groups "
            f"({SECTION}.group_size) and must be a multiple of it"
        )
    per_group = total // ft.group_size
    dp = inner_dp_degree(config.parallelism, world_size)
    if per_group % (training.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size={total} gives {per_group} per replica group "
            f"({ft.group_size} groups), which must be a multiple of training.local_batch_size="
            f"{training.local_batch_size} x {dp} data-parallel ranks in a group"
        )
    training.global_batch_size = per_group
    steps = per_group // (training.local_batch_size * dp)
    return (
        f"FT: training.global_batch_size={total} covers {ft.group_size} replica groups: "
        f"{per_group} per group = {steps} gradient accumulation step(s) x local batch "
        f"{training.local_batch_size} x {dp} data-parallel rank(s)"
    )


def resolve_compute_dtype(config: JobConfig, explicit: bool) -> DtypeChoice:
    """Set ``training.mixed_precision_param`` by what this machine runs fast (see
    :mod:`~torchtitan_ft.titan.compute_dtype`) unless the user set it, and log the choice."""
    from torchtitan.tools.logging import logger
    from torchtitan.tools.utils import device_type

    cpu = probe_cpu() if device_type == "cpu" else None
    configured = config.training.mixed_precision_param if explicit else None
    choice = choose_param_dtype(device_type, cpu, configured)
    config.training.mixed_precision_param = choice.param_dtype
    logger.info(f"Compute dtype: {choice.param_dtype} ({choice.reason})")
    return choice


# --- files this machine must have -------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
"""What TorchTitan's ``HuggingFaceTokenizer`` loads from ``model.hf_assets_path``."""


def check_local_paths(job_config: Any) -> None:
    """Raise :class:`ConfigError` when a file the run reads at start-up is missing here: the
    tokenizer directory ``model.hf_assets_path`` (if the model has a tokenizer).

    Separate from :func:`validate_job_config`, which checks values: a config written for
    another machine validates anywhere; running it needs its files. The entry point calls
    both before any process group exists. A relative path starts at the working directory,
    as in TorchTitan.
    """
    from torchtitan.protocols.train_spec import get_train_spec

    name = job_config.model.name
    try:
        spec = get_train_spec(name)
    except ValueError:
        from torchtitan.models import _supported_models

        raise ConfigError(
            f"model.name={name!r} is not a registered model; expected one of "
            f"{', '.join(repr(m) for m in sorted(_supported_models))}"
        ) from None
    if spec.build_tokenizer_fn is None:
        return
    path = job_config.model.hf_assets_path
    where = f"model.hf_assets_path={path!r}"
    if not os.path.isabs(path):
        where += f" (from the working directory {os.getcwd()})"
    fix = (
        "put the model's tokenizer (tokenizer.json) there, e.g. with TorchTitan's "
        "scripts/download_hf_assets.py, or pass --model.hf_assets_path=<directory> (absolute, "
        "or relative to where the run starts)"
    )
    if not os.path.isdir(path):
        raise ConfigError(f"{where} is not a directory: {fix}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ConfigError(f"{where} holds no {' / '.join(_TOKENIZER_FILES)}: {fix}")


def check_local_address(job_config: Any, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` when ``fault_tolerance.hostname`` (empty: this machine's
    name) is not an address of this machine: the group's servers listen on it, so a config
    written for another machine would fail there with a bare socket error. The error suggests
    this machine's address towards the lighthouse (``env``: default ``os.environ``)."""
    import socket

    from torchtitan_ft.addresses import hostname_problem

    ft = job_config.fault_tolerance
    if not ft.enable:
        return
    env = os.environ if env is None else env
    lighthouse = ft.lighthouse_addr or env.get(LIGHTHOUSE_ENV) or DEFAULT_LIGHTHOUSE_ADDR
    problem = hostname_problem(
        ft.hostname or socket.gethostname(), lighthouse, unset=not ft.hostname
    )
    if problem is not None:
        raise ConfigError(problem)


def check_model_fragments(job_config: Any) -> None:
    """Raise :class:`ConfigError` when ``module_fqns_per_model_fragment`` names a module the
    model does not have, or does not put every parameter in exactly one fragment. Checked on
    a meta-device copy of the model, before any process group exists."""
    fqns = fragment_fqns(job_config.fault_tolerance)
    if not fqns or not uses_semi_sync(job_config):
        return
    from torchtitan_ft.semi_sync import fragments_from_fqns
    from torchtitan_ft.titan.replica_axis import meta_model

    model = meta_model(job_config)
    where = f"{SECTION}.module_fqns_per_model_fragment"
    for name in (n for names in fqns for n in names):
        try:
            model.get_submodule(name)
        except AttributeError:
            top = ", ".join(n for n, _ in model.named_children())
            raise ConfigError(
                f"{where} names {name!r}, which is not a module of model "
                f"{job_config.model.name} {job_config.model.flavor}; its top-level modules are "
                f"{top} (nested ones by dotted name, e.g. layers.0)"
            ) from None
    try:
        fragments_from_fqns(model, fqns)
    except ValueError as e:
        raise ConfigError(f"{where}={fqns!r}: {e}") from None
