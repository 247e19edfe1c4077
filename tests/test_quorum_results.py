"""Table tests of compute_quorum_results (pure: no processes, no sockets)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.quorum_results import QuorumResult, compute_quorum_results


def _quorum(*steps: tuple[str, int], commit_failures: dict[str, int] | None = None) -> Quorum:
    failures = commit_failures or {}
    members = tuple(
        QuorumMember(
            replica_id=rid,
            address=f"http://{rid}:1",
            store_address=f"{rid}:2",
            step=step,
            world_size=2,
            commit_failures=failures.get(rid, 0),
        )
        for rid, step in steps
    )
    return Quorum(quorum_id=7, participants=members, created=datetime.now(UTC))


# a and c at step 5, b and d behind. Members are deliberately given out of order.
MIXED = _quorum(("c", 5), ("a", 5), ("d", 0), ("b", 3))
FRESH = _quorum(("a", 0), ("b", 0), ("c", 0))
STEADY = _quorum(("a", 3), ("b", 3))

# (name, quorum, replica_id, group_rank, init_sync, expected subset of QuorumResult fields)
CASES = [
    # Mixed steps: b and d recover round-robin over the up-to-date a (rank 0) and c (rank 2).
    (
        "mixed_a_g0",
        MIXED,
        "a",
        0,
        True,
        dict(
            replica_rank=0,
            replica_world_size=4,
            max_step=5,
            max_replica_rank=0,
            max_world_size=2,
            heal=False,
            recover_src_replica_rank=None,
            recover_src_manager_address="",
            recover_dst_replica_ranks=[1],
            store_address="a:2",
            replica_ids=["a", "b", "c", "d"],
        ),
    ),
    (
        "mixed_b_g0",
        MIXED,
        "b",
        0,
        True,
        dict(
            replica_rank=1,
            max_replica_rank=None,
            heal=True,
            recover_src_replica_rank=0,
            recover_src_manager_address="http://a:1",
            recover_dst_replica_ranks=[],
            store_address="a:2",
        ),
    ),
    (
        "mixed_c_g0",
        MIXED,
        "c",
        0,
        True,
        dict(replica_rank=2, max_replica_rank=1, heal=False, recover_dst_replica_ranks=[3]),
    ),
    (
        "mixed_d_g0",
        MIXED,
        "d",
        0,
        False,
        dict(replica_rank=3, heal=True, recover_src_replica_rank=2, store_address="a:2"),
    ),
    # Group rank 1: primary is c, and the round-robin is offset by one.
    (
        "mixed_b_g1",
        MIXED,
        "b",
        1,
        True,
        dict(heal=True, recover_src_replica_rank=2, store_address="c:2"),
    ),
    (
        "mixed_a_g1",
        MIXED,
        "a",
        1,
        True,
        dict(heal=False, recover_dst_replica_ranks=[3], store_address="c:2"),
    ),
    ("mixed_c_g1", MIXED, "c", 1, True, dict(recover_dst_replica_ranks=[1])),
    # Group rank 2 wraps around to a as primary.
    ("mixed_b_g2", MIXED, "b", 2, True, dict(recover_src_replica_rank=0, store_address="a:2")),
    # init_sync at step 0: every member except the primary of this group rank heals from it.
    (
        "fresh_a_g0",
        FRESH,
        "a",
        0,
        True,
        dict(heal=False, recover_dst_replica_ranks=[1, 2], max_world_size=3, max_replica_rank=0),
    ),
    ("fresh_b_g0", FRESH, "b", 0, True, dict(heal=True, recover_src_replica_rank=0)),
    ("fresh_c_g0", FRESH, "c", 0, True, dict(heal=True, recover_src_replica_rank=0)),
    (
        "fresh_a_g1",
        FRESH,
        "a",
        1,
        True,
        dict(heal=True, recover_src_replica_rank=1, store_address="b:2"),
    ),
    ("fresh_b_g1", FRESH, "b", 1, True, dict(heal=False, recover_dst_replica_ranks=[0, 2])),
    ("fresh_c_g2", FRESH, "c", 2, True, dict(heal=False, store_address="c:2")),
    # Skip init_sync: nobody heals at step 0; the primary still rotates with the group rank.
    (
        "fresh_b_g0_skip",
        FRESH,
        "b",
        0,
        False,
        dict(heal=False, recover_src_replica_rank=None, recover_dst_replica_ranks=[]),
    ),
    ("fresh_a_g0_skip", FRESH, "a", 0, False, dict(heal=False, recover_dst_replica_ranks=[])),
    ("fresh_a_g2_skip", FRESH, "a", 2, False, dict(store_address="c:2", max_replica_rank=0)),
    # init_sync only matters at step 0.
    ("steady_b_g0", STEADY, "b", 0, True, dict(heal=False, recover_dst_replica_ranks=[])),
    # Commit failures: the maximum over members, whoever asks.
    (
        "failures",
        _quorum(("a", 1), ("b", 1), ("c", 1), commit_failures={"a": 1, "b": 3}),
        "c",
        0,
        True,
        dict(commit_failures=3, quorum_id=7),
    ),
    ("no_failures", STEADY, "a", 0, True, dict(commit_failures=0)),
    # A single member never heals, even at step 0 with init_sync.
    (
        "alone",
        _quorum(("solo", 0)),
        "solo",
        3,
        True,
        dict(heal=False, replica_world_size=1, max_world_size=1, store_address="solo:2"),
    ),
]


@pytest.mark.parametrize(
    ("quorum", "replica_id", "group_rank", "init_sync", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_compute_quorum_results(
    quorum: Quorum, replica_id: str, group_rank: int, init_sync: bool, expected: dict
) -> None:
    result = compute_quorum_results(replica_id, group_rank, quorum, init_sync)
    got = {name: getattr(result, name) for name in expected}
    assert got == expected


@pytest.mark.parametrize("group_rank", [0, 1, 2, 3])
@pytest.mark.parametrize("quorum", [MIXED, FRESH, STEADY], ids=["mixed", "fresh", "steady"])
def test_sources_and_destinations_agree(quorum: Quorum, group_rank: int) -> None:
    """Every healer's source lists it as a destination, and only up-to-date members donate."""
    results = {
        m.replica_id: compute_quorum_results(m.replica_id, group_rank, quorum, True)
        for m in quorum.participants
    }
    by_rank = {r.replica_rank: r for r in results.values()}
    for result in results.values():
        if result.heal:
            src = by_rank[result.recover_src_replica_rank]
            assert result.replica_rank in src.recover_dst_replica_ranks
            assert not src.heal
        for dst in result.recover_dst_replica_ranks:
            assert by_rank[dst].recover_src_replica_rank == result.replica_rank
    assert len({r.store_address for r in results.values()}) == 1
    assert len({r.quorum_id for r in results.values()}) == 1


def test_missing_member_names_it() -> None:
    with pytest.raises(ValueError, match="'zed'"):
        compute_quorum_results("zed", 0, MIXED, True)


def test_negative_group_rank() -> None:
    with pytest.raises(ValueError, match="-1"):
        compute_quorum_results("a", -1, MIXED, True)


def test_proto_round_trip_keeps_optional_zero() -> None:
    result = compute_quorum_results("b", 0, MIXED, True)
    msg = result.to_proto()
    assert msg.HasField("recover_src_replica_rank")
    assert msg.recover_src_replica_rank == 0
    assert not msg.HasField("max_replica_rank")
    wire = pb.ManagerQuorumResponse.FromString(msg.SerializeToString())
    assert QuorumResult.from_proto(wire) == result

    a = compute_quorum_results("a", 0, MIXED, True).to_proto()
    assert a.HasField("max_replica_rank") and a.max_replica_rank == 0
    assert not a.HasField("recover_src_replica_rank")
