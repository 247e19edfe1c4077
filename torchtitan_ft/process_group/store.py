"""Connections to the TCPStore a quorum's process groups meet on, in every rank (the store of
the replica group that is the quorum's primary for this group rank)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from torchtitan_ft.netaddr import split_host_port
from torchtitan_ft.process_group.base import COLLECTIVE_ERRORS


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Split ``"host:port/prefix"`` into ``(host, port, prefix)``.

    Args:
        store_addr: TCPStore address with a key prefix, e.g. ``"127.0.0.1:29600/torchft/3/0"``.
            An IPv6 host may be bracketed (``"[::1]:29600/p"``). The prefix must not be empty:
            every group built on the store needs its own keys.

    Raises:
        ValueError: if the address does not have that shape.
    """
    addr, _, prefix = store_addr.partition("/")
    try:
        host, port = split_host_port(addr)
    except ValueError:
        host, port = "", 0
    if not prefix or not host:
        raise ValueError(
            f"store_addr must look like 'host:port/prefix' with a non-empty prefix, "
            f"got {store_addr!r}"
        )
    return host, port, prefix


def create_store_client(store_addr: str, timeout: timedelta) -> dist.Store:
    """Connect to a TCPStore served elsewhere and scope it to the address's prefix.

    Args:
        store_addr: ``"host:port/prefix"`` (see :func:`parse_store_addr`).
        timeout: timeout of the connection and of every store operation (``get``/``wait``).

    Returns:
        a ``PrefixStore`` over a ``TCPStore`` client.
    """
    host, port, prefix = parse_store_addr(store_addr)
    return dist.PrefixStore(prefix, connect(host, port, timeout))


def connect(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore client of the server at ``host:port``.

    A process group keeps its client and reuses it for every later group on the same store
    (see :func:`is_alive`): torchft opens a new connection per configure, but with torch 2.13
    on this platform the store server intermittently leaves a new client's handshake unanswered
    for the whole client timeout (measured: the 25th connection to a fresh server stalled in 3
    of 3 runs), which would cost a reconfigure the full timeout. The client is the group's own:
    a TCPStore client serializes its operations, and a rendezvous ``wait`` holds it.
    """
    return dist.TCPStore(
        host_name=host, port=port, is_master=False, wait_for_workers=False, timeout=timeout
    )


def is_alive(client: dist.TCPStore) -> bool:
    """Whether a kept client still reaches its server (one round trip; a dead server fails at
    once)."""
    try:
        client.num_keys()
    except COLLECTIVE_ERRORS:
        return False
    return True
