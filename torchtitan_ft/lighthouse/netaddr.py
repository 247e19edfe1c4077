"""Parsing of ``host:port`` bind strings and the host name servers advertise."""

from __future__ import annotations

import socket

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def parse_bind(bind: str) -> tuple[str, int]:
    """Splits ``host:port`` (``[v6]:port`` for IPv6); raises ValueError naming the bad part."""
    host, sep, port_text = bind.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"bind address {bind!r} is not host:port (e.g. 127.0.0.1:29510)")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"bind address {bind!r} has port {port}, expected 0-65535")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"bind address {bind!r} has an unbalanced IPv6 bracket")
    return host, port


def advertised_host(host: str) -> str:
    """The name peers should dial: the machine's host name for a wildcard bind."""
    return socket.gethostname() if host in _WILDCARDS else host
