"""The donor's side of ``HTTPTransport``: offered snapshots, leases, and the HTTP server.

``SnapshotStore`` decides what may be served (the offered snapshot; retired ones while a
receiver that got their header, i.e. holds a lease, still fetches them; a spare staging buffer
for reuse). ``CheckpointServer`` answers the HTTP requests on background threads; the routes are
described in ``http_transport``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from torchtitan_ft.checkpoint._serialization import Header
from torchtitan_ft.checkpoint._staging import Staging, set_io_timeout

logger = logging.getLogger(__name__)

_MAX_HANDLERS = 64
_RESOURCES = ("header", "data", "full")


@dataclass
class _Lease:
    remaining: int
    """Bytes this receiver has not fetched yet."""
    expires: float
    """``time.monotonic()`` after which the lease no longer keeps a retired snapshot alive."""


@dataclass
class Snapshot:
    header: Header
    header_bytes: bytes
    staging: Staging | None
    leases: dict[str, _Lease] = field(default_factory=dict)
    readers: int = 0
    tainted: bool = False
    """A reader timed out: the socket may still reference the staging pages, never reuse them."""

    def needed(self, now: float) -> bool:
        return self.readers > 0 or any(
            lease.remaining > 0 and lease.expires > now for lease in self.leases.values()
        )


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SnapshotStore:
    """The offered snapshot, retired ones still serving leased receivers, and a spare buffer."""

    def __init__(self, lease_timeout: float) -> None:
        self._lease_timeout = lease_timeout
        self._lock = threading.Condition()
        self._offered: Snapshot | None = None
        self._retired: dict[str, Snapshot] = {}
        self._spare: Staging | None = None
        self._closed = False

    def take_staging(self, nbytes: int) -> Staging:
        with self._lock:
            if self._closed:
                raise RuntimeError("HTTPTransport is shut down")
            self._retire_locked()
            spare, self._spare = self._spare, None
        if spare is not None and spare.capacity >= nbytes:
            return spare
        if spare is not None:
            spare.close()
        return Staging(nbytes)

    def offer(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._retire_locked()
            self._offered = snapshot

    def give_back(self, staging: Staging) -> None:
        with self._lock:
            self._keep_spare_locked(staging)

    def disallow(self) -> None:
        with self._lock:
            self._retire_locked()

    def lease(self, step: int) -> tuple[Snapshot, str]:
        with self._lock:
            snap = self._offered
            if snap is None or snap.header.step < step:
                # The donor has not staged this step yet (its quorum thread is a moment behind
                # the receiver's): retryable.
                offering = "nothing" if snap is None else f"step {snap.header.step}"
                raise _Refused(503, f"not offering step {step} yet (offering {offering})")
            if snap.header.step != step:
                raise _Refused(400, f"offering step {snap.header.step}, requested step {step}")
            now = time.monotonic()
            for stale in [k for k, v in snap.leases.items() if v.expires <= now]:
                del snap.leases[stale]
            lease_id = secrets.token_hex(8)
            snap.leases[lease_id] = _Lease(snap.header.total_bytes, now + self._lease_timeout)
            return snap, lease_id

    @contextlib.contextmanager
    def reading(self, step: int, snapshot_id: str, lease_id: str) -> Any:
        """Pins a snapshot for one data response; yields ``(snapshot, on_done)``.

        ``on_done(nbytes, clean)`` records the bytes served; ``clean`` is False when the peer
        may not have read them yet (the staging buffer is then never reused).
        """
        with self._lock:
            now = time.monotonic()
            snap = self._offered
            if snap is None or snap.header.snapshot_id != snapshot_id:
                snap = self._retired.get(snapshot_id)
            if snap is None:
                raise _Refused(410, f"snapshot {snapshot_id!r} is no longer offered")
            if snap.header.step != step:
                raise _Refused(
                    400, f"snapshot is of step {snap.header.step}, requested step {step}"
                )
            lease = snap.leases.get(lease_id)
            if lease is None or lease.expires <= now:
                raise _Refused(410, f"lease {lease_id!r} is unknown or expired")
            snap.readers += 1

        def on_done(nbytes: int, clean: bool) -> None:
            with self._lock:
                lease.remaining = max(0, lease.remaining - nbytes)
                if not lease.remaining:
                    snap.leases.pop(lease_id, None)
                snap.tainted |= not clean

        try:
            yield snap, on_done
        finally:
            with self._lock:
                snap.readers -= 1
                self._reap_locked()

    def close(self, wait_s: float) -> None:
        with self._lock:
            self._closed = True
            self._retire_locked()
            self._lock.wait_for(lambda: not self._retired, wait_s)
            # Snapshots still being read are released by their last reader (see _reap_locked).
            if self._spare is not None:
                self._spare.close()
                self._spare = None

    def _retire_locked(self) -> None:
        snap, self._offered = self._offered, None
        if snap is not None:
            self._retired[snap.header.snapshot_id] = snap
        self._reap_locked()

    def _reap_locked(self) -> None:
        now = time.monotonic()
        for snapshot_id, snap in list(self._retired.items()):
            if snap.readers == 0 and (self._closed or not snap.needed(now)):
                del self._retired[snapshot_id]
                self._release_locked(snap)
        self._lock.notify_all()

    def _release_locked(self, snap: Snapshot) -> None:
        staging, snap.staging = snap.staging, None
        if staging is None:
            return
        if snap.tainted or self._closed:
            staging.close()
        else:
            self._keep_spare_locked(staging)

    def _keep_spare_locked(self, staging: Staging) -> None:
        if self._closed:
            staging.close()
        elif self._spare is None or self._spare.capacity < staging.capacity:
            if self._spare is not None:
                self._spare.close()
            self._spare = staging
        else:
            staging.close()


class CheckpointServer:
    """Serves the snapshots of ``store`` over HTTP on background threads.

    Args:
        host: address to listen on.
        port: port to listen on (0: a free one).
        timeout_s: bound on every socket operation with a peer, and lease lifetime.
        auth_token: when set, only requests with ``Authorization: Bearer <token>`` are answered.
    """

    def __init__(self, host: str, port: int, timeout_s: float, auth_token: str | None) -> None:
        self.store = SnapshotStore(lease_timeout=timeout_s)
        self.timeout_s = timeout_s
        self._auth_token = auth_token
        self._http = _make_server(host, port, self)
        self.address: tuple[str, int] = self._http.server_address[:2]
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"heal-http-{self.address[1]}",
            daemon=True,
        )
        self._thread.start()

    def shutdown(self, wait: bool) -> None:
        """Stops accepting requests; with ``wait``, waits (<= timeout) for in-flight ones."""
        self._http.shutdown()
        self._http.server_close()
        self.store.close(self.timeout_s if wait else 0.0)
        if wait:
            self._thread.join()

    def _authorized(self, handler: BaseHTTPRequestHandler) -> bool:
        if self._auth_token is None:
            return True
        got = handler.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self._auth_token}".encode())

    def serve(self, handler: _Handler) -> None:
        try:
            if not self._authorized(handler):
                raise _Refused(401, "missing or wrong bearer token")
            url = urlsplit(handler.path)
            parts = url.path.split("/")
            if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] not in _RESOURCES:
                raise _Refused(404, f"no such resource {url.path!r}")
            try:
                step = int(parts[2])
            except ValueError:
                raise _Refused(404, f"{parts[2]!r} is not a step number") from None
            if parts[3] == "header":
                self._serve_header(handler, step)
            elif parts[3] == "full":
                self._serve_full(handler, step)
            else:
                query = parse_qs(url.query)
                snapshot_id = query.get("snapshot", [""])[0]
                lease_id = query.get("lease", [""])[0]
                self._serve_data(handler, step, snapshot_id, lease_id)
        except _Refused as e:
            logger.info("refused %s from %s: %s", handler.path, handler.client_address, e)
            _reply_error(handler, e.status, e.message)

    def _serve_header(self, handler: _Handler, step: int) -> None:
        snap, lease_id = self.store.lease(step)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(snap.header_bytes)))
        handler.send_header("X-Checkpoint-Lease", lease_id)
        handler.end_headers()
        handler.wfile.write(snap.header_bytes)

    def _serve_full(self, handler: _Handler, step: int) -> None:
        snap, lease_id = self.store.lease(step)
        with self.store.reading(step, snap.header.snapshot_id, lease_id) as (snap, on_done):
            total = snap.header.total_bytes
            prefix = len(snap.header_bytes).to_bytes(8, "big") + snap.header_bytes
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(len(prefix) + total))
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.close_connection = True
            handler.wfile.write(prefix)
            on_done(total, self._send_and_wait(handler, snap, 0, total))

    def _serve_data(self, handler: _Handler, step: int, snapshot_id: str, lease_id: str) -> None:
        with self.store.reading(step, snapshot_id, lease_id) as (snap, on_done):
            total = snap.header.total_bytes
            start, end = _parse_range(handler.headers.get("Range"), total)
            handler.send_response(206)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(end - start))
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{total}")
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.close_connection = True
            on_done(end - start, self._send_and_wait(handler, snap, start, end - start))

    def _send_and_wait(self, handler: _Handler, snap: Snapshot, start: int, count: int) -> bool:
        """Sends the bytes, then waits for the peer to close; False if it never did."""
        sock = handler.connection
        set_io_timeout(sock, self.timeout_s)
        if count:
            # Pinned by the caller's reading(): released only after this returns.
            snap.staging.send(sock, start, count)
        # sendfile hands pages to the socket: wait for the peer to close, i.e. to have read
        # them, before the buffer may be reused for another snapshot.
        try:
            sock.recv(1)
        except (BlockingIOError, TimeoutError):
            return False
        except OSError:
            pass  # peer reset: its receive queue is gone with it
        return True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        # Bounds every socket operation of this connection (a stuck peer frees its thread).
        self.timeout = self.server.owner.timeout_s
        super().setup()

    def do_GET(self) -> None:
        try:
            self.server.owner.serve(self)
        except OSError as e:  # peer went away, timed out, or reset
            logger.info(
                "checkpoint request %s from %s aborted: %s", self.path, self.client_address, e
            )
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.client_address[0], *args)


class _Server(HTTPServer):
    """An HTTP server whose requests run on reused daemon threads.

    ``ThreadingHTTPServer`` starts a thread per connection, and ``Thread.start`` waits until
    the new thread runs: on a busy machine that is a scheduling delay per request. Here idle
    workers wait on a queue; a new one is started only when none is idle (up to
    ``_MAX_HANDLERS``; beyond that requests wait their turn). Daemon threads never hold up
    process exit.
    """

    request_queue_size = 64
    owner: CheckpointServer

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self._requests: queue.SimpleQueue[tuple[socket.socket, Any] | None] = queue.SimpleQueue()
        self._pool_lock = threading.Lock()
        self._workers = 0
        self._idle = 0

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall; skip it.
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._pool_lock:
            start = self._idle == 0 and self._workers < _MAX_HANDLERS
            if start:
                self._workers += 1
            else:
                self._idle -= 1
        self._requests.put((request, client_address))
        if start:
            threading.Thread(target=self._work, name="heal-serve", daemon=True).start()

    def server_close(self) -> None:
        super().server_close()
        with self._pool_lock:
            for _ in range(self._workers):
                self._requests.put(None)

    def _work(self) -> None:
        while (item := self._requests.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
            with self._pool_lock:
                self._idle += 1


def _make_server(host: str, port: int, owner: CheckpointServer) -> _Server:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    cls = type("_Server", (_Server,), {"address_family": family})
    server = cls((host.strip("[]"), port))
    server.owner = owner
    return server


def _reply_error(handler: BaseHTTPRequestHandler, status: int, message: str) -> None:
    body = (message + "\n").encode()
    handler.send_response(status)
    if status == 401:
        handler.send_header("WWW-Authenticate", "Bearer")
    handler.send_header("Content-Type", "text/plain; charset=utf-8")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _parse_range(value: str | None, total: int) -> tuple[int, int]:
    """``Range: bytes=a-b`` (b inclusive) -> ``[a, b+1)``; no header -> everything."""
    if value is None:
        return 0, total
    unit, _, spec = value.partition("=")
    first, dash, last = spec.partition("-")
    try:
        if unit.strip() != "bytes" or not dash or "," in spec:
            raise ValueError
        start, end = int(first), int(last) + 1
    except ValueError:
        raise _Refused(416, f"unsupported Range {value!r}; expected bytes=<first>-<last>") from None
    if not 0 <= start < end <= total:
        raise _Refused(416, f"Range {value!r} is outside the snapshot's {total} bytes")
    return start, end
