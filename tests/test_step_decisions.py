"""The step's pure decisions (``torchtitan_ft.step_decisions``), from hand-built quorum results."""

from __future__ import annotations

from typing import Any

import pytest

from torchtitan_ft.quorum_results import QuorumResult
from torchtitan_ft.step_decisions import (
    Participation,
    WorldSizeMode,
    check_commit_failures,
    compute_participation,
    global_ranks,
    heal_needs_group_agreement,
    local_commit_vote,
    quorum_store_address,
)


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
