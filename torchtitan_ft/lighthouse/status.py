"""The lighthouse's HTTP status endpoints, served on the lighthouse's own event loop.

- ``GET /``: an HTML page (no external assets) with the current quorum, the decision's reason
  and every replica's heartbeat age; it refreshes itself every second.
- ``GET /status.json``: the same data as JSON.
- ``GET /metrics``: Prometheus text format.
- ``POST /replica/<replica_id>/kill``: only when the lighthouse has an auth token, and only
  for requests carrying ``Authorization: Bearer <token>``; forwards ``ManagerService/Kill``
  (with the same token) to that member's manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import json
import logging
from urllib.parse import unquote

import grpc

from torchtitan_ft.lighthouse.state import DECISION_BUCKETS, LighthouseState
from torchtitan_ft.netaddr import split_host_port
from torchtitan_ft.proto import torchft_pb2 as pb

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 16 * 1024
_KILL_TIMEOUT_S = 5.0


async def serve(bind: str, state: LighthouseState, auth_token: str | None) -> asyncio.Server:
    host, port = split_host_port(bind, "bind address")

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            code, ctype, body = await _handle(reader, state, auth_token)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            code, ctype, body = 400, "text/plain", f"bad request: {e}\n".encode()
        reason = {
            200: "OK",
            400: "Bad Request",
            401: "Unauthorized",
            404: "Not Found",
            405: "Method Not Allowed",
            502: "Bad Gateway",
        }[code]
        head = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    return await asyncio.start_server(on_client, host or None, port, limit=_MAX_HEADER_BYTES)


async def _handle(
    reader: asyncio.StreamReader, state: LighthouseState, auth_token: str | None
) -> tuple[int, str, bytes]:
    request_line = (await reader.readuntil(b"\r\n")).decode("latin-1").split()
    if len(request_line) != 3:
        raise ValueError(f"request line {' '.join(request_line)!r} is not 'METHOD PATH HTTP/1.1'")
    method, path, _ = request_line
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    path = path.split("?", 1)[0]

    if method == "POST" and path.startswith("/replica/") and path.endswith("/kill"):
        if auth_token is None:
            return 404, "text/plain", b"no kill action: the lighthouse has no --auth_token\n"
        given = headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {auth_token}".encode()):
            return 401, "text/plain", b"kill needs 'Authorization: Bearer <token>'\n"
        return await _kill(state, unquote(path[len("/replica/") : -len("/kill")]), auth_token)
    if method != "GET":
        return 405, "text/plain", f"{method} is not supported on {path}\n".encode()
    if path == "/":
        return 200, "text/html; charset=utf-8", render_html(state.status(), auth_token is not None)
    if path == "/status.json":
        return 200, "application/json", json.dumps(state.status(), indent=1).encode()
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4", render_metrics(state).encode()
    return 404, "text/plain", f"no page at {path}; try /, /status.json or /metrics\n".encode()


async def _kill(state: LighthouseState, replica_id: str, token: str) -> tuple[int, str, bytes]:
    members = {m.replica_id: m for m in (state.quorum.participants if state.quorum else ())}
    member = members.get(replica_id)
    if member is None:
        return 404, "text/plain", f"{replica_id!r} is not in the current quorum\n".encode()
    target = member.address.removeprefix("http://").removeprefix("https://")
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
                metadata=(("authorization", f"Bearer {token}"),),
            )
        except grpc.aio.AioRpcError as e:
            # The manager exits while answering, so a dropped connection means it worked.
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                msg = f"kill of {replica_id} failed: {e.code().name} {e.details()}\n"
                return 502, "text/plain", msg.encode()
    logger.warning("killed replica %s from the status page", replica_id)
    return 200, "text/plain", f"killed {replica_id}\n".encode()


def render_metrics(state: LighthouseState) -> str:
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
        "# HELP torchft_lighthouse_bad_requests_total Requests rejected as malformed.",
        "# TYPE torchft_lighthouse_bad_requests_total counter",
        f"torchft_lighthouse_bad_requests_total {m.bad_requests}",
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
    return "\n".join(lines) + "\n"


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>torchft lighthouse</title>
<meta http-equiv="refresh" content="1">
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #bbb; padding: 0.3em 0.7em; text-align: left; }}
th {{ background: #eee; }}
tr.member td {{ background: #dff5e1; }}
.unhealthy {{ color: #b00; }}
.reason {{ font-family: monospace; background: #f4f4f4; padding: 0.5em; }}
</style></head><body>
<h1>torchft lighthouse</h1>
<p class="reason">{reason}</p>
<h2>Quorum {quorum_title}</h2>
<table id="members"><tr><th>replica</th><th>step</th><th>address</th><th>store</th>
<th>world size</th><th>commit failures</th>{kill_head}</tr>
{member_rows}
</table>
<h2>Heartbeats</h2>
<table id="heartbeats"><tr><th>replica</th><th>age (s)</th><th>healthy</th><th>stream</th></tr>
{heartbeat_rows}
</table>
<p>min_replicas = {min_replicas}; pending: {pending}.
<a href="/status.json">JSON</a> &middot; <a href="/metrics">metrics</a></p>
{kill_script}
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


def render_html(status: dict, kill_enabled: bool) -> bytes:
    e = html.escape
    quorum = status["quorum"]
    rows = []
    for m in quorum["members"] if quorum else []:
        kill = (
            f'<td><button onclick="kill({e(json.dumps(m["replica_id"]))})">kill</button></td>'
            if kill_enabled
            else ""
        )
        rows.append(
            f'<tr class="member"><td>{e(m["replica_id"])}</td><td>{m["step"]}</td>'
            f"<td>{e(m['address'])}</td><td>{e(m['store_address'])}</td>"
            f"<td>{m['world_size']}</td><td>{m['commit_failures']}</td>{kill}</tr>"
        )
    beats = [
        f'<tr class="{"healthy" if h["healthy"] else "unhealthy"}"><td>{e(h["replica_id"])}</td>'
        f"<td>{h['age_s']:.2f}</td><td>{'yes' if h['healthy'] else 'no'}</td>"
        f"<td>{'open' if h['stream'] else '-'}</td></tr>"
        for h in status["heartbeats"]
    ]
    title = (
        f"{quorum['quorum_id']} ({len(quorum['members'])} members, age {quorum['age_s']:.1f} s)"
        if quorum
        else "(none yet)"
    )
    page = _PAGE.format(
        reason=e(status["reason"]),
        quorum_title=e(title),
        kill_head="<th>kill</th>" if kill_enabled else "",
        member_rows="\n".join(rows),
        heartbeat_rows="\n".join(beats),
        min_replicas=status["min_replicas"],
        pending=e(", ".join(status["pending"]) or "none"),
        kill_script=_KILL_SCRIPT if kill_enabled else "",
    )
    return page.encode()
