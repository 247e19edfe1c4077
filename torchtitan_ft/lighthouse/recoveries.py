"""The lighthouse's breakdown of each replica group's recoveries, for the status page,
``/status.json`` and ``torchft_lighthouse status``.

Two halves meet here. Each group's rank 0 reports the milestones of its own recoveries once
it committed again as a participant (``RecoveryReport`` in its ``GroupProgress``;
``manager.recovery``). The lighthouse saw the other half: when a group's process went away
(:class:`Departure`: its last sign of life, and when and how the lighthouse noticed: its
heartbeat stream ended, its heartbeats stopped for ``--heartbeat_timeout_ms``, or a quorum was
issued without it). A process's start after a departure of its group is a **replacement**
(phases noticed, restart, imports, set-up, quorum, heal, first commit); a start that healed
with no departure before it is a **join**; a running process's heal is a **heal**. The phases
come from ``torchtitan_ft.recoveries`` (the event stream's breakdown, ``python -m
torchtitan_ft.recoveries``), so they mean the same and add up to the total. The two can differ
in ``noticed``: here it is the lighthouse's noticing, there the first other group's (a
collective error, say). A group's first start without a heal is no recovery.

Wall clocks of the hosts are compared (the process's milestones against the lighthouse's), as
the event stream does; a milestone earlier than the one before it counts as reached then.
Nothing here reads a clock.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.recoveries import (
    PHASES,
    Heal,
    Noticed,
    Recovery,
    RecoveryKind,
    healed,
    make_heal,
    replacement,
)

RECOVERIES_KEPT = 20
"""Recoveries kept per group (the newest)."""
DEPARTURES_KEPT = 1000
"""Departures kept (one per group name, the newest)."""


def group_name(replica_id: str) -> str:
    """The replica id without the per-process uuid suffix (``replica_1``), as
    ``events.Event.replica_name``."""
    return replica_id.rsplit(":", 1)[0]


@dataclass(frozen=True)
class Departure:
    """A group's process the lighthouse saw go away."""

    replica_id: str
    last_seen: float
    """Its last sign of life (wall seconds): its last heartbeat, or the end of its heartbeat
    stream (a process's death closes it)."""
    noticed_at: float
    """When the lighthouse knew (wall seconds)."""
    how: Noticed
    """``STREAM_END``, ``HEARTBEAT_TIMEOUT`` or ``QUORUM`` (a quorum without it came
    first)."""


def recovery(
    replica_id: str,
    report: pb.RecoveryReport,
    departure: Departure | None,
    heal_bytes: int | None = None,
) -> Recovery | None:
    """The breakdown of ``report`` of group ``replica_id``; ``departure``: the newest
    departure of another process of the group (None: none seen); ``heal_bytes``: the heal's
    bytes as the group reported them (its ranks summed), else the report's (group rank 0's).
    None for a first start without a heal, and for a kind this lighthouse does not know (a
    newer client's)."""
    name = group_name(replica_id)
    heal = _heal(report, heal_bytes)
    healed_at = report.healed or None
    if report.kind == "start":
        if departure is not None and departure.last_seen <= report.manager_built:
            return replacement(
                replica=name,
                replica_id=replica_id,
                failed_replica_id=departure.replica_id,
                last_seen=departure.last_seen,
                noticed_by=departure.how,
                noticed_at=departure.noticed_at,
                process_started=report.process_started or None,
                manager_built=report.manager_built or None,
                quorum_asked=report.quorum_asked or None,
                quorum_received=report.quorum_received or None,
                healed=healed_at,
                healing=heal is not None,
                committed=report.first_commit or None,
                heal=heal,
            )
        if heal is None:
            return None
        kind = RecoveryKind.JOIN
    elif report.kind == "heal":
        kind = RecoveryKind.HEAL
    else:
        return None
    return healed(
        replica=name,
        replica_id=replica_id,
        kind=kind,
        quorum_asked=report.quorum_asked,
        quorum_received=report.quorum_received or None,
        healed_at=healed_at,
        committed=report.first_commit or None,
        heal=heal,
    )


def _heal(report: pb.RecoveryReport, heal_bytes: int | None) -> Heal | None:
    if not report.heal_outcome and not report.healed:
        return None
    return make_heal(
        outcome=report.heal_outcome,
        nbytes=report.heal_bytes if heal_bytes is None else heal_bytes,
        seconds=report.heal_seconds,
        donor_replica_rank=(
            report.donor_replica_rank if report.HasField("donor_replica_rank") else None
        ),
        donor_address=report.donor_address,
        to_step=report.heal_to_step,
        path=report.heal_path,
    )


def departure_before(departures: Mapping[str, Departure], replica_id: str) -> Departure | None:
    """The newest departure of ``replica_id``'s group by another process than itself."""
    found = departures.get(group_name(replica_id))
    return found if found is not None and found.replica_id != replica_id else None


# -- views --------------------------------------------------------------------------------


def describe(r: Mapping) -> str:
    """One recovery of ``/status.json`` (``Recovery.to_json``) in one line: its kind, how the
    failure was noticed, its total and each phase, and the heal (bytes, rate, donor, path)."""
    head = r["kind"] + (f" (noticed by {r['noticed_by']})" if r["noticed_by"] else "")
    total = f"{r['total_s']:.2f} s" + ("" if r["complete"] else " so far")
    phases = ", ".join(f"{p} {r['phases'][p]:.2f}" for p in PHASES if p in r["phases"])
    text = f"{head}: {total} = {phases}"
    heal = r.get("heal")
    if heal:
        rate = f"{heal['rate_mb_s']:g} MB/s" if heal["rate_mb_s"] is not None else "rate -"
        text += (
            f"; heal {heal['bytes'] / 1e6:.1f} MB at {rate} from replica rank "
            f"{heal['donor_replica_rank']} ({heal['donor_address'] or '?'}) over "
            f"{heal['path'] or '?'}, {heal['outcome']}"
        )
    return text


def text_lines(groups: Iterable[Mapping]) -> list[str]:
    """``torchft_lighthouse status``'s lines: each group's recoveries, newest last."""
    lines = []
    for g in groups:
        for r in g.get("recoveries", ()):
            lines.append(f"  {g['replica_id']}: {describe(r)}")
    return ["", "recoveries (oldest first):", *lines] if lines else []


def html_section(groups: Iterable[Mapping]) -> str:
    """The status page's recoveries table (empty when there is none)."""
    rows = [
        f'<tr class="recovery" data-group="{html.escape(g["replica_id"])}">'
        f"<td>{html.escape(g['replica_id'])}</td><td>{html.escape(describe(r))}</td></tr>"
        for g in groups
        for r in g.get("recoveries", ())
    ]
    if not rows:
        return ""
    return (
        "<h2>Recoveries</h2>\n<p>Each recovery's phases, in seconds; they add up to its total "
        "(<code>python -m torchtitan_ft.recoveries</code> gives the same from the event "
        'stream).</p>\n<table id="recoveries"><tr><th>group</th><th>recovery</th></tr>\n'
        + "\n".join(rows)
        + "\n</table>"
    )
