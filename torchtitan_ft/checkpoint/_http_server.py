"""The donor's side of ``HTTPTransport``: offered snapshots, leases, and the HTTP server.

``SnapshotStore`` decides what may be served (the offered snapshot; retired ones while a
receiver that got their header, i.e. holds a lease, still fetches them; a spare staging buffer
for reuse). ``CheckpointServer`` answers the HTTP requests on background threads; the routes are
described in ``http_transport``. It speaks just enough HTTP/1.1 for ``_http_client`` and curl:
one GET per connection, every response ``Connection: close``.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import math
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from torchtitan_ft.auth import AUTHORIZATION, RefusalLog, presents
from torchtitan_ft.checkpoint._serialization import Header
from torchtitan_ft.checkpoint._staging import Staging, set_io_timeout

logger = logging.getLogger(__name__)

_MAX_WORKERS = 64
"""Threads answering requests that passed authentication; more requests wait their turn."""
_MAX_PENDING = 256
"""Connections whose request head is still awaited; a newcomer beyond evicts the oldest."""
HEAD_TIMEOUT_S = 5.0
"""A connection must send its whole request head within this (or ``timeout_s`` if shorter):
receivers send it at once, an idle or trickling connection is closed."""
_MAX_HEAD_BYTES = 8 << 10
_MAX_HEADER_LINES = 32
_ACCEPT_PAUSE_S = 0.1
_RESOURCES = ("header", "data", "full")
PROBE = "probe"
"""``GET /checkpoint/probe?bytes=<n>``: ``n`` zero bytes, to time a path (``http_transport``)."""
MAX_PROBE_BYTES = 16 << 20
"""The most a probe may ask for."""
_ZEROS = bytes(1 << 20)
_LINGER_RESET = struct.pack("ii", 1, 0)


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

    One thread (``_Acceptor``) accepts connections and reads every request head without
    blocking; only a complete head that carries the token (when one is set) reaches a worker
    thread (``_WorkerPool``). So idle, trickling or unauthenticated connections hold no worker:
    they wait at most ``HEAD_TIMEOUT_S`` for their head, at most ``_MAX_PENDING`` of them at
    once (a newcomer evicts the oldest), and a request without the token is answered 401
    before any work. A response must be taken by its receiver within ``timeout_s`` in total (a
    reader that trickles is cut off then, and releases the snapshot it pinned).

    Args:
        host: address to listen on.
        port: port to listen on (0: a free one).
        timeout_s: bound on serving one response, and lease lifetime.
        auth_token: when set, only requests with ``Authorization: Bearer <token>`` are answered.
        also: more addresses to listen on, on the same port (a donor's other paths); one that
            cannot be bound is left out with a warning (``addresses`` lists those bound).
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        auth_token: str | None,
        also: Sequence[str] = (),
    ) -> None:
        self.store = SnapshotStore(lease_timeout=timeout_s)
        self.timeout_s = timeout_s
        self._auth_token = auth_token
        self._refusals = RefusalLog("the checkpoint server")
        listeners = [_listen(host, port)]
        self.address: tuple[str, int] = listeners[0].getsockname()[:2]
        self.addresses = [host]
        """The addresses listened on, ``host`` first."""
        for extra in also:
            try:
                listeners.append(_listen(extra, self.address[1]))
            except OSError as e:
                logger.warning(
                    "the checkpoint server cannot listen on %s port %d too (%s); that path is "
                    "not offered",
                    extra,
                    self.address[1],
                    e,
                )
                continue
            self.addresses.append(extra)
        self._workers = _WorkerPool(self._serve, _MAX_WORKERS)
        self._watchdog = _Watchdog()
        self._acceptor = _Acceptor(listeners, min(HEAD_TIMEOUT_S, timeout_s), self._dispatch)
        self._thread = threading.Thread(
            target=self._acceptor.run, name=f"heal-http-{self.address[1]}", daemon=True
        )
        self._thread.start()

    def shutdown(self, wait: bool) -> None:
        """Stops accepting requests; with ``wait``, waits (<= timeout) for in-flight ones."""
        self._acceptor.close()
        self._thread.join()
        self._workers.close()
        self.store.close(self.timeout_s if wait else 0.0)

    def _dispatch(self, request: _Request) -> None:
        """A complete request head (on the acceptor thread): refuse it or queue it."""
        if self._auth_token is not None and not presents(
            request.headers.get(AUTHORIZATION), self._auth_token
        ):
            self._refusals.refused(request.peer, f"{request.method} {request.path}")
            _reply_at_once(request.sock, 401, "missing or wrong bearer token")
            return
        self._workers.submit(request)

    def _serve(self, request: _Request) -> None:
        """Answers one request (on a worker thread) and closes its connection; the watchdog
        shuts the connection down if that takes longer than ``timeout_s``."""
        sock = request.sock
        overrun = threading.Event()
        try:
            with self._watchdog.guard(sock, time.monotonic() + self.timeout_s, overrun):
                set_io_timeout(sock, self.timeout_s)
                self._route(request, overrun)
        except _Refused as e:
            log = logger.debug if e.status == 503 else logger.info  # 503: receivers retry
            log("refused %s from %s: %s", request.path, request.peer, e)
            with contextlib.suppress(OSError):
                sock.sendall(_error_response(e.status, e.message))
        except OSError as e:  # peer went away, timed out, or reset
            logger.info("checkpoint request %s from %s aborted: %s", request.path, request.peer, e)
        finally:
            if overrun.is_set():
                # Reset rather than close: a plain close leaves the send queue (up to the
                # socket's buffer, referencing the snapshot's pages) to trickle out.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            sock.close()

    def _route(self, request: _Request, overrun: threading.Event) -> None:
        if request.method != "GET":
            raise _Refused(405, f"{request.method} is not supported; only GET")
        url = urlsplit(request.path)
        parts = url.path.split("/")
        if parts[1:] == ["checkpoint", PROBE]:
            self._serve_probe(request.sock, parse_qs(url.query).get("bytes", [""])[0])
            return
        if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] not in _RESOURCES:
            raise _Refused(404, f"no such resource {url.path!r}")
        step = _decimal(parts[2])
        if step is None:
            raise _Refused(404, f"{_shorten(parts[2])!r} is not a step number")
        if parts[3] == "header":
            self._serve_header(request.sock, step)
        elif parts[3] == "full":
            self._serve_full(request.sock, step, overrun)
        else:
            query = parse_qs(url.query)
            snapshot_id = query.get("snapshot", [""])[0]
            lease_id = query.get("lease", [""])[0]
            range_ = request.headers.get("range")
            self._serve_data(request.sock, step, snapshot_id, lease_id, range_, overrun)

    def _serve_probe(self, sock: socket.socket, count: str) -> None:
        nbytes = _decimal(count)
        if nbytes is None or nbytes > MAX_PROBE_BYTES:
            raise _Refused(400, f"bytes={_shorten(count)!r}: expected 0 to {MAX_PROBE_BYTES}")
        head = _response_head(
            200, ("Content-Type", "application/octet-stream"), ("Content-Length", str(nbytes))
        )
        sock.sendall(head)
        view = memoryview(_ZEROS)
        while nbytes > 0:
            piece = min(nbytes, len(view))
            sock.sendall(view[:piece])
            nbytes -= piece

    def _serve_header(self, sock: socket.socket, step: int) -> None:
        snap, lease_id = self.store.lease(step)
        head = _response_head(
            200,
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(snap.header_bytes))),
            ("X-Checkpoint-Lease", lease_id),
        )
        sock.sendall(head + snap.header_bytes)

    def _serve_full(self, sock: socket.socket, step: int, overrun: threading.Event) -> None:
        snap, lease_id = self.store.lease(step)
        with self.store.reading(step, snap.header.snapshot_id, lease_id) as (snap, on_done):
            total = snap.header.total_bytes
            prefix = len(snap.header_bytes).to_bytes(8, "big") + snap.header_bytes
            head = _response_head(
                200,
                ("Content-Type", "application/octet-stream"),
                ("Content-Length", str(len(prefix) + total)),
            )
            sock.sendall(head + prefix)
            on_done(total, self._send_and_wait(sock, snap, 0, total, overrun))

    def _serve_data(
        self,
        sock: socket.socket,
        step: int,
        snapshot_id: str,
        lease_id: str,
        range_: str | None,
        overrun: threading.Event,
    ) -> None:
        with self.store.reading(step, snapshot_id, lease_id) as (snap, on_done):
            total = snap.header.total_bytes
            start, end = _parse_range(range_, total)
            head = _response_head(
                206,
                ("Content-Type", "application/octet-stream"),
                ("Content-Length", str(end - start)),
                ("Content-Range", f"bytes {start}-{end - 1}/{total}"),
            )
            sock.sendall(head)
            on_done(end - start, self._send_and_wait(sock, snap, start, end - start, overrun))

    def _send_and_wait(
        self, sock: socket.socket, snap: Snapshot, start: int, count: int, overrun: threading.Event
    ) -> bool:
        """Sends the bytes, then waits for the peer to close; False unless it read them all
        (the buffer is then never reused: the socket may still reference its pages)."""
        try:
            if count:
                # Pinned by the caller's reading(): released only after this returns.
                snap.staging.send(sock, start, count)
            # sendfile hands pages to the socket: wait for the peer to close, i.e. to have
            # read them, before the buffer may be reused for another snapshot.
            sock.recv(1)
        except (BlockingIOError, TimeoutError):
            return False
        except OSError:
            pass  # peer reset: its receive queue is gone with it
        if overrun.is_set():
            logger.info(
                "a receiver of step %d did not take its %d bytes within %.1f s; cut off",
                snap.header.step,
                count,
                self.timeout_s,
            )
            return False
        return True


class _Watchdog:
    """Shuts down connections whose response overran its deadline.

    A blocking ``sendfile`` (or the wait for the peer's close) cannot be bounded from its own
    thread: the kernel's send timeout restarts with every bit a trickling reader takes. One
    thread, started on first use, shuts overdue connections down, which ends those calls.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadlines: list[tuple[float, int, socket.socket, threading.Event]] = []
        self._count = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(
        self, sock: socket.socket, deadline: float, overrun: threading.Event
    ) -> Iterator[None]:
        """While inside, ``sock`` is shut down at ``deadline``, and ``overrun`` set."""
        with self._cond:
            self._count += 1
            entry = (deadline, self._count, sock, overrun)
            heapq.heappush(self._deadlines, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="heal-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:  # after this the socket may be closed: never touch it again
                if not overrun.is_set():  # else the watchdog took it out already
                    self._deadlines.remove(entry)
                    heapq.heapify(self._deadlines)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, _, sock, overrun = heapq.heappop(self._deadlines)
                    overrun.set()
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._cond.wait(wait)


@dataclass
class _Request:
    """A complete request head, and the connection it came on."""

    sock: socket.socket
    peer: str
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class _Incoming:
    """A connection still sending its request head."""

    peer: str
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class _Acceptor:
    """Accepts connections and reads their request heads, all on one thread (``selectors``).

    A head must be complete within ``head_timeout`` seconds of the accept and at most
    ``_MAX_HEAD_BYTES`` long; at most ``_MAX_PENDING`` connections are waited on, the oldest
    evicted for a newcomer. Complete heads go to ``dispatch`` (on this thread, so it must not
    block). Out of file descriptors, it drops the oldest waiting connection or pauses
    accepting briefly, logging that once a minute.
    """

    def __init__(
        self,
        listeners: Sequence[socket.socket],
        head_timeout: float,
        dispatch: Callable[[_Request], None],
    ) -> None:
        self._listeners = list(listeners)
        self._head_timeout = head_timeout
        self._dispatch = dispatch
        self._incoming: dict[socket.socket, _Incoming] = {}  # insertion order: oldest first
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for listener in self._listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._paused_until: float | None = None
        self._last_fd_warning = -math.inf

    def run(self) -> None:
        try:
            while True:
                now = time.monotonic()
                if self._paused_until is not None and now >= self._paused_until:
                    self._paused_until = None
                    for listener in self._listeners:
                        self._selector.register(listener, selectors.EVENT_READ)
                for key, _ in self._selector.select(self._wait_s(now)):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj in self._listeners:
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    elif key.fileobj in self._incoming:  # not evicted earlier in this batch
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            for sock in list(self._incoming):
                self._drop(sock)
            self._selector.close()
            for sock in (*self._listeners, self._wake_r, self._wake_w):
                sock.close()

    def close(self) -> None:
        """Makes ``run`` return (and close the listening sockets)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _wait_s(self, now: float) -> float | None:
        deadlines = [i.deadline for i in self._incoming.values()]
        if self._paused_until is not None:
            deadlines.append(self._paused_until)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_MAX_PENDING):
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return  # e.g. the peer gave up before the accept
                if self._incoming:
                    self._drop(next(iter(self._incoming)))
                    continue
                self._pause(e)
                return
            if len(self._incoming) >= _MAX_PENDING:
                self._drop(next(iter(self._incoming)))
            sock.setblocking(False)
            peer = str(address[0])
            self._incoming[sock] = _Incoming(peer, time.monotonic() + self._head_timeout)
            self._selector.register(sock, selectors.EVENT_READ)

    def _pause(self, error: OSError) -> None:
        now = time.monotonic()
        for listener in self._listeners:
            self._selector.unregister(listener)
        self._paused_until = now + _ACCEPT_PAUSE_S
        if now - self._last_fd_warning >= 60:
            self._last_fd_warning = now
            logger.warning("the checkpoint server cannot accept connections: %s", error)

    def _read(self, sock: socket.socket) -> None:
        incoming = self._incoming[sock]
        try:
            data = sock.recv(_MAX_HEAD_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # closed or reset before sending a whole head: nothing to answer
            self._drop(sock)
            return
        incoming.head += data
        end = incoming.head.find(b"\r\n\r\n")
        if end < 0 and len(incoming.head) <= _MAX_HEAD_BYTES:
            return
        self._selector.unregister(sock)
        del self._incoming[sock]
        if not 0 <= end <= _MAX_HEAD_BYTES:
            _reply_at_once(sock, 431, f"request head longer than {_MAX_HEAD_BYTES} bytes")
            return
        try:
            method, path, headers = _parse_head(bytes(incoming.head[:end]))
        except ValueError as e:
            _reply_at_once(sock, 400, str(e))
            return
        self._dispatch(_Request(sock, incoming.peer, method, path, headers))

    def _expire(self, now: float) -> None:
        for sock, incoming in list(self._incoming.items()):
            if incoming.deadline > now:
                break  # oldest first: the rest are younger
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._incoming[sock]
        sock.close()


class _WorkerPool:
    """Runs ``serve(request)`` on reused daemon threads, at most ``max_workers`` at once.

    ``ThreadPoolExecutor`` would do, but its threads are not daemons (they would hold up
    process exit while a stuck receiver is served) and ``Thread.start`` per request waits until
    the new thread runs: on a busy machine that is a scheduling delay per request. Idle
    workers wait on a queue; a new one starts only when none is idle; beyond ``max_workers``
    requests wait their turn.
    """

    def __init__(self, serve: Callable[[_Request], None], max_workers: int) -> None:
        self._serve = serve
        self._max_workers = max_workers
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0
        self._idle = 0

    def submit(self, request: _Request) -> None:
        with self._lock:
            start = self._idle == 0 and self._workers < self._max_workers
            if start:
                self._workers += 1
            else:
                self._idle -= 1  # below 0: requests queued for a busy worker
        self._queue.put(request)
        if start:
            threading.Thread(target=self._work, name="heal-serve", daemon=True).start()

    def close(self) -> None:
        """Workers exit once the queued requests are served."""
        with self._lock:
            for _ in range(self._workers):
                self._queue.put(None)

    def _work(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                self._serve(request)
            except Exception:  # a bug must not shrink the pool: log it, serve the next
                logger.exception("serving %s from %s failed", request.path, request.peer)
            with self._lock:
                self._idle += 1


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(_MAX_PENDING)
    except BaseException:
        sock.close()
        raise
    return sock


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """``METHOD PATH HTTP/1.x`` and its header lines; raises ValueError naming what is wrong."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"request line {lines[0][:100]!r} is not 'METHOD PATH HTTP/1.1'")
    if len(lines) - 1 > _MAX_HEADER_LINES:
        raise ValueError(f"more than {_MAX_HEADER_LINES} header lines")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"header line {line[:100]!r} has no ':'")
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


def _response_head(status: int, *headers: tuple[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines += ["Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _error_response(status: int, message: str) -> bytes:
    body = (message + "\n").encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    if status == 401:
        headers.append(("WWW-Authenticate", "Bearer"))
    return _response_head(status, *headers) + body


def _reply_at_once(sock: socket.socket, status: int, message: str) -> None:
    """Answers a fresh, non-blocking connection with a short error and closes it: one send
    into an empty socket buffer, never a wait."""
    with contextlib.suppress(OSError):
        sock.send(_error_response(status, message))
    sock.close()


def _parse_range(value: str | None, total: int) -> tuple[int, int]:
    """``Range: bytes=a-b`` (b inclusive) -> ``[a, b+1)``; no header -> everything."""
    if value is None:
        return 0, total
    unit, _, spec = value.partition("=")
    first, dash, last = spec.partition("-")
    start, last_byte = _decimal(first), _decimal(last)
    if unit.strip() != "bytes" or not dash or start is None or last_byte is None:
        raise _Refused(416, f"unsupported Range {_shorten(value)!r}; expected bytes=<first>-<last>")
    end = last_byte + 1
    if not 0 <= start < end <= total:
        raise _Refused(416, f"Range {_shorten(value)!r} is outside the snapshot's {total} bytes")
    return start, end


_MAX_DIGITS = 18
"""Step numbers and byte offsets fit in 18 decimal digits (an int64). Longer ones are refused
before ``int()`` sees them, which raises for over 4,300 digits."""


def _decimal(text: str) -> int | None:
    """``text`` as a number if it is 1 to ``_MAX_DIGITS`` ASCII digits, else None (no sign, no
    spaces, no other scripts' digits, which ``str.isdigit`` accepts and ``int`` may not)."""
    if not 0 < len(text) <= _MAX_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def _shorten(text: str, keep: int = 40) -> str:
    """``text`` cut to ``keep`` characters for an error message (a stranger chooses its size)."""
    return text if len(text) <= keep else f"{text[:keep]}...({len(text)} characters)"
