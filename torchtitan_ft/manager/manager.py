"""The Manager, one per rank of a replica group: the training loop's side of each step's
quorum, healing and commit vote (a façade over the modules beside it).

The step protocol is in docs/architecture.md ("One step"). Who writes which field (the training
thread reads the quorum thread's after ``_quorum.wait_ready()``/``wait()``; ``stats()`` reads
any field at any time):

==============================================================  ===============================
field                                                           written on
==============================================================  ===============================
``_step``, ``_batches_committed``, ``_commit_failures``,        the training thread
``_discarded_steps``, ``_samples_per_batch``,
``_identity``, ``_retries_this_step``, ``_participated``,
``_hung_armed``, ``_step_timer``'s timings, ``_quorum``'s
futures, ``_collectives``' pending futures
``_quorum.result``, ``.participation``, ``.healing``,           the quorum thread (``healing``
``._quorum_id``; ``_heal``'s received state, receive time and   and ``_heal`` are reset by
served flag                                                     ``start_quorum`` first)
``_collectives.usable``                                         the quorum thread, the training
                                                                thread, a failed allreduce's
                                                                callback, the hung-peer watch
                                                                thread (``_hung``, through
                                                                ``_abort_hung_step``)
``_collectives``' error, ``_counters``                          any thread, under their locks
                                                                (the hung-peer watch thread's
                                                                ``report_error`` included)
everything else                                                 ``__init__`` only
==============================================================  ===============================
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import ReduceOp

from torchtitan_ft import timeouts
from torchtitan_ft.checkpoint import CheckpointTransport
from torchtitan_ft.events import EventKind, EventWriter, open_event_writer, this_process_started
from torchtitan_ft.lighthouse.client import LighthouseClient
from torchtitan_ft.manager.decisions import (
    RetryDecision,
    WorldSizeMode,
    check_commit_failures,
    check_step_arguments,
    heal_needs_group_agreement,
    inflight_retry_decision,
    local_commit_vote,
)
from torchtitan_ft.manager.healing import Healing
from torchtitan_ft.manager.hung import HungPeerError, HungPeerWatch
from torchtitan_ft.manager.identity import GroupIdentity
from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.quorum import QuorumRequest, QuorumThread
from torchtitan_ft.manager.rendezvous import join_replica_group
from torchtitan_ft.manager.settings import (
    ManagerSettings,
    Source,
    overridden_message,
    resolve_manager_settings,
    timeout_values,
)
from torchtitan_ft.manager.state_loss import STATE_LOST_EXIT, OnStateLoss, StateLostError
from torchtitan_ft.manager.stats import Counters, ManagerStats
from torchtitan_ft.manager.step_collectives import ExceptionWithTraceback, StepCollectives, profiled
from torchtitan_ft.manager.steptimes import StepTimer
from torchtitan_ft.process_group.base import ProcessGroup
from torchtitan_ft.process_group.futures import completed_future
from torchtitan_ft.proto import torchft_pb2 as pb

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")


class Manager:
    """Drives one replica-group rank through quorum, reconfiguration, healing and commit.

    Group rank 0 hosts the replica group's ManagerServer (which talks to the lighthouse) and,
    unless one is already listening there (torchrun's agent store), the group's TCPStore;
    other ranks find the server in that store. Save and restore ``Manager.state_dict()`` with
    periodic checkpoints: it holds the committed step count.

    Args (torchft 0.2.0's in its order, then ours, keyword-only; "A > B > C": argument, else
    env var, else default):
        pg: the reconfigurable cross-replica-group process group (e.g. ``ProcessGroupGloo``),
            reconfigured whenever the quorum id changes.
        load_state_dict: loads user state received when healing, on the training thread at a
            safe point. ``None``: ``register_state_dict_fn`` later.
        state_dict: returns the user state offered to healing peers (quorum thread).
        min_replica_size: minimum participating replica groups for a step to commit (and the
            participant cap under FIXED_WITH_SPARES).
        use_async_quorum: run the quorum on a worker thread overlapped with the forward
            (default True). With False, ``start_quorum`` blocks and a healing replica applies
            the received state before its forward and participates at once.
        timeout: collectives, ``wrap_future``, ShouldCommit and CheckpointMetadata RPCs and
            checkpoint transfers: argument > ``TORCHFT_TIMEOUT_SEC`` (seconds) > 60 s.
        quorum_timeout: how long ``start_quorum`` waits for the lighthouse: argument >
            ``TORCHFT_QUORUM_TIMEOUT_SEC`` > 60 s; raise it for LocalSGD/DiLoCo with long sync
            intervals.
        connect_timeout: connecting to the ManagerServer, lighthouse and TCPStore: argument >
            ``TORCHFT_CONNECT_TIMEOUT_SEC`` > 60 s.
        rank: rank in the replica group: argument > ``RANK`` > 0.
        world_size: ranks in the replica group: argument > ``WORLD_SIZE`` > 1.
        world_size_mode: ``WorldSizeMode.DYNAMIC`` (default) or ``FIXED_WITH_SPARES``.
        store_addr: host of the group's TCPStore, dialled by the other groups: argument >
            ``MASTER_ADDR`` > ``hostname``. A loopback name (torchrun sets
            ``MASTER_ADDR=localhost`` on many machines) is advertised to them as ``hostname``
            unless that is loopback too.
        store_port: its port: argument > ``MASTER_PORT`` > 0 (a free port; 1-rank groups only).
        lighthouse_addr: lighthouse URL (group rank 0): argument > ``TORCHFT_LIGHTHOUSE`` >
            ``http://localhost:29510``.
        replica_id: the group's id (group rank 0): argument > ``REPLICA_GROUP_ID`` > "". A
            per-process uuid is appended (a restarted group joins as a new member); trailing
            digits number the group's global ranks.
        port: ManagerServer port (group rank 0): argument > ``TORCHFT_MANAGER_PORT`` > 0 (free).
        hostname: the name other groups dial for this one's ManagerServer and checkpoint
            server; a loopback name keeps both on loopback. Default ``None``: this machine's
            name, ``socket.gethostname()`` when the Manager is constructed.
        heartbeat_interval: how often group rank 0 heartbeats the lighthouse (default 100 ms).
            Group ranks > 0 that know the lighthouse's address send their own heartbeats at
            this interval too, so that a rank hung inside the group is noticed
            (``manager.hung``).
        checkpoint_transport: how state moves to healing peers; default ``HTTPTransport`` with
            ``timeout``, ``hostname`` and ``auth_token``.
        init_sync: at step 0 every replica group loads the primary's state so all start
            identical (default True); False only when all groups initialise identically.
        max_retries: consecutive failed commits allowed; one more raises RuntimeError from
            ``should_commit``. ``None`` (default) retries forever.
        quorum_retries: retries (with backoff) of a failed lighthouse quorum request by group
            rank 0's ManagerServer before the quorum fails: argument >
            ``TORCHFT_QUORUM_RETRIES`` > 0.
        auth_token: the job token (default ``None``: none), the same in every group and the
            lighthouse. With one, the group's ManagerServer answers only calls carrying it
            (every rank's client sends it; its Kill RPC is enabled), it presents it to the
            lighthouse and to donor groups' ManagerServers, and the default checkpoint
            transport serves and fetches state only with it: argument >
            ``TORCHFT_AUTH_TOKEN`` > none (the env var lets a program written for torchft,
            whose API has no such argument, join a job with a token).
        model_fingerprint: what model this group trains (``model_fingerprint(model)``) or a
            function returning it, called once at the first ``start_quorum``; a group whose
            fingerprint differs from a live group's fails its first quorum with
            ``ReplicaGroupMismatchError``. Default ``None``: not checked.
        num_replica_groups: the planned number of replica groups (TorchTitan's
            ``fault_tolerance.group_size``), checked the same way; default ``None``. A replica
            id that a live group already uses is always refused.
        retry_inflight_allreduce: when a step's allreduce fails because a peer group died
            (or dropped the group), finish the same step with the survivors instead of
            discarding it: get a new quorum, re-run the step's allreduces from copies of their
            inputs over it (averaging over its participants) and vote (default False). Every
            allreduce's input is copied before it is reduced: memory cost one copy of the
            step's allreduced bytes (the gradients, for ``DistributedDataParallel``), held
            while the Manager lives, plus that memcpy each step. Applies to groups of one rank
            with an async quorum and a process group that can wait for the collectives it
            abandoned (``pg.can_wait_abandoned()``: ``ProcessGroupGloo``, ``ProcessGroupNCCL``
            and wrappers of them; with another group the Manager logs a warning at
            construction saying why, and never retries); not after a timeout (see
            ``decisions.inflight_retry_decision``). Use the same value in every group. The
            retried allreduces rewrite their tensors in place inside ``should_commit``: for
            code that reads the results after it (``DistributedDataParallel``,
            ``PureDistributedDataParallel``, ``OptimizerWrapper``, a participation vector), not
            for the semi-sync strategies (they judge the sync by the first attempt's futures).
        events_dir: the folder of the event stream (``torchtitan_ft.events``; one JSON-lines
            file per rank, docs/operations.md "The event stream"): argument >
            ``TORCHFT_EVENTS_DIR`` > none (no stream; the default).
        samples_per_batch: how many samples (e.g. sequences) one replica group trains per step
            (its batch, all its ranks together), for the lighthouse's committed samples per
            second (status page, ``torchft_lighthouse status``): the Manager reports
            ``batches_committed() * samples_per_batch``. Use the same value in every group
            (groups with different batch sizes would count each other's batches at their own
            size). Argument > ``TORCHFT_SAMPLES_PER_BATCH`` > none (the default: the page shows
            committed batches and says why, as for torchft's clients, which cannot send it).
            A trainer that learns its batch size after building the Manager calls
            ``set_samples_per_batch``.
        lighthouse_outage: what the group does while its lighthouse cannot be reached (group
            rank 0): ``"previous_quorum"`` (``LighthouseOutage.PREVIOUS_QUORUM``, the default)
            goes on committing steps on the group's previous quorum while every member keeps
            taking part (a member that dies or fails a commit fails the step's collective;
            the groups then wait for the lighthouse), so a lighthouse restart costs no step;
            ``"wait"`` waits for the lighthouse until ``quorum_timeout``, as torchft 0.2.0
            does (every group stalls for the outage). Healing, joining and any membership
            change wait for the lighthouse either way (docs/lighthouse.md, "A lighthouse
            outage"). Argument > ``TORCHFT_LIGHTHOUSE_OUTAGE`` > ``"previous_quorum"``.
        on_state_loss: what the group does when the lighthouse reports the job's state lost
            (every member holding its highest step gone; docs/lighthouse.md, "State loss"):
            ``"stop"`` (``OnStateLoss.STOP``, the default) logs one ERROR line, records a
            ``state_lost`` event and raises ``SystemExit(STATE_LOST_EXIT)`` (3) from
            ``start_quorum``/``wait_quorum``/``should_commit``; ``"from_scratch"`` logs and
            records the same and trains on from the quorum's step. Argument >
            ``TORCHFT_ON_STATE_LOSS`` > ``"stop"``.

    Raises:
        ValueError: bad settings (see ``settings``), ``min_replica_size < 1``, timeouts out
            of the order ``timeouts.RELATIONS`` requires (with ``pg``'s own timeout).
        AddressInUseError: the ManagerServer's port is taken; the message says where it was set.
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta | None = None,
        quorum_timeout: timedelta | None = None,
        connect_timeout: timedelta | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int | None = None,
        *,
        auth_token: str | None = None,
        model_fingerprint: str | Callable[[], str] | None = None,
        num_replica_groups: int | None = None,
        retry_inflight_allreduce: bool = False,
        events_dir: str | os.PathLike[str] | None = None,
        samples_per_batch: int | None = None,
        lighthouse_outage: LighthouseOutage | str | None = None,
        on_state_loss: OnStateLoss | str | None = None,
    ) -> None:
        check_step_arguments(min_replica_size, world_size_mode, max_retries)
        if not isinstance(retry_inflight_allreduce, bool):
            raise ValueError(
                f"retry_inflight_allreduce must be a bool, got {retry_inflight_allreduce!r}"
            )
        if retry_inflight_allreduce and not use_async_quorum:
            raise ValueError(
                "retry_inflight_allreduce=True needs use_async_quorum=True (with a sync quorum "
                "a group healed by the retry's quorum would count as a participant)"
            )
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("pass both load_state_dict and state_dict, or neither")
        if hostname is None:
            hostname = socket.gethostname()
        settings = resolve_manager_settings(
            env=os.environ,
            lighthouse_addr=lighthouse_addr,
            port=port,
            replica_id=replica_id,
            store_addr=store_addr,
            store_port=store_port,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            quorum_retries=quorum_retries,
            auth_token=auth_token,
            events_dir=events_dir,
            samples_per_batch=samples_per_batch,
            lighthouse_outage=lighthouse_outage,
            on_state_loss=on_state_loss,
            default_store_host=hostname,
        )
        pg_timeout = pg.get_timeout() if isinstance(pg, ProcessGroup) else None
        timeouts.check_order(timeout_values(settings, pg_timeout))
        auth_token = settings.auth_token.value
        timeout = settings.timeout.value
        connect_timeout = settings.connect_timeout.value
        self._settings: ManagerSettings = settings
        self._group_rank: int = settings.group_rank.value
        self._group_world_size: int = settings.group_world_size.value
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._timeout = timeout
        self._quorum_timeout = settings.quorum_timeout.value
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._pg = pg
        self._pg_can_wait_abandoned = isinstance(pg, ProcessGroup) and pg.can_wait_abandoned()
        self._step = 0
        self._batches_committed = 0
        self._discarded_steps = 0
        self._commit_failures = 0
        self._identity: Callable[[], GroupIdentity] | None = lambda: GroupIdentity.resolve(
            settings.replica_id.value, model_fingerprint, num_replica_groups
        )
        self._counters = Counters()
        self._retry_enabled = retry_inflight_allreduce
        self._retries_this_step = 0
        self._hung_armed = False
        self._participated = False
        """This group contributed its own tensors to the step's allreduces."""
        self._step_timer = StepTimer()
        self._oversize = timeouts.OversizeWatch(
            {
                timeouts.Key.STEP: timeout.total_seconds(),
                timeouts.Key.QUORUM: self._quorum_timeout.total_seconds(),
                timeouts.Key.CONNECT: connect_timeout.total_seconds(),
                **({timeouts.Key.PROCESS_GROUP: pg_timeout.total_seconds()} if pg_timeout else {}),
            }
        )
        """Warns once when a timeout is far above the measured step."""
        """Times each step and its compute part for the lighthouse's straggler report."""
        self._samples_per_batch: int | None = settings.samples_per_batch.value

        group = join_replica_group(
            settings,
            env=os.environ,
            hostname=hostname,
            heartbeat_interval=heartbeat_interval,
            connect_timeout=connect_timeout,
            quorum_retries=settings.quorum_retries.value,
            auth_token=auth_token,
            transport=checkpoint_transport,
            transport_timeout=timeout,
        )
        self._store, self._server, self._client = group.store, group.server, group.client
        self._replica_id: str = group.replica_id
        self._events: EventWriter = open_event_writer(
            settings.events_dir.value, group.replica_id, self._group_rank, lambda: self._step
        )
        self._collectives = StepCollectives(
            pg,
            timeout=timeout,
            counters=self._counters,
            log=self._log,
            keep_inputs=retry_inflight_allreduce,
            events=self._events,
        )
        self._checkpoint_transport: CheckpointTransport = group.transport
        self._heal = Healing(
            group.transport,
            group_rank=self._group_rank,
            timeout=timeout,
            connect_timeout=connect_timeout,
            auth_token=auth_token,
            counters=self._counters,
            events=self._events,
            log=self._log,
        )
        self._quorum = QuorumThread(
            group,
            settings,
            pg=pg,
            healing=self._heal,
            collectives=self._collectives,
            init_sync=init_sync,
            use_async_quorum=use_async_quorum,
            world_size_mode=world_size_mode,
            min_replica_size=min_replica_size,
            events=self._events,
            log=self._log,
        )
        self._hung: HungPeerWatch | None = None
        if self._group_rank == 0 or settings.lighthouse_addr.source is not Source.DEFAULT:
            self._hung = HungPeerWatch(
                LighthouseClient(settings.lighthouse_addr.value, connect_timeout, auth_token),
                group.replica_id,
                on_abort=self._abort_hung_step,
                log=self._log,
                group_rank=self._group_rank,
                heartbeat_interval=heartbeat_interval,
            )
        self._events.emit(
            EventKind.START,
            pid=os.getpid(),
            process_started=this_process_started(),
            group_world_size=self._group_world_size,
            settings=settings.record(),
            overridden=list(settings.overridden),
        )
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        self._log(
            logging.INFO,
            f"settings: {settings.describe()}; manager server {group.manager_address}, "
            f"store {group.store_address}",
        )
        if (overridden := overridden_message(settings, os.environ)) is not None:
            self._log(logging.WARNING, overridden)
        if retry_inflight_allreduce and not self._pg_can_wait_abandoned:
            self._log(
                logging.WARNING,
                f"retry_inflight_allreduce=True has no effect with this process group ({pg!r}): "
                "it cannot wait for the collectives it abandoned (can_wait_abandoned() is "
                "False), so a step whose allreduce fails is discarded, not retried. "
                "ProcessGroupGloo, ProcessGroupNCCL and wrappers of them can.",
            )

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds one named piece of user state to what healing sends and loads."""
        self._heal.register(key, load_state_dict, state_dict)

    def set_samples_per_batch(self, samples_per_batch: int) -> None:
        """Sets ``samples_per_batch`` (see the constructor) from the next quorum request on,
        for a trainer that knows its batch size only after it built the Manager (TorchTitan's).

        Raises:
            ValueError: not a positive integer.
        """
        if isinstance(samples_per_batch, bool) or not isinstance(samples_per_batch, int):
            raise ValueError(f"samples_per_batch must be a positive int, got {samples_per_batch!r}")
        if samples_per_batch < 1:
            raise ValueError(f"samples_per_batch must be >= 1, got {samples_per_batch}")
        self._samples_per_batch = samples_per_batch

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Sets the ``"default"`` user state functions (torchft compatibility)."""
        self._heal.replace("default", load_state_dict, state_dict)

    # ---------------------------------------------------------------- quorum

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Starts this step's quorum; call at the start of every step (``OptimizerWrapper``
        calls it from ``zero_grad``).

        Args:
            allow_heal: heal this replica if it is behind (all replicas must pass the same).
            shrink_only: ask for a quorum of the previous members only (no newcomers).
            timeout: how long to wait for the lighthouse; default ``quorum_timeout``.
        """
        self._quorum.finish_previous()
        identity, self._identity = self._identity, None
        if identity is not None and self._server is not None:
            # Once, on the caller's thread: the fingerprint function needs the model.
            self._server.set_identity(identity())
        self._collectives.new_step()
        self._heal.new_step()
        self._retries_this_step = 0
        self._participated = False
        self._hung_armed = False
        if self._hung is not None:
            self._hung.new_step()
        self._quorum.start(
            QuorumRequest(
                step=self._step,
                commit_failures=self._commit_failures,
                allow_heal=allow_heal,
                shrink_only=shrink_only,
                timeout=timeout or self._quorum_timeout,
                manager_state=self.state_dict(),
                progress=self._progress(),
            )
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            self._heal_all_or_nothing()  # safe point: the forward has not started

    def _progress(self) -> pb.GroupProgress:
        """What this rank tells the lighthouse with its quorum request: the previous step's
        timing (``steptimes``), the committed batches (and samples, when the trainer said its
        ``samples_per_batch``) and discarded steps, the heals that ended since (its
        ManagerServer merges the group's ranks')."""
        progress = self._step_timer.start(self._step, time.monotonic()) or pb.GroupProgress()
        for timing in progress.steps:
            self._judge_timeouts(timing.step_seconds)
        progress.batches_committed = self._batches_committed
        if self._samples_per_batch is not None:
            progress.samples_committed = self._batches_committed * self._samples_per_batch
        progress.discarded_steps = self._discarded_steps
        progress.heals.extend(self._heal.take_reports())
        return progress

    def _judge_timeouts(self, step_seconds: float) -> None:
        """Once, after the first steps: a warning and an event per timeout far above the
        measured step (``timeouts.OversizeWatch``)."""
        for found in self._oversize.step(step_seconds) or ():
            self._log(logging.WARNING, found.message())
            self._events.emit(
                EventKind.OVERSIZED_TIMEOUT,
                timeout=timeouts.BY_KEY[found.key].title.strip("`"),
                seconds=found.seconds,
                step_seconds=round(found.step_s, 6),
            )

    def wait_quorum(self) -> None:
        """Blocks until this step's quorum, reconfiguration and heal transfer are done.

        Raises:
            RuntimeError: ``start_quorum`` was never called.
            Exception: the quorum itself failed (e.g. TimeoutError: no lighthouse answer).
            SystemExit: ``STATE_LOST_EXIT``, the job's state is lost and ``on_state_loss``
                is ``"stop"`` (the Manager is shut down).
        """
        with profiled("torchft::manager::wait_quorum"):
            try:
                self._quorum.wait()
            except StateLostError:  # said in one line and an event by the quorum thread
                self.shutdown(wait=False)
                raise SystemExit(STATE_LOST_EXIT) from None

    def _heal_all_or_nothing(self) -> None:
        """Applies a received state at a safe point if the whole group received (training
        thread; ``Healing.apply_all_or_nothing``), when the group may heal this step."""
        result = self._quorum.result
        if result is not None and heal_needs_group_agreement(self._step, result, self._init_sync):
            self._heal.apply_all_or_nothing(
                healing=self._quorum.healing,
                group_and=lambda received: self._group_and(received, self._timeout),
                report_error=self.report_error,
                load_manager_state=self.load_state_dict,
            )

    # ---------------------------------------------------------------- collectives and errors

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    ) -> torch.futures.Future[torch.Tensor]:
        """Fault-tolerant in-place allreduce across the participating replica groups.

        Waits for the quorum and reconfiguration (not for a heal transfer), zeroes ``tensor``
        if this replica does not participate (spare or healing), sums across all members and,
        for ``ReduceOp.AVG`` (default), divides by the number of participants. The returned
        future never carries an error: on failure (now or later, including ``timeout``) the
        error is recorded, the future completes with ``tensor`` (contents undefined) and later
        collectives of the step are no-ops.

        Args:
            tensor: the tensor to reduce in place.
            should_quantize: send int8 blocks with fp32 scales (``process_group.quantized``:
                about a quarter of the bytes, error bounded by half a quantization step per
                block); ``SUM`` and ``AVG`` only.
            reduce_op: ``ReduceOp.AVG`` (floating point only), ``SUM``, ``MAX`` or ``MIN``.
        """
        with profiled("torchft::manager::allreduce"):
            return self._allreduce(tensor, should_quantize, reduce_op)

    def _allreduce(
        self, tensor: torch.Tensor, should_quantize: bool, reduce_op: ReduceOp.RedOpType
    ) -> torch.futures.Future[torch.Tensor]:
        if reduce_op == ReduceOp.AVG and not torch.is_floating_point(tensor):
            raise TypeError(f"ReduceOp.AVG needs a floating point tensor, got {tensor.dtype}")
        if should_quantize and reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"should_quantize supports ReduceOp.SUM and AVG, got {reduce_op}")
        self._step_timer.collective(time.monotonic())
        try:
            self._quorum.wait_ready()
        except Exception as e:  # recorded: the step is discarded, the future completes
            self.report_error(e)
            return completed_future(tensor)
        if self._quorum.excluded:
            # Left out of the quorum: the step runs alone and is not committed; the tensor
            # keeps this group's own values.
            return completed_future(tensor)
        self._participated = self.is_participating()
        self._arm_hung_watch()
        return self._collectives.allreduce(
            tensor,
            participants=self._quorum.participation.world_size,
            participating=self.is_participating(),
            should_quantize=should_quantize,
            reduce_op=reduce_op,
        )

    def _arm_hung_watch(self) -> None:
        """Watches the step's quorum for hung peers from its first collective on."""
        result = self._quorum.result
        if self._hung is not None and not self._hung_armed and result is not None:
            self._hung_armed = True
            self._hung.arm(result.replica_ids)

    def _abort_hung_step(self, reason: str) -> None:
        """``HungPeerWatch``'s verdict (its thread): fails the step's collectives now. Not a
        retryable collective error: gloo may still write the hung collectives' tensors once
        the peer resumes, so the step is discarded and its buffers left to them."""
        self.report_error(HungPeerError(reason))
        self._collectives.usable = False
        self._pg.abort()

    def report_error(self, e: BaseException) -> None:
        """Records an error for this step: the step will not commit and the process group is
        rebuilt on the next quorum. The first error of a step is kept (the root cause)."""
        self._collectives.report_error(e)

    def errored(self) -> ExceptionWithTraceback | None:
        """The error recorded this step, or None."""
        return self._collectives.error

    def wrap_future(
        self, fut: torch.futures.Future[T], default: T, timeout: timedelta | None = None
    ) -> torch.futures.Future[T]:
        """A future that completes like ``fut``, or with ``default`` if ``fut`` fails or does
        not complete within ``timeout`` (default: the manager's ``timeout``); the error is
        recorded with ``report_error``. ``should_commit`` waits for these futures."""
        return self._collectives.wrap_future(fut, default, timeout)

    # ---------------------------------------------------------------- commit

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Decides whether this step's optimizer update may be applied; call once per step
        after backward and before ``optimizer.step()`` on every rank of the group.

        Waits for outstanding collectives, applies a healed state (safe point: before the
        optimizer step), votes locally (no error, enough participants) and ANDs the vote
        over the replica group. On commit the step and ``batches_committed`` advance.

        Args:
            timeout: for the group-wide vote; default the manager's ``timeout``.

        Raises:
            RuntimeError: ``start_quorum`` was never called, or ``max_retries`` consecutive
                failures were exceeded.
            Exception: the quorum failed, or the group-wide vote could not be taken.
        """
        with profiled("torchft::manager::should_commit"):
            return self._should_commit(timeout)

    def _should_commit(self, timeout: timedelta | None) -> bool:
        self.wait_quorum()
        if self._quorum.excluded:
            return self._discard_excluded()
        self._settle_collectives()
        if self.retry_decision().retry:
            self._retry_inflight()
        if self._use_async_quorum:
            # Safe point: after the backward, before the optimizer step; on commit the
            # averaged gradient applies to the healed weights.
            self._heal_all_or_nothing()
        if self._hung is not None and (reason := self._hung.fence()) is not None:
            self.report_error(HungPeerError(reason))
        participation = self._quorum.participation
        vote = local_commit_vote(self.errored(), participation.vote_size, self._min_replica_size)
        decision = self._group_and(vote.should_commit, timeout or self._timeout)
        self._heal.withdraw_stale_offer()
        self._log(
            logging.INFO,
            f"should_commit={decision} (local vote {vote.should_commit}: {vote.reason})",
        )
        if decision:
            self._step += 1
            self._batches_committed += participation.world_size
            self._commit_failures = 0
            self._events.emit(EventKind.COMMIT, participants=participation.world_size)
        else:
            self._commit_failures += 1
            self._discarded_steps += 1
            self._counters.add(steps_discarded=1)
            self._events.emit(
                EventKind.DISCARD,
                participants=participation.world_size,
                reason=vote.reason
                if not vote.should_commit
                else "another rank of the replica group voted no",
            )
            check_commit_failures(self._commit_failures, self._max_retries)
        return decision

    def _discard_excluded(self) -> bool:
        """The step of a group the straggler policy left out: never committed (its weights
        must not diverge from the quorum's, and it consumes no data), not a commit failure
        (``max_retries`` does not count it); every rank of the group got the same answer, so
        no group vote is needed."""
        self._collectives.wait_pending()
        self._log(logging.INFO, "should_commit=False (left out of the quorum: straggler policy)")
        self._discarded_steps += 1
        self._counters.add(steps_discarded=1)
        self._events.emit(
            EventKind.DISCARD,
            participants=0,
            reason="left out of the quorum by the lighthouse's straggler policy",
        )
        return False

    def _settle_collectives(self) -> None:
        self._collectives.wait_pending()
        if self._hung is not None:
            self._hung.disarm()
            self._hung_armed = False
        pg_error = self._pg.errored()
        if pg_error is not None:
            self.report_error(pg_error)

    def retry_decision(self) -> RetryDecision:
        """Whether this step, if it failed in an allreduce, is finished with the survivors at
        ``should_commit`` (``retry_inflight_allreduce``; ``decisions.inflight_retry_decision``).
        ``DistributedDataParallel`` asks after its backward: a retried step keeps its buffers."""
        error = self.errored()
        return inflight_retry_decision(
            enabled=self._retry_enabled,
            first_error=error.original_exception if error is not None else None,
            first_error_is_collective=self._collectives.first_error_is_collective,
            participated=self._participated,
            inputs_kept=self._collectives.inputs_kept,
            retries_done=self._retries_this_step,
            group_world_size=self._group_world_size,
            can_wait_abandoned=self._pg_can_wait_abandoned,
        )

    def _retry_inflight(self) -> None:
        """Finishes a step whose allreduce failed with the groups still alive: waits until
        gloo is done with the failed collectives' tensors, gets a new quorum at the same step,
        and re-runs the step's allreduces from their kept inputs over it. Its participants (a
        group now behind heals and sends zeros) are the step's: the average and
        ``batches_committed`` count exactly them. On failure the step is discarded as usual.

        Raises:
            RuntimeError: gloo did not finish the failed collectives within its timeout (the
                tensors they write into can no longer be trusted).
        """
        decision = self.retry_decision()
        self._log(logging.WARNING, decision.reason)
        self._retries_this_step += 1
        started = time.perf_counter()
        limit = self._timeout + self._pg_timeout()
        if not self._pg.wait_abandoned(limit):
            raise RuntimeError(
                f"the failed collectives did not end within {limit}; their tensors (the "
                "gradients) may still be written: cannot continue"
            )
        self._collectives.begin_retry()
        self._heal.new_step()
        self._quorum.start(
            QuorumRequest(
                step=self._step,
                # As a group that discarded the step would ask: the quorum id changes.
                commit_failures=self._commit_failures + 1,
                allow_heal=True,
                shrink_only=False,
                timeout=self._quorum_timeout,
                manager_state=self.state_dict(),
            )
        )
        try:
            self._quorum.wait_ready()
            self._participated = self.is_participating()
            self._arm_hung_watch()
            self._collectives.replay(
                participants=self._quorum.participation.world_size,
                participating=self._participated,
            )
            self.wait_quorum()
        except Exception as e:  # recorded: the step is discarded
            self.report_error(e)
        self._settle_collectives()
        self._counters.add(steps_retried=1)
        self._log(
            logging.INFO,
            f"retried the step over quorum {self.stats().quorum_id} with "
            f"{self._quorum.participation.world_size} participants in "
            f"{time.perf_counter() - started:.3f} s (error: {self.errored()})",
        )

    def _pg_timeout(self) -> timedelta:
        timeout = self._pg.get_timeout() if isinstance(self._pg, ProcessGroup) else None
        return timeout if timeout is not None else self._timeout

    def _group_and(self, vote: bool, timeout: timedelta) -> bool:
        """The logical AND of this vote over the replica group's ranks (a barrier); a group
        of one rank needs no round trip to its ManagerServer."""
        if self._group_world_size == 1:
            return vote
        return self._client.should_commit(self._group_rank, self._step, vote, timeout=timeout)

    # ---------------------------------------------------------------- state and queries

    def state_dict(self) -> dict[str, int]:
        """The manager's own state (committed step, batches committed) for checkpoints."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores ``state_dict()`` output (e.g. from a disk checkpoint)."""
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def current_step(self) -> int:
        """Number of committed steps."""
        return self._step

    def batches_committed(self) -> int:
        """Sum over committed steps of the participants (2 groups x 5 steps = 10 batches)."""
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """This group's rank among the step's participants (None: spare/healing/no quorum
        yet). Waits for the quorum, not for a heal transfer."""
        if not self._quorum.started:
            return None
        self._quorum.wait_ready()
        return self._quorum.participation.rank

    def num_participants(self) -> int:
        """Number of replica groups participating this step (0 before the first quorum).
        Waits for the quorum, not for a heal transfer."""
        if not self._quorum.started:
            return 0
        self._quorum.wait_ready()
        return self._quorum.participation.world_size

    def is_participating(self) -> bool:
        """Whether this group contributes its gradients this step (not a spare, not healing
        with an async quorum)."""
        if self._quorum.participation.rank is None:
            return False
        return not (self._quorum.healing and self._use_async_quorum)

    def stats(self) -> ManagerStats:
        """A snapshot of what this rank did so far (see ``ManagerStats``). Cheap and safe from
        any thread: it never waits for the quorum (quorum fields are the last completed one's)
        and takes no lock held across I/O."""
        result = self._quorum.result
        speed = result.speed if result is not None else None
        return ManagerStats(
            step=self._step,
            quorum_id=result.quorum_id if result is not None else -1,
            replica_world_size=result.replica_world_size if result is not None else 0,
            num_participants=self._quorum.participation.world_size,
            participating=self.is_participating(),
            commit_failures=self._commit_failures,
            relative_speed=speed.relative_speed if speed is not None else 0.0,
            link_relative_speed=speed.link_relative_speed if speed is not None else 0.0,
            straggler=speed is not None and speed.straggler,
            excluded=speed is not None and speed.excluded,
            **self._counters.snapshot(),
        )

    @property
    def use_async_quorum(self) -> bool:
        """Whether the quorum overlaps the forward (``start_quorum`` returns at once)."""
        return self._use_async_quorum

    @property
    def replica_id(self) -> str:
        """This replica group's id including the per-process uuid suffix."""
        return self._replica_id

    @property
    def settings(self) -> ManagerSettings:
        """The resolved connection settings and where each came from."""
        return self._settings

    def shutdown(self, wait: bool = True) -> None:
        """Stops the checkpoint transport, the ManagerServer (group rank 0) and the quorum
        worker. The process group is the caller's."""
        self._checkpoint_transport.shutdown(wait=wait)
        if self._hung is not None:
            self._hung.close()
        if self._server is not None:
            self._server.shutdown()
        self._quorum.shutdown(wait=wait)
        self._client.close()
        self._events.close()

    def _log(self, level: int, msg: str) -> None:
        # ft_message: a process-wide prefix (TorchTitan's, titan/metrics.py) replaces this one.
        prefix = f"[{self._replica_id} group_rank={self._group_rank} committed_steps={self._step}]"
        logger.log(level, "%s %s", prefix, msg, extra={"ft_message": msg})
