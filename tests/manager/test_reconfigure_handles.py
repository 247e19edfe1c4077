"""torchft-nightly's reconfigure handles on our wire: a rank's ``ManagerQuorumRequest`` field 7
becomes its member's ``QuorumMember`` field 9 at the lighthouse (in group-rank order), and
each rank's ``ManagerQuorumResponse`` field 14 lists its cross-group group's handles, one per
member in replica-rank order. Pure rules first, then real servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import UTC, datetime, timedelta

import pytest

from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer
from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.manager import ManagerClient, ManagerServer, QuorumResult
from torchtitan_ft.manager.decisions import compute_quorum_results, cross_group_handles

T = timedelta(seconds=10)


def _members(*handles: tuple[str, ...]) -> list[QuorumMember]:
    return [QuorumMember(replica_id=f"r{i}", reconfigure_handles=h) for i, h in enumerate(handles)]


@pytest.mark.parametrize(
    ("handles", "group_rank", "expected"),
    [
        ((("a0", "a1"), ("b0", "b1")), 0, ["a0", "b0"]),
        ((("a0", "a1"), ("b0", "b1")), 1, ["a1", "b1"]),
        # A member that sent none (torchft 0.2.0, or ranks without handles): none at all.
        ((("a0", "a1"), ()), 0, []),
        # A member with fewer handles than the rank asking: none for that rank.
        ((("a0", "a1"), ("b0",)), 1, []),
        ((("a0", "a1"), ("b0",)), 0, ["a0", "b0"]),
        # An empty handle is none, never passed on as "".
        ((("a0", ""), ("b0", "b1")), 1, []),
        ((), 0, []),
    ],
)
def test_cross_group_handles(
    handles: tuple[tuple[str, ...], ...], group_rank: int, expected: list[str]
) -> None:
    assert cross_group_handles(_members(*handles), group_rank) == expected


def test_quorum_results_order_handles_by_replica_rank_and_survive_the_wire() -> None:
    members = (
        QuorumMember(replica_id="b", step=3, reconfigure_handles=("b0", "b1")),
        QuorumMember(replica_id="a", step=3, reconfigure_handles=("a0", "a1")),
    )
    quorum = Quorum(7, members, datetime.now(UTC))
    result = compute_quorum_results("b", 1, quorum, init_sync=True)
    assert (result.replica_rank, result.reconfigure_handles) == (1, ["a1", "b1"])
    assert QuorumResult.from_proto(result.to_proto()) == result


# ------------------------------------------------------------------------------ real servers


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], None]]]:
    callbacks: list[Callable[[], None]] = []
    yield callbacks
    for callback in reversed(callbacks):
        callback()


def _group(cleanup, lighthouse: str, replica_id: str, store: str) -> ManagerClient:
    server = ManagerServer(
        replica_id,
        lighthouse,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr=store,
        world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    cleanup.append(server.shutdown)
    client = ManagerClient(server.address(), connect_timeout=T)
    cleanup.append(client.close)
    return client


def _ask(client: ManagerClient, group_rank: int, handle: str) -> Callable[[], QuorumResult]:
    return lambda: client._quorum(
        group_rank=group_rank,
        step=1,
        checkpoint_metadata="",
        shrink_only=False,
        timeout=T,
        init_sync=False,
        reconfigure_handle=handle,
    )


def _round(*calls: Callable[[], QuorumResult]) -> list[QuorumResult]:
    with futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(call) for call in calls]]


@pytest.mark.multiprocess
def test_ranks_handles_reach_every_ranks_cross_group_peers(cleanup) -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    cleanup.append(lighthouse.shutdown)
    a = _group(cleanup, lighthouse.address(), "a", "127.0.0.1:1001")
    b = _group(cleanup, lighthouse.address(), "b", "127.0.0.1:1002")
    a0, a1, b0, b1 = _round(
        _ask(a, 0, "h-a0"), _ask(a, 1, "h-a1"), _ask(b, 0, "h-b0"), _ask(b, 1, "h-b1")
    )
    assert a0.reconfigure_handles == b0.reconfigure_handles == ["h-a0", "h-b0"]
    assert a1.reconfigure_handles == b1.reconfigure_handles == ["h-a1", "h-b1"]

    # Group b's rank 1 sends none in the next round: b's member carries none, so no rank of
    # either group gets a list with a hole in it.
    a0, a1, b0, b1 = _round(
        _ask(a, 0, "h-a0"), _ask(a, 1, "h-a1"), _ask(b, 0, "h-b0"), _ask(b, 1, "")
    )
    assert [r.reconfigure_handles for r in (a0, a1, b0, b1)] == [[], [], [], []]
    assert a0.replica_ids == ["a", "b"]


def test_our_lighthouse_issues_the_members_handles() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        client = LighthouseClient(lighthouse.address())
        quorum, _ = client.quorum_with_speeds("r", T, world_size=2, reconfigure_handles=["x", "y"])
        client.close()
    finally:
        lighthouse.shutdown()
    assert quorum.participants[0].reconfigure_handles == ("x", "y")
