"""Raw-socket helpers of the tests that flood servers with connections."""

from __future__ import annotations

import socket


def idle_connections(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to 127.0.0.1:``port`` that never send a byte. The connects do not
    block: a server that stops accepting (full backlog) must not stall the test."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def preface_connections(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to 127.0.0.1:``port`` that complete gRPC's HTTP/2 handshake (the
    client preface, an empty SETTINGS frame and the ACK of the server's) and make no call."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(HTTP2_PREFACE + _EMPTY_SETTINGS + _SETTINGS_ACK)
        socks.append(s)
    return socks


def _literal(name: str, value: str) -> bytes:
    """An HPACK header field, literal without indexing, new name, no Huffman (< 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def call_frame(stream_id: int, path: str) -> bytes:
    """A HEADERS frame that opens and ends (no message) a gRPC call to ``path`` on stream
    ``stream_id`` (odd, increasing per connection), without a token: the server refuses it
    (or answers UNIMPLEMENTED for a method it does not have), and its idle timer restarts."""
    block = b"".join(
        _literal(k, v)
        for k, v in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "flood"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )
    return len(block).to_bytes(3, "big") + b"\x01\x05" + stream_id.to_bytes(4, "big") + block
