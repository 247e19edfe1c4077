"""Quorum results for one group rank of one replica group (pure).

The lighthouse answers a replica group with the whole quorum. Each group rank then needs its own
view of it: its replica rank, which members are behind and must heal, which up-to-date member it
heals from (or serves), and which TCPStore its cross-group process group uses. This module turns
``(replica_id, group_rank, quorum, init_sync)`` into that view, with the same rules as torchft
0.2.0 so that mixed deployments agree on who sends what to whom:

- members are ordered by ``replica_id``; a member's replica rank is its index in that order;
- the members at the highest step are the up-to-date set ("max members");
- the primary for group rank ``g`` is ``max_members[g % len(max_members)]``: its store hosts the
  cross-group process group of group rank ``g`` (spreading store load across replicas);
- a member recovers when it is behind ``max_step``, or, with ``init_sync`` at step 0, when it is
  not ``max_members[0]`` (so every replica starts from that member's initial weights). Unlike
  torchft, which picks the step-0 source per group rank like the store host, one source
  serves every group rank: a replica group then heals as a whole or not at all, so all its
  ranks agree on whether it participates in step 0 (whose gradient is the source's alone);
- the k-th recovering member (in replica-rank order) heals from
  ``up_to_date[(k + g) % len(up_to_date)]``: different group ranks pull their shards from
  different donors.

It also checks that the members of a quorum belong to the same job (``GroupIdentity``, carried
in ``QuorumMember.data``): same model, same planned number of groups, no replica id used twice.
torchft 0.2.0 members send no identity; they are not checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb


@dataclass(frozen=True)
class QuorumResult:
    """One group rank's view of a quorum; mirrors ``torchft.ManagerQuorumResponse``."""

    quorum_id: int
    """Lighthouse quorum id; changes when membership changes or a member reports failures."""
    recover_src_manager_address: str
    """Manager URL of the member to heal from; ``""`` when not healing."""
    recover_src_replica_rank: int | None
    """Replica rank to heal from; ``None`` when not healing."""
    recover_dst_replica_ranks: list[int] = field(hash=False)
    """Replica ranks that heal from this member, ascending."""
    store_address: str
    """``host:port`` of the primary's TCPStore for this group rank."""
    max_step: int
    """Highest step reported by any member."""
    max_replica_rank: int | None
    """Index of this member among the members at ``max_step``; ``None`` when behind."""
    max_world_size: int
    """Number of members at ``max_step``."""
    replica_rank: int
    """Index of this member among all members ordered by replica id."""
    replica_world_size: int
    """Number of members in the quorum."""
    heal: bool
    """Whether this member must load state from ``recover_src_replica_rank`` before training."""
    commit_failures: int
    """Highest ``commit_failures`` reported by any member."""
    replica_ids: list[str] = field(hash=False)
    """Member replica ids in replica-rank order."""

    def to_proto(self) -> pb.ManagerQuorumResponse:
        msg = pb.ManagerQuorumResponse(
            quorum_id=self.quorum_id,
            recover_src_manager_address=self.recover_src_manager_address,
            recover_dst_replica_ranks=self.recover_dst_replica_ranks,
            store_address=self.store_address,
            max_step=self.max_step,
            max_world_size=self.max_world_size,
            replica_rank=self.replica_rank,
            replica_world_size=self.replica_world_size,
            heal=self.heal,
            commit_failures=self.commit_failures,
            replica_ids=self.replica_ids,
        )
        # proto3 ``optional``: presence must be explicit, also when the value is 0.
        if self.recover_src_replica_rank is not None:
            msg.recover_src_replica_rank = self.recover_src_replica_rank
        if self.max_replica_rank is not None:
            msg.max_replica_rank = self.max_replica_rank
        return msg

    @classmethod
    def from_proto(cls, msg: pb.ManagerQuorumResponse) -> QuorumResult:
        return cls(
            quorum_id=msg.quorum_id,
            recover_src_manager_address=msg.recover_src_manager_address,
            recover_src_replica_rank=(
                msg.recover_src_replica_rank if msg.HasField("recover_src_replica_rank") else None
            ),
            recover_dst_replica_ranks=list(msg.recover_dst_replica_ranks),
            store_address=msg.store_address,
            max_step=msg.max_step,
            max_replica_rank=(msg.max_replica_rank if msg.HasField("max_replica_rank") else None),
            max_world_size=msg.max_world_size,
            replica_rank=msg.replica_rank,
            replica_world_size=msg.replica_world_size,
            heal=msg.heal,
            commit_failures=msg.commit_failures,
            replica_ids=list(msg.replica_ids),
        )


def compute_quorum_results(
    replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool
) -> QuorumResult:
    """Returns group rank ``group_rank`` of replica ``replica_id``'s view of ``quorum``.

    Args:
        replica_id: the replica group asking; must be a member of ``quorum``.
        group_rank: rank inside the replica group (>= 0); selects the primary store and offsets
            the recovery source assignment.
        quorum: the quorum issued by the lighthouse (members in any order).
        init_sync: at step 0, make every member except the first up-to-date one heal from it
            so all replicas start from identical weights. With ``False`` nobody heals at step 0
            (the caller guarantees identical initialisation, e.g. a fixed seed).

    Raises:
        ValueError: ``replica_id`` is not a member, or ``group_rank`` is negative.
    """
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    members = sorted(quorum.participants, key=lambda m: m.replica_id)
    replica_ids = [m.replica_id for m in members]
    if replica_id not in replica_ids:
        raise ValueError(
            f"replica {replica_id!r} is not a member of quorum {quorum.quorum_id} "
            f"(members: {replica_ids})"
        )
    replica_rank = replica_ids.index(replica_id)

    max_step = max(m.step for m in members)
    max_members = [m for m in members if m.step == max_step]
    max_ids = [m.replica_id for m in max_members]
    max_replica_rank = max_ids.index(replica_id) if replica_id in max_ids else None
    primary = max_members[group_rank % len(max_members)]

    recovering = [
        rank
        for rank, member in enumerate(members)
        if _must_recover(member, max_members[0], max_step, init_sync)
    ]
    recovering_set = set(recovering)
    up_to_date = [rank for rank in range(len(members)) if rank not in recovering_set]
    sources = {
        dst: up_to_date[(k + group_rank) % len(up_to_date)] for k, dst in enumerate(recovering)
    }

    src = sources.get(replica_rank)
    return QuorumResult(
        quorum_id=quorum.quorum_id,
        recover_src_manager_address=members[src].address if src is not None else "",
        recover_src_replica_rank=src,
        recover_dst_replica_ranks=[dst for dst in recovering if sources[dst] == replica_rank],
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(max_members),
        replica_rank=replica_rank,
        replica_world_size=len(members),
        heal=src is not None,
        commit_failures=max(m.commit_failures for m in members),
        replica_ids=replica_ids,
    )


def _must_recover(
    member: QuorumMember, init_source: QuorumMember, max_step: int, init_sync: bool
) -> bool:
    if member.step != max_step:
        return True
    return init_sync and max_step == 0 and member.replica_id != init_source.replica_id


# ------------------------------------------------------------------------------ group identity


@dataclass(frozen=True)
class GroupIdentity:
    """What a replica group says about itself in ``QuorumMember.data`` (JSON), so that the
    members of a quorum can check they run the same job."""

    replica: str
    """Configured replica id, without the per-process uuid suffix ("" = none configured)."""
    model: str | None = None
    """Short model fingerprint (e.g. ``"ab12cd34: 10 params / 6.1M elements"``); None: unknown."""
    group_size: int | None = None
    """Planned number of replica groups; None: unknown."""

    def to_data(self) -> dict[str, Any]:
        """The ``QuorumMember.data`` payload."""
        return {"replica": self.replica, "model": self.model, "group_size": self.group_size}

    @classmethod
    def from_data(cls, data: Any) -> GroupIdentity | None:
        """Decodes ``QuorumMember.data``; None when absent or not ours (e.g. a torchft member)."""
        if not isinstance(data, dict) or not isinstance(data.get("replica"), str):
            return None
        model, group_size = data.get("model"), data.get("group_size")
        return cls(
            replica=data["replica"],
            model=model if isinstance(model, str) else None,
            group_size=group_size if isinstance(group_size, int) else None,
        )


def identity_conflict(replica_id: str, quorum: Quorum) -> str | None:
    """The first way member ``replica_id`` is inconsistent with another member of ``quorum``,
    as one line that says what to do; None when consistent (or not checkable).

    Checked against every other member that sent an identity, in replica-id order: the same
    configured replica id (a second live group claims it), a different ``group_size``, a
    different model fingerprint.
    """
    members = {m.replica_id: GroupIdentity.from_data(m.data) for m in quorum.participants}
    mine = members.get(replica_id)
    if mine is None:
        return None
    for other_id in sorted(members):
        theirs = members[other_id]
        if other_id == replica_id or theirs is None:
            continue
        if mine.replica and theirs.replica == mine.replica:
            return (
                f"replica_id {mine.replica!r} is already used by a live replica group; give each "
                "group a distinct --fault_tolerance.replica_id (Manager replica_id / "
                "REPLICA_GROUP_ID)"
            )
        me, peer = _name(mine, replica_id), _name(theirs, other_id)
        if None not in (mine.group_size, theirs.group_size) and (
            mine.group_size != theirs.group_size
        ):
            return (
                f"replica group {me!r} expects group_size={mine.group_size} but {peer!r} "
                f"expects {theirs.group_size}; give every group the same "
                "--fault_tolerance.group_size"
            )
        if None not in (mine.model, theirs.model) and mine.model != theirs.model:
            return (
                f"replica group {me!r} runs a different model than {peer!r} (fingerprint "
                f"{mine.model} vs {theirs.model}); start every group with the same model config"
            )
    return None


def _name(identity: GroupIdentity, replica_id: str) -> str:
    return identity.replica or replica_id
