"""The lighthouse's HTTP status endpoints, served on the lighthouse's own event loop.

- ``GET /?range=hour|job``: an HTML page (no external assets): the job's figures (committed
  samples per second against its best, or batches when no group reports its batch size;
  availability, discarded steps), a timeline of the
  groups in the quorum with a mark per event (``lighthouse.timeline``), each group's figures,
  the newest events with their reasons, the current quorum and the heartbeats. Every table and
  the SVG charts are rendered here (readable with scripts off); a script swaps in a fresh copy
  every 2 s without reloading, and shows a mark's reason on click.
- ``GET /status.json``: the same data as JSON.
- ``GET /metrics``: Prometheus text format.
- ``GET /events?since=N``: the job's events after sequence number ``N`` (default 0: all that
  are kept), oldest first, as JSON (``lighthouse.history``); at most ``EVENTS_PER_PAGE``, with
  ``last_seq`` to ask for the next ones.
- ``POST /replica/<replica_id>/kill``: only when the lighthouse has an auth token, and only
  for requests carrying ``Authorization: Bearer <token>``; forwards ``ManagerService/Kill``
  (with the same token) to that member's manager, if it is alive (``kill_target``).

Every connection must send its request head within ``HEAD_TIMEOUT_S``; at most
``max_connections`` are open at once (see ``_Connections``), one request each.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import time
from collections import OrderedDict
from urllib.parse import parse_qs, unquote, urlsplit

import grpc

from torchtitan_ft.auth import AUTHORIZATION, grpc_metadata, presents
from torchtitan_ft.lighthouse import recoveries
from torchtitan_ft.lighthouse.history import HistoryEntry, HistoryKind
from torchtitan_ft.lighthouse.state import DECISION_BUCKETS, LighthouseState
from torchtitan_ft.lighthouse.summary import state_loss_line
from torchtitan_ft.lighthouse.timeline import clock, render_timeline, sparkline
from torchtitan_ft.lighthouse.types import Quorum
from torchtitan_ft.netaddr import split_host_port
from torchtitan_ft.proto import torchft_pb2 as pb

logger = logging.getLogger(__name__)

_MAX_LINE_BYTES = 8 * 1024
_MAX_HEADER_LINES = 64
HEAD_TIMEOUT_S = 5.0
"""A connection must deliver its whole request head within this; browsers and scrapers send it
at once, an idle or trickling connection is closed."""
_WRITE_TIMEOUT_S = 10.0
_KILL_TIMEOUT_S = 5.0
EVENTS_PER_PAGE = 1000
"""Most events one ``/events`` answer holds (about 150 kB of JSON)."""
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class _Connections:
    """The open status connections, capped at ``limit``.

    A connection over the cap evicts the oldest one still waiting for its request head (idle or
    trickling: what a flood of idle connections consists of), so a flood delays a real request
    by at most the time it takes to send its head; with none to evict the newcomer is closed.
    Every connection costs a file descriptor, and the gRPC server shares the process's limit.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._reading: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()

    def admit(self, writer: asyncio.StreamWriter) -> bool:
        if self.open >= self.limit:
            if not self._reading:
                return False
            oldest, _ = self._reading.popitem(last=False)
            oldest.transport.abort()
        self.open += 1
        self._reading[writer] = None
        return True

    def head_read(self, writer: asyncio.StreamWriter) -> None:
        self._reading.pop(writer, None)

    def closed(self, writer: asyncio.StreamWriter) -> None:
        self._reading.pop(writer, None)
        self.open -= 1


async def serve(
    bind: str, state: LighthouseState, auth_token: str | None, max_connections: int
) -> asyncio.Server:
    bind_host, port = split_host_port(bind, "bind address")
    host = bind_host or None
    connections = _Connections(max_connections)
    pages = _PageCache()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not connections.admit(writer):
            writer.transport.abort()
            return
        try:
            await _answer(reader, writer, state, auth_token, connections, pages)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
            # The peer went away, reset, was evicted or was too slow: nothing to answer.
            logger.debug("status connection closed early: %s: %s", type(e).__name__, e)
        finally:
            connections.closed(writer)
            # The response was drained (or the peer is gone): close now, never linger.
            writer.transport.abort()

    # ``backlog`` is also how many connections asyncio accepts per loop iteration before any
    # of them runs (and before evicted ones are closed): it bounds the burst of descriptors.
    return await asyncio.start_server(
        on_client, host, port, limit=_MAX_LINE_BYTES, backlog=max(1, max_connections // 2)
    )


async def _answer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    state: LighthouseState,
    auth_token: str | None,
    connections: _Connections,
    pages: _PageCache,
) -> None:
    try:
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            method, path, headers = await _read_head(reader)
    except (asyncio.LimitOverrunError, ValueError) as e:
        code, ctype, body = 400, "text/plain", f"bad request: {e}\n".encode()
    else:
        connections.head_read(writer)
        code, ctype, body = await _handle(method, path, headers, state, auth_token, pages)
    head = (
        f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    async with asyncio.timeout(_WRITE_TIMEOUT_S):
        await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    request_line = (await reader.readuntil(b"\r\n")).decode("latin-1").split()
    if len(request_line) != 3:
        raise ValueError(f"request line {' '.join(request_line)!r} is not 'METHOD PATH HTTP/1.1'")
    method, path, _ = request_line
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        if len(headers) >= _MAX_HEADER_LINES:
            raise ValueError(f"more than {_MAX_HEADER_LINES} header lines")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def _handle(
    method: str,
    target: str,
    headers: dict[str, str],
    state: LighthouseState,
    auth_token: str | None,
    pages: _PageCache,
) -> tuple[int, str, bytes]:
    path, _, query = target.partition("?")
    if method == "POST" and path.startswith("/replica/") and path.endswith("/kill"):
        if auth_token is None:
            return 404, "text/plain", b"no kill action: the lighthouse has no --auth_token\n"
        if not presents(headers.get(AUTHORIZATION), auth_token):
            return 401, "text/plain", b"kill needs 'Authorization: Bearer <token>'\n"
        replica_id = unquote(path[len("/replica/") : -len("/kill")])
        code, ctype, body = await _kill(state, replica_id, auth_token)
        state.history.record(
            HistoryKind.KILL_REQUESTED,
            replica_id,
            f"from the status page: {body.decode(errors='replace').strip()}",
        )
        return code, ctype, body
    if method != "GET":
        return 405, "text/plain", f"{method} is not supported on {path}\n".encode()
    if path == "/":
        try:
            range_name = page_range(query)
        except ValueError as e:
            return 400, "text/plain", f"{e}\n".encode()
        return 200, "text/html; charset=utf-8", pages.get(state, auth_token, range_name)
    if path == "/status.json":
        return 200, "application/json", json.dumps(state.status(), indent=1).encode()
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4", render_metrics(state).encode()
    if path == "/events":
        try:
            since = events_since(query)
        except ValueError as e:
            return 400, "text/plain", f"{e}\n".encode()
        return 200, "application/json", json.dumps(events_json(state, since)).encode()
    return (
        404,
        "text/plain",
        (f"no page at {path}; try /, /status.json, /events or /metrics\n".encode()),
    )


def events_since(query: str) -> int:
    """The ``since`` of an ``/events`` query string (0 when absent).

    Raises:
        ValueError: ``since`` is not a whole number >= 0, or another parameter is given.
    """
    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"since"})
    if unknown:
        raise ValueError(f"/events takes only ?since=N, got {', '.join(unknown)}")
    values = params.get("since", ["0"])
    if len(values) != 1 or not values[0].isdigit():
        raise ValueError(
            f"/events?since= must be a sequence number >= 0 (an event's seq), got {values!r}"
        )
    return int(values[0])


def events_json(state: LighthouseState, since: int) -> dict:
    """``/events``: the events after ``since`` (at most ``EVENTS_PER_PAGE``)."""
    events = state.history.since(since, EVENTS_PER_PAGE)
    return {
        "events": [e.to_json() for e in events],
        "last_seq": events[-1].seq if events else max(since, 0),
        "newest_seq": state.history.last_seq,
    }


class KillRefused(Exception):
    """The kill action cannot go ahead; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def kill_target(quorum: Quorum | None, healthy: set[str], replica_id: str) -> str:
    """The gRPC target (``host:port``) the kill of ``replica_id`` goes to.

    The kill carries the job token, so it only goes to an address a token holder gave: a
    lighthouse with a token (the only kind with a kill action) refuses every Quorum call without
    it, so each member of its quorum proved the token when it claimed its address. And only
    while the member is alive (fresh heartbeat): a dead member's port may since belong to
    another process.

    Raises:
        KillRefused: not a member of the current quorum (404), not alive, or its address is
            not ``http://host:port`` (409).
    """
    members = {m.replica_id: m for m in (quorum.participants if quorum else ())}
    member = members.get(replica_id)
    if member is None:
        raise KillRefused(404, f"{replica_id!r} is not in the current quorum")
    if replica_id not in healthy:
        raise KillRefused(
            409, f"{replica_id!r} has no fresh heartbeat (it died or hangs); nothing to kill"
        )
    url = urlsplit(member.address)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme not in ("http", "https") or not url.hostname or port is None:
        raise KillRefused(
            409, f"{replica_id!r} advertised {member.address!r}, not an http://host:port URL"
        )
    return url.netloc


async def _kill(state: LighthouseState, replica_id: str, token: str) -> tuple[int, str, bytes]:
    try:
        target = kill_target(state.quorum, state.healthy(), replica_id)
    except KillRefused as e:
        return e.status, "text/plain", f"{e}\n".encode()
    async with grpc.aio.insecure_channel(target) as channel:
        kill = channel.unary_unary(
            "/torchft.ManagerService/Kill",
            request_serializer=pb.KillRequest.SerializeToString,
            response_deserializer=pb.KillResponse.FromString,
        )
        try:
            await kill(
                pb.KillRequest(msg=f"killed from the lighthouse status page: {replica_id}"),
                timeout=_KILL_TIMEOUT_S,
                metadata=grpc_metadata(token),
            )
        except grpc.aio.AioRpcError as e:
            # The manager exits while answering, so a dropped connection means it worked.
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                msg = f"kill of {replica_id} failed: {e.code().name} {e.details()}\n"
                return 502, "text/plain", msg.encode()
    logger.warning("killed replica %s from the status page", replica_id)
    return 200, "text/plain", f"killed {replica_id}\n".encode()


def _round_metrics(state: LighthouseState) -> list[str]:
    """/metrics' quorum rounds, replicas, requests and decision times."""
    m = state.metrics
    members = len(state.quorum.participants) if state.quorum else 0
    lines = [
        "# HELP torchft_lighthouse_quorums_issued_total Quorums issued (one per round).",
        "# TYPE torchft_lighthouse_quorums_issued_total counter",
        f"torchft_lighthouse_quorums_issued_total {m.quorums_issued}",
        "# HELP torchft_lighthouse_quorum_id_changes_total Rounds that got a new quorum_id.",
        "# TYPE torchft_lighthouse_quorum_id_changes_total counter",
        f"torchft_lighthouse_quorum_id_changes_total {m.quorum_id_changes}",
        "# HELP torchft_lighthouse_quorum_members Members of the current quorum.",
        "# TYPE torchft_lighthouse_quorum_members gauge",
        f"torchft_lighthouse_quorum_members {members}",
        "# HELP torchft_lighthouse_quorum_id The current quorum_id.",
        "# TYPE torchft_lighthouse_quorum_id gauge",
        f"torchft_lighthouse_quorum_id {state.quorum_id}",
        "# HELP torchft_lighthouse_pending_requests Replicas waiting for the next quorum.",
        "# TYPE torchft_lighthouse_pending_requests gauge",
        f"torchft_lighthouse_pending_requests {len(state.pending)}",
        "# HELP torchft_lighthouse_healthy_replicas Replicas with a fresh heartbeat.",
        "# TYPE torchft_lighthouse_healthy_replicas gauge",
        f"torchft_lighthouse_healthy_replicas {len(state.healthy())}",
        "# HELP torchft_lighthouse_heartbeats_total Heartbeats received (unary and stream).",
        "# TYPE torchft_lighthouse_heartbeats_total counter",
        f"torchft_lighthouse_heartbeats_total {m.heartbeats}",
        "# HELP torchft_lighthouse_stream_deaths_total Replicas dropped when their stream ended.",
        "# TYPE torchft_lighthouse_stream_deaths_total counter",
        f"torchft_lighthouse_stream_deaths_total {m.stream_deaths}",
        "# HELP torchft_lighthouse_state_losses_total Times the job's state was declared "
        "lost (every member holding its highest step gone).",
        "# TYPE torchft_lighthouse_state_losses_total counter",
        f"torchft_lighthouse_state_losses_total {m.state_losses}",
        "# HELP torchft_lighthouse_bad_requests_total Requests rejected as malformed.",
        "# TYPE torchft_lighthouse_bad_requests_total counter",
        f"torchft_lighthouse_bad_requests_total {m.bad_requests}",
        "# HELP torchft_lighthouse_unauthenticated_requests_total Calls refused for lacking the "
        "job token.",
        "# TYPE torchft_lighthouse_unauthenticated_requests_total counter",
        f"torchft_lighthouse_unauthenticated_requests_total {m.unauthenticated_requests}",
        "# HELP torchft_lighthouse_decision_seconds Time to compute one quorum decision.",
        "# TYPE torchft_lighthouse_decision_seconds histogram",
    ]
    lines += [
        f'torchft_lighthouse_decision_seconds_bucket{{le="{bound}"}} {count}'
        for bound, count in zip(DECISION_BUCKETS, m.decision_buckets, strict=True)
    ]
    lines += [
        f'torchft_lighthouse_decision_seconds_bucket{{le="+Inf"}} {m.decision_count}',
        f"torchft_lighthouse_decision_seconds_sum {m.decision_seconds_sum:.6f}",
        f"torchft_lighthouse_decision_seconds_count {m.decision_count}",
    ]
    return lines


def _speed_metrics(state: LighthouseState) -> list[str]:
    """/metrics' straggler report: each group's speeds and verdicts."""
    m = state.metrics
    lines = [
        "# HELP torchft_lighthouse_relative_speed A replica group's compute speed relative to "
        "the others' median (1 typical, 0.25 four times slower; 0 not judged yet).",
        "# TYPE torchft_lighthouse_relative_speed gauge",
    ]
    speeds = state.speeds.views(state.excluded())
    lines += [
        f"torchft_lighthouse_relative_speed{{replica_id={_label(s.replica_id)}}} "
        f"{s.relative_speed:.4f}"
        for s in speeds
    ]
    lines += [
        "# HELP torchft_lighthouse_link_relative_speed A replica group's link rate (its link "
        "probes) relative to the others' median (1 typical, 0.25 four times slower; 0 not "
        "judged yet).",
        "# TYPE torchft_lighthouse_link_relative_speed gauge",
    ]
    lines += [
        f"torchft_lighthouse_link_relative_speed{{replica_id={_label(s.replica_id)}}} "
        f"{s.link_relative_speed:.4f}"
        for s in speeds
    ]
    lines += [
        "# HELP torchft_lighthouse_link_probe_bytes_total Payload bytes of the groups' link "
        "probes, both ways.",
        "# TYPE torchft_lighthouse_link_probe_bytes_total counter",
        f"torchft_lighthouse_link_probe_bytes_total {m.link_probe_bytes}",
        "# HELP torchft_lighthouse_straggler Whether a replica group is reported as a "
        "straggler (for its compute, its link, or both).",
        "# TYPE torchft_lighthouse_straggler gauge",
    ]
    lines += [
        f"torchft_lighthouse_straggler{{replica_id={_label(s.replica_id)}}} {int(s.straggler)}"
        for s in speeds
    ]
    lines += [
        "# HELP torchft_lighthouse_link_straggler Whether a replica group is reported as a "
        "straggler for its link.",
        "# TYPE torchft_lighthouse_link_straggler gauge",
    ]
    lines += [
        f"torchft_lighthouse_link_straggler{{replica_id={_label(s.replica_id)}}} "
        f"{int('link' in s.cause.split(','))}"
        for s in speeds
    ]
    lines += [
        "# HELP torchft_lighthouse_straggler_reports_total Straggler reports started.",
        "# TYPE torchft_lighthouse_straggler_reports_total counter",
        f"torchft_lighthouse_straggler_reports_total {state.speeds.reports_started}",
        "# HELP torchft_lighthouse_excluded Whether the straggler policy leaves a replica group "
        "out of the quorum now.",
        "# TYPE torchft_lighthouse_excluded gauge",
    ]
    lines += [
        f"torchft_lighthouse_excluded{{replica_id={_label(s.replica_id)}}} {int(s.excluded)}"
        for s in speeds
    ]
    return lines


def render_metrics(state: LighthouseState) -> str:
    m = state.metrics
    lines = [*_round_metrics(state), *_speed_metrics(state)]
    lines += [
        "# HELP torchft_lighthouse_straggler_exclusions_total Times the straggler policy left "
        "a replica group out of the quorum.",
        "# TYPE torchft_lighthouse_straggler_exclusions_total counter",
        f"torchft_lighthouse_straggler_exclusions_total {m.exclusions}",
        "# HELP torchft_lighthouse_straggler_readmissions_total Times it took one back.",
        "# TYPE torchft_lighthouse_straggler_readmissions_total counter",
        f"torchft_lighthouse_straggler_readmissions_total {m.readmissions}",
        "# HELP torchft_lighthouse_events_total Events of the job's history recorded by this "
        "process, by kind, and by reason where it is one of a few (why a group left).",
        "# TYPE torchft_lighthouse_events_total counter",
    ]
    lines += [
        f"torchft_lighthouse_events_total{{kind={_label(kind.value)},reason={_label(reason)}}} "
        f"{count}"
        for (kind, reason), count in sorted(state.history.counts.items())
    ]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value, quoted and escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class _PageCache:
    """The page of each range, rendered at most once per ``PAGE_CACHE_S``: however many
    browsers have it open, rendering it costs the lighthouse's loop (which also decides the
    quorums) one render per range per period. One per status server."""

    def __init__(self) -> None:
        self._pages: dict[str, tuple[float, bytes]] = {}

    def get(self, state: LighthouseState, auth_token: str | None, range_name: str) -> bytes:
        now = time.monotonic()
        cached = self._pages.get(range_name)
        if cached is not None and now - cached[0] < PAGE_CACHE_S:
            return cached[1]
        page = render_html(state.status(), auth_token is not None, list(state.history), range_name)
        self._pages[range_name] = (now, page)
        return page


PAGE_CACHE_S = 1.0
"""How long a rendered page is served again (the page's script refreshes every 2 s)."""
RANGES = {"hour": 3600.0, "job": None}
"""The timeline's ranges (``/?range=``): the last hour (default), or the whole job (what the
history still holds)."""
EVENTS_SHOWN = 100
"""Rows of the page's event table (the newest); ``/events`` has them all."""
HEALS_SHOWN = 5
"""Durations of a group's newest heals in its row (``/status.json`` has the last 20)."""

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>torchft lighthouse</title>
<noscript><meta http-equiv="refresh" content="2"></noscript>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #bbb; padding: 0.3em 0.7em; text-align: left; }}
th {{ background: #eee; }}
tr.member td {{ background: #dff5e1; }}
tr.straggler td {{ background: #fde2e2; }}
tr.in-quorum td {{ background: #eef7ee; }}
tr.away td {{ background: #fff3e0; }}
.unhealthy {{ color: #b00; }}
.reason {{ font-family: monospace; background: #f4f4f4; padding: 0.5em; }}
svg text.lane, svg text.tick {{ font-size: 11px; font-family: monospace; }}
svg circle.mark {{ cursor: pointer; stroke: #fff; stroke-width: 1; }}
#mark-detail {{ font-family: monospace; min-height: 1.2em; }}
.figure {{ font-size: 1.3em; font-weight: bold; }}
</style></head><body>
<h1>torchft lighthouse</h1>
<div id="live">
<p class="reason">{reason}</p>
{state_loss}
<h2>Job</h2>
<table id="job" data-unit="{unit}"><tr><th>committed {unit}</th>
<th>{unit}/s (last {window:g} s)</th>
<th>best sustained {unit}/s</th><th>availability (time at full membership: {full} groups)</th>
<th>discarded steps</th></tr>
<tr><td class="figure">{committed}</td><td class="figure">{rate}</td>
<td class="figure">{best}</td>
<td class="figure">{availability}</td><td class="figure">{discarded}</td></tr></table>
{unit_note}
<h2>Timeline ({range_title})</h2>
<p>Range: <a href="/?range=hour">last hour</a> &middot; <a href="/?range=job">whole job</a>.
Green bars: time in the quorum. Marks: events (hover or click for the reason).</p>
{timeline}
<p id="mark-detail"></p>
<h2>Groups</h2>
<table id="groups"><tr><th>replica</th><th>launcher job</th><th>in quorum</th><th>steps/s</th>
<th>recent steps/s</th>
<th>time in quorum (s)</th><th>time away (s)</th><th>heals (newest durations)</th>
<th>last heal</th>
<th>committed {unit}</th><th>discarded steps</th></tr>
{group_rows}
</table>
{recoveries}
<h2>Quorum {quorum_title}</h2>
<table id="members"><tr><th>replica</th><th>step</th><th>address</th><th>store</th>
<th>world size</th><th>commit failures</th>{kill_head}</tr>
{member_rows}
</table>
<h2>Events (newest first; <a href="/events">all as JSON</a>)</h2>
<table id="events"><tr><th>#</th><th>time (UTC)</th><th>kind</th><th>group</th><th>reason</th></tr>
{event_rows}
</table>
<h2>Heartbeats</h2>
<table id="heartbeats"><tr><th>replica</th><th>age (s)</th><th>healthy</th><th>stream</th></tr>
{heartbeat_rows}
</table>
<p id="other-callers">{other_callers}</p>
<h2>Speed</h2>
<table id="speeds"><tr><th>replica</th><th>relative speed</th><th>link (relative rate)</th>
<th>straggler since step</th><th>slow at</th><th>in quorum</th></tr>
{speed_rows}
</table>
<p>min_replicas = {min_replicas}; straggler policy: {straggler_policy}; pending: {pending}.
<a href="/status.json">JSON</a> &middot; <a href="/events">events</a> &middot;
<a href="/metrics">metrics</a></p>
</div>
{kill_script}
<script>
function showMark(ev) {{
  const m = ev.target.closest('circle.mark');
  if (m) document.getElementById('mark-detail').textContent = m.dataset.reason;
}}
document.addEventListener('click', showMark);
async function refresh() {{
  try {{
    const r = await fetch(location.pathname + location.search, {{cache: 'no-store'}});
    if (r.ok) {{
      const doc = new DOMParser().parseFromString(await r.text(), 'text/html');
      const detail = document.getElementById('mark-detail').textContent;
      document.getElementById('live').replaceWith(doc.getElementById('live'));
      document.getElementById('mark-detail').textContent = detail;
    }}
  }} catch (e) {{}}
  setTimeout(refresh, 2000);
}}
setTimeout(refresh, 2000);
</script>
</body></html>
"""

_KILL_SCRIPT = """<p>Token for kill: <input id="token" type="password"></p>
<script>
function kill(id) {
  fetch('/replica/' + encodeURIComponent(id) + '/kill', {method: 'POST',
    headers: {'Authorization': 'Bearer ' + document.getElementById('token').value}})
    .then(r => r.text()).then(t => alert(t));
}
</script>"""


def page_range(query: str) -> str:
    """The ``range`` of a page query string (default ``hour``).

    Raises:
        ValueError: an unknown range or parameter.
    """
    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"range"})
    if unknown:
        raise ValueError(f"/ takes only ?range={'|'.join(RANGES)}, got {', '.join(unknown)}")
    values = params.get("range", ["hour"])
    if len(values) != 1 or values[0] not in RANGES:
        raise ValueError(f"/?range= must be one of {', '.join(RANGES)}, got {values!r}")
    return values[0]


def _figure(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_html(
    status: dict, kill_enabled: bool, events: list[HistoryEntry], range_name: str = "hour"
) -> bytes:
    """The status page: ``status`` (``LighthouseState.status``) and the history's ``events``
    (oldest first), the timeline over ``range_name`` (``RANGES``)."""
    e = html.escape
    now = status["now"]
    window = RANGES[range_name]
    start = now - window if window is not None else (events[0].time if events else now)
    quorum = status["quorum"]
    rows = [_member_row(m, kill_enabled) for m in (quorum["members"] if quorum else [])]
    beats = [
        f'<tr class="{"healthy" if h["healthy"] else "unhealthy"}"><td>{e(h["replica_id"])}</td>'
        f"<td>{h['age_s']:.2f}</td><td>{'yes' if h['healthy'] else 'no'}</td>"
        f"<td>{'open' if h['stream'] else '-'}</td></tr>"
        for h in status["heartbeats"]
    ]
    speeds = [
        f'<tr class="{"straggler" if s["straggler"] else "speed"}"><td>{e(s["replica_id"])}</td>'
        f"<td>{_speed_text(s['relative_speed'])}</td>"
        f"<td>{_speed_text(s['link_relative_speed'])}</td>"
        f"<td>{s['straggler_since_step'] if s['straggler'] else '-'}</td>"
        f"<td>{e(s['cause']) or '-'}</td>"
        f"<td>{'no: left out (straggler policy)' if s['excluded'] else 'yes'}</td></tr>"
        for s in status["speeds"]
    ]
    job = status["job"]
    group_rows = [_group_row(g, job["unit"]) for g in status["groups"]]
    event_rows = [
        f'<tr class="event" data-kind="{ev.kind.value}" data-seq="{ev.seq}"><td>{ev.seq}</td>'
        f"<td>{clock(ev.time)}</td><td>{ev.kind.value}</td><td>{e(ev.group)}</td>"
        f"<td>{e(ev.reason)}</td></tr>"
        for ev in reversed(events[-EVENTS_SHOWN:])
    ]
    others = status["other_callers"]
    other_callers = (
        f"Heartbeats from {len(others)} caller(s) that never asked for a quorum (readiness "
        f"probes; not replica groups): {e(', '.join(others[:10]))}"
        if others
        else ""
    )
    title = (
        f"{quorum['quorum_id']} ({len(quorum['members'])} members, age {quorum['age_s']:.1f} s)"
        if quorum
        else "(none yet)"
    )
    page = _PAGE.format(
        reason=e(status["reason"]),
        state_loss=(
            f'<p id="state-loss" class="unhealthy">{e(state_loss_line(status["state_loss"]))}</p>'
            if status["state_loss"]
            else ""
        ),
        **_job_fields(job),
        range_title="last hour" if range_name == "hour" else "whole job",
        timeline=render_timeline(events, [g["replica_id"] for g in status["groups"]], start, now),
        group_rows="\n".join(group_rows),
        recoveries=recoveries.html_section(status["groups"]),
        event_rows="\n".join(event_rows),
        other_callers=other_callers,
        quorum_title=e(title),
        kill_head="<th>kill</th>" if kill_enabled else "",
        member_rows="\n".join(rows),
        heartbeat_rows="\n".join(beats),
        speed_rows="\n".join(speeds),
        min_replicas=status["min_replicas"],
        straggler_policy=e(status["straggler_policy"]),
        pending=e(", ".join(status["pending"]) or "none"),
        kill_script=_KILL_SCRIPT if kill_enabled else "",
    )
    return page.encode()


def _member_row(m: dict, kill_enabled: bool) -> str:
    """The status page's row of quorum member ``m``, with its kill button if enabled."""
    e = html.escape
    kill = (
        f'<td><button onclick="kill({e(json.dumps(m["replica_id"]))})">kill</button></td>'
        if kill_enabled
        else ""
    )
    return (
        f'<tr class="member"><td>{e(m["replica_id"])}</td><td>{m["step"]}</td>'
        f"<td>{e(m['address'])}</td><td>{e(m['store_address'])}</td>"
        f"<td>{m['world_size']}</td><td>{m['commit_failures']}</td>{kill}</tr>"
    )


def _group_row(g: dict, unit: str) -> str:
    """The status page's row of replica group ``g`` (``LighthouseState.status``'s "groups"),
    its committed work counted in ``unit``."""
    e = html.escape
    last = g["heals"][-1] if g["heals"] else None
    last_heal = (
        f"started {clock(last['started'] or last['time'])}: {last['seconds']:.3f} s, "
        f"{last['bytes']} bytes, {e(last['outcome'])}"
        if last
        else "-"
    )
    durations = ", ".join(f"{h['seconds']:.2f} s" for h in g["heals"][-HEALS_SHOWN:])
    not_reported = "" if g["reports"] else " (not reported: torchft client)"
    return (
        f'<tr class="{"in-quorum" if g["in_quorum"] else "away"}" '
        f'data-group="{e(g["replica_id"])}"><td>{e(g["replica_id"])}</td>'
        f"<td>{e(g['launcher_job'] or '-')}</td>"
        f"<td>{'yes' if g['in_quorum'] else 'no'}</td>"
        f"<td>{_figure(g['steps_per_s'], '.2f')}{not_reported}</td>"
        f"<td>{sparkline(g['steps_per_s_series'])}</td>"
        f"<td>{g['in_quorum_s']:.1f}</td><td>{g['away_s']:.1f}</td>"
        f"<td>{g['heal_count']}{f' ({durations})' if durations else ''}</td>"
        f"<td>{last_heal}</td>"
        f"<td>{_committed(g, unit)}</td><td>{g['discarded_steps']}</td></tr>"
    )


def _job_fields(job: dict) -> dict[str, object]:
    """The status page's fields of the job's figures (``LighthouseState.status``'s "job")."""
    unit = job["unit"]
    availability = job["availability"]
    return {
        "window": job["sustained_window_s"],
        "full": job["full_membership"],
        "unit": unit,
        "unit_note": (
            f'<p id="unit-note">{html.escape(job["unit_reason"])}</p>'
            if "unit_reason" in job
            else ""
        ),
        "committed": job[f"{unit}_committed"],
        "rate": _figure(job[f"{unit}_per_s"], ".2f"),
        "best": _figure(job[f"best_{unit}_per_s"], ".2f"),
        "availability": _figure(None if availability is None else 100 * availability, ".1f")
        + ("%" if availability is not None else ""),
        "discarded": job["discarded_steps"],
    }


def _committed(group: dict, unit: str) -> str:
    """A group's committed count in the job's unit; "-" for a group that reports none."""
    count = group[f"{unit}_committed"]
    return "-" if count is None or not group["reports"] else str(count)


def _speed_text(relative_speed: float) -> str:
    """1.00x, or "not judged yet" before a group has reported enough steps."""
    return f"{relative_speed:.2f}x" if relative_speed > 0 else "not judged yet"
