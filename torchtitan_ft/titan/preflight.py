"""Checks run before any process group exists, in every trainer process (the entry point
calls them in this order): the values of the ``fault_tolerance`` section
(:func:`validate_job_config`, also run by the parse), what this machine must have for the run
(:func:`check_local_paths`, :func:`check_local_address`, :func:`check_manager_env`,
:func:`check_model_fragments`), and
the values the plugin derives for TorchTitan's Trainer (:func:`trainer_job_config`: the
user's config keeps what the user wrote; each derived value is logged once, with where it came
from).
"""

import copy
import math
import os
import socket
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torchtitan.models import _supported_models
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from torchtitan_ft.addresses import hostname_problem, local_interfaces
from torchtitan_ft.checkpoint.paths import missing_interfaces
from torchtitan_ft.manager.settings import (
    DEFAULT_LIGHTHOUSE_ADDR,
    LIGHTHOUSE_ENV,
    Source,
    is_lighthouse_url,
    resolve_heal_interfaces,
    resolve_heal_stall_timeout,
    resolve_timeouts,
    validate_env,
)
from torchtitan_ft.netaddr import split_host_port
from torchtitan_ft.process_group.base import native_reconfigure_available
from torchtitan_ft.semi_sync import fragments_from_fqns
from torchtitan_ft.semi_sync.config import QuorumMode, SyncMethod, check_quorum_mode
from torchtitan_ft.timeouts import Key, Value, check_order, config_value, seconds_value
from torchtitan_ft.titan.compute_dtype import choose_param_dtype, probe_cpu
from torchtitan_ft.titan.config_schema import (
    SECTION,
    ConfigError,
    JobConfig,
    fragment_fqns,
    is_set,
    manager_timeouts,
    num_fragments,
    quorum_mode,
    sync_config,
    sync_method,
    type_matches,
    uses_semi_sync,
)
from torchtitan_ft.titan.replica_axis import meta_model

# --- values -----------------------------------------------------------------------------------


def _check_types(section: Any) -> None:
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        value = getattr(section, f.name)
        ok, expected = type_matches(value, hints[f.name])
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
    "heal_stall_timeout_ms",
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
    check_timeout_order(ft, job_config)
    check_lighthouse_addr(ft)
    check_process_group_kind(ft, native_reconfigure_available(), torch.__version__)
    _require(
        not ft.retry_inflight_allreduce,
        f"{SECTION}.retry_inflight_allreduce=true is not supported with TorchTitan: the "
        "Manager re-runs a failed step's allreduces in should_commit, after TorchTitan clipped "
        "the gradients from the failed sums; the ranks of a group (each all-reducing its own "
        "shard) would first have to agree to retry; and units whose shard FSDP casts, copies "
        "or accumulates after the hook cannot be rewritten (docs/titan.md); leave it false",
    )
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


def check_process_group_kind(ft: Any, native_available: bool, torch_version: str) -> None:
    """``process_group_kind = "native"`` needs torch's native reconfigure (``native_available``
    on ``torch_version``), gloo and a ``process_group_store``; one line for the first missing."""
    if ft.process_group_kind != "native":
        return
    _require(
        native_available,
        f"{SECTION}.process_group_kind='native' needs torch>=2.14 (enable_reconfigure); torch "
        f"{torch_version} is installed: use 'rebuilt'",
    )
    _require(
        ft.process_group == "gloo",
        f"{SECTION}.process_group_kind='native' wraps gloo, got {SECTION}.process_group="
        f"{ft.process_group!r}: set it to 'gloo' or use process_group_kind='rebuilt'",
    )
    try:
        split_host_port(ft.process_group_store)
    except ValueError as e:
        raise ConfigError(
            f"{SECTION}.process_group_store={ft.process_group_store!r} must be the host:port of "
            f"a TCPStore that outlives every replica group when "
            f"{SECTION}.process_group_kind='native' ({e})"
        ) from None


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
    ``fragment_sync_delay < sync_steps / num_fragments``), as one :class:`ConfigError`. The
    one place a trainer validates its ``SyncConfig``: the replica axis builds on it."""
    try:
        sync_config(ft)  # a SyncConfig checks itself when built
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


def timeout_values(
    ft: Any, job_config: Any = None, env: Mapping[str, str] | None = None
) -> dict[Key, Value]:
    """The timeouts of this job, as the user set them, for ``timeouts.check_order``: the
    ``fault_tolerance`` fields; with ``env``, a ``TORCHFT_*`` variable in place of a field the
    user did not set (``config_schema.ENV_OVERRIDABLE``, as the Manager resolves them); with
    ``job_config``, TorchTitan's ``comm.train_timeout_seconds`` and ``init_timeout_seconds``.
    The heal's stall timeout only where it is set (field or variable), as the Manager does
    (``settings.timeout_values``)."""
    values = {
        Key.PROCESS_GROUP: config_value("process_group_timeout_ms", ft.process_group_timeout_ms),
        Key.STEP: config_value("step_timeout_ms", ft.step_timeout_ms),
        Key.QUORUM: config_value("quorum_timeout_ms", ft.quorum_timeout_ms),
        Key.CONNECT: config_value("connect_timeout_ms", ft.connect_timeout_ms),
    }
    if is_set(ft, "heal_stall_timeout_ms"):  # at its default it yields to a short step timeout
        values[Key.HEAL_STALL] = config_value("heal_stall_timeout_ms", ft.heal_stall_timeout_ms)
    if env is not None:
        args = manager_timeouts(ft)
        resolved = (
            *resolve_timeouts(
                env,
                timeout=args["timeout"],
                quorum_timeout=args["quorum_timeout"],
                connect_timeout=args["connect_timeout"],
            ),
            resolve_heal_stall_timeout(args["heal_stall_timeout"], env),
        )
        keyed = ((Key.STEP, "step_timeout_ms"), (Key.QUORUM, "quorum_timeout_ms"))
        keyed += ((Key.CONNECT, "connect_timeout_ms"), (Key.HEAL_STALL, "heal_stall_timeout_ms"))
        for (key, field), value in zip(keyed, resolved, strict=True):
            if value.source is Source.ENV:
                values[key] = seconds_value(
                    value.value.total_seconds(),
                    f"env {value.env_var}",
                    f"(as {SECTION}.{field} is not set)",
                )
    comm = getattr(job_config, "comm", None)
    if comm is not None:
        for key, name in (
            (Key.TITAN_TRAIN, "train_timeout_seconds"),
            (Key.TITAN_INIT, "init_timeout_seconds"),
        ):
            values[key] = seconds_value(getattr(comm, name), f"comm.{name}")
    return values


def check_timeout_order(ft: Any, job_config: Any = None) -> None:
    """Raise :class:`ConfigError` naming the first relation of ``timeouts.RELATIONS`` that the
    fields (and, with ``job_config``, TorchTitan's ``comm`` timeouts) break, and values that
    satisfy it."""
    try:
        check_order(timeout_values(ft, job_config))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate_job_config(job_config: Any) -> None:
    """Raise :class:`ConfigError` for the first bad value of the parts of ``job_config`` this
    plugin owns (the ``fault_tolerance`` section and the replicate degree beside it)."""
    validate_fault_tolerance(job_config.fault_tolerance, job_config)


def check_profiler_schedule(profiler: Any, section: str) -> None:
    """Raise :class:`ConfigError` when TorchTitan's profiler is on and its cycle
    (``profile_freq`` steps) is shorter than its ``profiler_warmup + profiler_active`` steps:
    TorchTitan asserts this when it builds the profiler, after the process groups and the model
    exist, and the run ends in a traceback. ``section`` is where the release keeps the fields
    (``profiling`` on 0.2.2, ``profiler`` on 0.3.0)."""
    if not profiler.enable_profiling:
        return
    freq, warmup, active = profiler.profile_freq, profiler.profiler_warmup, profiler.profiler_active
    if freq < warmup + active:
        raise ConfigError(
            f"{section}.profile_freq={freq} is shorter than {section}.profiler_warmup + "
            f"{section}.profiler_active = {warmup} + {active}: expected profile_freq >= "
            f"{warmup + active} (each cycle of profile_freq steps waits, warms up, then traces), "
            f"or fewer warm-up steps, e.g. --{section}.profiler_warmup="
            f"{max(0, freq - active)}"
        )


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
    # load order: the train specs load modules cpu_compat patches (the agent never applies it)
    from torchtitan.protocols.train_spec import get_train_spec

    name = job_config.model.name
    try:
        spec = get_train_spec(name)
    except ValueError:
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
    check_heal_interfaces(ft, env)


def check_heal_interfaces(ft: Any, env: Mapping[str, str]) -> None:
    """Raise :class:`ConfigError` when the pinned heal interfaces (``heal_interfaces``, else
    ``TORCHFT_HEAL_INTERFACES``) are malformed or do not all exist on this machine: one line
    naming them, before any process group."""
    try:
        names = resolve_heal_interfaces(manager_timeouts(ft)["heal_interfaces"], env).value
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problem = missing_interfaces(names, local_interfaces())
    if problem is not None:
        raise ConfigError(problem)


def check_manager_env(job_config: Any, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` for a ``TORCHFT_*`` variable the Manager would refuse
    (``manager.settings.validate_env``; ``env``: default ``os.environ``), before TorchTitan
    builds anything: one line naming the variable instead of a traceback in every rank."""
    ft = job_config.fault_tolerance
    if not ft.enable:
        return
    env = os.environ if env is None else env
    try:
        validate_env(env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_effective_timeout_order(ft, env, job_config)


def check_effective_timeout_order(ft: Any, env: Mapping[str, str], job_config: Any = None) -> None:
    """:func:`check_timeout_order` on the timeouts the Manager will use, where a ``TORCHFT_*``
    variable stands in for a field the user did not set (``config_schema.ENV_OVERRIDABLE``);
    the error names the variable."""
    try:
        check_order(timeout_values(ft, job_config, env))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model_fragments(job_config: Any) -> None:
    """Raise :class:`ConfigError` when ``module_fqns_per_model_fragment`` names a module the
    model does not have, or does not put every parameter in exactly one fragment. Checked on
    a meta-device copy of the model, before any process group exists."""
    fqns = fragment_fqns(job_config.fault_tolerance)
    if not fqns or not uses_semi_sync(job_config):
        return
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


# --- values the trainer is given --------------------------------------------------------------


@dataclass(frozen=True)
class Derived:
    """A value the plugin derives for TorchTitan's Trainer in place of a field of the user's
    config; the user's config keeps what the user wrote (see :func:`trainer_job_config`)."""

    field: str
    """The field, as ``section.name``, e.g. ``training.global_batch_size``."""
    value: Any
    """What the trainer's config holds there."""
    source: str
    """The fields it was derived from and how, for the log."""

    def notice(self) -> str:
        """The line logged once: ``FT: derived <field>=<value> from <source>``."""
        return f"FT: derived {self.field}={self.value!r} from {self.source}"


def implied_quorum_mode(ft: Any) -> Derived | None:
    """A semi-sync FT job without ``quorum_mode`` quorums synchronously (see
    :func:`~torchtitan_ft.titan.config_schema.quorum_mode`); None when nothing is implied."""
    method = sync_method(ft)
    if not ft.enable or ft.quorum_mode is not None or method is SyncMethod.PER_STEP:
        return None
    return Derived(
        f"{SECTION}.quorum_mode",
        QuorumMode.SYNC.value,
        f"{SECTION}.semi_sync_method={ft.semi_sync_method!r}: semi_sync_method="
        f"{method.value!r} implies a synchronous quorum (as in TorchTitan): quorums and heals "
        "happen at sync points, before the step trains",
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


def per_group_batch(config: Any, world_size: int) -> Derived | None:
    """With FT, ``training.global_batch_size`` is the batch of all replica groups together
    (TorchTitan's FT doc): each group's trainer takes ``global_batch_size / group_size``, which
    sets its gradient accumulation steps. None without FT or without a global batch size
    (TorchTitan derives it). Raises :class:`ConfigError` when it does not divide."""
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
    steps = per_group // (training.local_batch_size * dp)
    return Derived(
        "training.global_batch_size",
        per_group,
        f"{SECTION}.group_size={ft.group_size}: training.global_batch_size={total} covers "
        f"{ft.group_size} replica groups: {per_group} per group = {steps} gradient accumulation "
        f"step(s) x local batch {training.local_batch_size} x {dp} data-parallel rank(s)",
    )


def with_values(config: JobConfig, values: Mapping[str, Any]) -> JobConfig:
    """A deep copy of ``config`` with each ``section.name`` of ``values`` set (``config`` is
    left as it is)."""
    copied = copy.deepcopy(config)
    for name, value in values.items():
        section, _, field_name = name.rpartition(".")
        setattr(getattr(copied, section), field_name, value)
    return copied


def trainer_job_config(
    config: JobConfig, *, explicit_param_dtype: bool, world_size: int
) -> JobConfig:
    """The config TorchTitan's Trainer is given: ``config`` (which keeps the user's values)
    with the values the plugin derives (:func:`implied_quorum_mode`, :func:`per_group_batch`,
    and ``training.mixed_precision_param`` by what this machine runs fast unless
    ``explicit_param_dtype``, see :mod:`~torchtitan_ft.titan.compute_dtype`), each logged once.

    Args:
        config: the parsed and validated job config.
        explicit_param_dtype: whether the TOML or the command line set
            ``training.mixed_precision_param`` (then it is used as is).
        world_size: the processes of this replica group (torchrun's ``WORLD_SIZE``).
    """
    device_type = utils.device_type
    cpu = probe_cpu() if device_type == "cpu" else None
    configured = config.training.mixed_precision_param if explicit_param_dtype else None
    choice = choose_param_dtype(device_type, cpu, configured)
    logger.info(f"Compute dtype: {choice.param_dtype} ({choice.reason})")
    derived = [
        d
        for d in (implied_quorum_mode(config.fault_tolerance), per_group_batch(config, world_size))
        if d is not None
    ]
    for d in derived:
        logger.info(d.notice())
    values = {d.field: d.value for d in derived}
    values["training.mixed_precision_param"] = choice.param_dtype
    return with_values(config, values)
