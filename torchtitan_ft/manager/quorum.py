"""The quorum thread of every rank: asks the group's ManagerServer for the step's quorum,
decides participation, reconfigures the cross-group process group, then runs the heal transfer.

Docs: architecture.md, "One step" (steps 1 to 6).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchtitan_ft.events import EventKind, EventWriter, quorum_role
from torchtitan_ft.lighthouse.types import GroupSpeed, StateLoss
from torchtitan_ft.manager.decisions import (
    Participation,
    QuorumResult,
    WorldSizeMode,
    compute_participation,
    global_ranks,
    quorum_store_address,
)
from torchtitan_ft.manager.healing import Healing
from torchtitan_ft.manager.rendezvous import GroupRendezvous
from torchtitan_ft.manager.settings import ManagerSettings
from torchtitan_ft.manager.state_loss import (
    OnStateLoss,
    StateLossAction,
    StateLostError,
    state_loss_action,
    state_loss_line,
)
from torchtitan_ft.manager.step_collectives import StepCollectives, profiled
from torchtitan_ft.process_group.base import ReconfigureOptions
from torchtitan_ft.proto import torchft_pb2 as pb


@dataclass(frozen=True)
class QuorumRequest:
    """What one step asks the quorum thread for (all taken on the training thread)."""

    step: int
    """Committed steps of this rank."""
    commit_failures: int
    """Consecutive failed commits, told to the lighthouse."""
    allow_heal: bool
    shrink_only: bool
    timeout: timedelta
    manager_state: dict[str, int]
    """The Manager's ``state_dict()``, offered with the user state to healing peers."""
    progress: pb.GroupProgress | None = None
    """The previous step's timing, for the straggler report (``steptimes``)."""


class QuorumThread:
    """One worker thread running one quorum at a time; its results are read on the training
    thread once ``wait_ready`` (collectives may start) or ``wait`` (heal transfer done too)
    returned, and by ``Manager.stats()`` at any time.

    Args:
        group: this rank's client of the group's ManagerServer, the group's replica id and the
            checkpoint transport whose ``metadata()`` goes with every request.
        settings: this rank's place in its group (for ``pg.configure``).
        pg: the cross-replica-group process group, reconfigured when the quorum id changes.
        healing: runs the heal transfer after the collectives are released.
        collectives: where errors are recorded and the process group is marked usable.
        init_sync, use_async_quorum, world_size_mode, min_replica_size: the Manager's
            arguments of these names.
        events: the event stream; a quorum with a new id, or a new role for this group in
            it, is a ``QUORUM`` event; a change of the lighthouse's straggler report on this
            group is a ``STRAGGLER`` event; being left out of the quorum by the straggler
            policy, and taken back, are ``EXCLUDED`` and ``READMITTED`` events; a state loss
            the lighthouse reports is a ``STATE_LOST`` event (once per loss).
        log: the Manager's logger (level, message).
    """

    def __init__(
        self,
        group: GroupRendezvous,
        settings: ManagerSettings,
        *,
        pg: Any,
        healing: Healing,
        collectives: StepCollectives,
        init_sync: bool,
        use_async_quorum: bool,
        world_size_mode: WorldSizeMode,
        min_replica_size: int,
        events: EventWriter,
        log: Callable[[int, str], None],
    ) -> None:
        self._client = group.client
        self._transport = group.transport
        self._replica_id = group.replica_id
        self._group_rank = settings.group_rank.value
        self._group_world_size = settings.group_world_size.value
        self._on_state_loss = settings.on_state_loss.value
        self.checkpoint_step: Callable[[], int | None] | None = None
        """The step of the job's newest complete checkpoint (``Manager.set_checkpoint_step``;
        None: the job has none)."""
        self._state_loss: tuple[StateLoss, StateLossAction] | None = None
        """The last state loss this process announced, with its action
        (``_announce_state_loss``)."""
        self._pg = pg
        self._healing = healing
        self._collectives = collectives
        self._init_sync = init_sync
        self._use_async_quorum = use_async_quorum
        self._world_size_mode = world_size_mode
        self._min_replica_size = min_replica_size
        self._events = events
        self._announced: tuple[int, str] | None = None
        """The (quorum id, role) of the last ``QUORUM`` event."""
        self._straggler = False
        """Whether the lighthouse reported this group as a straggler in the last quorum."""
        self._log = log
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="torchft_quorum"
        )
        self._future: concurrent.futures.Future[None] | None = None
        self._ready: concurrent.futures.Future[None] | None = None
        self._quorum_id = -1
        self.result: QuorumResult | None = None
        """The last quorum's result for this rank (None before the first)."""
        self.participation = Participation(rank=None, world_size=0, vote_size=0)
        """This group's slot in the last quorum's gradient average."""
        self.healing = False
        """Whether this rank heals in the current step."""
        self.excluded = False
        """Whether the lighthouse's straggler policy left this group out of the step's
        quorum: the step runs alone (no cross-group collective) and must not commit."""

    @property
    def started(self) -> bool:
        """Whether a quorum was ever started."""
        return self._future is not None

    def finish_previous(self) -> None:
        """Waits until the previous quorum is over (its failure was already raised to the
        caller of ``wait``; a fresh quorum is the retry)."""
        if self._future is not None:
            concurrent.futures.wait([self._future])

    def start(self, request: QuorumRequest) -> None:
        """Starts the step's quorum on the worker thread and returns at once."""
        self.healing = False
        self._ready = concurrent.futures.Future()
        self._future = self._executor.submit(self._run, request, self._ready)

    def wait_ready(self) -> None:
        """Blocks until the quorum and reconfiguration (not the heal transfer) are done;
        raises what the quorum raised."""
        if self._ready is None:
            raise RuntimeError("a collective was started before start_quorum()")
        self._ready.result()

    def wait(self) -> None:
        """Blocks until the quorum, reconfiguration and heal transfer are done; raises what
        the quorum raised."""
        if self._future is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        self._future.result()

    def shutdown(self, wait: bool) -> None:
        """Stops the worker thread (a quorum in flight is not interrupted)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def _run(self, request: QuorumRequest, ready: concurrent.futures.Future[None]) -> None:
        with profiled("torchft::manager::_async_quorum"):
            self._run_phases(request, ready)

    def _run_phases(self, request: QuorumRequest, ready: concurrent.futures.Future[None]) -> None:
        """Two phases. Phase 1 (quorum, participation, reconfigure) releases the step's
        collectives; phase 2 (the heal transfer) runs while they proceed, so neither a donor
        nor a healing replica waits for the transfer before its allreduce. Errors other than
        the quorum RPC's are recorded, not raised."""
        asked_at = time.time()
        try:
            with profiled("torchft::manager::_client::_quorum"):
                result = self._client._quorum(
                    group_rank=self._group_rank,
                    step=request.step,
                    checkpoint_metadata=self._transport.metadata(),
                    shrink_only=request.shrink_only,
                    init_sync=self._init_sync,
                    commit_failures=request.commit_failures,
                    timeout=request.timeout,
                    progress=request.progress,
                    reconfigure_handle=self._handle(),
                )
            self.result = result
            self._announce_state_loss(result)
            self._announce_speed(result)
            self._announce_exclusion(result)
            if self.excluded:
                # A quorum of this group alone: no participation, no reconfiguration (the
                # process group keeps the last real quorum's id, so being taken back
                # reconfigures it), no heal.
                self.participation = Participation(rank=None, world_size=0, vote_size=0)
                return
            self.participation = compute_participation(
                result,
                use_async_quorum=self._use_async_quorum,
                allow_heal=request.allow_heal,
                init_sync=self._init_sync,
                world_size_mode=self._world_size_mode,
                min_replica_size=self._min_replica_size,
            )
            self.healing = request.allow_heal and result.heal
            self._announce(result, asked_at)
            self._collectives.usable = True
            if result.quorum_id != self._quorum_id and not self._reconfigure(result):
                self._collectives.usable = False
                return
        except BaseException as e:
            ready.set_exception(e)
            raise
        finally:
            if not ready.done():
                ready.set_result(None)
        if request.allow_heal:
            try:
                self._healing.exchange(result, request.manager_state)
            except Exception as e:  # recorded: a failed heal discards the step; next quorum retries
                self._collectives.report_error(e)

    def _announce(self, result: QuorumResult, asked_at: float) -> None:
        """A ``QUORUM`` event when the quorum id or this group's role changed (``asked_at``:
        Unix time at which this rank asked for it)."""
        role = quorum_role(self.participation.rank, self.healing)
        if self._announced == (result.quorum_id, role.value):
            return
        self._announced = (result.quorum_id, role.value)
        self._events.emit(
            EventKind.QUORUM,
            quorum_id=result.quorum_id,
            replica_ids=result.replica_ids,
            participants=self.participation.world_size,
            max_step=result.max_step,
            role=role,
            asked_at=round(asked_at, 6),
        )

    def _announce_state_loss(self, result: QuorumResult) -> None:
        """The lighthouse reports the job's state lost: one ERROR line (group rank 0; the
        other ranks at INFO) and a ``STATE_LOST`` event, once per loss and action in this
        process; raises ``StateLostError`` whenever ``state_loss_action`` says stop (every
        time: nothing may train on)."""
        loss = result.state_loss
        if loss is None:
            return
        checkpoint = None
        if self._on_state_loss is OnStateLoss.CHECKPOINT and self.checkpoint_step is not None:
            checkpoint = self.checkpoint_step()
        action = state_loss_action(self._on_state_loss, result.max_step, checkpoint)
        if (loss, action) != self._state_loss:
            self._state_loss = (loss, action)
            self._log(
                logging.ERROR if self._group_rank == 0 else logging.INFO,
                state_loss_line(loss, result.max_step, self._on_state_loss, checkpoint),
            )
            self._events.emit(
                EventKind.STATE_LOST,
                lost_step=loss.lost_step,
                holders=list(loss.holders),
                max_step=result.max_step,
                on_state_loss=self._on_state_loss,
                action=action,
                checkpoint_step=checkpoint,
            )
        if action is StateLossAction.STOP:
            raise StateLostError(
                f"the job's state at step {loss.lost_step} is lost "
                f"(on_state_loss={self._on_state_loss.value!r})"
            )

    def _announce_speed(self, result: QuorumResult) -> None:
        """An event when the lighthouse starts or stops reporting this group as a straggler."""
        speed = result.speed
        if speed is None or speed.straggler == self._straggler:
            return
        self._straggler = speed.straggler
        self._log(
            logging.WARNING if speed.straggler else logging.INFO,
            f"the lighthouse reports this replica group as a straggler ({speed.cause}) since "
            f"its step {speed.straggler_since_step}: {_speeds(speed)}"
            if speed.straggler
            else "the lighthouse no longer reports this replica group as a straggler: "
            f"{_speeds(speed)}",
        )
        self._events.emit(
            EventKind.STRAGGLER,
            straggler=speed.straggler,
            relative_speed=round(speed.relative_speed, 4),
            link_relative_speed=round(speed.link_relative_speed, 4),
            cause=speed.cause,
            since_step=speed.straggler_since_step,
        )

    def _announce_exclusion(self, result: QuorumResult) -> None:
        """Sets ``excluded`` from the lighthouse's answer; an event when it changes."""
        speed = result.speed
        excluded = speed is not None and speed.excluded
        if excluded == self.excluded:
            return
        self.excluded = excluded
        relative = round(speed.relative_speed, 4) if speed is not None else 0.0
        self._log(
            logging.WARNING if excluded else logging.INFO,
            f"the lighthouse's straggler policy left this replica group out of the quorum "
            f"({_speeds(speed) if speed is not None else 'not judged'}): its steps run alone "
            "and are not committed until it is taken back"
            if excluded
            else "the lighthouse took this replica group back into the quorum; it heals from "
            "the others if it is behind",
        )
        self._events.emit(
            EventKind.EXCLUDED if excluded else EventKind.READMITTED, relative_speed=relative
        )

    def _handle(self) -> str:
        """This rank's reconfigure handle, sent with its quorum request, where its process
        group exchanges handles through the quorum (a native torch group); else none."""
        exchanges = getattr(self._pg, "exchanges_handles", None)
        return self._pg.get_reconfigure_handle() if exchanges is not None and exchanges() else ""

    def _reconfigure(self, result: QuorumResult) -> bool:
        if self._handle():
            return self._reconfigure_native(result)
        prefixed = quorum_store_address(result.store_address, result.quorum_id, self._group_rank)
        self._log(
            logging.INFO,
            f"reconfiguring for quorum {result.quorum_id}: replica rank "
            f"{result.replica_rank}/{result.replica_world_size}, store {prefixed}",
        )
        try:
            with profiled("torchft::manager::_pg::configure"):
                self._pg.configure(
                    store_addr=prefixed,
                    replica_id=self._replica_id,
                    rank=result.replica_rank,
                    world_size=result.replica_world_size,
                    quorum_id=result.quorum_id,
                    group_rank=self._group_rank,
                    group_world_size=self._group_world_size,
                    global_ranks=global_ranks(
                        result.replica_ids, self._group_world_size, self._group_rank
                    ),
                )
        except Exception as e:  # recorded: the step is discarded, the next quorum retries
            self._collectives.report_error(e)
            return False
        self._quorum_id = result.quorum_id
        return True

    def _reconfigure_native(self, result: QuorumResult) -> bool:
        """Reconfigure a native torch group with the quorum's members' handles for this group
        rank (replica-rank order; torchft-nightly's wire, ``reconfigure_handles``) under the
        quorum id as its uuid."""
        self._log(
            logging.INFO,
            f"reconfiguring for quorum {result.quorum_id}: replica rank "
            f"{result.replica_rank}/{result.replica_world_size}, native handles",
        )
        opts = ReconfigureOptions()
        opts.uuid = result.quorum_id
        opts.handles = list(result.reconfigure_handles)
        try:
            if len(opts.handles) != result.replica_world_size:
                raise RuntimeError(
                    f"quorum {result.quorum_id} carries {len(opts.handles)} reconfigure "
                    f"handles for {result.replica_world_size} members: a member, its "
                    "ManagerServer or the lighthouse does not pass handles (torchft 0.2.0's "
                    "drops them); use the same process group type in every group"
                )
            with profiled("torchft::manager::_pg::configure"):
                self._pg.reconfigure(opts).wait()
        except Exception as e:  # recorded: the step is discarded, the next quorum retries
            self._collectives.report_error(e)
            return False
        self._quorum_id = result.quorum_id
        return True


def _speeds(speed: GroupSpeed) -> str:
    """How fast the lighthouse judges the group, for a log line."""
    link = (
        f", its link at {speed.link_relative_speed:.2f}x the others' rate"
        if speed.link_relative_speed > 0
        else ""
    )
    return f"it computes at {speed.relative_speed:.2f}x the others' speed{link}"
