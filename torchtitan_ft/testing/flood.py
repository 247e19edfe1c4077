"""A flood of HTTP/2 connections that hold a gRPC server's connection slots (issue 20, N2 and
N3), for the tests and ``benchmarks/flood.py``.

Each connection completes gRPC's HTTP/2 handshake (the client preface, an empty SETTINGS frame
and the ACK of the server's) and then only sends, every ``call_every_s``, one call without the
job token: refused (UNAUTHENTICATED) by a server with a token, or, to a method the server does
not have, UNIMPLEMENTED; either restarts gRPC's idle timer, so without the connection guard
the connections live as long as the flood wants. A connection the server closes is opened
again at the next pass, so the flood keeps pressing on the cap.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta
from types import TracebackType

FLOOD_BOUND = timedelta(seconds=10)
"""The most a flood at the cap may delay a quorum or a heal's ManagerServer call (the tests'
deadline; docs/operations.md states it, benchmarks/flood.py measures the delay)."""

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
_HEADERS = 1
_END_STREAM_AND_HEADERS = 0x05


def preface_connection(port: int) -> socket.socket:
    """A connection to 127.0.0.1:``port`` that completed the HTTP/2 handshake and made no
    call (non-blocking once open)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(HTTP2_PREFACE + _EMPTY_SETTINGS + _SETTINGS_ACK)
    except OSError:
        s.close()
        raise
    s.setblocking(False)
    return s


def call_frame(stream_id: int, path: str) -> bytes:
    """A HEADERS frame that opens and ends (no message) a call to ``path`` on stream
    ``stream_id`` (odd, increasing per connection), without a token."""
    block = b"".join(
        _literal(name, value)
        for name, value in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "flood"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )
    header = len(block).to_bytes(3, "big") + bytes([_HEADERS, _END_STREAM_AND_HEADERS])
    return header + stream_id.to_bytes(4, "big") + block


def _literal(name: str, value: str) -> bytes:
    """An HPACK header field: literal without indexing, new name, no Huffman (< 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


class _Held:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.next_stream = 1
        self.last_call = time.monotonic()


class Flood:
    """``n`` connections to 127.0.0.1:``port`` held on a thread (see the module doc).

    Args:
        port: the server's port.
        n: how many connections to hold (more than the server's cap presses on it).
        path: the method each connection calls, e.g. ``/torchft.LighthouseService/Heartbeat``.
        call_every_s: how often each connection calls.
        pass_s: how often the flood looks for closed connections and opens them again.
    """

    def __init__(
        self, port: int, n: int, path: str, call_every_s: float = 2.0, pass_s: float = 0.25
    ) -> None:
        self._port = port
        self._n = n
        self._path = path
        self._call_every_s = call_every_s
        self._pass_s = pass_s
        self._held: list[_Held] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self.started = time.monotonic()
        """When the flood began (monotonic seconds; set again on entry)."""
        self.opened = 0
        """Connections opened so far (the first ``n``, then every reopening)."""
        self.calls = 0
        """Calls sent so far."""

    def __enter__(self) -> Flood:
        self.started = time.monotonic()
        self._fill()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        for held in self._held:
            held.sock.close()

    def _run(self) -> None:
        while not self._stop.wait(self._pass_s):
            self._held = [held for held in self._held if self._keep(held)]
            self._fill()

    def _fill(self) -> None:
        while len(self._held) < self._n and not self._stop.is_set():
            try:
                self._held.append(_Held(preface_connection(self._port)))
            except OSError:
                return  # refused or reset at once: the next pass tries again
            self.opened += 1

    def _keep(self, held: _Held) -> bool:
        """Reads what the server sent, calls when due; False (and closed) once it is gone."""
        try:
            while True:
                if not held.sock.recv(65536):
                    raise ConnectionResetError("closed by the server")
        except BlockingIOError:
            pass  # all read
        except OSError:
            held.sock.close()
            return False
        if time.monotonic() - held.last_call >= self._call_every_s:
            with contextlib.suppress(BlockingIOError):  # the server reads slowly: next time
                held.sock.send(call_frame(held.next_stream, self._path))
                held.next_stream += 2
                held.last_call = time.monotonic()
                self.calls += 1
        return True
