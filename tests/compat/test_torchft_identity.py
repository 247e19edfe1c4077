"""Group identity checks (``QuorumMember.data``) next to torchft 0.2.0's real (Rust) servers.

A torchft manager server sends no identity: it is never checked and never blocks ours. The
torchft lighthouse passes ``data`` through unchanged, so our groups still check each other.
"""

from __future__ import annotations

import time
from concurrent import futures
from datetime import timedelta

import pytest

from benchmarks._reference import load_reference
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager import ManagerClient, ManagerServer, ReplicaGroupMismatchError
from torchtitan_ft.manager.identity import GroupIdentity

torchft = load_reference()
pytestmark = pytest.mark.skipif(torchft is None, reason="scripts/install_reference.sh not run")

T = timedelta(seconds=10)


def _ours(lighthouse_addr: str, replica_id: str, identity: GroupIdentity) -> ManagerServer:
    server = ManagerServer(
        replica_id,
        lighthouse_addr,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:29501",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5),
    )
    server.set_identity(identity)
    return server


def _ask(client: object, step: int = 0) -> object:
    return client._quorum(  # type: ignore[attr-defined]
        group_rank=0,
        step=step,
        checkpoint_metadata="meta",
        shrink_only=False,
        timeout=T,
        commit_failures=0,
        init_sync=False,
    )


def test_torchft_member_without_identity_is_not_checked() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    ours = _ours(lighthouse.address(), "a:u1", GroupIdentity("a", "fp: 1 params / 4 elements"))
    theirs = torchft.ManagerServer(
        replica_id="b",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:29502",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5),
        quorum_retries=0,
    )
    our_client = ManagerClient(ours.address(), connect_timeout=T)
    their_client = torchft.ManagerClient(theirs.address(), timedelta(seconds=5))
    try:
        with futures.ThreadPoolExecutor(2) as pool:
            results = [pool.submit(_ask, c) for c in (our_client, their_client)]
            mine, other = (f.result(timeout=20) for f in results)
    finally:
        our_client.close()
        ours.shutdown()
        theirs.shutdown()
        lighthouse.shutdown()
    assert mine.replica_world_size == other.replica_world_size == 2  # type: ignore[attr-defined]


def test_our_groups_check_each_other_through_torchft_lighthouse() -> None:
    lighthouse = torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10000)
    running = _ours(lighthouse.address(), "ft_0:u1", GroupIdentity("ft_0", "m1"))
    newcomer = _ours(lighthouse.address(), "ft_1:u2", GroupIdentity("ft_1", "m2"))
    clients = [ManagerClient(s.address(), connect_timeout=T) for s in (running, newcomer)]
    try:
        # ft_0 trains alone first, then ft_1 joins its next quorum
        assert _ask(clients[0], step=3).replica_world_size == 1  # type: ignore[attr-defined]
        with futures.ThreadPoolExecutor(2) as pool:
            joining = pool.submit(_ask, clients[1])
            time.sleep(0.3)
            again = pool.submit(_ask, clients[0], 3)
            with pytest.raises(ReplicaGroupMismatchError, match="'ft_1' runs a different model"):
                joining.result(timeout=20)
            assert again.result(timeout=20).replica_world_size == 2  # type: ignore[attr-defined]
    finally:
        for client in clients:
            client.close()
        running.shutdown()
        newcomer.shutdown()
        lighthouse.shutdown()
