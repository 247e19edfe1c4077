"""The ``fault_tolerance`` config section: TorchTitan 0.2.2's own section, extended.

TorchTitan 0.2.2's ``JobConfig`` already has a ``fault_tolerance`` section (read by outside code,
e.g. the metrics component puts TensorBoard logs under ``replica_<id>``). :class:`FaultTolerance`
subclasses it: the seven existing fields keep their names (some get a ``Literal`` type and a
fuller docstring), the new ones follow. :class:`JobConfig` is TorchTitan's ``JobConfig`` with
this section type; the entry point owns the parse, so no ``--job.custom_config_module`` is
needed and methods / ``isinstance`` survive (a custom config module still merges on top).
The module does not use ``from __future__ import annotations``: TorchTitan's TOML loader reads
``dataclasses.Field.type`` and needs real classes there.

Every field reads from TOML (``[fault_tolerance]`` in ``--job.config_file``) and from the CLI
(``--fault_tolerance.<field>``; booleans as ``--fault_tolerance.enable`` /
``--fault_tolerance.no-enable``). Precedence: CLI > TOML > the defaults below. For
``lighthouse_addr`` an empty value falls back to the ``TORCHFT_LIGHTHOUSE`` env var, then to
``http://localhost:29510`` (an explicit value is never overridden by the env var).

:func:`parse_job_config` parses and then :func:`validate_job_config` checks everything; both
run before any process group exists and raise one :class:`ConfigError` naming the bad key or
value (and, for timeouts, which one to raise).

Mapping onto the runtime (``torchtitan_ft.manager.Manager`` and the sync strategies):

=====================================  ===========================================
config field                           runtime argument
=====================================  ===========================================
``min_replica_size``                   ``Manager(min_replica_size)``
``step_timeout_ms``                    ``Manager(timeout)``
``quorum_timeout_ms``                  ``Manager(quorum_timeout)``
``connect_timeout_ms``                 ``Manager(connect_timeout)``
``world_size_mode``                    ``Manager(world_size_mode=WorldSizeMode.X)``
``lighthouse_addr``                    ``Manager(lighthouse_addr)`` ("" -> None)
``replica_id``                         ``Manager(replica_id=f"{prefix}{replica_id}")``
``init_sync``                          ``Manager(init_sync)``
``max_retries`` / ``quorum_retries``   ``Manager(max_retries / quorum_retries)``
``checkpoint_transport``               ``Manager(checkpoint_transport=HTTPTransport|PGTransport)``
``auth_token``                         ``Manager(auth_token)`` ("" -> None)
``hostname``                           ``Manager(hostname)`` ("" -> socket.gethostname())
``quorum_mode``                        ``Manager(use_async_quorum = quorum_mode == "async")``
``process_group*``                     ``ProcessGroupGloo|NCCL(timeout)``
``semi_sync_method`` and below         ``LocalSGD`` / ``DiLoCo`` arguments
=====================================  ===========================================
"""

import difflib
import sys
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from torchtitan.config import ConfigManager
from torchtitan.config import FaultTolerance as TitanFaultTolerance
from torchtitan.config import JobConfig as TitanJobConfig

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

ProcessGroupBackend = Literal["gloo", "nccl"]
SemiSyncMethod = Literal["none", "local_sgd", "diloco"]
QuorumMode = Literal["async", "sync"]
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

    semi_sync_method: SemiSyncMethod = "none"
    """
    How replica groups synchronise: "none" (default) = every step's gradients are averaged
    across groups and committed together (FT-HSDP); "local_sgd" = each group steps alone and
    parameters are averaged every ``sync_steps``; "diloco" = each group runs the inner
    optimizer and an outer optimizer applies averaged pseudo-gradients every ``sync_steps``
    (streaming when ``num_fragments`` > 1). Semi-sync trades convergence per step for far less
    communication; it requires ``quorum_mode = "sync"``. Applies when ``enable``.
    """

    lighthouse_addr: str = ""
    """
    Lighthouse URL, e.g. "http://lighthouse-host:29510". Default "" = the ``TORCHFT_LIGHTHOUSE``
    env var, else "http://localhost:29510". An explicit value always wins over the env var.
    Only group rank 0 talks to the lighthouse. Applies when ``enable``.
    """

    hostname: str = ""
    """
    Host name other replica groups use to reach this group's manager server and checkpoint
    server. Default "" = ``socket.gethostname()`` (servers listen on all interfaces). A loopback
    name ("127.0.0.1", "localhost") makes them listen on loopback only: single-machine runs
    and tests. Applies when ``enable``.
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
    Timeout for connecting to the lighthouse and to the group's manager server, in
    milliseconds. Default 60000 (torchft's ``connect_timeout``). Lower = a missing lighthouse is
    reported sooner. Must be <= ``quorum_timeout_ms``. Applies when ``enable``.
    """

    quorum_mode: QuorumMode = "async"
    """
    "async" (default): the quorum is requested on a background thread, overlapped with the
    forward pass; "sync": the step waits for the quorum before the forward. Async hides the
    quorum latency; sync is required by semi-sync methods (which only ask at sync points).
    Applies when ``enable``.
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
    Extra attempts of a failed quorum request before the step fails. Default 0. Retries
    absorb a lighthouse restart at the cost of a longer stall when it is really down. Applies
    when ``enable``.
    """

    checkpoint_transport: CheckpointTransportName = "http"
    """
    How a recovering replica group receives live state from a healthy one: "http" (default,
    served by the donor in the background, chunked) or "pg" (over a process group, fast
    between GPUs). Applies when ``enable``.
    """

    auth_token: str = ""
    """
    Shared secret required by the manager and checkpoint servers. Default "" = no
    authentication (acceptable on loopback only). Prefer passing it on the CLI from a secret
    store over writing it into a TOML file. Applies when ``enable``.
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


def validate_fault_tolerance(ft: Any, job_config: Any = None) -> None:
    """Raise :class:`ConfigError` for the first bad ``fault_tolerance`` value, else return.

    Types and ranges are always checked; relations between fields (replica id vs. group size,
    timeout order, semi-sync settings) only when ``ft.enable``, since they only matter then.
    """
    _check_types(ft)
    for name in ("process_group_timeout_ms", "step_timeout_ms", "quorum_timeout_ms"):
        _require(getattr(ft, name) > 0, f"{SECTION}.{name}={getattr(ft, name)} must be > 0")
    _require(ft.connect_timeout_ms > 0, f"{SECTION}.connect_timeout_ms must be > 0")
    _require(ft.replica_id >= 0, f"{SECTION}.replica_id={ft.replica_id} must be >= 0")
    _require(ft.group_size >= 0, f"{SECTION}.group_size={ft.group_size} must be >= 0")
    _require(ft.min_replica_size >= 1, f"{SECTION}.min_replica_size must be >= 1")
    _require(
        ft.max_retries is None or ft.max_retries >= 0,
        f"{SECTION}.max_retries={ft.max_retries} must be >= 0 (or None = unlimited)",
    )
    _require(ft.quorum_retries >= 0, f"{SECTION}.quorum_retries must be >= 0")
    _require(ft.sync_steps >= 1, f"{SECTION}.sync_steps={ft.sync_steps} must be >= 1")
    _require(ft.num_fragments >= 1, f"{SECTION}.num_fragments must be >= 1")
    _require(ft.fragment_sync_delay >= 0, f"{SECTION}.fragment_sync_delay must be >= 0")
    _require(
        0.0 <= ft.fragment_update_alpha <= 1.0,
        f"{SECTION}.fragment_update_alpha={ft.fragment_update_alpha} must be in [0, 1]",
    )
    _require(ft.outer_lr > 0, f"{SECTION}.outer_lr={ft.outer_lr} must be > 0")
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
    if ft.semi_sync_method != "none":
        _require(
            ft.quorum_mode == "sync",
            f"{SECTION}.semi_sync_method={ft.semi_sync_method!r} needs "
            f"{SECTION}.quorum_mode='sync' (got {ft.quorum_mode!r})",
        )
        check_semi_sync_schedule(ft)
    if job_config is not None:
        replicate = job_config.parallelism.data_parallel_replicate_degree
        _require(
            replicate == 1,
            f"parallelism.data_parallel_replicate_degree={replicate} must be 1 when "
            f"{SECTION}.enable is on: the replica axis is managed by fault tolerance "
            f"(use {SECTION}.group_size)",
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
            f"num_fragments={ft.num_fragments}, fragment_sync_delay={ft.fragment_sync_delay}): "
            f"{e}"
        ) from None


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
    """The ``--job.config_file`` value in ``args`` (``--flag value`` or ``--flag=value``)."""
    for i, arg in enumerate(args):
        key, sep, value = arg.partition("=")
        if key in _CONFIG_FILE_FLAGS:
            if sep:
                return value
            if i + 1 < len(args):
                return args[i + 1]
    return None


def check_toml_keys(values: dict[str, Any], cls: type = JobConfig, prefix: str = "") -> None:
    """Raise :class:`ConfigError` naming the first unknown key (dotted path, with a hint)."""
    known = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {path!r}{hint}")
        if is_dataclass(hints[key]) and isinstance(value, dict):
            check_toml_keys(value, hints[key], f"{path}.")


def parse_job_config(args: list[str] | None = None) -> JobConfig:
    """Parse TOML (``--job.config_file``) and CLI into :class:`JobConfig`, then validate.

    Precedence CLI > TOML > defaults (TorchTitan's ``ConfigManager`` does the merge). Unknown
    TOML keys and bad values raise :class:`ConfigError`; an unknown CLI flag or an invalid
    choice on the CLI makes tyro print the problem and exit with status 2.
    """
    args = list(sys.argv[1:] if args is None else args)
    config_file = config_file_from_args(args)
    uses_custom_module = any(a.partition("=")[0] in _CUSTOM_MODULE_FLAGS for a in args)
    if config_file is not None:
        with open(config_file, "rb") as f:
            toml_values = tomllib.load(f)
        custom = toml_values.get("job", {}).get("custom_config_module")
        if not (uses_custom_module or custom):
            try:
                check_toml_keys(toml_values)
            except ConfigError as e:
                raise ConfigError(f"{config_file}: {e}") from None
        ft_values = toml_values.get(SECTION, {})
        if isinstance(ft_values, dict):
            # Types only (the CLI may still override): tyro's own message for an out-of-range
            # Literal coming from TOML is less direct than ours.
            _check_types(_dict_to_ft(ft_values))
    config = ConfigManager(config_cls=JobConfig).parse_args(args)
    validate_job_config(config)
    return config


def _dict_to_ft(values: dict[str, Any]) -> FaultTolerance:
    known = {f.name for f in fields(FaultTolerance)}
    return FaultTolerance(**{k: v for k, v in values.items() if k in known})
