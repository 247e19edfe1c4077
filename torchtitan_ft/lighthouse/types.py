"""Quorum data types shared by the lighthouse, its clients and the manager.

Plain frozen dataclasses mirroring the ``QuorumMember`` and ``Quorum`` protobuf messages, so
that decision logic and tests never touch protobuf objects. ``data`` is the member's JSON
payload decoded (``None`` when the wire field is empty).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from torchtitan_ft.proto import torchft_pb2 as pb


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as it asks the lighthouse for a quorum (wire message ``QuorumMember``).

    Args:
        replica_id: the replica group's id (unique in the job).
        address: its ManagerServer's URL, ``http://host:port``.
        store_address: its TCPStore, ``host:port`` (the cross-group process group's rendezvous
            when this member is the primary).
        step: its last committed step.
        world_size: the number of ranks in the replica group.
        shrink_only: when set, the quorum may only lose members, never gain them.
        data: user data sent with the request (JSON-serializable), or None.
        commit_failures: consecutive failed commits it reports; a positive count makes the
            lighthouse issue a new quorum id.
        reconfigure_handles: one opaque process-group handle per group rank, in group-rank
            order (torchft-nightly's reconfigurable process groups); empty when the group's
            ranks sent none. The lighthouse passes them through unchanged.
    """

    replica_id: str
    address: str = ""
    """Manager URL, ``http://host:port``."""
    store_address: str = ""
    """TCPStore address, ``host:port``."""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    data: dict[str, Any] | None = field(default=None, compare=True)
    commit_failures: int = 0
    reconfigure_handles: tuple[str, ...] = ()

    def to_proto(self) -> pb.QuorumMember:
        return pb.QuorumMember(
            replica_id=self.replica_id,
            address=self.address,
            store_address=self.store_address,
            step=self.step,
            world_size=self.world_size,
            shrink_only=self.shrink_only,
            data=json.dumps(self.data) if self.data is not None else "",
            commit_failures=self.commit_failures,
            reconfigure_handles=self.reconfigure_handles,
        )

    @classmethod
    def from_proto(cls, msg: pb.QuorumMember) -> QuorumMember:
        """Decodes a wire member; raises ValueError when ``data`` is not JSON (or nests deeper
        than the JSON parser goes)."""
        try:
            data = json.loads(msg.data) if msg.data else None
        except json.JSONDecodeError as e:
            raise ValueError(
                f"QuorumMember.data of {msg.replica_id!r} is not JSON text: {e}"
            ) from e
        except RecursionError:
            raise ValueError(
                f"QuorumMember.data of {msg.replica_id!r} nests too deeply to decode"
            ) from None
        return cls(
            replica_id=msg.replica_id,
            address=msg.address,
            store_address=msg.store_address,
            step=msg.step,
            world_size=msg.world_size,
            shrink_only=msg.shrink_only,
            data=data,
            commit_failures=msg.commit_failures,
            reconfigure_handles=tuple(msg.reconfigure_handles),
        )


@dataclass(frozen=True)
class StateLoss:
    """The job's state is lost (wire message ``StateLoss``, a torchtitan_ft extension): the
    lighthouse issued a quorum whose members are all behind the job's highest step after every
    member that held it was gone for the holder wait (``decision.state_guard``).

    Args:
        lost_step: the job's highest step, which no member holds any more.
        holders: the members of the last quorum, which held it (or were healing to it),
            sorted; each is gone or back behind that step.
    """

    lost_step: int
    holders: tuple[str, ...]

    def to_proto(self) -> pb.StateLoss:
        return pb.StateLoss(lost_step=self.lost_step, holders=list(self.holders))

    @classmethod
    def from_proto(cls, msg: pb.StateLoss) -> StateLoss:
        return cls(msg.lost_step, tuple(msg.holders))


@dataclass(frozen=True)
class Quorum:
    """A quorum the lighthouse issued (wire message ``Quorum``).

    Args:
        quorum_id: its id; it changes whenever membership changes (or a member reports commit
            failures), which is what makes the managers reconfigure their process groups.
        participants: the members, sorted by ``replica_id``.
        created: when the lighthouse issued it (UTC).
        state_loss: the job's state loss the lighthouse reports with it (the response's
            ``state_loss``, not part of the wire ``Quorum``); None: none, or torchft's
            lighthouse.
    """

    quorum_id: int
    participants: tuple[QuorumMember, ...]
    """Members sorted by ``replica_id``."""
    created: datetime
    state_loss: StateLoss | None = None

    def to_proto(self) -> pb.Quorum:
        msg = pb.Quorum(
            quorum_id=self.quorum_id,
            participants=[m.to_proto() for m in self.participants],
        )
        msg.created.FromDatetime(self.created)
        return msg

    @classmethod
    def from_proto(cls, msg: pb.Quorum) -> Quorum:
        return cls(
            quorum_id=msg.quorum_id,
            participants=tuple(QuorumMember.from_proto(m) for m in msg.participants),
            created=msg.created.ToDatetime(tzinfo=UTC),
        )


@dataclass(frozen=True)
class GroupSpeed:
    """The lighthouse's view of one replica group's speed (wire message ``GroupSpeed``).

    Args:
        replica_id: the replica group.
        relative_speed: the other groups' typical compute time divided by this group's: 1.0
            typical, 0.25 four times slower; 0.0 not judged yet.
        straggler: whether the lighthouse reports the group as a straggler now.
        straggler_since_step: the group's step at which it became one; None when it is not.
        excluded: whether the straggler policy leaves the group out of the quorum now (its
            quorum is itself alone and it must not commit; ``lighthouse.exclusion``).
        link_relative_speed: this group's typical link rate (its ``LinkProbe`` round trips)
            divided by the other groups': 1.0 typical, 0.25 four times slower; 0.0 not judged.
        cause: what makes it a straggler: ``"compute"``, ``"link"`` or ``"compute,link"``
            (``stragglers.Cause``); ``""`` when it is not one.
    """

    replica_id: str
    relative_speed: float = 0.0
    straggler: bool = False
    straggler_since_step: int | None = None
    excluded: bool = False
    link_relative_speed: float = 0.0
    cause: str = ""

    def to_proto(self) -> pb.GroupSpeed:
        since = self.straggler_since_step
        return pb.GroupSpeed(
            replica_id=self.replica_id,
            relative_speed=self.relative_speed,
            straggler=self.straggler,
            straggler_since_step=since if since is not None else -1,
            excluded=self.excluded,
            link_relative_speed=self.link_relative_speed,
            straggler_cause=self.cause,
        )

    @classmethod
    def from_proto(cls, msg: pb.GroupSpeed) -> GroupSpeed:
        since = msg.straggler_since_step if msg.straggler else None
        return cls(
            msg.replica_id,
            msg.relative_speed,
            msg.straggler,
            since,
            msg.excluded,
            msg.link_relative_speed,
            msg.straggler_cause,
        )
