"""Where the Manager's connection settings come from, on every rank: argument, then env var,
then default (pure).

torchft 0.2.0 let some env vars silently override explicit arguments (torchtitan #2899); here
the order is the same for every setting and lives in ``resolve_manager_settings``, unit-tested
with an env mapping. ``ManagerSettings.describe`` is the one line the Manager logs at start-up.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from torchtitan_ft import timeouts
from torchtitan_ft.auth import AUTH_TOKEN_ENV, resolve_token
from torchtitan_ft.events import EVENTS_DIR_ENV
from torchtitan_ft.launcher_job import LAUNCHER_JOB_ENV
from torchtitan_ft.launcher_job import from_env as launcher_job_from_env
from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.state_loss import OnStateLoss

T = TypeVar("T")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
MANAGER_PORT_ENV = "TORCHFT_MANAGER_PORT"
REPLICA_GROUP_ID_ENV = "REPLICA_GROUP_ID"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"
SAMPLES_PER_BATCH_ENV = "TORCHFT_SAMPLES_PER_BATCH"
LIGHTHOUSE_OUTAGE_ENV = "TORCHFT_LIGHTHOUSE_OUTAGE"
ON_STATE_LOSS_ENV = "TORCHFT_ON_STATE_LOSS"
HEAL_INTERFACES_ENV = "TORCHFT_HEAL_INTERFACES"
HEAL_STALL_TIMEOUT_SEC_ENV = "TORCHFT_HEAL_STALL_TIMEOUT_SEC"

DEFAULT_TIMEOUT = timedelta(seconds=60)
DEFAULT_QUORUM_TIMEOUT = timedelta(seconds=60)
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=60)
DEFAULT_QUORUM_RETRIES = 0
DEFAULT_HEAL_STALL_TIMEOUT = timedelta(seconds=10)
"""The default transport's ``stall_timeout`` (``HTTPTransport``'s default too)."""

DEFAULT_LIGHTHOUSE_ADDR = "http://localhost:29510"


class Source(Enum):
    """Where a resolved setting came from."""

    ARGUMENT = "argument"
    ENV = "env"
    DEFAULT = "default"


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """One setting's value and its origin (``env_var`` names the variable when from env)."""

    value: T
    source: Source
    env_var: str | None = None

    def describe(self, secret: bool = False) -> str:
        """``value (origin)``; a ``secret`` is shown only as set or not."""
        origin = f"env {self.env_var}" if self.source is Source.ENV else self.source.value
        if secret:
            return f"{'set' if self.value is not None else 'none'} ({origin})"
        if isinstance(self.value, timedelta):
            return f"{self.value.total_seconds():g} s ({origin})"
        return f"{self.value!r} ({origin})"


@dataclass(frozen=True)
class ManagerSettings:
    """The Manager's resolved connection settings."""

    lighthouse_addr: Resolved[str]
    """Lighthouse URL; only group rank 0 uses it."""
    manager_port: Resolved[int]
    """Port of the ManagerServer on group rank 0; 0 picks a free port."""
    replica_id: Resolved[str]
    """Replica group id before the per-process uuid suffix; "" means uuid only."""
    store_addr: Resolved[str]
    """Host of this replica group's TCPStore."""
    store_port: Resolved[int]
    """Port of this replica group's TCPStore; 0 lets group rank 0 pick one (1-rank groups)."""
    group_rank: Resolved[int]
    """Rank inside the replica group."""
    group_world_size: Resolved[int]
    """Number of ranks in the replica group."""
    timeout: Resolved[timedelta]
    """Collectives, ``wrap_future``, ShouldCommit/CheckpointMetadata RPCs, checkpoint
    transfers."""
    quorum_timeout: Resolved[timedelta]
    """How long ``start_quorum`` waits for the lighthouse."""
    connect_timeout: Resolved[timedelta]
    """Connecting to the ManagerServer, the lighthouse and the TCPStore."""
    quorum_retries: Resolved[int]
    """Retries of a failed lighthouse quorum request by group rank 0's ManagerServer."""
    auth_token: Resolved[str | None]
    """The job token; ``None``: none. Never logged."""
    events_dir: Resolved[str | None] = Resolved(None, Source.DEFAULT)
    """Folder of the event stream (``torchtitan_ft.events``); ``None``: no stream."""
    samples_per_batch: Resolved[int | None] = Resolved(None, Source.DEFAULT)
    """Samples in one replica group's batch (one step), for the lighthouse's committed samples;
    ``None``: not said (the status page shows batches)."""
    lighthouse_outage: Resolved[LighthouseOutage] = Resolved(
        LighthouseOutage.PREVIOUS_QUORUM, Source.DEFAULT
    )
    """What group rank 0's ManagerServer does while the lighthouse cannot be reached."""
    on_state_loss: Resolved[OnStateLoss] = Resolved(OnStateLoss.CHECKPOINT, Source.DEFAULT)
    """What the group does when the lighthouse reports the job's state lost."""
    heal_interfaces: Resolved[tuple[str, ...]] = Resolved((), Source.DEFAULT)
    """The network interfaces heals may use (the default transport's ``interfaces``); empty:
    every interface, the fastest path measured."""
    heal_stall_timeout: Resolved[timedelta] = Resolved(DEFAULT_HEAL_STALL_TIMEOUT, Source.DEFAULT)
    """How long a heal's connection may receive no byte before the heal moves to the donor's
    next path (the default transport's ``stall_timeout``)."""
    launcher_job: Resolved[str | None] = Resolved(None, Source.DEFAULT)
    """The launcher's name for the job this process runs in, which the status page shows for
    the group (e.g. ``slurm:4312``, ``torchx:<app id>/replica_1``, ``pod:ft-groups-1``);
    ``None``: none known. Env only: ``TORCHFT_LAUNCHER_JOB`` > ``slurm:`` + ``SLURM_JOB_ID``
    (Slurm sets it in every job) > none (``_launcher_job``)."""
    overridden: tuple[str, ...] = ()
    """The ``TORCHFT_*`` variables that are set but lose to an argument (``overridden_env``)."""

    def record(self) -> dict[str, dict[str, object]]:
        """Every setting as ``{"value", "source"[, "env_var"]}`` (timeouts in seconds; the
        token only as set or not): the JSON-ready form of :meth:`describe`, for the event
        stream's ``start`` event."""
        out: dict[str, dict[str, object]] = {}
        for f in dataclasses.fields(self):
            resolved = getattr(self, f.name)
            if not isinstance(resolved, Resolved):
                continue
            value = resolved.value
            if f.name == "auth_token":
                value = value is not None
            elif isinstance(value, timedelta):
                value = value.total_seconds()
            elif isinstance(value, Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = {"value": value, "source": resolved.source.value}
            if resolved.env_var is not None:
                out[f.name]["env_var"] = resolved.env_var
        return out

    def describe(self) -> str:
        """One line naming every value and its source, e.g. for the start-up log."""
        names = (
            "lighthouse_addr",
            "manager_port",
            "replica_id",
            "store_addr",
            "store_port",
            "group_rank",
            "group_world_size",
            "timeout",
            "quorum_timeout",
            "connect_timeout",
            "quorum_retries",
            "events_dir",
            "samples_per_batch",
            "lighthouse_outage",
            "on_state_loss",
            "heal_interfaces",
            "heal_stall_timeout",
            "launcher_job",
        )
        described = [f"{n}={getattr(self, n).describe()}" for n in names]
        return ", ".join([*described, f"auth_token={self.auth_token.describe(secret=True)}"])


def _pick(arg: T | None, env: Mapping[str, str], var: str, default: T | None) -> Resolved[T]:
    if arg is not None:
        return Resolved(arg, Source.ARGUMENT)
    raw = env.get(var)
    if raw is not None and raw != "":
        return Resolved(raw, Source.ENV, var)  # type: ignore[arg-type]
    if default is None:
        raise ValueError(f"no value given and env var {var} is not set")
    return Resolved(default, Source.DEFAULT)


def _token(arg: str | None, env: Mapping[str, str]) -> Resolved[str | None]:
    """The job token: argument > ``TORCHFT_AUTH_TOKEN`` > none (``auth.resolve_token``)."""
    token = resolve_token(arg, env)
    if arg is not None:
        return Resolved(token, Source.ARGUMENT)
    if token is not None:
        return Resolved(token, Source.ENV, AUTH_TOKEN_ENV)
    return Resolved(None, Source.DEFAULT)


def _events_dir(arg: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Resolved[str | None]:
    """The events folder: argument > ``TORCHFT_EVENTS_DIR`` > none (an empty value is none)."""
    if arg is not None:
        return Resolved(os.fspath(arg), Source.ARGUMENT)
    if env.get(EVENTS_DIR_ENV):
        return Resolved(env[EVENTS_DIR_ENV], Source.ENV, EVENTS_DIR_ENV)
    return Resolved(None, Source.DEFAULT)


def _samples_per_batch(arg: int | None, env: Mapping[str, str]) -> Resolved[int | None]:
    """Samples per group batch: argument > ``TORCHFT_SAMPLES_PER_BATCH`` > none (an empty value
    is none); a positive integer."""
    if arg is not None:
        picked: Resolved[object] = Resolved(arg, Source.ARGUMENT)
    elif env.get(SAMPLES_PER_BATCH_ENV):
        picked = Resolved(env[SAMPLES_PER_BATCH_ENV], Source.ENV, SAMPLES_PER_BATCH_ENV)
    else:
        return Resolved(None, Source.DEFAULT)
    value = _as_int(picked, "samples_per_batch")
    if value.value < 1:
        origin = f"env var {value.env_var}" if value.env_var else "samples_per_batch"
        raise ValueError(
            f"{origin} must be a positive number of samples per batch, got {picked.value!r}"
        )
    return value  # type: ignore[return-value]


def resolve_heal_interfaces(
    arg: str | Sequence[str] | None, env: Mapping[str, str]
) -> Resolved[tuple[str, ...]]:
    """Argument > ``TORCHFT_HEAL_INTERFACES`` > none (every interface): interface names, a
    sequence or one comma-separated string (an empty value is unset). Raises ValueError
    naming where a malformed name came from (empty between commas, a ``/``, a space, more
    than 15 characters: not a Linux interface name). Whether they exist here is checked
    where the transport is built (``checkpoint.paths.offered``)."""
    if arg is not None:
        picked: Resolved[object] = Resolved(arg, Source.ARGUMENT)
    elif env.get(HEAL_INTERFACES_ENV):
        picked = Resolved(env[HEAL_INTERFACES_ENV], Source.ENV, HEAL_INTERFACES_ENV)
    else:
        return Resolved((), Source.DEFAULT)
    raw = picked.value
    if isinstance(raw, str):
        if not raw.strip():
            return Resolved((), picked.source, picked.env_var)
        names: list[object] = [n.strip() for n in raw.split(",")]
    else:
        names = list(raw)  # type: ignore[call-overload]
    origin = f"env var {picked.env_var}" if picked.env_var else "heal_interfaces"
    bad = [
        n
        for n in names
        if not isinstance(n, str) or not 0 < len(n) <= 15 or "/" in n or any(c.isspace() for c in n)
    ]
    if bad:
        raise ValueError(
            f"{origin} must name network interfaces (e.g. 'ib0' or 'ib0,eth1'), got {raw!r}: "
            f"{', '.join(repr(b) for b in bad)} is not an interface name"
        )
    return Resolved(tuple(names), picked.source, picked.env_var)


def _launcher_job(env: Mapping[str, str]) -> Resolved[str | None]:
    """The launcher's job name (``launcher_job.from_env``): ``TORCHFT_LAUNCHER_JOB`` (the
    TorchX components and the Kubernetes manifests set it) > ``slurm:<SLURM_JOB_ID>`` > none."""
    found = launcher_job_from_env(env)
    if found is None:
        return Resolved(None, Source.DEFAULT)
    return Resolved(found[0], Source.ENV, found[1])


E = TypeVar("E", bound=Enum)


def _choice(
    kind: type[E], arg: E | str | None, env: Mapping[str, str], env_var: str, default: E, name: str
) -> Resolved[E]:
    """Argument > ``env_var`` > ``default`` (an empty value is unset) for the choice ``name``:
    a ``kind`` member or its value; another value raises ValueError naming where it came from
    and the choices."""
    if arg is not None:
        picked: Resolved[object] = Resolved(arg, Source.ARGUMENT)
    elif env.get(env_var):
        picked = Resolved(env[env_var], Source.ENV, env_var)
    else:
        return Resolved(default, Source.DEFAULT)
    if isinstance(picked.value, kind):
        return picked  # type: ignore[return-value]
    try:
        member = kind(picked.value)
    except ValueError:
        origin = f"env var {picked.env_var}" if picked.env_var else name
        choices = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{origin} must be one of {choices}, got {picked.value!r}") from None
    return Resolved(member, picked.source, picked.env_var)


def _lighthouse_outage(
    arg: LighthouseOutage | str | None, env: Mapping[str, str]
) -> Resolved[LighthouseOutage]:
    """Argument > ``TORCHFT_LIGHTHOUSE_OUTAGE`` > ``previous_quorum``."""
    return _choice(
        LighthouseOutage, arg, env, LIGHTHOUSE_OUTAGE_ENV, LighthouseOutage.PREVIOUS_QUORUM,
        "lighthouse_outage",
    )  # fmt: skip


def _on_state_loss(arg: OnStateLoss | str | None, env: Mapping[str, str]) -> Resolved[OnStateLoss]:
    """Argument > ``TORCHFT_ON_STATE_LOSS`` > ``checkpoint``."""
    return _choice(
        OnStateLoss, arg, env, ON_STATE_LOSS_ENV, OnStateLoss.CHECKPOINT, "on_state_loss"
    )


_ENV_SETTINGS = {
    LIGHTHOUSE_ENV: "lighthouse_addr",
    MANAGER_PORT_ENV: "manager_port",
    TIMEOUT_SEC_ENV: "timeout",
    QUORUM_TIMEOUT_SEC_ENV: "quorum_timeout",
    CONNECT_TIMEOUT_SEC_ENV: "connect_timeout",
    QUORUM_RETRIES_ENV: "quorum_retries",
    AUTH_TOKEN_ENV: "auth_token",
    EVENTS_DIR_ENV: "events_dir",
    SAMPLES_PER_BATCH_ENV: "samples_per_batch",
    LIGHTHOUSE_OUTAGE_ENV: "lighthouse_outage",
    ON_STATE_LOSS_ENV: "on_state_loss",
    HEAL_INTERFACES_ENV: "heal_interfaces",
    HEAL_STALL_TIMEOUT_SEC_ENV: "heal_stall_timeout",
    LAUNCHER_JOB_ENV: "launcher_job",
}
"""The ``TORCHFT_*`` variables the Manager reads -> the setting each one gives."""


def validate_env(env: Mapping[str, str]) -> None:
    """Raises ValueError, naming the variable, for a ``TORCHFT_*`` variable that is set to a
    value the Manager could not use, whether or not an argument overrides it (a bad value is
    a mistake either way, and must not pass silently)."""

    def given(var: str) -> Resolved[object] | None:
        raw = env.get(var)
        return Resolved(raw, Source.ENV, var) if raw else None

    if (port := given(MANAGER_PORT_ENV)) is not None:
        value = _as_int(port, "port").value
        if not 0 <= value < 65536:
            raise ValueError(
                f"env var {MANAGER_PORT_ENV} must be a port in [0, 65536), got {value}"
            )
    for var in (
        TIMEOUT_SEC_ENV,
        QUORUM_TIMEOUT_SEC_ENV,
        CONNECT_TIMEOUT_SEC_ENV,
        HEAL_STALL_TIMEOUT_SEC_ENV,
    ):
        if (timeout := given(var)) is not None:
            _as_timeout(timeout, _ENV_SETTINGS[var])
    retries = given(QUORUM_RETRIES_ENV)
    if retries is not None and _as_int(retries, "quorum_retries").value < 0:
        raise ValueError(f"env var {QUORUM_RETRIES_ENV} must be >= 0, got {retries.value!r}")
    if (lighthouse := given(LIGHTHOUSE_ENV)) is not None:
        check_lighthouse_url(lighthouse)  # type: ignore[arg-type]
    resolve_token(None, env)
    _samples_per_batch(None, env)
    _lighthouse_outage(None, env)
    _on_state_loss(None, env)
    resolve_heal_interfaces(None, env)
    _launcher_job(env)


def overridden_env(settings: ManagerSettings, env: Mapping[str, str]) -> tuple[str, ...]:
    """The ``TORCHFT_*`` variables set in ``env`` whose setting came from an argument."""
    return tuple(
        var
        for var, name in _ENV_SETTINGS.items()
        if env.get(var) and getattr(settings, name).source is Source.ARGUMENT
    )


def overridden_message(settings: ManagerSettings, env: Mapping[str, str]) -> str | None:
    """One line naming each overridden variable, its value and the argument that wins (the
    token's value is never shown), or None."""
    if not settings.overridden:
        return None
    parts = []
    for var in settings.overridden:
        name = _ENV_SETTINGS[var]
        secret = name == "auth_token"
        shown = "(set)" if secret else f"{env.get(var)!r}"
        parts.append(f"{var}={shown} loses to {name}={getattr(settings, name).describe(secret)}")
    return (
        "set but overridden (an argument wins over the environment here; torchft 0.2.0 would "
        "use the variable): " + "; ".join(parts)
    )


def _as_int(r: Resolved[object], what: str) -> Resolved[int]:
    if isinstance(r.value, bool) or not isinstance(r.value, (int, str)):
        raise TypeError(f"{what} must be an int, got {r.value!r}")
    try:
        value = int(r.value)
    except ValueError:
        origin = f"env var {r.env_var}" if r.env_var else what
        raise ValueError(f"{origin} must be an integer, got {r.value!r}") from None
    return Resolved(value, r.source, r.env_var)


def _as_timeout(r: Resolved[object], what: str) -> Resolved[timedelta]:
    """A positive timedelta; from env, a number of seconds (torchft reads whole seconds; a
    fraction is accepted here)."""
    origin = f"env var {r.env_var}" if r.env_var else what
    if isinstance(r.value, timedelta):
        value = r.value
    elif isinstance(r.value, str):
        try:
            value = timedelta(seconds=float(r.value))
        except (ValueError, OverflowError):
            raise ValueError(
                f"{origin} must be a number of seconds, e.g. 60, got {r.value!r}"
            ) from None
    else:
        raise TypeError(f"{what} must be a datetime.timedelta, got {r.value!r}")
    if value <= timedelta(0):
        raise ValueError(f"{origin} must be positive, got {r.value!r}")
    return Resolved(value, r.source, r.env_var)


def resolve_timeouts(
    env: Mapping[str, str],
    *,
    timeout: timedelta | None = None,
    quorum_timeout: timedelta | None = None,
    connect_timeout: timedelta | None = None,
) -> tuple[Resolved[timedelta], Resolved[timedelta], Resolved[timedelta]]:
    """``(timeout, quorum_timeout, connect_timeout)``: argument, else ``TORCHFT_TIMEOUT_SEC``
    / ``TORCHFT_QUORUM_TIMEOUT_SEC`` / ``TORCHFT_CONNECT_TIMEOUT_SEC``, else 60 s each (the
    Manager's resolution, for callers that need the values before a Manager exists)."""
    return (
        _as_timeout(_pick(timeout, env, TIMEOUT_SEC_ENV, DEFAULT_TIMEOUT), "timeout"),
        _as_timeout(
            _pick(quorum_timeout, env, QUORUM_TIMEOUT_SEC_ENV, DEFAULT_QUORUM_TIMEOUT),
            "quorum_timeout",
        ),
        _as_timeout(
            _pick(connect_timeout, env, CONNECT_TIMEOUT_SEC_ENV, DEFAULT_CONNECT_TIMEOUT),
            "connect_timeout",
        ),
    )


def resolve_heal_stall_timeout(
    arg: timedelta | None, env: Mapping[str, str]
) -> Resolved[timedelta]:
    """Argument > ``TORCHFT_HEAL_STALL_TIMEOUT_SEC`` (seconds) > 10 s; a positive duration
    (ValueError naming where a bad value came from)."""
    picked = _pick(arg, env, HEAL_STALL_TIMEOUT_SEC_ENV, DEFAULT_HEAL_STALL_TIMEOUT)
    return _as_timeout(picked, "heal_stall_timeout")


def timeout_values(
    settings: ManagerSettings, pg_timeout: timedelta | None
) -> dict[timeouts.Key, timeouts.Value]:
    """The Manager's timeouts as they were set (argument, variable or default), and its
    process group's timeout when known, for ``timeouts.check_order``. The heal's stall
    timeout only when it was set (argument or variable): at its default beside a short step
    timeout the transport does not apply it (``HTTPTransport(stall_timeout)``)."""
    args = {
        "timeout": "step",
        "quorum_timeout": "quorum",
        "connect_timeout": "connect",
        "heal_stall_timeout": "heal_stall",
    }
    values = {}
    for name, key in args.items():
        resolved: Resolved[timedelta] = getattr(settings, name)
        if key == "heal_stall" and resolved.source is Source.DEFAULT:
            continue
        setting = f"env {resolved.env_var}" if resolved.env_var else f"Manager({name})"
        note = "(default)" if resolved.source is Source.DEFAULT else ""
        values[timeouts.Key(key)] = timeouts.seconds_value(
            resolved.value.total_seconds(), setting, note
        )
    if pg_timeout is not None:
        values[timeouts.Key.PROCESS_GROUP] = timeouts.seconds_value(
            pg_timeout.total_seconds(), "the process group's timeout"
        )
    return values


def resolve_manager_settings(
    *,
    env: Mapping[str, str],
    lighthouse_addr: str | None = None,
    port: int | None = None,
    replica_id: str | None = None,
    store_addr: str | None = None,
    store_port: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: timedelta | None = None,
    quorum_timeout: timedelta | None = None,
    connect_timeout: timedelta | None = None,
    quorum_retries: int | None = None,
    auth_token: str | None = None,
    events_dir: str | os.PathLike[str] | None = None,
    samples_per_batch: int | None = None,
    lighthouse_outage: LighthouseOutage | str | None = None,
    on_state_loss: OnStateLoss | str | None = None,
    heal_interfaces: str | Sequence[str] | None = None,
    heal_stall_timeout: timedelta | None = None,
    default_store_host: str = "127.0.0.1",
) -> ManagerSettings:
    """Resolves the Manager's settings: argument, else env var, else default.

    | setting | env var | default |
    |---|---|---|
    | lighthouse_addr | TORCHFT_LIGHTHOUSE | ``http://localhost:29510`` |
    | port | TORCHFT_MANAGER_PORT | 0 (free port) |
    | replica_id | REPLICA_GROUP_ID | "" (uuid only) |
    | store_addr | MASTER_ADDR | ``default_store_host`` |
    | store_port | MASTER_PORT | 0, only for 1-rank groups (else ValueError) |
    | rank | RANK | 0 |
    | world_size | WORLD_SIZE | 1 |
    | timeout | TORCHFT_TIMEOUT_SEC (seconds) | 60 s |
    | quorum_timeout | TORCHFT_QUORUM_TIMEOUT_SEC (seconds) | 60 s |
    | connect_timeout | TORCHFT_CONNECT_TIMEOUT_SEC (seconds) | 60 s |
    | quorum_retries | TORCHFT_QUORUM_RETRIES | 0 |
    | auth_token | TORCHFT_AUTH_TOKEN | none |
    | events_dir | TORCHFT_EVENTS_DIR | none (no event stream) |
    | samples_per_batch | TORCHFT_SAMPLES_PER_BATCH | none (the status page shows batches) |
    | lighthouse_outage | TORCHFT_LIGHTHOUSE_OUTAGE | ``previous_quorum`` |
    | on_state_loss | TORCHFT_ON_STATE_LOSS | ``checkpoint`` |
    | heal_interfaces | TORCHFT_HEAL_INTERFACES (comma-separated) | none (every interface) |
    | heal_stall_timeout | TORCHFT_HEAL_STALL_TIMEOUT_SEC (seconds) | 10 s |
    | (launcher_job) | TORCHFT_LAUNCHER_JOB, else ``slurm:`` + SLURM_JOB_ID | none |

    torchft 0.2.0 reads the same four ``TORCHFT_*`` variables but lets them override the
    arguments; here an argument wins, as for every other setting.

    An empty env var counts as unset; a set ``TORCHFT_*`` variable is checked even when an
    argument overrides it (``validate_env``), and ``overridden`` names those that lose to an
    argument. Raises ValueError for non-integer ports/ranks/retries, timeouts that are not
    positive numbers of seconds (the message names the env var when the value came from one),
    a ``samples_per_batch`` that is not a positive integer, a ``lighthouse_outage`` that is
    not a ``LighthouseOutage`` value, an ``on_state_loss`` that is not an ``OnStateLoss``
    value, a launcher job name that is not short printable ASCII, a rank outside
    ``[0, world_size)`` and a multi-rank group without a store port (its ranks could not find
    each other).
    """
    if store_port is not None and store_port < 0:
        raise ValueError(f"store_port must be >= 0, got {store_port}")
    validate_env(env)
    timeouts = resolve_timeouts(
        env, timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout
    )
    settings = ManagerSettings(
        lighthouse_addr=_pick(lighthouse_addr, env, LIGHTHOUSE_ENV, DEFAULT_LIGHTHOUSE_ADDR),
        manager_port=_as_int(_pick(port, env, MANAGER_PORT_ENV, 0), "port"),
        replica_id=_pick(replica_id, env, REPLICA_GROUP_ID_ENV, ""),
        store_addr=_pick(store_addr, env, MASTER_ADDR_ENV, default_store_host),
        store_port=_as_int(_pick(store_port, env, MASTER_PORT_ENV, 0), "store_port"),
        group_rank=_as_int(_pick(rank, env, RANK_ENV, 0), "rank"),
        group_world_size=_as_int(_pick(world_size, env, WORLD_SIZE_ENV, 1), "world_size"),
        timeout=timeouts[0],
        quorum_timeout=timeouts[1],
        connect_timeout=timeouts[2],
        quorum_retries=_as_int(
            _pick(quorum_retries, env, QUORUM_RETRIES_ENV, DEFAULT_QUORUM_RETRIES),
            "quorum_retries",
        ),
        auth_token=_token(auth_token, env),
        events_dir=_events_dir(events_dir, env),
        samples_per_batch=_samples_per_batch(samples_per_batch, env),
        lighthouse_outage=_lighthouse_outage(lighthouse_outage, env),
        on_state_loss=_on_state_loss(on_state_loss, env),
        heal_interfaces=resolve_heal_interfaces(heal_interfaces, env),
        heal_stall_timeout=resolve_heal_stall_timeout(heal_stall_timeout, env),
        launcher_job=_launcher_job(env),
    )
    settings = dataclasses.replace(settings, overridden=overridden_env(settings, env))
    if settings.quorum_retries.value < 0:
        raise ValueError(f"quorum_retries ({settings.quorum_retries.describe()}) must be >= 0")
    size, rank_ = settings.group_world_size.value, settings.group_rank.value
    if size < 1:
        raise ValueError(f"world_size must be >= 1, got {size}")
    if not 0 <= rank_ < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank_}")
    if size > 1 and settings.store_port.value == 0:
        raise ValueError(
            f"a replica group of {size} ranks needs a shared TCPStore: pass store_port "
            f"or set {MASTER_PORT_ENV}"
        )
    if not 0 <= settings.manager_port.value < 65536:
        raise ValueError(f"port must be in [0, 65536), got {settings.manager_port.value}")
    check_lighthouse_url(settings.lighthouse_addr)
    return settings


def is_lighthouse_url(url: str) -> bool:
    """Whether ``url`` has the form of a lighthouse address, ``http://host:port``."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None


def check_lighthouse_url(addr: Resolved[str]) -> None:
    """Raises ValueError unless the lighthouse address is ``http://host:port``."""
    if not is_lighthouse_url(addr.value):
        raise ValueError(
            f"lighthouse address {addr.describe()} is not http://host:port, "
            "e.g. http://localhost:29510"
        )


PER_ROUND_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun: "1" gives every incarnation of the workers a new store (the launcher,
``titan.launch``, sets it for every replica group it starts)."""


def store_key_prefix(env: Mapping[str, str]) -> str:
    """Prefix of the Manager's keys in the replica group's TCPStore.

    torchrun's agent store outlives the workers it restarts; keying by its restart count keeps
    ranks of a new incarnation from reading the previous incarnation's manager address. With
    a new store per incarnation (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) there is nothing to
    keep apart, and the restart count must not be used: the nodes of a multi-node group count
    differently (the node whose worker failed counts a restart, the others restart for the
    membership change and do not), so their ranks would look under different keys.
    """
    if env.get(PER_ROUND_STORE_ENV) == "1":
        return "torchft/"
    return f"torchft/{env.get(RESTART_COUNT_ENV) or '0'}/"


def port_in_use_message(port: Resolved[int], bind: str) -> str:
    """One line for a ManagerServer port that is taken: which port, where it was set, what to
    do."""
    if port.source is Source.ENV:
        origin = f"from {port.env_var}={port.value}"
    else:
        origin = f"from the Manager's port={port.value} argument"
    return (
        f"manager server port {port.value} ({origin}) is already in use ({bind}); stop the "
        f"process listening there or choose a free port (leave {MANAGER_PORT_ENV} unset and "
        "port=None to pick one automatically)"
    )
