"""Wire compatibility with torchft 0.2.0, against its real (Rust) servers and clients.

The reference is installed by scripts/install_reference.sh (run by run_tests.sh); these tests
skip only when it is absent.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from benchmarks._reference import load_reference
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer

torchft = load_reference()
pytestmark = pytest.mark.skipif(torchft is None, reason="scripts/install_reference.sh not run")

T = timedelta(seconds=10)


def test_torchft_clients_use_our_lighthouse() -> None:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        results = {}

        def ask(rid: str, step: int) -> None:
            client = torchft.LighthouseClient(server.address(), timedelta(seconds=5))
            client.heartbeat(rid)
            results[rid] = client.quorum(
                replica_id=rid,
                timeout=T,
                address=f"http://{rid}:1",
                store_address=f"{rid}:2",
                step=step,
                world_size=3,
                shrink_only=False,
                data={"from": rid},
            )

        threads = [threading.Thread(target=ask, args=(r, s)) for r, s in [("b", 4), ("a", 5)]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.shutdown()
    q = results["a"]
    assert [p.replica_id for p in q.participants] == ["a", "b"]
    assert [p.step for p in q.participants] == [5, 4]
    assert q.participants[0].address == "http://a:1"
    assert q.participants[1].store_address == "b:2"
    assert q.participants[0].data == {"from": "a"}
    assert results["b"].quorum_id == q.quorum_id


def test_our_client_uses_torchft_lighthouse() -> None:
    server = torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        client = LighthouseClient(server.address())
        client.heartbeat("r")
        q = client.quorum("r", T, address="http://r:1", step=9, world_size=2, data={"x": 1})
        stream = client.heartbeat_stream("r", timedelta(milliseconds=50))  # falls back to unary
        again = client.quorum("r", T, step=10)
        stream.close()
    finally:
        server.shutdown()
    assert [m.replica_id for m in q.participants] == ["r"]
    assert (q.participants[0].step, q.participants[0].data) == (9, {"x": 1})
    assert again.participants[0].step == 10


def test_torchft_manager_server_uses_our_lighthouse() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    manager = torchft.ManagerServer(
        replica_id="tf",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:29500",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5),
        quorum_retries=0,
    )
    try:
        client = torchft.ManagerClient(manager.address(), timedelta(seconds=5))
        result = client._quorum(
            group_rank=0,
            step=3,
            checkpoint_metadata="meta",
            shrink_only=False,
            timeout=T,
            commit_failures=0,
            init_sync=True,
        )
    finally:
        manager.shutdown()
        lighthouse.shutdown()
    assert (result.replica_rank, result.replica_world_size, result.max_step) == (0, 1, 3)
    assert result.store_address == "127.0.0.1:29500"
    assert result.heal is False


def test_our_manager_server_uses_torchft_lighthouse_and_torchft_client() -> None:
    from torchtitan_ft.manager import ManagerServer

    lighthouse = torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    manager = ManagerServer(
        "ours",
        lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:29501",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5),
    )
    try:
        client = torchft.ManagerClient(manager.address(), timedelta(seconds=5))
        result = client._quorum(
            group_rank=0,
            step=7,
            checkpoint_metadata="meta",
            shrink_only=False,
            timeout=T,
            commit_failures=0,
            init_sync=True,
        )
        assert client._checkpoint_metadata(0, T) == "meta"
        assert client.should_commit(0, 7, True, T) is True
    finally:
        manager.shutdown()
        lighthouse.shutdown()
    assert (result.replica_rank, result.max_step, result.store_address) == (0, 7, "127.0.0.1:29501")
    assert result.replica_ids[0].startswith("ours")


def test_reconfigure_handles_pass_our_lighthouse_where_torchft_0_2_0s_drops_them() -> None:
    """torchft-nightly's QuorumMember field 9: our lighthouse issues it back in the quorum;
    torchft 0.2.0's does not know it and issues the member without it."""
    issued = {}
    for name, server in [
        ("ours", LighthouseServer(bind="127.0.0.1:0", min_replicas=1)),
        ("torchft", torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)),
    ]:
        try:
            client = LighthouseClient(server.address())
            quorum, _ = client.quorum_with_speeds(
                "r", T, world_size=2, reconfigure_handles=["h0", "h1"]
            )
            client.close()
        finally:
            server.shutdown()
        issued[name] = quorum.participants[0].reconfigure_handles
    assert issued == {"ours": ("h0", "h1"), "torchft": ()}
