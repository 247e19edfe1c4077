"""Decisions of one step: a rank's view of a quorum (made on group rank 0's server) and what
every rank decides from it.

No I/O and no clock. All are functions of their arguments except ``QuorumGate``, which
remembers whether its group has taken part in a quorum and what it last reported. The rules
are in docs/architecture.md ("One step", steps 3, 4, 8 and 9); tested without servers in
``tests/manager/test_decisions.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from torchtitan_ft.addresses import AddressProblem, Severity
from torchtitan_ft.lighthouse.types import GroupSpeed, Quorum, QuorumMember, StateLoss
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.replica_ids import group_number

# ---------------------------------------------------------------------------- quorum results
# On group rank 0's ManagerServer: one group rank's view of the lighthouse's quorum.


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
    reconfigure_handles: list[str] = field(default_factory=list, hash=False)
    """The process-group handles of this group rank's cross-group group, one per member in
    replica-rank order (``cross_group_handles``); empty when a member sent none for it."""
    speed: GroupSpeed | None = None
    """This group's speed as the lighthouse judges it (the straggler report); None from a
    torchft 0.2.0 lighthouse or manager server."""
    state_loss: StateLoss | None = None
    """The job's state loss the lighthouse reported with the quorum (docs/lighthouse.md,
    "State loss"); None: none, or a torchft 0.2.0 lighthouse or manager server."""

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
            reconfigure_handles=self.reconfigure_handles,
            speed=self.speed.to_proto() if self.speed is not None else None,
            state_loss=self.state_loss.to_proto() if self.state_loss is not None else None,
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
            reconfigure_handles=list(msg.reconfigure_handles),
            speed=GroupSpeed.from_proto(msg.speed) if msg.HasField("speed") else None,
            state_loss=(
                StateLoss.from_proto(msg.state_loss) if msg.HasField("state_loss") else None
            ),
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
        reconfigure_handles=cross_group_handles(members, group_rank),
        state_loss=quorum.state_loss,
    )


def cross_group_handles(members: list[QuorumMember], group_rank: int) -> list[str]:
    """Group rank ``group_rank``'s handle of each member of ``members`` (in their order): the
    handles a torchft-nightly process group reconfigures with, its own at its replica rank.
    Empty unless every member sent a non-empty handle for that rank (a torchft 0.2.0 member or
    a group whose ranks sent none has no place in such a group; a partial list would seat the
    wrong ranks)."""
    handles = [
        m.reconfigure_handles[group_rank] if group_rank < len(m.reconfigure_handles) else ""
        for m in members
    ]
    return handles if all(handles) else []


def _must_recover(
    member: QuorumMember, init_source: QuorumMember, max_step: int, init_sync: bool
) -> bool:
    if member.step != max_step:
        return True
    return init_sync and max_step == 0 and member.replica_id != init_source.replica_id


# ------------------------------------------------------------------ who may act as a group rank
# On group rank 0's ManagerServer: a group rank's Quorum registration and its ShouldCommit vote
# are bound to the gRPC connection (``context.peer()``, ``ipv4:host:port``) the rank registered
# from, so that another client cannot act in its name.


def impostor_refusal(
    action: str, replica_id: str, group_rank: int, bound_peer: str, peer: str
) -> str:
    """Why a call from connection ``peer`` may not ``action`` as ``group_rank``, a rank bound
    to the connection ``bound_peer`` (``rounds.Record.matches`` decides that it may not)."""
    return (
        f"{action} as group rank {group_rank} of replica {replica_id!r} refused: that rank is "
        f"bound to the connection {bound_peer} of its Quorum call and to the session its "
        f"client got there, and this call came from {peer} without that session; only the "
        f"rank's own client may {action} for it (another process is using this group rank, or "
        "the rank's process restarted: a new process takes the rank over with its next Quorum "
        "call, once the old process's connection has closed)"
    )


# ------------------------------------------------------------------- whether a quorum is taken
# On group rank 0's ManagerServer, after every quorum: what the identity and address checks
# found, and whether this group takes part, stops, or logs and carries on.


@dataclass(frozen=True)
class QuorumAdmission:
    """What :meth:`QuorumGate.admit` decided about one quorum."""

    refusal: str | None = None
    """One line saying what to change: this group's round fails (``FAILED_PRECONDITION``, the
    trainer stops with ``ReplicaGroupMismatchError``); ``None``: it takes part."""
    error: str | None = None
    """A conflict this group logs as an error and carries on with (new since the last one)."""
    warning: str | None = None
    """An address warning about a peer to log (new since the last one)."""


class QuorumGate:
    """Whether this group takes part in each quorum it is issued, given what the checks found.

    - An identity conflict (``identity.identity_conflict``) stops a newcomer (a group that has
      not yet taken part in a quorum); a group already training logs it and carries on, since
      the newcomer stops.
    - An address ERROR (``addresses.quorum_address_problem``: this group advertises loopback
      and a member runs on another host) always stops this group, whether or not it trained
      before: no quorum with that member can ever build its process groups, and a group that
      trained alone or beside groups of its own host first (``min_replicas`` lets a fast
      starter go ahead) would otherwise fail every reconfiguration from then on.
    - Warnings and carried-on conflicts are returned only when they change, so each is logged
      once.
    """

    def __init__(self) -> None:
        self.accepted = False
        """Whether this group took part in a quorum: until then it is a newcomer."""
        self._last_conflict: str | None = None
        self._last_warning: str | None = None

    def admit(self, identity: str | None, addresses: AddressProblem | None) -> QuorumAdmission:
        warning = (
            addresses.message if addresses and addresses.severity is Severity.WARNING else None
        )
        new_warning = warning if warning != self._last_warning else None
        self._last_warning = warning
        if addresses is not None and addresses.severity is Severity.ERROR:
            refusal = identity if identity is not None and not self.accepted else addresses.message
            return QuorumAdmission(refusal=refusal, warning=new_warning)
        if identity is None:
            self.accepted = True
            self._last_conflict = None
            return QuorumAdmission(warning=new_warning)
        if not self.accepted:
            return QuorumAdmission(refusal=identity, warning=new_warning)
        error = identity if identity != self._last_conflict else None
        self._last_conflict = identity
        return QuorumAdmission(error=error, warning=new_warning)


# ------------------------------------------------------------------------------ step decisions
# On every rank: what the Manager decides from its QuorumResult.


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
    ``init_sync``, where every member but one (the step-0 source, see
    ``compute_quorum_results``) heals from it although all are at ``max_step``: the source is
    the only participant, so the step's average is its own gradient rather than that gradient
    divided by the number of members.
    With a sync quorum and healing, the heal completes before the forward and everyone
    participates. FIXED_WITH_SPARES caps the participants at ``min_replica_size``.
    """
    if use_async_quorum or not allow_heal:
        rank, size = result.max_replica_rank, result.max_world_size
    else:
        rank, size = result.replica_rank, result.replica_world_size
    vote_size = size
    if use_async_quorum and allow_heal and init_sync and result.max_step == 0 and size > 1:
        # The step-0 source is the one member that does not heal (compute_quorum_results).
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


@dataclass(frozen=True)
class RetryDecision:
    """Whether a step whose allreduce failed re-runs its collectives over a new quorum
    (``Manager(retry_inflight_allreduce=True)``), with the reason (logged)."""

    retry: bool
    reason: str


def inflight_retry_decision(
    *,
    enabled: bool,
    first_error: BaseException | None,
    first_error_is_collective: bool,
    participated: bool,
    inputs_kept: bool,
    retries_done: int,
    group_world_size: int,
    can_wait_abandoned: bool,
) -> RetryDecision:
    """Decides whether to finish a failed step with the survivors instead of discarding it.

    Retried only when the step's *first* error is an allreduce that failed in the process
    group (a peer died or dropped the group: gloo says so within milliseconds). Not when the
    first error is anything else (a user's ``report_error``, a failed heal, a timeout: a peer
    that stops answering would stall the retry as long), when this group contributed zeros (a
    healing or spare group has no gradients of its own to re-send), when some allreduce's input
    was not kept, when the step was retried already (one retry a step), for groups of several
    ranks (their ranks would have to agree first), or when the process group cannot say when
    gloo is done writing into the failed collectives' tensors.

    Args:
        enabled: ``retry_inflight_allreduce``.
        first_error: the step's first recorded error (None: nothing failed).
        first_error_is_collective: ``first_error`` was raised by an allreduce in the process
            group.
        participated: this group contributed its gradients in the failed attempt.
        inputs_kept: every allreduce of the step kept a copy of its input.
        retries_done: retries already run this step.
        group_world_size: ranks in this replica group.
        can_wait_abandoned: the process group can wait for the collectives it abandoned
            (``ProcessGroup.can_wait_abandoned()``, asked once by the Manager).
    """
    if not enabled:
        return RetryDecision(False, "retry_inflight_allreduce is off")
    if first_error is None:
        return RetryDecision(False, "no error this step")
    if not first_error_is_collective:
        return RetryDecision(
            False, f"the step's first error is not a failed allreduce: {first_error}"
        )
    if isinstance(first_error, TimeoutError):
        return RetryDecision(False, f"the allreduce timed out (a stuck peer): {first_error}")
    if retries_done >= 1:
        return RetryDecision(False, "the step was retried already")
    if not participated:
        return RetryDecision(False, "this group did not contribute gradients to the step")
    if not inputs_kept:
        return RetryDecision(False, "an allreduce's input was not kept")
    if group_world_size > 1:
        return RetryDecision(False, "replica groups of several ranks are not retried")
    if not can_wait_abandoned:
        return RetryDecision(
            False, "the process group has no wait_abandoned (can_wait_abandoned() is False)"
        )
    return RetryDecision(True, f"an allreduce failed ({first_error}): retrying over a new quorum")


def hung_peer_abort(
    quorum_ids: list[str], own_id: str, gone: list[str], self_gone: bool
) -> str | None:
    """Why this rank aborts the collectives of a step over quorum ``quorum_ids``, given the
    lighthouse's answer (``gone``: members silent for its heartbeat timeout; ``self_gone``: it
    named this group gone to a peer), or None to go on waiting. Only members of this quorum
    count: a gone replica elsewhere in the job is no peer of these collectives."""
    if self_gone:
        return (
            "the lighthouse named this replica group gone (silent for its heartbeat timeout, "
            "e.g. SIGSTOPped); its peers abort the step: discarding it"
        )
    hung = sorted(set(gone) & set(quorum_ids) - {own_id})
    if hung:
        return (
            f"peer replica group(s) {hung} are gone (alive but silent for the lighthouse's "
            "heartbeat timeout, e.g. SIGSTOPped): aborting the step's collectives"
        )
    return None


def needs_commit_fence(step_seconds: float, heartbeat_timeout: float | None) -> bool:
    """Whether a rank asks the lighthouse before voting to commit: its step lasted long enough
    (half the lighthouse's ``heartbeat_timeout``, seconds; ``None`` until known: always) that
    the lighthouse may have named its group gone, and its peers aborted the step while this
    rank was stopped."""
    return heartbeat_timeout is None or step_seconds >= heartbeat_timeout / 2


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


def check_step_arguments(
    min_replica_size: int, world_size_mode: WorldSizeMode, max_retries: int | None
) -> None:
    """Raises ``ValueError``/``TypeError`` for the Manager arguments these decisions reject."""
    if min_replica_size < 1:
        raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
    if not isinstance(world_size_mode, WorldSizeMode):
        raise TypeError(f"world_size_mode must be a WorldSizeMode, got {world_size_mode!r}")
    if max_retries is not None and max_retries < 0:
        raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")


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


def global_ranks(replica_ids: list[str], group_world_size: int, group_rank: int) -> list[int]:
    """Global ranks of this group rank's peers, one per quorum member (in replica-rank order).

    The replica group number is the trailing digits of the replica id before the uuid suffix
    (``"train_3:<uuid>"`` -> 3; none -> 0); global rank = group number * group size + rank.
    """
    return [
        group_number(replica_id, default=0) * group_world_size + group_rank
        for replica_id in replica_ids
    ]
