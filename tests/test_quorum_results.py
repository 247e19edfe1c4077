"""Table tests of compute_quorum_results (pure: no processes, no sockets)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.quorum_results import (
    GroupIdentity,
    QuorumResult,
    compute_quorum_results,
    identity_conflict,
)


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
    # init_sync at step 0: every member except the first (a) heals from it, for every group
    # rank (a group heals as a whole); the store host still rotates with the group rank.
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
        dict(heal=False, recover_dst_replica_ranks=[1, 2], store_address="b:2"),
    ),
    ("fresh_b_g1", FRESH, "b", 1, True, dict(heal=True, recover_src_replica_rank=0)),
    ("fresh_c_g2", FRESH, "c", 2, True, dict(heal=True, store_address="c:2")),
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


# ------------------------------------------------------------------------------ group identity


def _members(*identities: tuple[str, dict | None]) -> Quorum:
    return Quorum(
        quorum_id=3,
        participants=tuple(QuorumMember(replica_id=rid, data=data) for rid, data in identities),
        created=datetime.now(UTC),
    )


FP_A = "ab12cd34: 10 params / 6.1M elements"
FP_B = "9f3e0a11: 10 params / 7.2M elements"


def test_identity_round_trips_through_member_data() -> None:
    identity = GroupIdentity(replica="ft_0", model=FP_A, group_size=2)
    data = identity.to_data()
    assert data == {"replica": "ft_0", "model": FP_A, "group_size": 2}
    assert GroupIdentity.from_data(data) == identity
    # torchft members send no data or data of their own: not an identity
    for foreign in (None, {}, {"from": "a"}, [1, 2], "text", {"replica": 3}):
        assert GroupIdentity.from_data(foreign) is None
    # unknown fields ignored, wrongly typed optional fields read as unknown
    partial = {"replica": "x", "model": 5, "group_size": "2", "extra": True}
    assert GroupIdentity.from_data(partial) == GroupIdentity("x", None, None)


def _ident(replica: str, model: str | None = FP_A, group_size: int | None = 2) -> dict:
    return GroupIdentity(replica, model, group_size).to_data()


@pytest.mark.parametrize(
    ("quorum", "me", "expected"),
    [
        # consistent
        (_members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", _ident("ft_1"))), "ft_1:u2", None),
        # a model mismatch, from either side (names are the configured ids)
        (
            _members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", _ident("ft_1", FP_B))),
            "ft_1:u2",
            f"replica group 'ft_1' runs a different model than 'ft_0' (fingerprint {FP_B} vs "
            f"{FP_A}); start every group with the same model config",
        ),
        # the same configured id twice
        (
            _members(("ft_0:u1", _ident("ft_0")), ("ft_0:u2", _ident("ft_0"))),
            "ft_0:u2",
            "replica_id 'ft_0' is already used by a live replica group; give each group a "
            "distinct --fault_tolerance.replica_id (Manager replica_id / REPLICA_GROUP_ID)",
        ),
        # a different planned number of groups
        (
            _members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", _ident("ft_1", group_size=3))),
            "ft_1:u2",
            "replica group 'ft_1' expects group_size=3 but 'ft_0' expects 2; give every group "
            "the same --fault_tolerance.group_size",
        ),
        # unknown values are not compared
        (
            _members(("a:u1", _ident("a", None, None)), ("b:u2", _ident("b", FP_B, 3))),
            "b:u2",
            None,
        ),
        # no configured id (uuid only): never a duplicate
        (_members(("u1", _ident("")), ("u2", _ident(""))), "u2", None),
        # a torchft member (no identity) is not checked, nor is a member without one
        (_members(("ft_0:u1", None), ("ft_1:u2", _ident("ft_1", FP_B))), "ft_1:u2", None),
        (_members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", None)), "ft_1:u2", None),
        # alone
        (_members(("ft_0:u1", _ident("ft_0"))), "ft_0:u1", None),
    ],
)
def test_identity_conflict(quorum: Quorum, me: str, expected: str | None) -> None:
    conflict = identity_conflict(me, quorum)
    assert conflict == expected
    assert conflict is None or "\n" not in conflict
