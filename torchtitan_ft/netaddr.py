"""Address syntax: ``host:port`` and URLs (IPv6 in brackets), IP literals, port probes.

Used in every process (lighthouse, trainer rank): the lighthouse, the ManagerServer, the
process groups' stores and the checkpoint servers parse and format their addresses here.
Which address a replica group binds or advertises, and what counts as loopback, is policy:
:mod:`torchtitan_ft.addresses`.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
"""Hosts that mean "every interface" when binding (brackets removed)."""


def split_host_port(address: str, what: str = "address") -> tuple[str, int]:
    """Splits ``host:port`` or ``[v6]:port`` into the host (brackets removed) and the port.

    Args:
        address: e.g. ``"127.0.0.1:29510"``, ``"[::1]:29510"``, ``"[::]:0"``; an empty host
            (``":29510"``) is kept as ``""`` (every interface, when binding).
        what: how error messages name the value, e.g. ``"bind address"``.

    Raises:
        ValueError: naming ``address`` and what was expected.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{what} {address!r} is not host:port (e.g. 127.0.0.1:29510)")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{what} {address!r} has port {port}, expected 0-65535")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"{what} {address!r} has an unbalanced IPv6 bracket")
    return host.removeprefix("[").removesuffix("]"), port


def url_host(host: str) -> str:
    """``host`` as it goes before ``:port`` in an address or URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def join_host_port(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host (the inverse of :func:`split_host_port`)."""
    return f"{url_host(host)}:{port}"


def url_hostname(url: str) -> str:
    """The host of ``http://host:port`` (or of a bare ``host:port``), brackets removed."""
    return urlsplit(url if "://" in url else f"//{url}").hostname or ""


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (brackets allowed), or ``None`` when it is a name."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    return None


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (probed with a bind that is released
    at once). Port 0 is never in use. A port in TIME_WAIT is free, as for gRPC's own bind."""
    if port == 0:
        return False
    address = host or "::"
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def bind_problem(host: str, port: int) -> str | None:
    """Why listening on ``host:port`` would fail here, in words; None when it would work.

    A test bind, released at once. It runs before gRPC's own bind, whose failure is a bare
    "port 0" and a raw log line that cannot say whether the port is taken, the host is not an
    address of this machine, or its name does not resolve.
    """
    address = host.removeprefix("[").removesuffix("]") or "::"
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
