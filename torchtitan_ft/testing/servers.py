"""A group's ManagerServer on loopback with no trainer behind it, for tests and benchmarks that
drive its RPCs with their own clients (quorum rounds, tokens, restarts)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torchtitan_ft.manager import ManagerServer


def loopback_manager_server(
    lighthouse_addr: str,
    *,
    replica_id: str = "group",
    world_size: int = 1,
    connect_timeout: timedelta = timedelta(seconds=10),
    **options: Any,
) -> ManagerServer:
    """A ManagerServer bound to a free loopback port, heartbeating ``lighthouse_addr`` every
    100 ms. Its store address is a placeholder (nothing trains behind it); ``options`` go to
    ``ManagerServer`` as they are (``auth_token``, ``group_key``, ...)."""
    return ManagerServer(
        replica_id,
        lighthouse_addr,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=world_size,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=connect_timeout,
        **options,
    )
