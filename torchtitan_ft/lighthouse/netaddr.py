"""Parsing of ``host:port`` bind strings, the host name servers advertise, and why a bind fails."""

from __future__ import annotations

import errno
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


def bind_problem(host: str, port: int) -> str | None:
    """Why listening on ``host:port`` would fail here, in words; None when it would work.

    A test bind, released at once. It runs before gRPC's own bind, whose failure is a bare
    "port 0" and a raw log line that cannot say whether the port is taken, the host is not an
    address of this machine, or its name does not resolve.
    """
    address = host.strip("[]") or "::"
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"host {host!r} does not resolve ({e.strerror})"
    except UnicodeError:  # an empty or over-long label, refused before any lookup
        return f"host {host!r} is not a valid host name"
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is fine
        try:
            probe.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use on {host or '*'} (another lighthouse?)"
            if e.errno == errno.EADDRNOTAVAIL:
                resolved = "" if sockaddr[0] == address else f" ({sockaddr[0]})"
                return f"{host!r}{resolved} is not an address of this machine"
            if e.errno == errno.EACCES:
                return f"no permission to listen on port {port} (ports below 1024 need privileges)"
            return f"{e.strerror} ({sockaddr[0]} port {port})"
    return None
