"""Where every second of a recovery went, from a job's event stream (``torchtitan_ft.events``).

A **replacement** is a new process of a replica group (a new replica id with the same name,
``replica_1:<uuid>``) after an earlier one stopped; a **heal** is a group that received a
donor's state without restarting (it fell behind). For each, :func:`recoveries` gives the
phases between milestones the stream records, in order:

* ``noticed``: from the failed process's last event (its last sign of life) to the first sign
  that another group noticed: a ``fault`` (a collective's error, or a ``TimeoutError``), or a
  quorum without it;
* ``restart``: until the new process began (``start``'s ``process_started``);
* ``imports``: until its Manager was built (``start``: imports, the default process group);
* ``setup``: until it asked for its first quorum (``quorum``'s ``asked_at``: the trainer's
  set-up: model, parallelism, optimizer, data loader);
* ``quorum``: until the quorum came (``quorum``);
* ``heal``: until the received state was applied (``heal_end``);
* ``first_commit``: until its first commit as a participant.

A heal without a restart (and a group's first process that heals at its first quorum, a
``join``) has only the last three, from its healing quorum's request. A replacement's ``heal``
is the heal its first quorum began; without one (its first quorum did not have it heal: the
job's state was lost, say, and it trained on) a later heal of the process is a heal of its
own. A
milestone earlier than the one before it (torchrun may restart the process before the others
notice) counts as reached at that one, so the phase is 0 and the time is the earlier phase's:
the phases of a recovery add up to its total exactly. A recovery whose group never committed
again is ``complete=False``, its total up to its last milestone.

    python -m torchtitan_ft.recoveries outputs/events          # a short table
    python -m torchtitan_ft.recoveries outputs/events --json   # one JSON object per recovery

Reads group rank 0's events for the milestones (the heal's bytes: every rank's).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from torchtitan_ft.events import Event, EventKind, Role, read_events


class RecoveryKind(StrEnum):
    """What recovered."""

    REPLACEMENT = "replacement"
    """A new process of the group, after the previous one stopped."""
    HEAL = "heal"
    """A running group that fell behind received a donor's state."""
    JOIN = "join"
    """A group's first process healed at its first quorum (it started after the others, or
    ``init_sync`` made it load the first group's state): start-up, not a failure."""


class Noticed(StrEnum):
    """How the other groups noticed a replaced group's failure."""

    COLLECTIVE_ERROR = "collective_error"
    """A cross-group collective failed (a connection error, an abort)."""
    TIMEOUT = "timeout"
    """A wait timed out (``TimeoutError``): the peer hung, or no error reached the others."""
    QUORUM = "quorum"
    """A quorum without the group came first: the lighthouse dropped it (its heartbeat stream
    ended, or its heartbeats stopped for ``--heartbeat_timeout_ms``)."""
    NOT_SEEN = "not_seen"
    """No other group recorded it (it was alone, or the others had no step in flight)."""
    STREAM_END = "heartbeat_stream_end"
    """The lighthouse saw the failed process's heartbeat stream end (its process died; the
    lighthouse's breakdown, ``lighthouse.recoveries``)."""
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    """The lighthouse heard no heartbeat of it for ``--heartbeat_timeout_ms`` (it hung, or its
    host went away; the lighthouse's breakdown)."""


PHASES = ("noticed", "restart", "imports", "setup", "quorum", "heal", "first_commit")
"""The phases of a replacement, in order; a heal has the last three."""


@dataclass(frozen=True)
class Heal:
    """The state transfer of a recovery."""

    outcome: str
    """``applied``, ``failed`` or ``not_applied`` (``events.HealOutcome``)."""
    bytes: int
    """Tensor bytes received, all ranks of the group together."""
    seconds: float
    """Group rank 0's transfer (and load) time."""
    rate_mb_s: float | None
    """``bytes`` / ``seconds``, MB/s (None for a zero time)."""
    donor_replica_rank: int | None
    donor_address: str
    """The donor group's ManagerServer, through which the transfer was arranged."""
    to_step: int
    path: str = ""
    """The address the state came over (the transport's: the donor's checkpoint URL for
    HTTP; ``""`` when not recorded)."""


@dataclass(frozen=True)
class Recovery:
    """One replacement or heal of a replica group."""

    replica: str
    """The group's name (its replica id without the per-process uuid)."""
    replica_id: str
    """The recovering process's replica id."""
    kind: RecoveryKind
    started: float
    """Unix time of its first milestone (a replacement: the failed process's last event)."""
    total_s: float
    phases: dict[str, float]
    """Seconds per phase (:data:`PHASES`, those that apply), in order; they add up to
    ``total_s``."""
    complete: bool
    """Whether the group committed as a participant again."""
    noticed_by: Noticed | None = None
    """A replacement: how the others noticed."""
    failed_replica_id: str | None = None
    """A replacement: the process it replaced."""
    heal: Heal | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their values)."""
        out = asdict(self)
        out["kind"] = self.kind.value
        out["noticed_by"] = self.noticed_by.value if self.noticed_by else None
        return out


def _phases(
    names: Sequence[str], start: float, milestones: Sequence[float | None]
) -> dict[str, float]:
    """``names[i]`` lasts until ``milestones[i]`` from the one before (the first from
    ``start``); a milestone earlier than the one before it, or missing, counts as reached then.
    Missing milestones at the end end the phases (those phases are left out)."""
    known = len(milestones)
    while known and milestones[known - 1] is None:
        known -= 1
    out: dict[str, float] = {}
    reached = start
    for name, at in zip(names[:known], milestones[:known], strict=True):
        at = reached if at is None else max(at, reached)
        out[name] = round(at - reached, 6)
        reached = at
    return out


def _noticed(
    events: Sequence[Event], failed: str, name: str, since: float
) -> tuple[Noticed, float | None]:
    """The first sign, after ``since``, that another group noticed ``failed``."""
    for e in events:
        if e.time <= since or e.replica_name == name:
            continue
        if e.kind is EventKind.FAULT:
            kind = Noticed.TIMEOUT if e.get("error") == "TimeoutError" else Noticed.COLLECTIVE_ERROR
            return kind, e.time
        if e.kind is EventKind.QUORUM and failed not in e.get("replica_ids", ()):
            return Noticed.QUORUM, e.time
    return Noticed.NOT_SEEN, None


def _heal(events: Sequence[Event], start: Event) -> tuple[Heal | None, float | None]:
    """The heal begun at ``start`` (rank 0's ``heal_start``) and when it ended."""
    end = next(
        (
            e
            for e in events
            if e.kind is EventKind.HEAL_END
            and e.replica_id == start.replica_id
            and e.group_rank == 0
            and e.time >= start.time
        ),
        None,
    )
    if end is None:
        return None, None
    ends = [
        e
        for e in events
        if e.kind is EventKind.HEAL_END
        and e.replica_id == start.replica_id
        and start.time <= e.time
        and e.step == end.step
    ]
    return (
        make_heal(
            outcome=str(end.get("outcome")),
            nbytes=sum(int(e.get("bytes", 0)) for e in ends),
            seconds=float(end.get("seconds", 0.0)),
            donor_replica_rank=start.get("source_replica_rank"),
            donor_address=str(start.get("source_address", "")),
            to_step=int(start.get("to_step", -1)),
            path=str(end.get("path", "")),
        ),
        end.time,
    )


def make_heal(
    *,
    outcome: str,
    nbytes: int,
    seconds: float,
    donor_replica_rank: int | None,
    donor_address: str,
    to_step: int,
    path: str,
) -> Heal:
    """A :class:`Heal`, its rate computed."""
    return Heal(
        outcome=outcome,
        bytes=nbytes,
        seconds=seconds,
        rate_mb_s=round(nbytes / seconds / 1e6, 3) if seconds > 0 else None,
        donor_replica_rank=donor_replica_rank,
        donor_address=donor_address,
        to_step=to_step,
        path=path,
    )


def _first_participating_commit(own: Sequence[Event], after: float) -> float | None:
    """The time of the first commit after ``after`` in a step this rank participated in (the
    latest ``quorum`` event before it gave the role ``participant``)."""
    role = None
    for e in own:
        if e.kind is EventKind.QUORUM:
            role = e.get("role")
        elif e.kind is EventKind.COMMIT and e.time > after and role == Role.PARTICIPANT.value:
            return e.time
    return None


def recoveries(events: Iterable[Event]) -> list[Recovery]:
    """Every replacement and heal in a job's events (any order; all ranks, all groups),
    ordered by when each started."""
    events = sorted(events, key=lambda e: e.time)
    rank0 = [e for e in events if e.group_rank == 0]
    by_id: dict[str, list[Event]] = {}
    for e in rank0:
        by_id.setdefault(e.replica_id, []).append(e)
    by_name: dict[str, list[str]] = {}
    for replica_id, own in by_id.items():
        by_name.setdefault(own[0].replica_name, []).append(replica_id)
    last_event = {rid: max(e.time for e in events if e.replica_id == rid) for rid in by_id}

    out: list[Recovery] = []
    for name, ids in by_name.items():
        for i, replica_id in enumerate(ids):
            own = by_id[replica_id]
            heals = [e for e in own if e.kind is EventKind.HEAL_START]
            first_quorum = next((e for e in own if e.kind is EventKind.QUORUM), None)
            start = next((e for e in own if e.kind is EventKind.START), None)
            if i > 0 and start is not None:
                failed = ids[i - 1]
                first_heal = heals.pop(0) if _heals_at(first_quorum, heals[:1], own) else None
                out.append(
                    _replacement(
                        events, own, name, failed, last_event[failed], start, first_quorum,
                        first_heal,
                    )
                )  # fmt: skip
            joined = i == 0 and _heals_at(first_quorum, heals[:1], own)
            for j, heal_start in enumerate(heals):
                kind = RecoveryKind.JOIN if joined and j == 0 else RecoveryKind.HEAL
                out.append(_healed(events, own, name, heal_start, kind))
    return sorted(out, key=lambda r: r.started)


def _heals_at(quorum: Event | None, heals: Sequence[Event], own: Sequence[Event]) -> bool:
    """Whether the first of ``heals`` follows ``quorum`` with no other quorum between."""
    if quorum is None or not heals:
        return False
    between = [
        e for e in own if e.kind is EventKind.QUORUM and quorum.time < e.time < heals[0].time
    ]
    return quorum.get("role") == Role.HEALING.value and not between


def _asked(quorum: Event | None) -> float | None:
    if quorum is None:
        return None
    return float(quorum.get("asked_at", quorum.time))


def _replacement(
    events: Sequence[Event],
    own: Sequence[Event],
    name: str,
    failed: str,
    last_seen: float,
    start: Event,
    first_quorum: Event | None,
    heal_start: Event | None,
) -> Recovery:
    noticed_by, noticed_at = _noticed(events, failed, name, last_seen)
    heal, healed_at = _heal(events, heal_start) if heal_start is not None else (None, None)
    after = healed_at or (first_quorum.time if first_quorum is not None else start.time)
    return replacement(
        replica=name,
        replica_id=own[0].replica_id,
        failed_replica_id=failed,
        last_seen=last_seen,
        noticed_by=noticed_by,
        noticed_at=noticed_at,
        process_started=start.get("process_started") or start.time,
        manager_built=start.time,
        quorum_asked=_asked(first_quorum),
        quorum_received=first_quorum.time if first_quorum is not None else None,
        healed=healed_at if heal_start is not None else None,
        healing=heal_start is not None,
        committed=_first_participating_commit(own, after),
        heal=heal,
    )


def replacement(
    *,
    replica: str,
    replica_id: str,
    failed_replica_id: str,
    last_seen: float,
    noticed_by: Noticed,
    noticed_at: float | None,
    process_started: float | None,
    manager_built: float | None,
    quorum_asked: float | None,
    quorum_received: float | None,
    healed: float | None,
    healing: bool,
    committed: float | None,
    heal: Heal | None,
) -> Recovery:
    """A replacement from its milestones (Unix times; None: not reached or not known), from
    the failed process's last sign of life ``last_seen``; ``healing``: whether its first
    quorum had it heal (else it has no ``heal`` phase). The event stream's and the
    lighthouse's breakdowns (``lighthouse.recoveries``) both come from here."""
    milestones = [
        noticed_at,
        process_started,
        manager_built,
        quorum_asked,
        quorum_received,
        healed,
        committed,
    ]
    names = list(PHASES)
    if not healing:  # no heal: the first commit follows the quorum
        del names[PHASES.index("heal")]
        del milestones[PHASES.index("heal")]
    phases = _phases(names, last_seen, milestones)
    return Recovery(
        replica=replica,
        replica_id=replica_id,
        kind=RecoveryKind.REPLACEMENT,
        started=last_seen,
        total_s=round(sum(phases.values()), 6),
        phases=phases,
        complete=committed is not None,
        noticed_by=noticed_by,
        failed_replica_id=failed_replica_id,
        heal=heal,
    )


def _healed(
    events: Sequence[Event], own: Sequence[Event], name: str, start: Event, kind: RecoveryKind
) -> Recovery:
    quorum = next(
        (
            e
            for e in reversed(own)
            if e.kind is EventKind.QUORUM
            and e.time <= start.time
            and e.get("role") == Role.HEALING.value
        ),
        None,
    )
    heal, healed_at = _heal(events, start)
    return healed(
        replica=name,
        replica_id=start.replica_id,
        kind=kind,
        quorum_asked=_asked(quorum) or start.time,
        quorum_received=quorum.time if quorum is not None else start.time,
        healed_at=healed_at,
        committed=_first_participating_commit(own, healed_at or start.time),
        heal=heal,
    )


def healed(
    *,
    replica: str,
    replica_id: str,
    kind: RecoveryKind,
    quorum_asked: float,
    quorum_received: float | None,
    healed_at: float | None,
    committed: float | None,
    heal: Heal | None,
) -> Recovery:
    """A heal or a join from its milestones (Unix times; None: not reached), from the request
    of the quorum that had it heal."""
    phases = _phases(
        ["quorum", "heal", "first_commit"],
        quorum_asked,
        [quorum_received, healed_at, committed],
    )
    return Recovery(
        replica=replica,
        replica_id=replica_id,
        kind=kind,
        started=quorum_asked,
        total_s=round(sum(phases.values()), 6),
        phases=phases,
        complete=committed is not None,
        heal=heal,
    )


def table(found: Sequence[Recovery]) -> str:
    """A short text table: one row per recovery, its phases in seconds."""
    head = ["replica", "kind", "noticed by", *PHASES, "total", "heal"]
    rows = [head]
    for r in found:
        heal = ""
        if r.heal is not None:
            rate = f"{r.heal.rate_mb_s:g} MB/s" if r.heal.rate_mb_s is not None else "-"
            heal = (
                f"{r.heal.bytes / 1e6:.1f} MB at {rate} from replica rank "
                f"{r.heal.donor_replica_rank} ({r.heal.donor_address})"
                + (f" over {r.heal.path}" if r.heal.path else "")
                + f", {r.heal.outcome}"
            )
        rows.append(
            [
                r.replica,
                r.kind.value,
                r.noticed_by.value if r.noticed_by else "",
                *(f"{r.phases[p]:.2f}" if p in r.phases else "" for p in PHASES),
                f"{r.total_s:.2f}" + ("" if r.complete else " (incomplete)"),
                heal,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ft.recoveries",
        description="Print a job's recoveries (replacements and heals), phase by phase, from "
        "its events folder (TORCHFT_EVENTS_DIR).",
    )
    parser.add_argument("events", help="the events folder (or one events file)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    events = read_events(args.events)
    if not events:
        parser.error(f"no events in {args.events!r} (expected *.jsonl files of the event stream)")
    found = recoveries(events)
    if args.json:
        for r in found:
            print(json.dumps(r.to_json()))
    elif found:
        print(table(found))
    else:
        print(f"no recoveries in {len(events)} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
