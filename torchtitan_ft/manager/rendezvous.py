"""How every rank of a replica group joins it at start-up: the group's TCPStore, the
ManagerServer that group rank 0 starts, each rank's client of it, and its checkpoint server.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from torchtitan_ft.addresses import advertised_store_host, is_loopback, loopback_address
from torchtitan_ft.checkpoint import CheckpointTransport, HTTPTransport
from torchtitan_ft.manager.client import LocalManagerClient, ManagerClient
from torchtitan_ft.manager.server import AddressInUseError, ManagerServer
from torchtitan_ft.manager.settings import ManagerSettings, port_in_use_message, store_key_prefix
from torchtitan_ft.netaddr import join_host_port
from torchtitan_ft.replica_ids import process_replica_id

logger = logging.getLogger(__name__)

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"


@dataclass
class GroupRendezvous:
    """What a rank holds once it has joined its replica group."""

    store: TCPStore
    """The group's TCPStore (hosted by group rank 0 unless torchrun's agent already serves it)."""
    server: ManagerServer | None
    """The group's ManagerServer on group rank 0; None on the other ranks."""
    client: ManagerClient | LocalManagerClient
    """This rank's client of the group's ManagerServer (on group rank 0, the server's own
    handlers called in process)."""
    replica_id: str
    """The group's id with its per-process uuid suffix (``"{replica_id}:{uuid}"``)."""
    manager_address: str
    """The ManagerServer's URL."""
    store_address: str
    """``host:port`` of the group's TCPStore, advertised to the other groups."""
    transport: CheckpointTransport[Any]
    """How this rank serves its state to healing peers and receives theirs."""

    def shutdown(self) -> None:
        """Stops the ManagerServer (group rank 0) and closes the client."""
        if self.server is not None:
            self.server.shutdown()
        self.client.close()


def join_replica_group(
    settings: ManagerSettings,
    *,
    env: Mapping[str, str],
    hostname: str,
    heartbeat_interval: timedelta,
    transport: CheckpointTransport[Any] | None,
) -> GroupRendezvous:
    """Opens (or, on group rank 0, hosts) the group's TCPStore; group rank 0 starts the
    ManagerServer and publishes its address and the replica id there; every rank reads them and
    connects (waiting up to the settings' ``connect_timeout`` for each), and starts the default
    ``HTTPTransport`` (the settings' ``timeout``) unless given a ``transport``. The settings'
    ``auth_token`` goes to each of them.

    Raises:
        AddressInUseError: the ManagerServer's port is taken (the message says where it was set).
        TimeoutError: the store or the ManagerServer was not reachable in time.
    """
    group_rank = settings.group_rank.value
    connect_timeout = settings.connect_timeout.value
    auth_token = settings.auth_token.value
    # torchrun's MASTER_ADDR is often "localhost": the store is then on this machine, and
    # other machines must be told to dial `hostname` (torchtitan_ft.addresses).
    store_host = advertised_store_host(settings.store_addr.value, hostname)
    store = open_store(
        store_host,
        settings.store_port.value,
        host_it=group_rank == 0,
        timeout=connect_timeout,
    )
    store_address = f"{store_host}:{store.port}"
    key_prefix = store_key_prefix(env)
    server = None
    if group_rank == 0:
        base_id = settings.replica_id.value
        full_id = process_replica_id(base_id, str(uuid.uuid4()))
        try:
            server = ManagerServer(
                replica_id=full_id,
                lighthouse_addr=settings.lighthouse_addr.value,
                hostname=hostname,
                bind=join_host_port(_server_bind_host(hostname), settings.manager_port.value),
                store_addr=store_address,
                world_size=settings.group_world_size.value,
                heartbeat_interval=heartbeat_interval,
                connect_timeout=connect_timeout,
                quorum_retries=settings.quorum_retries.value,
                auth_token=auth_token,
                lighthouse_outage=settings.lighthouse_outage.value,
            )
        except AddressInUseError as e:
            message = port_in_use_message(settings.manager_port, e.bind)
            raise AddressInUseError(e.bind, message) from None
    client = None
    try:
        if server is not None:
            store.set(key_prefix + MANAGER_ADDR_KEY, server.address())
            store.set(key_prefix + REPLICA_ID_KEY, full_id)
        manager_address = store.get(key_prefix + MANAGER_ADDR_KEY).decode()
        replica_id = store.get(key_prefix + REPLICA_ID_KEY).decode()
        if server is not None:  # its handlers, called in process
            client = LocalManagerClient(server, manager_address)
        else:
            client = ManagerClient(
                manager_address, connect_timeout=connect_timeout, auth_token=auth_token
            )
        if transport is None:
            transport = HTTPTransport(
                timeout=settings.timeout.value,
                num_chunks=0,
                hostname=hostname,
                auth_token=auth_token,
                interfaces=settings.heal_interfaces.value,
                stall_timeout=settings.heal_stall_timeout.value,
            )
    except BaseException:
        if client is not None:
            client.close()
        if server is not None:
            server.shutdown()
        raise
    return GroupRendezvous(
        store, server, client, replica_id, manager_address, store_address, transport
    )


def _server_bind_host(hostname: str) -> str:
    """Where the ManagerServer listens: on loopback only when peers dial a loopback name, else
    on every interface."""
    if not is_loopback(hostname):
        return "::"
    return loopback_address(hostname)


def open_store(host: str, port: int, *, host_it: bool, timeout: timedelta) -> TCPStore:
    """Group rank 0 hosts the group's TCPStore unless one already listens there (torchrun's
    agent store); other ranks connect, waiting up to ``timeout`` for it to appear. A store on a
    loopback host listens on loopback only (TCPStore alone would listen on every interface)."""
    if host_it:
        try:
            return _host_store(host, port, timeout)
        except OSError as e:  # address in use: someone (torchrun's agent) already serves it
            if port == 0:
                raise
            # torchrun's agent store, or TorchTitan's own process group's: as expected
            logger.debug(
                "TCPStore %s:%d already served (%s); connecting as a client", host, port, e
            )
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def _host_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    if not is_loopback(host):
        try:
            return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        except RuntimeError as e:  # DistNetworkError: EADDRINUSE
            raise OSError(str(e)) from e
    address = loopback_address(host)
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    try:
        sock.bind((address, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    return TCPStore(
        host,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=sock.detach(),
    )
