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
