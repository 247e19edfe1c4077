"""The status page's timeline and sparklines, as inline SVG rendered on the server.

``lanes`` turns the history's ``joined``/``left`` events into each group's spells in the
quorum (a pure function of the events and the time); ``render_timeline`` draws one lane per
group with its spells as bars and a mark per event (its reason in a ``<title>``: the browser
shows it on hover; the page's script shows it on click too). Without scripts the SVG still
renders.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from torchtitan_ft.lighthouse.history import HistoryEntry, HistoryKind

JOB_LANE = "(job)"
"""The lane of events that concern the job, not one group (quorums, lighthouse starts)."""
MAX_MARKS = 2000
"""Most event marks drawn (the newest in range): the page stays light on a long bad night."""

_LANE_H = 22
_LABEL_W = 190
_WIDTH = 1100
_COLORS = {
    HistoryKind.LIGHTHOUSE_START: "#555",
    HistoryKind.LIGHTHOUSE_RESTART: "#555",
    HistoryKind.QUORUM: "#1565c0",
    HistoryKind.JOINED: "#2e7d32",
    HistoryKind.LEFT: "#c62828",
    HistoryKind.JOIN_TIMEOUT: "#ef6c00",
    HistoryKind.HEARTBEAT_LOST: "#ad1457",
    HistoryKind.HEARTBEAT_REGAINED: "#00838f",
    HistoryKind.STREAM_ENDED: "#b71c1c",
    HistoryKind.COMMIT_FAILURES: "#f9a825",
    HistoryKind.KILL_REQUESTED: "#000",
    HistoryKind.HEAL: "#6a1b9a",
    HistoryKind.STRAGGLER: "#8d6e63",
    HistoryKind.STRAGGLER_ENDED: "#8d6e63",
    HistoryKind.EXCLUDED: "#ef6c00",
    HistoryKind.READMITTED: "#2e7d32",
    HistoryKind.STATE_LOST: "#000",
}


def lanes(events: Iterable[HistoryEntry], now: float) -> dict[str, list[tuple[float, float]]]:
    """Each group's spells in the quorum, ``(start, end)`` wall times, oldest first: from
    its ``joined`` to its ``left`` (or ``now`` while it is in). A lighthouse restart ends every
    spell: the new one does not know who was in until the next quorum."""
    spells: dict[str, list[tuple[float, float]]] = {}
    since: dict[str, float] = {}
    for e in events:
        if e.kind is HistoryKind.JOINED:
            since.setdefault(e.group, e.time)
            spells.setdefault(e.group, [])
        elif e.kind is HistoryKind.LEFT and e.group in since:
            spells[e.group].append((since.pop(e.group), e.time))
        elif e.kind is HistoryKind.LIGHTHOUSE_RESTART:
            for group, start in since.items():
                spells[group].append((start, e.time))
            since.clear()
    for group, start in since.items():
        spells[group].append((start, now))
    return spells


def clock(t: float) -> str:
    """Wall time as the page writes it: ``HH:MM:SS`` UTC."""
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def render_timeline(
    events: Sequence[HistoryEntry], groups: Iterable[str], start: float, now: float
) -> str:
    """The timeline from ``start`` to ``now``: a lane per group (and one for the job)."""
    e = html.escape
    spells = lanes(events, now)
    order = [JOB_LANE, *sorted(set(groups) | set(spells))]
    row = {lane: i for i, lane in enumerate(order)}
    span = max(now - start, 1e-3)
    plot_w = _WIDTH - _LABEL_W - 10

    def x(t: float) -> float:
        return _LABEL_W + plot_w * (min(max(t, start), now) - start) / span

    height = _LANE_H * len(order) + 24
    parts = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
        f'height="{height}" role="img" aria-label="participating groups over time">'
    ]
    for lane, i in row.items():
        y = i * _LANE_H
        parts.append(
            f'<text x="4" y="{y + 15}" class="lane">{e(lane[:28])}</text>'
            f'<line x1="{_LABEL_W}" x2="{_WIDTH - 10}" y1="{y + 11}" y2="{y + 11}" '
            'stroke="#ddd"/>'
        )
        for s, t in spells.get(lane, ()):
            if t < start:
                continue
            parts.append(
                f'<rect class="spell" data-group="{e(lane)}" x="{x(s):.1f}" y="{y + 4}" '
                f'width="{max(x(t) - x(s), 1):.1f}" height="14" fill="#a5d6a7"/>'
            )
    in_range = [ev for ev in events if ev.time >= start][-MAX_MARKS:]
    for ev in in_range:
        y = row.get(ev.group or JOB_LANE, 0) * _LANE_H + 11
        label = f"{clock(ev.time)} {ev.kind.value}: {ev.reason}"
        parts.append(
            f'<circle class="mark" data-kind="{ev.kind.value}" data-group="{e(ev.group)}" '
            f'data-seq="{ev.seq}" data-reason="{e(label)}" cx="{x(ev.time):.1f}" cy="{y}" r="5" '
            f'fill="{_COLORS[ev.kind]}"><title>{e(label)}</title></circle>'
        )
    axis_y = _LANE_H * len(order) + 14
    for i in range(5):
        t = start + span * i / 4
        parts.append(f'<text x="{x(t) - 24:.1f}" y="{axis_y}" class="tick">{clock(t)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def sparkline(values: Sequence[float], width: int = 120, height: int = 22) -> str:
    """A small SVG line of ``values`` (empty when fewer than two)."""
    if len(values) < 2:
        return ""
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(
        f"{i * step:.1f},{height - 2 - (height - 4) * v / top:.1f}" for i, v in enumerate(values)
    )
    return (
        f'<svg class="spark" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
        f'<polyline points="{points}" fill="none" stroke="#1565c0" stroke-width="1.5"/></svg>'
    )
