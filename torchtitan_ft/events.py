"""The event stream: what a trainer's Manager did, one JSON object per line, for tools to read
(the failure demo, the benchmarks, the tests) instead of log wording.

Every Manager rank writes its own file when an events folder is configured (``Manager``'s
``events_dir`` argument, else the ``TORCHFT_EVENTS_DIR`` environment variable; neither: no
stream, the default). The file is ``<folder>/<replica id>.r<group rank>.jsonl``; the replica id
carries the per-process uuid, so a restarted process writes a new file. Each line is one
:class:`Event`: the common fields ``time``, ``kind``, ``replica_id``, ``group_rank`` and
``step``, then the kind's own fields (docs/operations.md, "Event stream", lists them all).

Writing costs one ``json.dumps``, one ``write`` and one ``flush`` per event, a few per step
(a commit or discard every step; quorum and heal events only when they happen).

    events = read_events("outputs/events")   # a file or a folder of them, time-ordered
    commits = [e for e in events if e.kind is EventKind.COMMIT]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import IO, Any

from torchtitan_ft.replica_ids import replica_name

logger: logging.Logger = logging.getLogger(__name__)

EVENTS_DIR_ENV = "TORCHFT_EVENTS_DIR"
"""Environment variable naming the events folder when the Manager's ``events_dir`` is not
given (TorchTitan: set it in the trainers' environment, e.g. before ``run_train.sh``)."""


class EventKind(StrEnum):
    """What happened; the value is the ``kind`` field of the JSON line."""

    START = "start"
    """The Manager of a (re)started process joined its replica group. Fields: ``pid``,
    ``process_started`` (Unix time at which this process began, to about 10 ms: a worker
    forked by ``./run_train.sh``'s zygote, its fork; None where ``/proc`` cannot tell),
    ``group_world_size``, ``settings`` (``ManagerSettings.record()``: each setting's value and
    source), ``overridden`` (the ``TORCHFT_*`` variables an argument beat)."""
    QUORUM = "quorum"
    """This rank got a quorum with a new id, or its role changed. Fields: ``quorum_id``,
    ``replica_ids`` (the members, in replica-rank order), ``participants`` (groups averaging
    gradients this step), ``max_step`` (the highest member step), ``role`` (a :class:`Role`),
    ``asked_at`` (Unix time at which this rank asked for the quorum: the wait is ``time``
    minus it)."""
    COMMIT = "commit"
    """The step committed; ``step`` is the committed step count after it. Fields:
    ``participants``."""
    DISCARD = "discard"
    """The step did not commit; ``step`` is unchanged. Fields: ``participants``, ``reason``
    (this rank's vote's reason, or that another rank of the group voted no)."""
    HEAL_START = "heal_start"
    """This rank starts receiving a donor's state. Fields: ``to_step`` (the donor's step),
    ``source_replica_rank``, ``source_address`` (the donor group's ManagerServer)."""
    HEAL_END = "heal_end"
    """A heal this rank started ended. Fields: ``outcome`` (a :class:`HealOutcome`),
    ``seconds`` (transfer, plus load when applied), ``bytes`` (tensor bytes received; 0 when
    the transfer failed), ``path`` (the path the state came over: ``<host:port> on
    <interface>`` for HTTP, the donor's interface as it offered it, or its URL from a
    transport that does not say; ``"process group"`` for the process-group transport; ``""``
    when the transfer failed before it had one), ``error`` (``""`` unless failed or not
    applied); over HTTP also ``path_address``, ``path_interface`` (``None``: not said),
    ``path_probe_mb_s`` (the probed rate, ``None``: not probed, e.g. the only path) and
    ``path_failures`` (the paths tried before it, each ``address (why)``)."""
    STRAGGLER = "straggler"
    """The lighthouse started or stopped reporting this replica group as a straggler (its
    compute slower than the others' by ``--straggler_factor``, or its link, by its link probes,
    by ``--straggler_link_factor``; nothing changes for the job). Fields: ``straggler``
    (whether it is one now), ``cause`` (``"compute"``, ``"link"``, ``"compute,link"``; ``""``
    when it ended), ``relative_speed`` (the others' typical compute time / this group's: 0.25
    is four times slower), ``link_relative_speed`` (the same for its link probes; 0.0 not
    judged), ``since_step`` (the group's step at which the report started; None when it
    ended)."""
    EXCLUDED = "excluded"
    """The lighthouse's straggler policy left this replica group out of the quorum: it runs
    its steps alone, without cross-group collectives, and commits none of them (each is a
    ``DISCARD``) until it is taken back. Fields: ``relative_speed``."""
    READMITTED = "readmitted"
    """The lighthouse took this group back into the quorum (it is fast again, or the others
    need it for ``min_replicas``); it heals from the others if it is behind. Fields:
    ``relative_speed``."""
    OVERSIZED_TIMEOUT = "oversized_timeout"
    """A timeout far above what the job needs (``timeouts.oversized``; judged once, on the
    first steps): what a peer that hangs would cost. Fields: ``timeout`` (its name),
    ``seconds``, ``step_seconds`` (the median measured step)."""
    STATE_LOST = "state_lost"
    """The lighthouse reports the job's state lost: the quorum's members are all behind the
    job's highest step and every member that held it is gone (docs/lighthouse.md, "State
    loss"). Once per loss and action in a process. Fields: ``lost_step`` (the step no member
    holds), ``holders`` (the last quorum's members, gone or restarted), ``max_step`` (the
    quorum's highest step, where training goes on), ``on_state_loss`` (the operator's choice:
    ``"checkpoint"``, ``"stop"`` or ``"from_scratch"``), ``action`` (what it came to:
    ``"train_on"``, or ``"stop"``: the process exits with status 3) and ``checkpoint_step``
    (with ``"checkpoint"``: the job's newest complete checkpoint, null if none; steps
    ``max_step + 1`` to ``lost_step`` are rolled back)."""
    FAULT = "fault"
    """The first error recorded in a step (the step will not commit). Fields: ``error`` (the
    exception's type name), ``message``, ``collective`` (raised by an allreduce)."""


class Role(StrEnum):
    """This replica group's part in a quorum's step (``EventKind.QUORUM``'s ``role``)."""

    PARTICIPANT = "participant"
    """Averages its gradients with the others."""
    HEALING = "healing"
    """Receives a donor's state this step (with an async quorum it contributes zeros; with a
    sync quorum it loads the state before its forward and participates)."""
    SPARE = "spare"
    """A member without a slot in the average (``FIXED_WITH_SPARES``), not healing."""


def process_started(stat: str, uptime: str, ticks_per_second: float, now: float) -> float | None:
    """Unix time at which a process began, from its ``/proc/<pid>/stat`` text, ``/proc/uptime``
    text and the kernel's clock ticks per second, read at Unix time ``now``; None when the
    texts do not parse. (``/proc/stat``'s boot time is whole seconds; the uptime keeps
    hundredths.)"""
    try:
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        since_boot = float(uptime.split()[0])
    except (IndexError, ValueError):
        return None
    return now - (since_boot - start_ticks / ticks_per_second)


def this_process_started() -> float | None:
    """:func:`process_started` for this process; None where ``/proc`` is missing."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = Path("/proc/uptime").read_text()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    return process_started(stat, uptime, ticks, time.time())


def quorum_role(participant_rank: int | None, healing: bool) -> Role:
    """This group's role in a quorum's step: healing first (it receives state, whatever its
    slot), else a participant when it has a slot in the average, else a spare."""
    if healing:
        return Role.HEALING
    return Role.PARTICIPANT if participant_rank is not None else Role.SPARE


class HealOutcome(StrEnum):
    """How a heal ended (``EventKind.HEAL_END``'s ``outcome``)."""

    APPLIED = "applied"
    """The received state was loaded."""
    FAILED = "failed"
    """The transfer or its check failed; the step is discarded and the next quorum retries."""
    NOT_APPLIED = "not_applied"
    """Received, but another rank of the group did not receive its own: nothing loaded."""


COMMON_FIELDS = ("time", "kind", "replica_id", "group_rank", "step")
"""The fields every line has, in this order, before the kind's own."""


@dataclass(frozen=True)
class Event:
    """One line of the stream."""

    time: float
    """Unix time (seconds) when it was written."""
    kind: EventKind
    replica_id: str
    """The replica group's id, with the per-process uuid suffix."""
    group_rank: int
    """This rank within its replica group."""
    step: int
    """The Manager's committed step count at that moment (after the commit, for COMMIT)."""
    data: dict[str, Any] = field(default_factory=dict)
    """The kind's own fields (see :class:`EventKind`)."""

    @property
    def replica_name(self) -> str:
        """The replica id without the per-process uuid suffix (``replica_1``)."""
        return replica_name(self.replica_id)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def to_json(self) -> str:
        common = {
            "time": self.time,
            "kind": self.kind.value,
            "replica_id": self.replica_id,
            "group_rank": self.group_rank,
            "step": self.step,
        }
        return json.dumps({**common, **self.data})

    @staticmethod
    def from_json(line: str) -> Event:
        """Parses one line; raises ``ValueError`` (``json.JSONDecodeError``, a missing common
        field, an unknown kind) when it is not an event."""
        raw = json.loads(line)
        if not isinstance(raw, dict) or any(name not in raw for name in COMMON_FIELDS):
            raise ValueError(f"not an event line (needs fields {COMMON_FIELDS}): {line!r}")
        return Event(
            time=float(raw.pop("time")),
            kind=EventKind(raw.pop("kind")),
            replica_id=str(raw.pop("replica_id")),
            group_rank=int(raw.pop("group_rank")),
            step=int(raw.pop("step")),
            data=raw,
        )


def events_file(directory: str | os.PathLike[str], replica_id: str, group_rank: int) -> Path:
    """Where one Manager rank writes: ``<directory>/<replica id>.r<group rank>.jsonl`` (a
    ``/`` or ``:`` of the replica id becomes ``_``)."""
    name = replica_id.replace("/", "_").replace(":", "_")
    return Path(directory) / f"{name}.r{group_rank}.jsonl"


class EventWriter:
    """Appends events of one Manager rank to its file; safe from any thread (one locked write
    and flush per line, so lines never interleave and a SIGKILL tears at most the last one).

    A writer made with ``path=None`` writes no file. A write that fails (``OSError``, e.g. a
    full disk) is logged once and ends the stream; training goes on.

    Args:
        path: the file (its folder is created), or None for no stream.
        replica_id: written on every line.
        group_rank: written on every line.
        step: returns the Manager's committed step count, written on every line.
        listener: called with every event, on the emitting thread, with or without a file
            (group rank 0's recovery watch, ``manager.recovery``); default None.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        replica_id: str,
        group_rank: int,
        step: Callable[[], int],
        listener: Callable[[Event], None] | None = None,
    ) -> None:
        self._replica_id = replica_id
        self._group_rank = group_rank
        self._step = step
        self._listener = listener
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close)

    @property
    def enabled(self) -> bool:
        """Whether ``emit`` writes (a path was given, and no write failed, and not closed)."""
        return self._file is not None

    def emit(self, kind: EventKind, **fields: Any) -> None:
        """Writes one event now (``fields``: the kind's own, JSON-serialisable; an Enum is
        written as its value)."""
        if self._file is None and self._listener is None:
            return
        data = {k: v.value if isinstance(v, Enum) else v for k, v in fields.items()}
        event = Event(time.time(), kind, self._replica_id, self._group_rank, self._step(), data)
        if self._listener is not None:
            self._listener(event)
        if self._file is None:
            return
        line = event.to_json() + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as e:  # a full disk must not stop training: the stream ends here
                logger.warning("event stream %s stopped: cannot write: %s", self.path, e)
                self._close()

    def close(self) -> None:
        """Closes the file; later events are dropped (``Manager.shutdown`` calls it)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def open_event_writer(
    events_dir: str | os.PathLike[str] | None,
    replica_id: str,
    group_rank: int,
    step: Callable[[], int],
    listener: Callable[[Event], None] | None = None,
) -> EventWriter:
    """The writer for one Manager rank into the folder ``events_dir`` (resolved against
    ``TORCHFT_EVENTS_DIR`` by ``manager.settings``); ``None`` or empty: no file
    (``listener``: see :class:`EventWriter`)."""
    path = events_file(events_dir, replica_id, group_rank) if events_dir else None
    return EventWriter(path, replica_id, group_rank, step, listener)


def parse_events(lines: Iterable[str]) -> list[Event]:
    """The events of some lines; a line that is not an event (a torn last line) is skipped."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            out.append(Event.from_json(line))
        except ValueError:
            continue
    return out


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """Every event of a file, or of the ``*.jsonl`` files of a folder (also in its
    subfolders), ordered by time. A missing path reads as no events."""
    path = Path(path)
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path] if path.exists() else []
    events = []
    for file in files:
        events.extend(parse_events(file.read_text(encoding="utf-8", errors="replace").splitlines()))
    return sorted(events, key=lambda e: e.time)
