"""Group rank 0's record of its own recoveries, for the lighthouse's breakdown.

:class:`RecoveryWatch` follows the events its rank emits (``events.EventWriter``'s listener,
with or without an events folder) and keeps the milestones of the recovery under way, with
the same meaning as ``torchtitan_ft.recoveries`` gives them in the event stream:

* a process's **start**: when the process began (``start``'s ``process_started``), when its
  Manager was built (``start``), its first quorum (asked, received), the heal that quorum began
  if any, and its first commit as a participant;
* a **heal** of a running process: the quorum that had it heal (asked, received), the heal's
  end, and its next commit as a participant.

A recovery ends at that commit: :meth:`RecoveryWatch.take_reports` then returns it as a
``RecoveryReport``, sent to the lighthouse with the next quorum request (``GroupProgress``).
The lighthouse adds what it saw of the failed process a start replaced
(``lighthouse.recoveries``). A heal retried before the commit (the first failed) counts in the
same recovery, with the last heal's figures; a heal before a start's first commit that its
first quorum did not begin counts in the start's ``first_commit`` phase. A recovery without
that commit is never sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from torchtitan_ft.events import Event, EventKind, Role
from torchtitan_ft.proto import torchft_pb2 as pb


@dataclass
class _Pending:
    kind: str
    """``"start"`` or ``"heal"`` (``RecoveryReport.kind``)."""
    process_started: float = 0.0
    manager_built: float = 0.0
    quorum_asked: float | None = None
    quorum_received: float | None = None
    first_role: str | None = None
    """A start: its first quorum's role (a heal belongs to the start when that one began
    it)."""
    heal: Event | None = None
    """The last ``heal_start``."""
    heal_end: Event | None = None
    """The last ``heal_end`` after it."""


class RecoveryWatch:
    """The recovery under way and those ended (thread-safe: the training and the quorum
    thread both emit events)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: _Pending | None = None
        self._role: str | None = None
        self._healing_quorum: tuple[float, float] | None = None
        """(asked, received) of the last quorum that gave this rank the healing role."""
        self._reports: list[pb.RecoveryReport] = []

    def observe(self, event: Event) -> None:
        """Takes one event of this rank."""
        with self._lock:
            self._observe(event)

    def _observe(self, e: Event) -> None:
        pending = self._pending
        if e.kind is EventKind.START:
            self._pending = _Pending(
                "start",
                process_started=float(e.get("process_started") or e.time),
                manager_built=e.time,
            )
        elif e.kind is EventKind.QUORUM:
            self._role = e.get("role")
            asked = float(e.get("asked_at", e.time))
            if self._role == Role.HEALING.value:
                self._healing_quorum = (asked, e.time)
            if pending is not None and pending.quorum_asked is None:
                pending.quorum_asked, pending.quorum_received = asked, e.time
                pending.first_role = self._role
        elif e.kind is EventKind.HEAL_START:
            if (
                pending is not None
                and pending.kind == "start"
                and pending.first_role != (Role.HEALING.value)
            ):
                return  # not the start's heal: in its first_commit phase
            if pending is None:
                asked, received = self._healing_quorum or (e.time, e.time)
                pending = self._pending = _Pending(
                    "heal", quorum_asked=asked, quorum_received=received
                )
            pending.heal, pending.heal_end = e, None
        elif e.kind is EventKind.HEAL_END:
            if pending is not None and pending.heal is not None:
                pending.heal_end = e
        elif e.kind is EventKind.COMMIT and (
            pending is not None
            and pending.quorum_received is not None
            and self._role == Role.PARTICIPANT.value
        ):
            self._reports.append(_report(pending, e.time))
            self._pending = None

    def take_reports(self) -> list[pb.RecoveryReport]:
        """The recoveries that ended since the last call, oldest first."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports


def _report(p: _Pending, committed: float) -> pb.RecoveryReport:
    report = pb.RecoveryReport(
        kind=p.kind,
        process_started=p.process_started,
        manager_built=p.manager_built,
        quorum_asked=p.quorum_asked or 0.0,
        quorum_received=p.quorum_received or 0.0,
        first_commit=committed,
    )
    if p.heal is not None:
        report.heal_to_step = int(p.heal.get("to_step", -1))
        donor = p.heal.get("source_replica_rank")
        if donor is not None:
            report.donor_replica_rank = int(donor)
        report.donor_address = str(p.heal.get("source_address", ""))
    if p.heal_end is not None:
        report.healed = p.heal_end.time
        report.heal_path = str(p.heal_end.get("path", ""))
        report.heal_outcome = str(p.heal_end.get("outcome", ""))
        report.heal_seconds = float(p.heal_end.get("seconds", 0.0))
        report.heal_bytes = int(p.heal_end.get("bytes", 0))
    return report
