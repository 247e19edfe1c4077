"""The Manager, one per rank of a replica group: the training loop's side of each step's
quorum, healing and commit vote (a façade over the modules beside it).

The step protocol is in docs/architecture.md ("One step"). Who writes which field of the
Manager and of its parts (the training thread reads what the quorum thread wrote once
``_quorum.wait_ready()``/``wait()`` returned; ``stats()`` reads any field at any time):

==============================================================  ==============================
field                                                           written on
==============================================================  ==============================
``_identity``; ``_ledger``'s step, batches, commit failures     the training thread
and discarded steps; ``_progress``'s samples per batch, step
timer and oversize watch; ``_retry``'s retries this step and
``participated``; ``_hung``'s armed flag and its watch's step
clock; ``_quorum``'s futures; ``_collectives``' calls, kept
inputs, pending futures and ``inputs_kept``
``_quorum.result``, ``.participation``, ``.healing``,           the quorum thread (``healing``
``.excluded``, and its last quorum id, announced role,          is reset by ``start_quorum``
straggler flag and state loss                                   first)
``_heal``'s received state and its figures, served flag and     the training thread and the
heal reports                                                    quorum thread, one after the
                                                                other (``Healing``)
``_collectives.usable``                                         the quorum thread, the training
                                                                thread, a failed allreduce's
                                                                callback, the hung-peer watch
                                                                thread (``HungPeerGuard._abort``)
``_hung.watch``'s armed members and long poll                   the training thread (``arm``,
                                                                ``disarm``) and the hung-peer
                                                                watch thread, under its
                                                                condition
``_hung.watch``'s ``supported`` and ``heartbeat_timeout``       the hung-peer watch thread
                                                                (``heartbeat_timeout`` also the
                                                                training thread's ``fence``)
``_collectives``' error, ``_counters``, ``_events``' file       any thread, under their locks
                                                                (the hung-peer watch thread's
                                                                abort included)
everything else                                                 ``__init__`` only
==============================================================  ==============================
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
from torchtitan_ft.manager.decisions import (
    RetryDecision,
    WorldSizeMode,
    heal_needs_group_agreement,
    local_commit_vote,
)
from torchtitan_ft.manager.identity import GroupIdentity
from torchtitan_ft.manager.options import ManagerOptions
from torchtitan_ft.manager.parts import StepRules, open_parts
from torchtitan_ft.manager.quorum import QuorumRequest
from torchtitan_ft.manager.rendezvous import GroupRendezvous
from torchtitan_ft.manager.settings import (
    ManagerSettings,
    overridden_message,
    resolve_manager_settings,
    timeout_values,
)
from torchtitan_ft.manager.state_loss import STATE_LOST_EXIT, StateLostError
from torchtitan_ft.manager.stats import ManagerStats
from torchtitan_ft.manager.step_collectives import ExceptionWithTraceback, profiled
from torchtitan_ft.process_group.base import ProcessGroup, native_reconfigure_available
from torchtitan_ft.process_group.futures import completed_future
from torchtitan_ft.process_group.native import as_manager_group, group_type_line

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")


class Manager:
    """Drives one replica-group rank through quorum, reconfiguration, healing and commit.

    Group rank 0 hosts the replica group's ManagerServer (which talks to the lighthouse) and,
    unless one is already listening there (torchrun's agent store), the group's TCPStore;
    other ranks find the server in that store. Save and restore ``Manager.state_dict()`` with
    periodic checkpoints: it holds the committed step count.

    Args (torchft 0.2.0's, in its order; "A > B > C": argument, else env var, else default):
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
            ``timeout``, ``hostname`` and the job token (``ManagerOptions.auth_token``).
        init_sync: at step 0 every replica group loads the primary's state so all start
            identical (default True); False only when all groups initialise identically.
        max_retries: consecutive failed commits allowed; one more raises RuntimeError from
            ``should_commit``. ``None`` (default) retries forever.
        quorum_retries: retries (with backoff) of a failed lighthouse quorum request by group
            rank 0's ManagerServer before the quorum fails: argument >
            ``TORCHFT_QUORUM_RETRIES`` > 0.
        options: the Manager's own options, beyond torchft's (``ManagerOptions``: the job
            token, the event stream, in-flight retry, ...); default ``ManagerOptions()``, each
            field's own default. Its fields may also be passed as keyword arguments of the
            same names (not both).

    Raises:
        ValueError: bad settings (see ``settings``), ``min_replica_size < 1``, timeouts out
            of the order ``timeouts.RELATIONS`` requires (with ``pg``'s own timeout).
        TypeError: a keyword argument that is no ``ManagerOptions`` field.
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
        options: ManagerOptions | None = None,
        **option_keywords: Any,
    ) -> None:
        options = ManagerOptions.of(options, option_keywords)
        rules = StepRules(
            min_replica_size, world_size_mode, max_retries, init_sync, use_async_quorum
        )
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("pass both load_state_dict and state_dict, or neither")
        hostname = socket.gethostname() if hostname is None else hostname
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
            default_store_host=hostname,
            **options.settings_arguments(),
        )
        pg = as_manager_group(pg, settings.timeout.value)
        pg_timeout = pg.get_timeout() if isinstance(pg, ProcessGroup) else None
        timeouts.check_order(timeout_values(settings, pg_timeout))
        self._settings, self._rules, self._pg = settings, rules, pg
        self._group_rank: int = settings.group_rank.value
        self._identity: Callable[[], GroupIdentity] | None = lambda: GroupIdentity.resolve(
            settings.replica_id.value, options.model_fingerprint, options.num_replica_groups
        )
        parts = open_parts(
            settings,
            options,
            rules,
            pg=pg,
            pg_timeout=pg_timeout,
            hostname=hostname,
            heartbeat_interval=heartbeat_interval,
            checkpoint_transport=checkpoint_transport,
            log=self._log,
        )
        group = parts.group
        self._store, self._server, self._client = group.store, group.server, group.client
        self._replica_id, self._checkpoint_transport = group.replica_id, group.transport
        self._events, self._counters, self._ledger = parts.events, parts.counters, parts.ledger
        self._collectives, self._heal, self._quorum = parts.collectives, parts.healing, parts.quorum
        self._hung, self._retry, self._progress = parts.hung, parts.retry, parts.progress
        _say_started(self._log, settings, self._retry.warning(), group)
        if isinstance(pg, ProcessGroup):
            pg.set_rank_info(self._replica_id, self._group_rank, settings.group_world_size.value)
            if native_reconfigure_available():
                self._log(logging.INFO, group_type_line(pg))
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds one named piece of user state to what healing sends and loads."""
        self._heal.register(key, load_state_dict, state_dict)

    def set_samples_per_batch(self, samples_per_batch: int) -> None:
        """Sets ``samples_per_batch`` (``ManagerOptions``) from the next quorum request on,
        for a trainer that knows its batch size only after it built the Manager (TorchTitan's).

        Raises:
            ValueError: not a positive integer.
        """
        self._progress.set_samples_per_batch(samples_per_batch)

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
        self._retry.new_step()
        self._hung.new_step()
        self._quorum.start(
            QuorumRequest(
                step=self._ledger.step,
                commit_failures=self._ledger.commit_failures,
                allow_heal=allow_heal,
                shrink_only=shrink_only,
                timeout=timeout or self._settings.quorum_timeout.value,
                manager_state=self.state_dict(),
                progress=self._progress.start_step(),
            )
        )
        if not self._rules.use_async_quorum:
            self.wait_quorum()
            self._heal_all_or_nothing()  # safe point: the forward has not started

    def set_checkpoint_step(self, newest: Callable[[], int | None]) -> None:
        """Where the job keeps disk checkpoints of its per-step state (steps as the Manager's):
        ``newest`` gives the newest complete one's step (None: none yet), read when a quorum
        reports the state lost (``on_state_loss="checkpoint"``). Set before ``start_quorum``."""
        self._quorum.checkpoint_step = newest

    def wait_quorum(self) -> None:
        """Blocks until this step's quorum, reconfiguration and heal transfer are done.

        Raises:
            RuntimeError: ``start_quorum`` was never called.
            Exception: the quorum itself failed (e.g. TimeoutError: no lighthouse answer).
            SystemExit: ``STATE_LOST_EXIT``, the job's state is lost and ``on_state_loss``
                says stop for this quorum (``state_loss_action``; the Manager is shut down).
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
        if result is not None and heal_needs_group_agreement(
            self._ledger.step, result, self._rules.init_sync
        ):
            self._heal.apply_all_or_nothing(
                healing=self._quorum.healing,
                group_and=lambda received: self._group_and(received, self._settings.timeout.value),
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
        self._progress.timer.collective(time.monotonic())
        try:
            self._quorum.wait_ready()
        except Exception as e:  # recorded: the step is discarded, the future completes
            self.report_error(e)
            return completed_future(tensor)
        if self._quorum.excluded:
            # Left out of the quorum: the step runs alone and is not committed; the tensor
            # keeps this group's own values.
            return completed_future(tensor)
        self._retry.participated = self.is_participating()
        self._hung.arm(self._quorum.result)
        return self._collectives.allreduce(
            tensor,
            participants=self._quorum.participation.world_size,
            participating=self.is_participating(),
            should_quantize=should_quantize,
            reduce_op=reduce_op,
        )

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
        if self.retry_decision().retry:  # ``retry.InflightRetry.run``
            self._retry.run(
                self.state_dict(),
                self._ledger.commit_failures,
                wait_quorum=self.wait_quorum,
                is_participating=self.is_participating,
                settle=self._settle_collectives,
            )
        if self._rules.use_async_quorum:
            # Safe point: after the backward, before the optimizer step; on commit the
            # averaged gradient applies to the healed weights.
            self._heal_all_or_nothing()
        self._hung.fence()
        participation = self._quorum.participation
        vote = local_commit_vote(
            self.errored(), participation.vote_size, self._rules.min_replica_size
        )
        decision = self._group_and(vote.should_commit, timeout or self._settings.timeout.value)
        self._heal.withdraw_stale_offer()
        self._log(
            logging.INFO,
            f"should_commit={decision} (local vote {vote.should_commit}: {vote.reason})",
        )
        self._ledger.record_vote(decision, participation.world_size, vote)
        return decision

    def _discard_excluded(self) -> bool:
        """The step of a group the straggler policy left out: never committed (its weights
        must not diverge from the quorum's, and it consumes no data), not a commit failure
        (``max_retries`` does not count it); every rank of the group got the same answer, so
        no group vote is needed."""
        self._collectives.wait_pending()
        self._log(logging.INFO, "should_commit=False (left out of the quorum: straggler policy)")
        self._ledger.discard(
            0, "left out of the quorum by the lighthouse's straggler policy", failed=False
        )
        return False

    def _settle_collectives(self) -> None:
        self._collectives.wait_pending()
        self._hung.disarm()
        pg_error = self._pg.errored()
        if pg_error is not None:
            self.report_error(pg_error)

    def retry_decision(self) -> RetryDecision:
        """Whether this step, if it failed in an allreduce, is finished with the survivors at
        ``should_commit`` (``retry_inflight_allreduce``; ``decisions.inflight_retry_decision``).
        ``DistributedDataParallel`` asks after its backward: a retried step keeps its buffers."""
        return self._retry.decision()

    def _group_and(self, vote: bool, timeout: timedelta) -> bool:
        """The logical AND of this vote over the replica group's ranks (a barrier); a group
        of one rank needs no round trip to its ManagerServer."""
        if self._settings.group_world_size.value == 1:
            return vote
        return self._client.should_commit(
            self._group_rank, self._ledger.step, vote, timeout=timeout
        )

    # ---------------------------------------------------------------- state and queries

    def state_dict(self) -> dict[str, int]:
        """The manager's own state (committed step, batches committed) for checkpoints."""
        return self._ledger.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores ``state_dict()`` output (e.g. from a disk checkpoint)."""
        self._ledger.load_state_dict(state_dict)

    def current_step(self) -> int:
        """Number of committed steps."""
        return self._ledger.step

    def batches_committed(self) -> int:
        """Sum over committed steps of the participants (2 groups x 5 steps = 10 batches)."""
        return self._ledger.batches_committed

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
        return not (self._quorum.healing and self._rules.use_async_quorum)

    def stats(self) -> ManagerStats:
        """A snapshot of what this rank did so far (see ``ManagerStats``). Cheap and safe from
        any thread: it never waits for the quorum (quorum fields are the last completed one's)
        and takes no lock held across I/O."""
        result = self._quorum.result
        speed = result.speed if result is not None else None
        return ManagerStats(
            step=self._ledger.step,
            quorum_id=result.quorum_id if result is not None else -1,
            replica_world_size=result.replica_world_size if result is not None else 0,
            num_participants=self._quorum.participation.world_size,
            participating=self.is_participating(),
            commit_failures=self._ledger.commit_failures,
            relative_speed=speed.relative_speed if speed is not None else 0.0,
            link_relative_speed=speed.link_relative_speed if speed is not None else 0.0,
            straggler=speed is not None and speed.straggler,
            excluded=speed is not None and speed.excluded,
            **self._counters.snapshot(),
        )

    @property
    def use_async_quorum(self) -> bool:
        """Whether the quorum overlaps the forward (``start_quorum`` returns at once)."""
        return self._rules.use_async_quorum

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
        self._hung.close()
        if self._server is not None:
            self._server.shutdown()
        self._quorum.shutdown(wait=wait)
        self._client.close()
        self._events.close()

    def _log(self, level: int, msg: str) -> None:
        # ft_message: a process-wide prefix (TorchTitan's, titan/metrics.py) replaces this one.
        step, rank = self._ledger.step, self._group_rank
        prefix = f"[{self._replica_id} group_rank={rank} committed_steps={step}]"
        logger.log(level, "%s %s", prefix, msg, extra={"ft_message": msg})


def _say_started(
    log: Callable[[int, str], None],
    settings: ManagerSettings,
    retry_warning: str | None,
    group: GroupRendezvous,
) -> None:
    """The settings in the log (a warning when an argument beat a ``TORCHFT_*`` variable,
    or when the in-flight retry cannot run)."""
    log(
        logging.INFO,
        f"settings: {settings.describe()}; manager server {group.manager_address}, "
        f"store {group.store_address}",
    )
    for warning in (overridden_message(settings, os.environ), retry_warning):
        if warning is not None:
            log(logging.WARNING, warning)
