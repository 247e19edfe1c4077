"""The receiver's side of ``HTTPTransport``: a minimal HTTP/1.1 client that reads tensor bytes
straight into preallocated tensors (one response, or parallel range requests).

A donor's answer is checked before it costs anything: the header's length against
``MAX_HEADER_BYTES``, its tensors' total against the memory available here, every range
response's ``Content-Range`` against what was asked; pages are populated only a window ahead of
the bytes received (``Prefaulter``).
"""

from __future__ import annotations

import bisect
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from torchtitan_ft.checkpoint._serialization import Header, check_header_length, check_receivable
from torchtitan_ft.checkpoint._staging import (
    Prefaulter,
    PrefaultJob,
    ReceiveBuffer,
    set_io_timeout,
    writable_view,
)
from torchtitan_ft.netaddr import url_host

_READ_PIECE = 32 << 20
"""Receivers check their deadline (and cancellation) between reads of at most this size."""
_PREFAULT_WINDOW = 256 << 20
"""How far page population may run ahead of the bytes received (see ``Prefaulter``)."""
_CHUNK_ALIGN = 1 << 16
_MAX_ERROR_BODY = 4096
_RETRY_FIRST_S = 0.005
_RETRY_MAX_S = 0.1
_PROBE_PIECE = 64 << 10
R = TypeVar("R")


class NotOfferedYet(ValueError):
    """The donor answered 503: it has not staged the requested step yet."""


_MAX_HEAD = 64 << 10


class Response:
    """One HTTP/1.1 response read from a blocking socket, body straight into caller buffers.

    A minimal client (we speak to our own server): the request always says
    ``Connection: close`` and the body is ``Content-Length`` bytes. Body reads use
    ``recv_into(..., MSG_WAITALL)``, so a whole piece arrives in one system call with the GIL
    released, the socket's kernel timeout bounding each call.
    """

    def __init__(self, sock: socket.socket, stall_s: float | None = None) -> None:
        self.sock = sock
        self.stall_s = stall_s
        """The socket's timeout when it is the source's stall bound, not the deadline (for
        the error)."""
        head = bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > _MAX_HEAD:
                raise ValueError("response head too long")
            chunk = self._recv(65536)
            if not chunk:
                raise ConnectionResetError("donor closed the connection before answering")
            head += chunk
        self._left = memoryview(bytes(head[end + 4 :]))
        lines = head[:end].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, self.reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise ValueError(f"not an HTTP response: {lines[0]!r}")
        self.status = int(code)
        self.headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        length = self.headers.get("content-length", "0")
        if not length.isdigit():
            raise ValueError(f"Content-Length {length!r} is not a byte count")
        self.length = int(length)
        self.progress: PrefaultJob | None = None
        """Told of every body piece read, to pace page population."""

    def readinto(self, view: memoryview, deadline: float) -> None:
        """Fills ``view`` with the next body bytes; raises on EOF, timeout or overrun."""
        if len(view) > self.length:
            raise ValueError(f"reading {len(view)} bytes, only {self.length} left in the body")
        got = min(len(self._left), len(view))
        view[:got] = self._left[:got]
        self._left = self._left[got:]
        while got < len(view):
            if time.monotonic() > deadline:
                raise TimeoutError("transfer deadline passed")
            piece = view[got : min(len(view), got + _READ_PIECE)]
            try:
                n = self.sock.recv_into(piece, len(piece), socket.MSG_WAITALL)
            except BlockingIOError:
                raise self._timed_out() from None
            if n == 0:
                raise ConnectionResetError(
                    f"donor closed the connection with {self.length - got} body bytes missing"
                )
            got += n
            if self.progress is not None:
                self.progress.advance(n)
        self.length -= len(view)

    def read(self, n: int, deadline: float) -> bytes:
        if n > self.length:  # before allocating n bytes
            raise ValueError(f"reading {n} bytes, only {self.length} left in the body")
        buf = bytearray(n)
        self.readinto(memoryview(buf), deadline)
        return bytes(buf)

    def _recv(self, n: int) -> bytes:
        try:
            return self.sock.recv(n)
        except BlockingIOError:
            raise self._timed_out() from None

    def _timed_out(self) -> TimeoutError:
        """The error of a read that got nothing within the socket's timeout: the stall bound,
        or the deadline."""
        if self.stall_s is not None:
            return TimeoutError(f"no byte from the donor for {self.stall_s:g} s (stalled)")
        return TimeoutError("timed out waiting for the donor")


class Source:
    """The receiving end of one transfer: a donor's host, port and base path.

    ``stall_s``: a connection that gets no byte for this long (a pulled cable: nothing resets
    it) fails with ``TimeoutError``, so that the heal can fall back to another path before its
    deadline; ``None``: only the deadline bounds it.
    """

    def __init__(
        self, host: str, port: int, base: str, auth_token: str | None, stall_s: float | None = None
    ) -> None:
        self._host = host
        self._port = port
        self._base = base
        self._stall_s = stall_s
        self._auth = f"Authorization: Bearer {auth_token}\r\n" if auth_token else ""
        self._cancel = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    def full(
        self, step: int, deadline: float, into: ReceiveBuffer | None = None
    ) -> tuple[Header, list[torch.Tensor]]:
        """Header and all bytes in one response (one round trip); into views of ``into`` when
        given, else into new tensors."""
        with self._get(f"{self._base}/{step}/full", "", 200, deadline) as resp:
            size = int.from_bytes(resp.read(8, deadline), "big")
            if size > resp.length:
                raise ValueError(f"header length {size} exceeds the {resp.length}-byte body")
            check_header_length(size)
            header = Header.from_bytes(resp.read(size, deadline))
            if resp.length != header.total_bytes:
                raise ValueError(
                    f"header describes {header.total_bytes} bytes, response has {resp.length}"
                )
            tensors, fresh = receive_tensors(header, step, into)
            prefault = resp.progress = Prefaulter.submit(fresh, _PREFAULT_WINDOW)
            try:
                views = [writable_view(t) for t in tensors]
                offsets = [s.offset for s in header.tensors]
                self._read_range(resp, 0, header.total_bytes, views, offsets, deadline)
            finally:
                prefault.cancel()
            return header, tensors

    def probe(self, nbytes: int, deadline: float, cutoff: Callable[[], float]) -> float:
        """Times a download of ``nbytes`` zero bytes from the donor (``/probe``) from the
        response's head on (connecting and asking are round trips, not bandwidth, and on a
        loaded machine mostly scheduling); returns the rate in MB/s. A probe still running at
        ``cutoff()`` (a
        monotonic time, read between pieces: a race of probes ends the others once one is
        done) or at ``deadline`` measures what came so far. Raises OSError (path
        unreachable, nothing came) or ValueError (the donor has no probe)."""
        got = 0
        with self._get(f"{self._base}/probe?bytes={nbytes}", "", 200, deadline) as resp:
            started = time.perf_counter()
            buf = memoryview(bytearray(min(nbytes, _PROBE_PIECE)))
            try:
                while resp.length and time.monotonic() < cutoff():
                    n = min(len(buf), resp.length)
                    resp.readinto(buf[:n], deadline)
                    got += n
            except TimeoutError:
                if not got:
                    raise
        return got / 1e6 / max(time.perf_counter() - started, 1e-9)

    def header(self, step: int, deadline: float) -> tuple[Header, str]:
        with self._get(f"{self._base}/{step}/header", "", 200, deadline) as resp:
            lease = resp.headers.get("x-checkpoint-lease", "")
            check_header_length(resp.length)
            return Header.from_bytes(resp.read(resp.length, deadline)), lease

    def data(
        self,
        header: Header,
        lease: str,
        tensors: list[torch.Tensor],
        num_chunks: int,
        deadline: float,
        fresh: list[torch.Tensor],
    ) -> None:
        """Reads the bytes into ``tensors``; ``fresh``: the memory among them whose pages are
        not populated yet (faulted in a window ahead of the bytes received)."""
        total = header.total_bytes
        if total == 0:
            return
        views = [writable_view(t) for t in tensors]
        offsets = [s.offset for s in header.tensors]
        path = f"{self._base}/{header.step}/data?snapshot={header.snapshot_id}&lease={lease}"
        bounds = _split(total, num_chunks)
        errors: list[BaseException] = []

        prefault = Prefaulter.submit(fresh, _PREFAULT_WINDOW)

        def worker(start: int, end: int) -> None:
            try:
                self._fetch(path, start, end, total, views, offsets, prefault, deadline)
            except BaseException as e:
                errors.append(e)
                self._abort()

        threads = [
            threading.Thread(target=worker, args=b, name="heal-recv", daemon=True) for b in bounds
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            prefault.cancel()
        if errors:
            # The first error is the cause; the others are mostly our own aborts.
            raise errors[0]

    def _fetch(
        self,
        path: str,
        start: int,
        end: int,
        total: int,
        views: list[memoryview],
        offsets: list[int],
        progress: PrefaultJob,
        deadline: float,
    ) -> None:
        with self._get(path, f"Range: bytes={start}-{end - 1}\r\n", 206, deadline) as resp:
            expected = f"bytes {start}-{end - 1}/{total}"
            if resp.headers.get("content-range") != expected:
                got = resp.headers.get("content-range")
                raise ValueError(f"asked for {expected}, donor answered Content-Range {got!r}")
            if resp.length != end - start:
                raise ValueError(f"asked for {end - start} bytes, response has {resp.length}")
            resp.progress = progress
            self._read_range(resp, start, end, views, offsets, deadline)

    def _read_range(
        self,
        resp: Response,
        start: int,
        end: int,
        views: list[memoryview],
        offsets: list[int],
        deadline: float,
    ) -> None:
        """Reads stream bytes ``[start, end)`` into the tensors' views they belong to."""
        i = bisect.bisect_right(offsets, start) - 1
        pos = start
        while pos < end:
            while offsets[i] + len(views[i]) <= pos:
                i += 1
            lo = pos - offsets[i]
            hi = min(len(views[i]), end - offsets[i])
            if self._cancel.is_set():
                raise ConnectionAbortedError("transfer aborted after another chunk failed")
            resp.readinto(views[i][lo:hi], deadline)
            pos = offsets[i] + hi

    def retrying(self, fetch: Callable[[], R], deadline: float) -> R:
        """Calls ``fetch`` until the donor offers the step (503 until then) or the deadline;
        then raises TimeoutError naming the donor's last answer."""
        pause = _RETRY_FIRST_S
        last: NotOfferedYet | None = None
        while True:
            try:
                return fetch()
            except NotOfferedYet as e:
                last = e
                if time.monotonic() + pause >= deadline:
                    raise TimeoutError(f"timed out waiting for the donor to offer it: {e}") from e
                time.sleep(pause)
                pause = min(2 * pause, _RETRY_MAX_S)
            except TimeoutError as e:
                if last is None:
                    raise
                # The deadline fell inside a retry: the donor's last answer is the reason.
                raise TimeoutError(f"timed out waiting for the donor to offer it: {last}") from e

    @contextlib.contextmanager
    def _get(self, path: str, headers: str, expect: int, deadline: float) -> Iterator[Response]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("transfer deadline passed")
        bound = remaining if self._stall_s is None else min(remaining, self._stall_s)
        sock = socket.create_connection((self._host, self._port), timeout=bound)
        try:
            with self._lock:
                self._socks.append(sock)
            if self._cancel.is_set():
                raise ConnectionAbortedError("transfer aborted after another chunk failed")
            left = deadline - time.monotonic()
            stall = self._stall_s if self._stall_s is not None and self._stall_s < left else None
            set_io_timeout(sock, left if stall is None else stall)
            host = url_host(self._host)
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {host}:{self._port}\r\n{self._auth}{headers}"
                "Connection: close\r\n\r\n"
            )
            sock.sendall(request.encode("latin-1"))
            resp = Response(sock, stall)
            if resp.status != expect:
                body = resp.read(min(resp.length, _MAX_ERROR_BODY), deadline)
                text = body.decode(errors="replace").strip()
                error = NotOfferedYet if resp.status == 503 else ValueError
                raise error(f"donor answered {resp.status} {resp.reason}: {text}")
            yield resp
        finally:
            sock.close()

    def _abort(self) -> None:
        self._cancel.set()
        with self._lock:
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def receive_tensors(
    header: Header, step: int, into: ReceiveBuffer | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors to receive the header's table into (views of ``into`` when given, else new
    ones), and the memory among them that is fresh (to prefault)."""
    if into is None:
        tensors = allocate(header, step)
        return tensors, tensors
    if header.step != step:
        raise ValueError(f"donor sent step {header.step}, requested step {step}")
    return into.views(header.tensors)


def allocate(header: Header, step: int) -> list[torch.Tensor]:
    """Empty tensors for the header's table (address space: pages are populated as bytes
    arrive); raises ValueError for another step, or a state larger than memory here."""
    if header.step != step:
        raise ValueError(f"donor sent step {header.step}, requested step {step}")
    check_receivable(header)
    try:
        return [torch.empty(s.shape, dtype=s.dtype) for s in header.tensors]
    except (RuntimeError, MemoryError) as e:  # the allocator refused
        raise ValueError(f"cannot allocate the {header.total_bytes} bytes announced: {e}") from e


def _split(total: int, n: int) -> list[tuple[int, int]]:
    n = max(1, min(n, -(-total // _CHUNK_ALIGN)))
    size = -(-total // n // _CHUNK_ALIGN) * _CHUNK_ALIGN
    return [(a, min(a + size, total)) for a in range(0, total, size)]
