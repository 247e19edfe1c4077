"""Every fault-tolerance timeout in one table, the relations between them that must hold, and
the checks made of them (pure: values in, a verdict out).

A timeout is a bound on one wait (:data:`TIMEOUTS`). Some waits contain others, or run while
another process waits on them, so their bounds must be ordered (:data:`RELATIONS`): otherwise
the outer wait gives up first and the failure surfaces under the wrong name (a quorum timeout
below the process-group timeout reports "no quorum from the lighthouse" for a hung
collective), or a failure on the replica axis takes a whole replica group down (TorchTitan's
own collective timeout below the process-group timeout; torchtitan #2899).

Where the values are known together, they are checked before anything starts: the TorchTitan
plugin's preflight (``titan.preflight.check_timeout_order``, on the ``fault_tolerance`` fields,
the ``TORCHFT_*`` variables standing in for unset ones, and ``comm.*``), the ``Manager`` at
construction (its resolved arguments or variables and its process group's timeout), the
lighthouse on its flags. :func:`check_order` names the first violated relation, both values as
they were set, and values that satisfy it, in one line.

At run time, :func:`oversized` finds timeouts far above what the job needs (:data:`OVERSIZE_FACTOR`
times the measured step, and above :data:`OVERSIZE_FLOOR_S`): harmless while nothing fails,
but each is how long a hung peer can stall the survivors (torchft #329 raised them to
3,000-6,000 s "thinking they wouldn't slow down the process"). The Manager warns once.

docs/timeouts.md's tables are generated from :data:`TIMEOUTS` and :data:`RELATIONS`
(``scripts/gen_config_docs.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Key(StrEnum):
    """A timeout (or the period it is compared with), as the relations name it."""

    PROCESS_GROUP = "process_group"
    STEP = "step"
    QUORUM = "quorum"
    CONNECT = "connect"
    HEAL_STALL = "heal_stall"
    JOIN = "join"
    HEARTBEAT = "heartbeat"
    HEARTBEAT_INTERVAL = "heartbeat_interval"
    TITAN_TRAIN = "titan_train"
    TITAN_INIT = "titan_init"


@dataclass(frozen=True)
class Timeout:
    """One row of the table."""

    key: Key
    title: str
    """How the docs name it (the config field or flag users know)."""
    default_s: float
    set_with: str
    """Every way to set it, Markdown."""
    bounds: str
    """The wait it bounds, Markdown."""
    hang_cost: str = ""
    """What a peer that hangs costs when this timeout is large (``""``: it does not bound a
    wait on a hung peer; never reported as oversized)."""


TIMEOUTS: tuple[Timeout, ...] = (
    Timeout(
        Key.PROCESS_GROUP,
        "`process_group_timeout_ms`",
        10.0,
        "config; `ProcessGroupGloo(timeout)` / `ProcessGroupNCCL(timeout)`",
        "building the cross-group process group after a quorum change (store connection + "
        "rendezvous with every peer), and each cross-group collective. A peer that is alive "
        "but never joins a collective (hung, SIGSTOP) and that the lighthouse does not name "
        "gone first (`--heartbeat_timeout_ms`) is noticed only here; a killed peer is usually "
        "noticed at once by a connection error",
        "a peer that hangs in a collective stalls every other group's step this long before "
        "it is discarded",
    ),
    Timeout(
        Key.STEP,
        "`step_timeout_ms`",
        60.0,
        "config; `Manager(timeout)`, else `TORCHFT_TIMEOUT_SEC`",
        "the Manager's per-step waits: each all-reduce future (`wrap_future`), the "
        "`ShouldCommit` vote (a barrier over the group's ranks), the `CheckpointMetadata` call "
        "and the checkpoint send/receive when healing (`HTTPTransport(timeout)`, "
        "`PGTransport(timeout)` get this value), how long a receiver's lease keeps a withdrawn "
        "snapshot alive and how long the checkpoint server waits on a stuck peer",
        "a rank that hangs before its commit vote, or a donor that hangs mid-transfer, stalls "
        "its peers this long",
    ),
    Timeout(
        Key.QUORUM,
        "`quorum_timeout_ms`",
        60.0,
        "config; `Manager(quorum_timeout)`, else `TORCHFT_QUORUM_TIMEOUT_SEC`; "
        "`start_quorum(timeout=)`",
        "one quorum: waiting for every rank of the group to ask, then for the lighthouse to "
        "issue a quorum that contains this group. The lighthouse client keeps retrying an "
        "unreachable lighthouse until this deadline, unless the group goes on on its previous "
        "quorum meanwhile (`lighthouse_outage`, [lighthouse.md](lighthouse.md#a-lighthouse-"
        "outage)); `quorum_retries` retries other failures within the same deadline",
        "a rank of this group that hangs before asking for the quorum stalls the group's "
        "other ranks this long",
    ),
    Timeout(
        Key.CONNECT,
        "`connect_timeout_ms`",
        60.0,
        "config; `Manager(connect_timeout)`, else `TORCHFT_CONNECT_TIMEOUT_SEC`",
        "start-up and connections inside a group: the group's TCPStore (ranks > 0 wait this "
        "long for group rank 0 to publish its ManagerServer address), connecting a "
        "`ManagerClient` to the group's server or, when healing, to the donor's server, and a "
        "unary lighthouse `heartbeat()`. It does **not** shorten a quorum request to a "
        "lighthouse that cannot be reached: that waits `quorum_timeout_ms`",
        "a donor whose server hangs while a healing group connects stalls the heal this long",
    ),
    Timeout(
        Key.HEAL_STALL,
        "`heal_stall_timeout_ms`",
        10.0,
        "config; `Manager(heal_stall_timeout)`, else `TORCHFT_HEAL_STALL_TIMEOUT_SEC`; "
        "`HTTPTransport(stall_timeout)`",
        'one path of a heal over HTTP (`checkpoint_transport = "http"`): a connection to '
        "the donor that receives no byte this long (a pulled cable or a dead switch resets "
        "nothing) counts as failed, and the transfer restarts on the donor's next path "
        "([operations.md](operations.md#the-heals-network-path)); the whole heal, every path "
        "together, stays bounded by `step_timeout_ms`",
    ),
    Timeout(
        Key.JOIN,
        "`--join_timeout_ms`",
        60.0,
        "lighthouse flag",
        "how long a quorum round waits for healthy replicas that have not asked yet before "
        "issuing without them: a group that heartbeats but is still starting up, or whose "
        "ManagerServer is still waiting for one of its ranks. Does not apply to a *fast "
        "quorum* (every member of the previous quorum asked again), the steady state. For "
        "LocalSGD/DiLoCo it is the outer sync's deadline "
        "([operations.md](operations.md#stragglers))",
    ),
    Timeout(
        Key.HEARTBEAT,
        "`--heartbeat_timeout_ms`",
        5.0,
        "lighthouse flag",
        "how long a replica may go without a heartbeat before the lighthouse considers it "
        "unhealthy. Our managers hold a heartbeat stream, so a dead process drops out at once; "
        "this timeout governs hung processes (stream open, no heartbeats) and torchft clients. "
        "It is also how long the survivors of a hung group wait in their collective before "
        "aborting it: the lighthouse names the group gone to their `GoneMembers` long poll "
        '(architecture.md, "A hung peer"), instead of their waiting for '
        "`process_group_timeout_ms`; the same for one hung rank of a group, whose ranks > 0 "
        "heartbeat on streams of their own",
    ),
    Timeout(
        Key.HEARTBEAT_INTERVAL,
        "heartbeat interval",
        0.1,
        "`Manager(heartbeat_interval)` (not in the config)",
        "not a timeout: how often each rank heartbeats on its stream",
    ),
    Timeout(
        Key.TITAN_TRAIN,
        "`comm.train_timeout_seconds`",
        100.0,
        "TorchTitan config",
        "TorchTitan's own process groups (the inner mesh, inside one replica group) after the "
        "first step (TorchTitan lowers the timeout to it when `Trainer.step == 1`)",
    ),
    Timeout(
        Key.TITAN_INIT,
        "`comm.init_timeout_seconds`",
        300.0,
        "TorchTitan config",
        "the same process groups during initialization and the first training step",
    ),
)
"""Every fault-tolerance timeout, with its default in seconds."""

BY_KEY: dict[Key, Timeout] = {t.key: t for t in TIMEOUTS}


class CheckedAt(StrEnum):
    """Where a relation is checked before anything starts."""

    START = "start"
    """By the TorchTitan preflight and the Manager wherever both values are known to them."""
    TITAN = "titan"
    """By the TorchTitan preflight only (one side is a TorchTitan setting)."""
    NOWHERE = "nowhere"
    """The two values live in different processes (a lighthouse flag and a trainer's
    setting): documented, not checked."""


@dataclass(frozen=True)
class Relation:
    """``upper >= factor * lower`` (``>`` when ``strict``) must hold."""

    lower: Key
    upper: Key
    why: str
    """What goes wrong otherwise, Markdown."""
    checked_at: CheckedAt
    factor: float = 1.0
    strict: bool = False

    def holds(self, lower_s: float, upper_s: float) -> bool:
        """Whether the relation holds for these values (seconds)."""
        bound = self.factor * lower_s
        return upper_s > bound if self.strict else upper_s >= bound

    def formula(self) -> str:
        """``step_timeout_ms >= process_group_timeout_ms``, as the docs and messages write it."""
        lower = BY_KEY[self.lower].title.strip("`")
        upper = BY_KEY[self.upper].title.strip("`")
        factor = f"{self.factor:g} x " if self.factor != 1.0 else ""
        return f"{upper} {'>' if self.strict else '>='} {factor}{lower}"


RELATIONS: tuple[Relation, ...] = (
    Relation(
        Key.PROCESS_GROUP,
        Key.STEP,
        "a failed or hung collective must be detected (and recorded, so the step is "
        "discarded) before the step's own wait on it gives up",
        CheckedAt.START,
    ),
    Relation(
        Key.CONNECT,
        Key.QUORUM,
        "connecting (to the group's server, to the lighthouse) is part of a quorum request",
        CheckedAt.START,
    ),
    Relation(
        Key.PROCESS_GROUP,
        Key.QUORUM,
        "a group can come to its next quorum request up to one process-group timeout late "
        "(its collective or reconfiguration waited on a peer that never joined), and the "
        "other groups' requests wait for it at the lighthouse; a shorter quorum timeout fails "
        "them first, as `no quorum from the lighthouse`, which points at the wrong cause",
        CheckedAt.START,
    ),
    Relation(
        Key.HEAL_STALL,
        Key.STEP,
        "the step timeout bounds the whole heal, every path together: a stall bound that is not "
        "below it never fires first, and a pulled cable fails the heal instead of moving it to "
        "the donor's next path. Checked where the stall timeout is set (field, variable or "
        "argument): at its default beside a step timeout of 10 s or less it is not applied, and "
        "the step timeout alone bounds each path",
        CheckedAt.START,
        strict=True,
    ),
    Relation(
        Key.PROCESS_GROUP,
        Key.TITAN_TRAIN,
        "the cross-group all-reduce runs in FSDP's hook during the backward (DiLoCo: at a "
        "sync): while one rank of a group waits there for a peer that never joins, the "
        "group's other ranks wait in their next TorchTitan collective. If TorchTitan's timeout "
        "fires first, the group's own collectives fail and the whole group goes down (and "
        "restarts and heals): a failure on the replica axis becomes the loss of a group "
        "(torchtitan #2899)",
        CheckedAt.TITAN,
        strict=True,
    ),
    Relation(
        Key.PROCESS_GROUP,
        Key.TITAN_INIT,
        "the same during TorchTitan's initialization and first step, which a replacement "
        "spends joining the others' process group and healing",
        CheckedAt.TITAN,
        strict=True,
    ),
    Relation(
        Key.HEARTBEAT_INTERVAL,
        Key.HEARTBEAT,
        "a few late heartbeats (a busy or slow machine) must not make the lighthouse drop a "
        "healthy replica",
        CheckedAt.NOWHERE,
        factor=10.0,
    ),
)
"""The relations that must hold between :data:`TIMEOUTS`, first checked first.

Not a relation here: torchtitan #2899 also asks for the init timeout below the quorum
timeout, so that a new group's initialization does not outlast the others' quorum request. Here
the lighthouse issues the survivors' quorum without a group that is still starting up after
``--join_timeout_ms``, so they do not wait for it, and nothing fails either way."""


@dataclass(frozen=True)
class Value:
    """A timeout's value as it was set, for the check and its message."""

    seconds: float
    setting: str
    """How the user set it, e.g. ``fault_tolerance.quorum_timeout_ms``, ``env
    TORCHFT_QUORUM_TIMEOUT_SEC``, ``Manager(quorum_timeout)``."""
    unit_s: float = 1.0
    """Seconds per unit of the setting (0.001 for a ``*_ms`` field), to write values in it."""
    note: str = ""
    """Appended to the setting's name in a message, e.g. ``(as fault_tolerance.x is not set)``."""

    def shown(self, seconds: float | None = None) -> str:
        """``seconds`` (default: the value) in the setting's unit, without needless decimals."""
        value = (self.seconds if seconds is None else seconds) / self.unit_s
        return f"{round(value, 3):g}"

    def named(self) -> str:
        """``fault_tolerance.quorum_timeout_ms=5000``, with the note if any."""
        return f"{self.setting}={self.shown()}" + (f" {self.note}" if self.note else "")


def config_value(field: str, ms: int, section: str = "fault_tolerance", note: str = "") -> Value:
    """The value of a ``*_ms`` config field."""
    return Value(ms / 1000, f"{section}.{field}", 0.001, note)


def seconds_value(seconds: float, setting: str, note: str = "") -> Value:
    """The value of a setting given in seconds (a ``TORCHFT_*`` variable, a ``timedelta``
    argument, TorchTitan's ``comm.*_seconds``)."""
    return Value(seconds, setting, 1.0, note)


@dataclass(frozen=True)
class Violation:
    """A relation that does not hold, with the values that break it."""

    relation: Relation
    lower: Value
    upper: Value

    def message(self) -> str:
        """One line: the relation, both values as set, why it must hold, values that do."""
        r = self.relation
        need_upper = r.factor * self.lower.seconds
        need_lower = self.upper.seconds / r.factor
        at_least = "above" if r.strict else "at least"
        at_most = "below" if r.strict else "at most"
        return (
            f"timeouts out of order: {self.upper.named()} must be "
            f"{'>' if r.strict else '>='} {f'{r.factor:g} x ' if r.factor != 1 else ''}"
            f"{self.lower.named()} ({r.formula()}): {r.why.replace('`', '')}; raise "
            f"{self.upper.setting} to {at_least} {self.upper.shown(need_upper)}, or lower "
            f"{self.lower.setting} to {at_most} {self.lower.shown(need_lower)}"
        )


def violations(values: Mapping[Key, Value]) -> list[Violation]:
    """Every relation of :data:`RELATIONS` whose two timeouts are both in ``values`` and that
    does not hold, in the table's order."""
    return [
        Violation(r, values[r.lower], values[r.upper])
        for r in RELATIONS
        if r.lower in values
        and r.upper in values
        and not r.holds(values[r.lower].seconds, values[r.upper].seconds)
    ]


def check_order(values: Mapping[Key, Value]) -> None:
    """Raises ``ValueError`` with :meth:`Violation.message` of the first violated relation
    among the timeouts given (the others are not known here)."""
    found = violations(values)
    if found:
        raise ValueError(found[0].message())


def defaults() -> dict[Key, Value]:
    """Every timeout at its default (they satisfy every relation; tests/test_timeouts.py)."""
    return {t.key: seconds_value(t.default_s, t.title.strip("`")) for t in TIMEOUTS}


OVERSIZE_FACTOR = 10.0
"""A timeout is far above what the job needs when it exceeds this many measured steps..."""
OVERSIZE_FLOOR_S = 600.0
"""... and this many seconds: ten times the defaults of the step, quorum and connect timeouts,
and far beyond a process restart plus a heal of a typical state, so that the defaults and the
settings of jobs with short steps never warn; a hang costs the survivors minutes past it."""


@dataclass(frozen=True)
class Oversized:
    """A timeout far above the measured step."""

    key: Key
    seconds: float
    step_s: float

    def message(self) -> str:
        """One line: the value, how far above the step it is, what it costs on a hang."""
        timeout = BY_KEY[self.key]
        return (
            f"{timeout.title.strip('`')} is {self.seconds:g} s, {self.seconds / self.step_s:.0f}x "
            f"the measured step ({self.step_s:.3g} s): {timeout.hang_cost} (up to "
            f"{self.seconds:g} s, nothing to do meanwhile); lower it to a few times the "
            "longest step or heal you expect"
        )


def oversized(values: Mapping[Key, float], step_s: float) -> list[Oversized]:
    """The timeouts of ``values`` (seconds) that bound a wait on a hung peer and exceed both
    :data:`OVERSIZE_FACTOR` x ``step_s`` (the job's typical step, seconds) and
    :data:`OVERSIZE_FLOOR_S`, in the table's order."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0 seconds, got {step_s}")
    return [
        Oversized(t.key, values[t.key], step_s)
        for t in TIMEOUTS
        if t.hang_cost
        and t.key in values
        and values[t.key] > OVERSIZE_FACTOR * step_s
        and values[t.key] > OVERSIZE_FLOOR_S
    ]


OVERSIZE_STEPS = 5
"""Steps measured before the timeouts are judged (the first, with its start-up and heal, is
not one of them)."""


class OversizeWatch:
    """Judges the timeouts once, on the median of the first :data:`OVERSIZE_STEPS` measured
    steps after the first; the caller passes each step's duration.

    Args:
        values: the timeouts to judge, seconds.
    """

    def __init__(self, values: Mapping[Key, float]) -> None:
        self._values = dict(values)
        self._seen = 0
        self._steps: list[float] = []
        self._done = False

    def step(self, step_s: float) -> list[Oversized] | None:
        """The oversized timeouts (maybe none) at the step that decides, else None (before
        it, and after: the judgement is made once)."""
        if self._done:
            return None
        self._seen += 1
        if self._seen == 1 or step_s <= 0:
            return None
        self._steps.append(step_s)
        if len(self._steps) < OVERSIZE_STEPS:
            return None
        self._done = True
        return oversized(self._values, sorted(self._steps)[len(self._steps) // 2])
