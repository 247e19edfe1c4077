"""The job's story: a bounded log of what happened to its replica groups, and why.

The lighthouse records a :class:`HistoryEntry` (wall time, kind, group, reason) at each change
it sees: quorums issued with a new membership (who joined, who left and why), fast and slow
rounds, groups left out by the join timeout, kills asked for on the status page, commit
failures and heals the groups report, heartbeats lost and regained, straggler reports and the
straggler policy's exclusions, and its own start or restart. The status page, ``/events``,
``/metrics`` and ``torchft_lighthouse status`` read it.

Not to be confused with the replica groups' own event stream (``torchtitan_ft.events``:
``Event``/``EventKind``, one file per process): some kinds share a value ("quorum",
"straggler", "excluded") with another meaning there, so the two vocabularies have distinct
names in code (``HistoryKind``/``HistoryEntry`` here); the values written are unchanged.

The reducers (``membership_events``, ``why_left``, ``heartbeat_events``) are pure functions of
state and time; :class:`History` only stores what they return.

Memory: events live in a ring of ``capacity`` slots kept as columns (a float array for times,
a byte array for kinds, lists of interned strings for groups and reasons): about 25 bytes per
event plus the text of the reasons that differ (``benchmarks/history_memory.py`` measures it).

Persistence (``state_dir``): each event is appended to ``events.jsonl`` as one JSON line; the
file is rewritten with the newest ``capacity`` events when it reaches twice that. A lighthouse
started on the same directory loads them, continues their sequence numbers and records a
``lighthouse_restart``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Set
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from torchtitan_ft.lighthouse.decision import RoundKind

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
DEFAULT_CAPACITY = 10_000
"""Events kept in memory (and, about twice as many, on disk)."""


class HistoryKind(StrEnum):
    """What happened to the job, as the lighthouse saw it; ``/events`` and ``events.jsonl``
    write the value."""

    LIGHTHOUSE_START = "lighthouse_start"
    """The lighthouse started with no history (no ``--state_dir`` or an empty one)."""
    LIGHTHOUSE_RESTART = "lighthouse_restart"
    """The lighthouse started on a ``--state_dir`` holding an earlier run's history."""
    QUORUM = "quorum"
    """A quorum with a new id was issued; the reason says who joined and left, and the round
    (fast: every previous member back; full: every healthy group asked; join timeout)."""
    JOINED = "joined"
    """A group is a member of the quorum again (or for the first time)."""
    LEFT = "left"
    """A member of the previous quorum is not in the new one; the reason says why."""
    JOIN_TIMEOUT = "join_timeout"
    """A healthy group that had not asked was left out when the join timeout passed."""
    HEARTBEAT_LOST = "heartbeat_lost"
    """No heartbeat for ``--heartbeat_timeout_ms`` (a hung or stopped process)."""
    HEARTBEAT_REGAINED = "heartbeat_regained"
    """A group whose heartbeat was lost is heard from again."""
    STREAM_ENDED = "stream_ended"
    """A group's heartbeat stream ended: its process died or shut down."""
    COMMIT_FAILURES = "commit_failures"
    """A group reports failed commits (its last steps were discarded)."""
    KILL_REQUESTED = "kill_requested"
    """Someone asked the status page to kill a group."""
    HEAL = "heal"
    """A group reports a heal: source, bytes, seconds, outcome."""
    STRAGGLER = "straggler"
    """The straggler report of a group started."""
    STRAGGLER_ENDED = "straggler_ended"
    """The straggler report of a group ended."""
    EXCLUDED = "excluded"
    """The straggler policy left a group out of the quorum."""
    READMITTED = "readmitted"
    """The straggler policy took a group back."""
    STATE_LOST = "state_lost"
    """The job's state is lost: a quorum was issued whose members are all behind the job's
    highest step, after every member that held it was gone for the holder wait
    (``decision.state_guard``); the reason names the step and the holders. Group: ""."""


_KINDS = list(HistoryKind)
_KIND_INDEX = {kind: i for i, kind in enumerate(_KINDS)}


@dataclass(frozen=True)
class HistoryEntry:
    """One line of the job's history (``/events``, ``events.jsonl``)."""

    seq: int
    """Position in the job's history, from 1; ``/events?since=N`` returns those after N."""
    time: float
    """Wall time, seconds since the epoch."""
    kind: HistoryKind
    group: str
    """The replica group; "" for the job (quorums, lighthouse starts)."""
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": round(self.time, 3),
            "kind": self.kind.value,
            "group": self.group,
            "reason": self.reason,
        }


class LeftBecause(StrEnum):
    """Why a member of the previous quorum is not in the new one (``why_left``)."""

    STREAM_ENDED = "heartbeat stream ended (process died)"
    HEARTBEAT_LOST = "heartbeat lost (hung or stopped)"
    EXCLUDED = "left out by the straggler policy"
    JOIN_TIMEOUT = "did not ask before the join timeout"
    NOT_ASKED = "did not ask"


def why_left(
    replica_id: str,
    stream_ended: Set[str],
    healthy: Set[str],
    excluded: Set[str],
    round_kind: RoundKind,
) -> LeftBecause:
    """Why ``replica_id``, a member of the previous quorum, is not in the new one."""
    if replica_id in stream_ended:
        return LeftBecause.STREAM_ENDED
    if replica_id in excluded:
        return LeftBecause.EXCLUDED
    if replica_id not in healthy:
        return LeftBecause.HEARTBEAT_LOST
    if round_kind is RoundKind.JOIN_TIMEOUT:
        return LeftBecause.JOIN_TIMEOUT
    return LeftBecause.NOT_ASKED


def membership_events(
    previous: Iterable[str],
    members: Iterable[str],
    quorum_id: int,
    round_kind: RoundKind,
    left_because: Mapping[str, LeftBecause],
    were_members: Set[str] = frozenset(),
) -> list[tuple[HistoryKind, str, str]]:
    """The events of a new quorum id: one ``quorum`` for the job, then ``left`` (with
    ``left_because``'s reason) and ``joined`` per group, sorted by group. ``were_members``:
    the groups that were in an earlier quorum (a joined group is "back", else in its "first
    quorum"). ``(kind, group, reason)`` triples."""
    before, after = set(previous), list(members)
    joined = sorted(set(after) - before)
    left = sorted(before - set(after))
    parts = [f"quorum {quorum_id}: {len(after)} member(s), {round_kind.value} round"]
    if joined:
        parts.append("joined " + ", ".join(joined))
    if left:
        parts.append("left " + ", ".join(f"{rid} ({left_because[rid].value})" for rid in left))
    events = [(HistoryKind.QUORUM, "", "; ".join(parts))]
    events += [(HistoryKind.LEFT, rid, left_because[rid].value) for rid in left]
    events += [
        (HistoryKind.JOINED, rid, "back in the quorum" if rid in were_members else "first quorum")
        for rid in joined
    ]
    return events


def heartbeat_events(
    was_healthy: Set[str], healthy: Set[str], lost_before: Set[str], timeout_s: float
) -> list[tuple[HistoryKind, str, str]]:
    """Heartbeats lost (healthy before, not now) and regained (lost before, healthy now),
    sorted by group. The caller passes only groups that asked for a quorum (a readiness probe
    that heartbeats once is no replica group), and only those still known: a group whose
    stream ended was recorded as such."""
    lost = sorted(was_healthy - healthy)
    regained = sorted(healthy & lost_before)
    return [
        (HistoryKind.HEARTBEAT_LOST, rid, f"no heartbeat for {timeout_s:g} s") for rid in lost
    ] + [(HistoryKind.HEARTBEAT_REGAINED, rid, "heard from again") for rid in regained]


class History:
    """The job's last ``capacity`` events, optionally persisted under ``state_dir``.

    Args:
        capacity: events kept; older ones are dropped (>= 1).
        state_dir: a directory to append the events to and reload them from; None keeps them
            in memory only.
        wall: wall-clock seconds (``time.time``).
    """

    def __init__(self, capacity: int, state_dir: str | None, wall: Any) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._wall = wall
        self._times = array("d", bytes(8 * capacity))
        self._kinds = array("B", bytes(capacity))
        self._groups: list[str] = [""] * capacity
        self._reasons: list[str] = [""] * capacity
        self._next = 1
        """The next event's ``seq``."""
        self.counts: dict[tuple[HistoryKind, str], int] = {}
        """Events recorded by this process, by kind and reason (``/metrics``)."""
        self._file: IO[str] | None = None
        self._path: Path | None = None
        self._lines = 0
        restarted = False
        if state_dir is not None:
            self._path = Path(state_dir) / EVENTS_FILE
            try:
                restarted = self._load(self._path)
                self._file = _open(self._path)
            except OSError as e:
                raise OSError(
                    f"cannot keep the event history in {self._path}: {e.strerror or e}; "
                    "pick another --state_dir"
                ) from None
        if restarted:
            self.record(HistoryKind.LIGHTHOUSE_RESTART, "", f"history loaded from {self._path}")
        else:
            self.record(HistoryKind.LIGHTHOUSE_START, "", "no earlier history")

    @property
    def last_seq(self) -> int:
        return self._next - 1

    def __len__(self) -> int:
        return min(self._next - 1, self.capacity)

    def record(self, kind: HistoryKind, group: str, reason: str) -> HistoryEntry:
        event = self._store(self._next, self._wall(), kind, group, reason)
        key = (kind, _count_reason(kind, reason))
        self.counts[key] = self.counts.get(key, 0) + 1
        if self._file is not None and self._path is not None:
            try:
                self._append(event, self._file, self._path)
            except OSError as e:
                # The job goes on without persistence (a full disk): say it once.
                logger.warning(
                    "history: cannot write %s (%s); events are kept in memory only from now",
                    self._path,
                    e.strerror or e,
                )
                self.close()
        return event

    def record_all(self, events: Iterable[tuple[HistoryKind, str, str]]) -> None:
        for kind, group, reason in events:
            self.record(kind, group, reason)

    def since(self, seq: int, limit: int | None = None) -> list[HistoryEntry]:
        """Events after ``seq``, oldest first (at most ``limit``, the oldest of them)."""
        first = max(seq + 1, self._next - len(self))
        last = self._next if limit is None else min(self._next, first + limit)
        return [self._event(s) for s in range(first, last)]

    def __iter__(self) -> Iterator[HistoryEntry]:
        return iter(self.since(0))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- storage --------------------------------------------------------------------------

    def _store(
        self, seq: int, t: float, kind: HistoryKind, group: str, reason: str
    ) -> HistoryEntry:
        slot = (seq - 1) % self.capacity
        self._times[slot] = t
        self._kinds[slot] = _KIND_INDEX[kind]
        # Interned: a job repeats its group ids and most reasons, and the ring holds pointers.
        self._groups[slot] = sys.intern(group)
        self._reasons[slot] = sys.intern(reason)
        self._next = seq + 1
        return HistoryEntry(seq, t, kind, group, reason)

    def _event(self, seq: int) -> HistoryEntry:
        slot = (seq - 1) % self.capacity
        return HistoryEntry(
            seq,
            self._times[slot],
            _KINDS[self._kinds[slot]],
            self._groups[slot],
            self._reasons[slot],
        )

    def _load(self, path: Path) -> bool:
        """Loads the newest ``capacity`` events of an earlier run; whether there were any."""
        try:
            with path.open(encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return False
        loaded = 0
        for number, line in enumerate(lines[-self.capacity :], 1):
            try:
                d = json.loads(line)
                self._store(
                    int(d["seq"]), float(d["time"]), HistoryKind(d["kind"]), d["group"], d["reason"]
                )
                loaded += 1
            except (ValueError, KeyError, TypeError) as e:
                # A line cut short by a crash mid-write, or not ours: skip it, say so once.
                logger.warning(
                    "history: skipping line %d of %s (%s: %s)", number, path, type(e).__name__, e
                )
        self._lines = len(lines)
        return loaded > 0

    def _append(self, event: HistoryEntry, file: IO[str], path: Path) -> None:
        file.write(json.dumps(event.to_json()) + "\n")
        file.flush()
        self._lines += 1
        if self._lines >= 2 * self.capacity:
            # Bounded on disk too: keep the newest ``capacity`` events, swapped in atomically.
            file.close()
            tmp = path.with_suffix(".tmp")
            with tmp.open("w", encoding="utf-8") as f:
                f.writelines(json.dumps(e.to_json()) + "\n" for e in self)
            os.replace(tmp, path)
            self._lines = len(self)
            self._file = _open(path)


def _open(path: Path) -> IO[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a", encoding="utf-8")


def _count_reason(kind: HistoryKind, reason: str) -> str:
    """The ``reason`` label of an event's counter: the reason where it is one of a few fixed
    texts (why a group left), "" for kinds whose reasons carry figures."""
    return reason if kind is HistoryKind.LEFT else ""
