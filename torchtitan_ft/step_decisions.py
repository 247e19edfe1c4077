"""Pure decisions of one step, from one group rank's quorum result: who participates in the
gradient average, the local commit vote, whether a heal needs the group's agreement, when to
give up, and where the cross-group process group meets. Tested without servers
(``tests/test_manager.py``); the Manager calls them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan_ft.quorum_results import QuorumResult


class WorldSizeMode(Enum):
    """How many replica groups take part in a step when more than ``min_replica_size`` are up.

    DYNAMIC: every up-to-date replica group participates; gradients are averaged over all of
        them, so the effective batch grows and shrinks with membership.
    FIXED_WITH_SPARES: exactly ``min_replica_size`` groups participate (the lowest replica ranks
        among the up-to-date ones); the others are spares that contribute zero gradients but
        apply the same averaged update, so they stay in sync and can take over at once.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


@dataclass(frozen=True)
class Participation:
    """Which slot this replica group takes in the step's gradient average."""

    rank: int | None
    """Rank among the participants; ``None`` for a spare or a replica still healing."""
    world_size: int
    """Number of participants: the divisor of the gradient average."""
    vote_size: int
    """Groups counted against ``min_replica_size`` in the commit vote: the participants, and
    at step 0 with ``init_sync`` also the groups taking the step-0 source's state (they
    contribute no gradient but finish the step identical to the source)."""


def compute_participation(
    result: QuorumResult,
    *,
    use_async_quorum: bool,
    allow_heal: bool,
    init_sync: bool,
    world_size_mode: WorldSizeMode,
    min_replica_size: int,
) -> Participation:
    """Who participates in this step, from one group rank's quorum result.

    With an async quorum (or without healing) only the members already at ``max_step``
    participate: a healing member's state arrives during the forward and is applied after the
    backward, so its gradients are stale and it contributes zeros. That includes step 0 with
    ``init_sync``, where every member but one (the step-0 source, see ``quorum_results``) heals
    from it although all are at ``max_step``: the source is the only participant, so the step's
    average is its own gradient rather than that gradient divided by the number of members.
    With a sync quorum and healing, the heal completes before the forward and everyone
    participates. FIXED_WITH_SPARES caps the participants at ``min_replica_size``.
    """
    if use_async_quorum or not allow_heal:
        rank, size = result.max_replica_rank, result.max_world_size
    else:
        rank, size = result.replica_rank, result.replica_world_size
    vote_size = size
    if use_async_quorum and allow_heal and init_sync and result.max_step == 0 and size > 1:
        # The step-0 source is the one member that does not heal (quorum_results).
        rank, size = (None if result.heal else 0), 1
    if world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
        size = min(size, min_replica_size)
        vote_size = min(vote_size, min_replica_size)
        if rank is not None and rank >= min_replica_size:
            rank = None
    return Participation(rank=rank, world_size=size, vote_size=vote_size)


@dataclass(frozen=True)
class CommitVote:
    """This rank's local vote on committing the step, with the reason (logged)."""

    should_commit: bool
    reason: str


def local_commit_vote(
    error: BaseException | None, num_participants: int, min_replica_size: int
) -> CommitVote:
    """Votes to commit only when no error was recorded and enough replicas took part."""
    if error is not None:
        return CommitVote(False, f"error this step: {error}")
    if num_participants < min_replica_size:
        return CommitVote(
            False, f"{num_participants} participants < min_replica_size={min_replica_size}"
        )
    return CommitVote(True, f"{num_participants} participants, no error")


def heal_needs_group_agreement(step: int, result: QuorumResult, init_sync: bool) -> bool:
    """Whether this group's ranks might heal this quorum (sync quorum only).

    Every rank of a replica group computes the same answer: the group is behind the quorum's
    max step, or it is step 0 with ``init_sync`` (our ManagerServer heals whole groups then,
    but torchft's picks the source per group rank, so behind it some ranks of a group may heal
    while others do not). Healed state is then
    applied only if every rank of the group received its state (all or nothing), so the ranks
    of a group never end up at different steps.
    """
    return step < result.max_step or (
        init_sync and result.max_step == 0 and result.replica_world_size > 1
    )


def check_commit_failures(commit_failures: int, max_retries: int | None) -> None:
    """Raises RuntimeError once ``commit_failures`` consecutive failures exceed ``max_retries``.

    ``max_retries=None`` retries forever; ``max_retries=0`` raises on the first failed commit.
    """
    if max_retries is not None and commit_failures > max_retries:
        raise RuntimeError(
            f"should_commit failed {commit_failures} times in a row, exceeding "
            f"max_retries={max_retries}; giving up on this replica group"
        )


def quorum_store_address(store_address: str, quorum_id: int, group_rank: int) -> str:
    """``host:port/prefix`` under which one quorum's process group for a group rank meets."""
    return f"{store_address}/torchft/{quorum_id}/{group_rank}"


_TRAILING_DIGITS = re.compile(r"(\d+)$")


def global_ranks(replica_ids: list[str], group_world_size: int, group_rank: int) -> list[int]:
    """Global ranks of this group rank's peers, one per quorum member (in replica-rank order).

    The replica group number is the trailing digits of the replica id before the uuid suffix
    (``"train_3:<uuid>"`` -> 3; none -> 0); global rank = group number * group size + rank.
    """
    ranks = []
    for replica_id in replica_ids:
        match = _TRAILING_DIGITS.search(replica_id.split(":")[0])
        group = int(match.group(1)) if match else 0
        ranks.append(group * group_world_size + group_rank)
    return ranks
