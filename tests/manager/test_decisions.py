"""The step's pure decisions (``torchtitan_ft.manager.decisions``), from hand-built quorums and
quorum results: no processes, no sockets."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from torchtitan_ft.addresses import AddressProblem, Severity
from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.manager.decisions import (
    Participation,
    QuorumAdmission,
    QuorumGate,
    QuorumResult,
    RetryDecision,
    WorldSizeMode,
    check_commit_failures,
    compute_participation,
    compute_quorum_results,
    global_ranks,
    heal_needs_group_agreement,
    hung_peer_abort,
    impostor_refusal,
    inflight_retry_decision,
    local_commit_vote,
    needs_commit_fence,
    quorum_store_address,
)
from torchtitan_ft.proto import torchft_pb2 as pb

# ------------------------------------------------------------------------------ quorum results


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


# ------------------------------------------------------------------------------ step decisions


def _result(**overrides: Any) -> QuorumResult:
    fields: dict[str, Any] = dict(
        quorum_id=1,
        recover_src_manager_address="",
        recover_src_replica_rank=None,
        recover_dst_replica_ranks=[],
        store_address="127.0.0.1:1",
        max_step=5,
        max_replica_rank=1,
        max_world_size=3,
        replica_rank=2,
        replica_world_size=4,
        heal=False,
        commit_failures=0,
        replica_ids=["a", "b", "c", "d"],
    )
    fields.update(overrides)
    return QuorumResult(**fields)


DYN, SPARES = WorldSizeMode.DYNAMIC, WorldSizeMode.FIXED_WITH_SPARES
# step 0 with init_sync: 3 members at step 0; the primary does not heal, the others do
STEP0_PRIMARY = _result(max_step=0, max_replica_rank=0, replica_rank=0, replica_world_size=3)
STEP0_HEALER = _result(
    max_step=0, max_replica_rank=2, replica_rank=2, replica_world_size=3, heal=True
)


@pytest.mark.parametrize(
    ("result", "async_", "heal", "init_sync", "mode", "min_size", "expected"),
    [
        # async quorum: only up-to-date members count
        (_result(), True, True, True, DYN, 1, Participation(1, 3, 3)),
        # sync quorum with healing: everyone (heal completes before the forward)
        (_result(), False, True, True, DYN, 1, Participation(2, 4, 4)),
        # sync quorum without healing: like async
        (_result(), False, False, True, DYN, 1, Participation(1, 3, 3)),
        # behind and healing: not a participant
        (_result(max_replica_rank=None), True, True, True, DYN, 1, Participation(None, 3, 3)),
        # fixed with spares: capped, rank beyond the cap is a spare
        (_result(), True, True, True, SPARES, 2, Participation(1, 2, 2)),
        (_result(), True, True, True, SPARES, 1, Participation(None, 1, 1)),
        (_result(), True, True, True, SPARES, 5, Participation(1, 3, 3)),
        # step 0 with init_sync, async: only the primary's gradient is averaged, but every
        # member counts for min_replica_size (all finish the step with the primary's state)
        (STEP0_PRIMARY, True, True, True, DYN, 1, Participation(0, 1, 3)),
        (STEP0_HEALER, True, True, True, DYN, 1, Participation(None, 1, 3)),
        (STEP0_HEALER, True, True, True, SPARES, 2, Participation(None, 1, 2)),
        # ... not without init_sync, without healing, or with a sync quorum (healed first)
        (STEP0_PRIMARY, True, True, False, DYN, 1, Participation(0, 3, 3)),
        (STEP0_HEALER, True, False, True, DYN, 1, Participation(2, 3, 3)),
        (STEP0_HEALER, False, True, True, DYN, 1, Participation(2, 3, 3)),
    ],
)
def test_compute_participation(
    result: QuorumResult,
    async_: bool,
    heal: bool,
    init_sync: bool,
    mode: WorldSizeMode,
    min_size: int,
    expected: Participation,
) -> None:
    got = compute_participation(
        result,
        use_async_quorum=async_,
        allow_heal=heal,
        init_sync=init_sync,
        world_size_mode=mode,
        min_replica_size=min_size,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("error", "participants", "min_size", "vote"),
    [
        (None, 2, 2, True),
        (None, 3, 2, True),
        (None, 1, 2, False),
        (RuntimeError("allreduce failed"), 3, 2, False),
        (RuntimeError("x"), 1, 2, False),
    ],
)
def test_local_commit_vote(
    error: Exception | None, participants: int, min_size: int, vote: bool
) -> None:
    got = local_commit_vote(error, participants, min_size)
    assert got.should_commit is vote
    if error is not None:
        assert "allreduce failed" in got.reason or "x" in got.reason
    elif not vote:
        assert "min_replica_size=2" in got.reason


def test_check_commit_failures() -> None:
    check_commit_failures(100, None)
    check_commit_failures(2, 2)
    with pytest.raises(RuntimeError, match="max_retries=2"):
        check_commit_failures(3, 2)
    with pytest.raises(RuntimeError, match="max_retries=0"):
        check_commit_failures(1, 0)


def test_quorum_store_address_and_global_ranks() -> None:
    assert quorum_store_address("h:1", 7, 2) == "h:1/torchft/7/2"
    ids = ["train_0:u1", "train_3:u2", "noid:u3", "7"]
    assert global_ranks(ids, group_world_size=2, group_rank=1) == [1, 7, 1, 15]


@pytest.mark.parametrize(
    ("step", "max_step", "init_sync", "replicas", "expected"),
    [
        (3, 7, True, 2, True),  # behind: every rank of the group heals
        (7, 7, True, 2, False),  # up to date
        (0, 0, True, 2, True),  # step 0 with init_sync: all but one group heal
        (0, 0, False, 2, False),  # no init_sync: nobody heals at step 0
        (0, 0, True, 1, False),  # alone: nothing to sync from
    ],
)
def test_heal_needs_group_agreement(step, max_step, init_sync, replicas, expected) -> None:
    result = QuorumResult(
        quorum_id=1,
        recover_src_manager_address="",
        recover_src_replica_rank=None,
        recover_dst_replica_ranks=[],
        store_address="127.0.0.1:1",
        max_step=max_step,
        max_replica_rank=0,
        max_world_size=replicas,
        replica_rank=0,
        replica_world_size=replicas,
        heal=False,
        commit_failures=0,
        replica_ids=[f"r{i}" for i in range(replicas)],
    )
    assert heal_needs_group_agreement(step, result, init_sync) is expected


# ------------------------------------------------------------------------------ impostors


def test_another_connection_is_refused_naming_both() -> None:
    refusal = impostor_refusal("vote", "group", 1, "ipv4:10.0.0.5:41234", "ipv4:10.0.0.9:5000")
    assert refusal.startswith("vote as group rank 1 of replica 'group' refused: ")
    assert "ipv4:10.0.0.5:41234" in refusal and "ipv4:10.0.0.9:5000" in refusal


# ------------------------------------------------------------------------------ in-flight retry


def _retry(**changes: Any) -> RetryDecision:
    failure = RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    args: dict[str, Any] = dict(
        enabled=True,
        first_error=failure,
        first_error_is_collective=True,
        participated=True,
        inputs_kept=True,
        retries_done=0,
        group_world_size=1,
        can_wait_abandoned=True,
    )
    args.update(changes)
    return inflight_retry_decision(**args)


def test_a_failed_allreduce_of_a_participant_is_retried() -> None:
    decision = _retry()
    assert decision.retry and "Connection closed by peer" in decision.reason


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"enabled": False}, "retry_inflight_allreduce is off"),
        ({"first_error": None}, "no error this step"),
        ({"first_error_is_collective": False}, "first error is not a failed allreduce"),
        ({"first_error": TimeoutError("allreduce did not complete")}, "timed out"),
        ({"retries_done": 1}, "retried already"),
        ({"participated": False}, "did not contribute"),
        ({"inputs_kept": False}, "input was not kept"),
        ({"group_world_size": 2}, "several ranks"),
        ({"can_wait_abandoned": False}, "no wait_abandoned"),
    ],
)
def test_what_is_not_retried(changes: dict[str, Any], reason: str) -> None:
    decision = _retry(**changes)
    assert not decision.retry
    assert reason in decision.reason


# ------------------------------------------------------------------------------ quorum gate

_UNREACHABLE = AddressProblem(Severity.ERROR, "group 1 advertises loopback; set 10.0.0.2")
_PEER_LOOPBACK = AddressProblem(Severity.WARNING, "group 2 advertises loopback")
_OTHER_MODEL = "replica group 'ft_1' runs a different model than 'ft_0'"


def test_gate_stops_a_loopback_group_at_its_first_remote_peer_even_after_training() -> None:
    """Trained alone, then beside a group of its own host (no problem: loopback is fine
    there), then a group on another host joins: this group stops, though no newcomer."""
    gate = QuorumGate()
    assert gate.admit(None, None) == QuorumAdmission()
    assert gate.admit(None, None) == QuorumAdmission()
    assert gate.accepted
    assert gate.admit(None, _UNREACHABLE) == QuorumAdmission(refusal=_UNREACHABLE.message)


def test_gate_stops_a_newcomer_with_an_unreachable_address() -> None:
    gate = QuorumGate()
    assert gate.admit(None, _UNREACHABLE).refusal == _UNREACHABLE.message
    assert not gate.accepted


def test_gate_stops_a_newcomer_that_conflicts_and_a_running_group_carries_on() -> None:
    newcomer = QuorumGate()
    assert newcomer.admit(_OTHER_MODEL, None) == QuorumAdmission(refusal=_OTHER_MODEL)
    running = QuorumGate()
    running.admit(None, None)
    assert running.admit(_OTHER_MODEL, None) == QuorumAdmission(error=_OTHER_MODEL)
    assert running.admit(_OTHER_MODEL, None) == QuorumAdmission()  # logged once
    assert running.admit(None, None) == QuorumAdmission()
    assert running.admit(_OTHER_MODEL, None) == QuorumAdmission(error=_OTHER_MODEL)  # again


def test_gate_names_the_identity_conflict_of_a_newcomer_first() -> None:
    assert QuorumGate().admit(_OTHER_MODEL, _UNREACHABLE).refusal == _OTHER_MODEL
    running = QuorumGate()
    running.admit(None, None)
    assert running.admit(_OTHER_MODEL, _UNREACHABLE).refusal == _UNREACHABLE.message


def test_gate_returns_an_address_warning_when_it_changes() -> None:
    gate = QuorumGate()
    assert gate.admit(None, _PEER_LOOPBACK) == QuorumAdmission(warning=_PEER_LOOPBACK.message)
    assert gate.admit(None, _PEER_LOOPBACK) == QuorumAdmission()
    assert gate.admit(None, None) == QuorumAdmission()
    assert gate.admit(None, _PEER_LOOPBACK).warning == _PEER_LOOPBACK.message


@pytest.mark.parametrize(
    "quorum_ids, gone, self_gone, aborts, names",
    [
        (["a", "b", "c"], [], False, False, ""),  # nobody gone: keep waiting
        (["a", "b", "c"], ["c"], False, True, "['c']"),  # a peer of this quorum is gone
        (["a", "b"], ["z"], False, False, ""),  # gone elsewhere in the job: no peer of ours
        (["a", "b"], ["a"], False, False, ""),  # this group itself is never its own peer
        (["a", "b"], [], True, True, "named this replica group gone"),  # the hung one, back
        (["a", "b", "c"], ["c", "b"], False, True, "['b', 'c']"),
    ],
)
def test_hung_peer_abort(quorum_ids, gone, self_gone, aborts, names) -> None:
    reason = hung_peer_abort(quorum_ids, "a", gone, self_gone)
    assert (reason is not None) == aborts
    if aborts:
        assert names in reason


@pytest.mark.parametrize(
    "step_s, heartbeat_timeout, fence",
    [
        (0.1, None, True),  # the lighthouse's timeout not known yet: ask
        (0.1, 5.0, False),  # a short step cannot have been named gone
        (2.5, 5.0, True),  # half the timeout: ask before voting
        (60.0, 5.0, True),
    ],
)
def test_needs_commit_fence(step_s, heartbeat_timeout, fence) -> None:
    assert needs_commit_fence(step_s, heartbeat_timeout) is fence
