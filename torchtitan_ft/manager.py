"""The Manager: one per rank of a replica group, driving the per-step fault-tolerance protocol.

One step, as the training loop sees it (``OptimizerWrapper`` does the first and last call)::

    manager.start_quorum()       # async: ask the lighthouse (via the group's ManagerServer)
    loss = model(batch)          #   ... overlapped with the forward
    loss.backward()              # DDP hook: manager.allreduce(grads) waits for the quorum
    if manager.should_commit():  # local vote, then AND over the replica group
        optimizer.step()

What happens on the quorum worker thread (``_run_quorum``): reconfigure the cross-group process
group when the quorum id changed (store prefix per quorum id), offer our state to peers that heal
from us, and, when we are behind, *receive* a healthy peer's state into a pending buffer. The
received state is applied only at a safe point on the caller's thread -- at the start of
``should_commit`` (async quorum: after backward, before the optimizer step) or inside
``start_quorum`` (sync quorum: before the forward) -- never while a forward may be reading the
parameters (torchtitan PR #4754). A heal that fails is an error like any other: the step is not
committed, our step counter stays behind, and the next quorum heals again.

Errors are data: a failed collective, reconfiguration or heal is recorded with ``report_error``;
later collectives of the step are no-ops that return their input; ``should_commit`` votes no and
the step is discarded. Only a failed quorum (no lighthouse answer in time) or a broken replica
group (the ShouldCommit barrier fails) raise, because then no step can be taken at all.

What happened is observable at no cost to the step: ``Manager.stats()`` returns a
``ManagerStats`` snapshot (quorum, participation, commit failures, heals and their bytes and
seconds, bytes handed to the cross-group allreduce) from counters the Manager keeps anyway.

The decisions are small pure functions in ``torchtitan_ft.step_decisions``
(``compute_participation``, ``local_commit_vote``, ``check_commit_failures``,
``quorum_store_address``, ``global_ranks``), tested without servers.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions

from torchtitan_ft.addresses import advertised_store_host
from torchtitan_ft.checkpoint import CheckpointTransport, HTTPTransport
from torchtitan_ft.config_env import (
    MANAGER_PORT_ENV,
    ManagerSettings,
    Resolved,
    Source,
    resolve_manager_settings,
    store_key_prefix,
)
from torchtitan_ft.futures import completed_future, future_with_timeout
from torchtitan_ft.manager_server import AddressInUseError, ManagerClient, ManagerServer
from torchtitan_ft.quantization import quantized_allreduce
from torchtitan_ft.quorum_results import GroupIdentity
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

if TYPE_CHECKING:
    from torchtitan_ft.quorum_results import QuorumResult

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class ExceptionWithTraceback(Exception):
    """An error recorded by ``report_error``, with the traceback where it was caught."""

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace: str = "".join(traceback.format_exception(e))
        super().__init__(f"{type(e).__name__}: {e}")


@dataclass(frozen=True)
class ManagerStats:
    """What the Manager did so far, as of the last completed quorum (``Manager.stats()``).

    Counters are cumulative since the Manager was created; heal and allreduce sizes are the
    payload (tensor bytes), not the bytes on the wire.
    """

    step: int
    """Committed steps."""
    quorum_id: int
    """Id of the last quorum this rank received; -1 before the first."""
    replica_world_size: int
    """Replica groups in the last quorum, including healing ones and spares."""
    num_participants: int
    """Replica groups whose gradients were averaged in the last quorum's step."""
    participating: bool
    """Whether this group contributed its gradients in the last quorum's step."""
    commit_failures: int
    """Consecutive failed commits now (what the lighthouse is told)."""
    steps_discarded: int
    """Steps that did not commit."""
    heal_count: int
    """Healed states this rank applied."""
    last_heal_seconds: float
    """Transfer plus load time of the last applied heal (0.0 before any)."""
    heal_seconds: float
    """Transfer plus load time of every applied heal."""
    heal_bytes_received: int
    """Tensor bytes of the states this rank received from donors (also ones not applied)."""
    heal_bytes_sent: int
    """Tensor bytes of the state this rank served as donor, once per healing peer."""
    allreduce_bytes: int
    """Tensor bytes handed to the cross-group allreduce (before any quantization)."""


@dataclass
class _Counters:
    """The mutable counters behind ``ManagerStats`` (guarded by ``Manager._stats_lock``)."""

    steps_discarded: int = 0
    heal_count: int = 0
    last_heal_seconds: float = 0.0
    heal_seconds: float = 0.0
    heal_bytes_received: int = 0
    heal_bytes_sent: int = 0
    allreduce_bytes: int = 0


def tensor_bytes(value: Any) -> int:
    """Total bytes of the tensors in a nested dict/list/tuple (a DTensor: its local shard)."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def model_fingerprint(modules: torch.nn.Module | Iterable[torch.nn.Module]) -> str:
    """A short fingerprint of a model's parameter names, global shapes and dtypes, e.g.
    ``"ab12cd34: 10 params / 6.1M elements"``; equal models give equal fingerprints.

    For the Manager's ``model_fingerprint`` argument. Shapes are global (a DTensor's
    ``shape``), so groups sharded differently inside still agree; a meta-device model works.
    """
    parts = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    digest = hashlib.sha1()
    params = elements = 0
    for index, part in enumerate(parts):
        for name, param in part.named_parameters():
            digest.update(f"{index}.{name}:{tuple(param.shape)}:{param.dtype};".encode())
            params += 1
            elements += param.numel()
    return f"{digest.hexdigest()[:8]}: {params} params / {_human(elements)} elements"


def _human(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def port_in_use_message(port: Resolved[int], bind: str) -> str:
    """One line for a ManagerServer port that is taken: which port, where it was set, what to
    do."""
    if port.source is Source.ENV:
        origin = f"from {port.env_var}={port.value}"
    else:
        origin = f"from the Manager's port={port.value} argument"
    return (
        f"manager server port {port.value} ({origin}) is already in use ({bind}); stop the "
        f"process listening there or choose a free port (leave {MANAGER_PORT_ENV} unset and "
        "port=None to pick one automatically)"
    )


# --------------------------------------------------------------------------------------------
# The Manager


class Manager:
    """Drives one replica-group rank through quorum, reconfiguration, healing and commit.

    Group rank 0 hosts the replica group's ManagerServer (which talks to the lighthouse) and,
    unless one is already listening there (torchrun's agent store), the group's TCPStore. Other
    ranks find the server's address in that store.

    When saving periodic checkpoints, save and restore ``Manager.state_dict()`` too: it holds
    the committed step count that healing and the quorum rely on.
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        auth_token: str | None = None,
        model_fingerprint: str | Callable[[], str] | None = None,
        num_replica_groups: int | None = None,
    ) -> None:
        """
        Args:
            pg: the reconfigurable cross-replica-group process group (e.g. ``ProcessGroupGloo``);
                reconfigured by the manager whenever the quorum id changes.
            load_state_dict: loads the user state received from a peer when healing. Called
                on the training thread at a safe point (see module doc). ``None``: register
                one later with ``register_state_dict_fn``.
            state_dict: returns the user state offered to healing peers (called on the quorum
                thread). ``None``: register later.
            min_replica_size: minimum number of participating replica groups for a step to
                commit (and the participant cap under FIXED_WITH_SPARES).
            use_async_quorum: run the quorum on a worker thread overlapped with the forward
                (default True). With False, ``start_quorum`` blocks and a healing replica
                applies the received state before its forward and participates at once.
            timeout: default for collectives, ``wrap_future``, the ShouldCommit and
                CheckpointMetadata RPCs and checkpoint transfers (default 60 s).
            quorum_timeout: how long ``start_quorum`` waits for the lighthouse to issue a
                quorum (default 60 s); raise it for LocalSGD/DiLoCo with long sync intervals.
            connect_timeout: for connecting to the ManagerServer, lighthouse and TCPStore
                (default 60 s).
            rank: rank inside the replica group. Argument > env ``RANK`` > 0.
            world_size: ranks in the replica group. Argument > env ``WORLD_SIZE`` > 1.
            world_size_mode: ``WorldSizeMode.DYNAMIC`` (default) or ``FIXED_WITH_SPARES``.
            store_addr: host of the replica group's TCPStore. Argument > env ``MASTER_ADDR``
                > ``hostname``. Other replica groups dial it, so it must be reachable by them;
                a loopback name (torchrun sets ``MASTER_ADDR=localhost`` on many machines) is
                advertised to them as ``hostname`` unless that is loopback too.
            store_port: port of that store. Argument > env ``MASTER_PORT`` > 0 (group rank 0
                hosts a store on a free port; allowed only for 1-rank groups).
            lighthouse_addr: lighthouse URL, used by group rank 0. Argument > env
                ``TORCHFT_LIGHTHOUSE`` > ``http://localhost:29510``.
            replica_id: replica group id, used by group rank 0. Argument > env
                ``REPLICA_GROUP_ID`` > "" . A per-process uuid is always appended
                (``"{replica_id}:{uuid}"``) so that a restarted replica joins as a new member.
                Trailing digits of the id give the group number used for global ranks.
            port: ManagerServer port on group rank 0. Argument > env ``TORCHFT_MANAGER_PORT``
                > 0 (a free port).
            hostname: the name other replica groups use to reach this one's ManagerServer and
                checkpoint server (default ``socket.gethostname()``). A loopback name
                (``127.0.0.1``/``localhost``) also makes the servers bind loopback only.
            heartbeat_interval: how often group rank 0 heartbeats the lighthouse (default 100 ms).
            checkpoint_transport: how state moves to healing peers; default ``HTTPTransport``
                with ``timeout``, ``hostname`` and ``auth_token``.
            init_sync: at step 0, make every replica group load the primary's state so all
                start identical (default True). Pass False only when all groups initialise
                identically (e.g. same seed).
            max_retries: consecutive failed commits allowed; one more raises RuntimeError from
                ``should_commit``. ``None`` (default) retries forever.
            quorum_retries: how many times group rank 0's ManagerServer retries a failed
                lighthouse quorum request (with backoff) before the quorum fails (default 0).
            auth_token: optional job token. The ManagerServer's Kill RPC and the default
                checkpoint transport only answer requests that carry it. Not read from env.
            model_fingerprint: what model this group trains (e.g. ``model_fingerprint(model)``),
                or a function returning it, called once at the first ``start_quorum`` (when the
                model exists). Group rank 0 sends it to the lighthouse, and a group whose
                fingerprint differs from a live group's fails its first quorum with
                ``ReplicaGroupMismatchError``. Default ``None``: not checked.
            num_replica_groups: the planned number of replica groups (TorchTitan's
                ``fault_tolerance.group_size``), checked the same way. Default ``None``: not
                checked. A replica id that a live group already uses is always refused.

        Raises:
            ValueError: bad settings (see ``torchtitan_ft.config_env``), ``min_replica_size < 1``.
            AddressInUseError: the ManagerServer's ``port`` (or ``TORCHFT_MANAGER_PORT``) is
                taken; the message says where the port came from.
        """
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        if not isinstance(world_size_mode, WorldSizeMode):
            raise TypeError(f"world_size_mode must be a WorldSizeMode, got {world_size_mode!r}")
        if max_retries is not None and max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")

        settings = resolve_manager_settings(
            env=os.environ,
            lighthouse_addr=lighthouse_addr,
            port=port,
            replica_id=replica_id,
            store_addr=store_addr,
            store_port=store_port,
            rank=rank,
            world_size=world_size,
            default_store_host=hostname,
        )
        self._settings: ManagerSettings = settings
        self._group_rank: int = settings.group_rank.value
        self._group_world_size: int = settings.group_world_size.value
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._timeout = timeout
        self._quorum_timeout = quorum_timeout
        self._connect_timeout = connect_timeout
        self._world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._pg = pg
        self._model_fingerprint = model_fingerprint
        self._num_replica_groups = num_replica_groups

        self._load_state_dict_fns: dict[str, Callable[[Any], None]] = {}
        self._user_state_dict_fns: dict[str, Callable[[], Any]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        elif (load_state_dict is None) != (state_dict is None):
            raise ValueError("pass both load_state_dict and state_dict, or neither")

        # Step state: changed only on the training thread, except where noted.
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._errored: ExceptionWithTraceback | None = None
        self._error_lock = threading.Lock()
        self._healing = False
        self._pending_state_dict: dict[str, Any] | None = None
        self._pending_work: list[torch.futures.Future[Any]] = []
        self._participation = Participation(rank=None, world_size=0, vote_size=0)
        self._quorum_result: QuorumResult | None = None
        self._collectives_ready: concurrent.futures.Future[None] | None = None
        self._served_this_step = False
        self._pg_usable = False
        self._quorum_future: concurrent.futures.Future[None] | None = None
        self._identity_sent = False
        self._pending_receive_seconds = 0.0
        self._counters = _Counters()
        self._stats_lock = threading.Lock()  # held for a few assignments only, never across I/O
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="torchft_quorum"
        )

        # torchrun's MASTER_ADDR is often "localhost": the store is then on this machine, and
        # other machines must be told to dial `hostname` (torchtitan_ft.addresses).
        store_host = advertised_store_host(settings.store_addr.value, hostname)
        self._store = _open_store(
            store_host,
            settings.store_port.value,
            host_it=self._group_rank == 0,
            timeout=connect_timeout,
        )
        store_address = f"{store_host}:{self._store.port}"
        key_prefix = store_key_prefix(os.environ)

        self._server: ManagerServer | None = None
        if self._group_rank == 0:
            base_id = settings.replica_id.value
            full_id = f"{base_id}:{uuid.uuid4()}" if base_id else str(uuid.uuid4())
            bind_host = "127.0.0.1" if hostname in _LOOPBACK_HOSTS else "[::]"
            try:
                self._server = ManagerServer(
                    replica_id=full_id,
                    lighthouse_addr=settings.lighthouse_addr.value,
                    hostname=hostname,
                    bind=f"{bind_host}:{settings.manager_port.value}",
                    store_addr=store_address,
                    world_size=self._group_world_size,
                    heartbeat_interval=heartbeat_interval,
                    connect_timeout=connect_timeout,
                    quorum_retries=quorum_retries,
                    auth_token=auth_token,
                )
            except AddressInUseError as e:
                message = port_in_use_message(settings.manager_port, e.bind)
                raise AddressInUseError(e.bind, message) from None
        try:
            if self._server is not None:
                self._store.set(key_prefix + MANAGER_ADDR_KEY, self._server.address())
                self._store.set(key_prefix + REPLICA_ID_KEY, full_id)
            manager_address = self._store.get(key_prefix + MANAGER_ADDR_KEY).decode()
            self._replica_id: str = self._store.get(key_prefix + REPLICA_ID_KEY).decode()
            self._client = ManagerClient(manager_address, connect_timeout=connect_timeout)
            if checkpoint_transport is None:
                checkpoint_transport = HTTPTransport(
                    timeout=timeout, num_chunks=0, hostname=hostname, auth_token=auth_token
                )
        except BaseException:
            if self._server is not None:
                self._server.shutdown()
            raise
        self._checkpoint_transport: CheckpointTransport = checkpoint_transport

        self._log(
            logging.INFO,
            f"settings: {settings.describe()}; manager server {manager_address}, "
            f"store {store_address}",
        )

    # ---------------------------------------------------------------- state dict registration

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds one named piece of user state to what healing sends and loads."""
        if key in self._load_state_dict_fns:
            raise ValueError(f"state dict fn {key!r} is already registered")
        self._load_state_dict_fns[key] = load_state_dict
        self._user_state_dict_fns[key] = state_dict

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Sets the ``"default"`` user state functions (torchft compatibility)."""
        self._load_state_dict_fns.pop("default", None)
        self._user_state_dict_fns.pop("default", None)
        self.register_state_dict_fn("default", load_state_dict, state_dict)

    # ---------------------------------------------------------------- quorum

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: timedelta | None = None,
    ) -> None:
        """Starts this step's quorum; call at the start of every step (``OptimizerWrapper``
        calls it from ``zero_grad``).

        Args:
            allow_heal: heal this replica if it is behind (all replicas must pass the same).
            shrink_only: ask for a quorum of the previous members only (no newcomers).
            timeout: how long to wait for the lighthouse; default ``quorum_timeout``.
        """
        if self._quorum_future is not None:
            # The previous quorum's failure was already raised to the caller (wait_quorum or
            # should_commit); a fresh quorum is the retry.
            concurrent.futures.wait([self._quorum_future])
        if not self._identity_sent:
            self._send_identity()
        self._errored = None
        self._healing = False
        self._pending_state_dict = None
        self._pending_work = []
        self._served_this_step = False
        self._pg_usable = False
        self._collectives_ready = concurrent.futures.Future()
        self._quorum_future = self._executor.submit(
            self._run_quorum, allow_heal, shrink_only, timeout or self._quorum_timeout
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            self._heal_all_or_nothing()  # safe point: the forward has not started

    def _send_identity(self) -> None:
        """Hands this group's identity to its ManagerServer (group rank 0) before the first
        quorum; the fingerprint function runs here, on the caller's thread, once."""
        self._identity_sent = True
        if self._server is None:
            return
        fingerprint = self._model_fingerprint
        self._server.set_identity(
            GroupIdentity(
                replica=self._settings.replica_id.value,
                model=fingerprint() if callable(fingerprint) else fingerprint,
                group_size=self._num_replica_groups,
            )
        )

    def wait_quorum(self) -> None:
        """Blocks until this step's quorum, reconfiguration and heal transfer are done.

        Raises:
            RuntimeError: ``start_quorum`` was never called.
            Exception: the quorum itself failed (e.g. TimeoutError: no lighthouse answer).
        """
        if self._quorum_future is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        self._quorum_future.result()

    def _run_quorum(self, allow_heal: bool, shrink_only: bool, timeout: timedelta) -> None:
        """Quorum worker, in two phases. Phase 1 (quorum, participation, reconfigure) releases
        the step's collectives; phase 2 (the heal transfer) runs while they proceed, so
        neither a donor nor a healing replica waits for the transfer before its allreduce.
        Errors other than the quorum RPC's are recorded, not raised."""
        ready = self._collectives_ready
        try:
            result = self._client._quorum(
                group_rank=self._group_rank,
                step=self._step,
                checkpoint_metadata=self._checkpoint_transport.metadata(),
                shrink_only=shrink_only,
                init_sync=self._init_sync,
                commit_failures=self._commit_failures,
                timeout=timeout,
            )
            self._quorum_result = result
            self._participation = compute_participation(
                result,
                use_async_quorum=self._use_async_quorum,
                allow_heal=allow_heal,
                init_sync=self._init_sync,
                world_size_mode=self._world_size_mode,
                min_replica_size=self._min_replica_size,
            )
            self._healing = allow_heal and result.heal
            self._pg_usable = True
            if result.quorum_id != self._quorum_id and not self._reconfigure(result):
                self._pg_usable = False
                return
        except BaseException as e:
            ready.set_exception(e)
            raise
        finally:
            if not ready.done():
                ready.set_result(None)
        if allow_heal:
            self._exchange_state(result)

    def _wait_collectives_ready(self) -> None:
        """Blocks until this step's quorum and reconfiguration (not the heal transfer) are
        done; raises what the quorum raised."""
        if self._collectives_ready is None:
            raise RuntimeError("a collective was started before start_quorum()")
        self._collectives_ready.result()

    def _reconfigure(self, result: QuorumResult) -> bool:
        prefixed = quorum_store_address(result.store_address, result.quorum_id, self._group_rank)
        self._log(
            logging.INFO,
            f"reconfiguring for quorum {result.quorum_id}: replica rank "
            f"{result.replica_rank}/{result.replica_world_size}, store {prefixed}",
        )
        try:
            self._pg.configure(
                prefixed,
                self._replica_id,
                result.replica_rank,
                result.replica_world_size,
                result.quorum_id,
                self._group_rank,
                self._group_world_size,
                global_ranks(result.replica_ids, self._group_world_size, self._group_rank),
            )
        except Exception as e:  # recorded: the step is discarded, the next quorum retries
            self.report_error(e)
            return False
        self._quorum_id = result.quorum_id
        return True

    def _exchange_state(self, result: QuorumResult) -> None:
        """Offers our state to peers healing from us; receives ours if we heal (not applied)."""
        try:
            if result.recover_dst_replica_ranks:
                self._log(
                    logging.INFO,
                    f"serving step {result.max_step} to replica ranks "
                    f"{result.recover_dst_replica_ranks}",
                )
                self._served_this_step = True
                state = self._manager_state_dict()
                self._checkpoint_transport.send_checkpoint(
                    dst_ranks=result.recover_dst_replica_ranks,
                    step=result.max_step,
                    state_dict=state,
                    timeout=self._timeout,
                )
                sent = tensor_bytes(state) * len(result.recover_dst_replica_ranks)
                with self._stats_lock:
                    self._counters.heal_bytes_sent += sent
            if result.heal:
                start = time.perf_counter()
                self._pending_state_dict = self._receive_state(result)
                self._pending_receive_seconds = time.perf_counter() - start
        except Exception as e:  # recorded: a failed heal discards the step; next quorum retries
            self.report_error(e)

    def _receive_state(self, result: QuorumResult) -> dict[str, Any]:
        src_rank = result.recover_src_replica_rank
        if src_rank is None:
            raise RuntimeError(f"quorum {result.quorum_id} says heal but names no source rank")
        self._log(
            logging.INFO,
            f"healing to step {result.max_step} from replica rank {src_rank} "
            f"({result.recover_src_manager_address})",
        )
        source = ManagerClient(
            result.recover_src_manager_address, connect_timeout=self._connect_timeout
        )
        try:
            metadata = source._checkpoint_metadata(self._group_rank, timeout=self._timeout)
        finally:
            source.close()
        state = self._checkpoint_transport.recv_checkpoint(
            src_rank=src_rank, metadata=metadata, step=result.max_step, timeout=self._timeout
        )
        received = tensor_bytes(state)
        with self._stats_lock:
            self._counters.heal_bytes_received += received
        _check_healed_state(state, self._load_state_dict_fns.keys(), result.max_step)
        return cast(dict[str, Any], state)

    def _heal_all_or_nothing(self) -> None:
        """Applies received state if every rank of the replica group received its own
        (training thread only; a group-wide AND when the group may heal).

        All or nothing, so a group's ranks never end up at different steps; and independent
        of the step's commit vote, so replicas behind can catch up even while too few
        replicas are at the max step for any step to commit (otherwise a livelock).
        """
        result = self._quorum_result
        if result is None or not heal_needs_group_agreement(self._step, result, self._init_sync):
            return
        received = not self._healing or self._pending_state_dict is not None
        if not self._group_and(received, self._timeout):
            if received:
                self.report_error(RuntimeError("another rank of this replica group failed to heal"))
            return
        pending, self._pending_state_dict = self._pending_state_dict, None
        if pending is None:
            return
        start = time.perf_counter()
        try:
            for key, load in self._load_state_dict_fns.items():
                load(pending["user"][key])
            self.load_state_dict(pending["torchft"])
        except Exception as e:
            # The other ranks applied theirs: this group can no longer be made consistent.
            raise RuntimeError(
                f"every rank of the replica group received its healed state but this rank "
                f"could not load it: {e}; is the model the same in every group?"
            ) from e
        seconds = self._pending_receive_seconds + time.perf_counter() - start
        with self._stats_lock:
            self._counters.heal_count += 1
            self._counters.last_heal_seconds = seconds
            self._counters.heal_seconds += seconds
        self._log(logging.INFO, f"applied healed state of step {self._step} ({seconds:.3f} s)")

    def _manager_state_dict(self) -> dict[str, Any]:
        if not self._user_state_dict_fns:
            raise RuntimeError(
                "a peer needs to heal from this replica but no state_dict function is "
                "registered (pass state_dict= or call register_state_dict_fn)"
            )
        return {
            "user": {key: fn() for key, fn in self._user_state_dict_fns.items()},
            "torchft": self.state_dict(),
        }

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
            should_quantize: send int8 blocks with fp32 scales instead of full precision
                (``torchtitan_ft.quantization``: about a quarter of the bytes, error bounded
                by half a quantization step per block); ``SUM`` and ``AVG`` only.
            reduce_op: ``ReduceOp.AVG`` (floating point only), ``SUM``, ``MAX`` or ``MIN``.
        """
        if reduce_op == ReduceOp.AVG and not torch.is_floating_point(tensor):
            raise TypeError(f"ReduceOp.AVG needs a floating point tensor, got {tensor.dtype}")
        if should_quantize and reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"should_quantize supports ReduceOp.SUM and AVG, got {reduce_op}")
        try:
            self._wait_collectives_ready()
            if self.errored() is not None and not self._join_despite_error():
                return completed_future(tensor)
            num_participants = self._participation.world_size
            if num_participants < 1:
                raise RuntimeError("quorum has no participants; cannot average")
            if not self.is_participating():
                tensor.zero_()
            with self._stats_lock:
                self._counters.allreduce_bytes += tensor.numel() * tensor.element_size()
            if should_quantize:
                fut = quantized_allreduce(tensor, self._pg, ReduceOp.SUM)
            else:
                opts = AllreduceOptions()
                opts.reduceOp = ReduceOp.SUM if reduce_op == ReduceOp.AVG else reduce_op
                fut = self._pg.allreduce([tensor], opts).get_future()
        except Exception as e:  # recorded: the step is discarded, the future completes
            self.report_error(e)
            return completed_future(tensor)

        def normalize(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()  # raises the collective's error, swallowed by wrap_future
            except Exception:
                # Peers blocked on this replica (a ring passes through it) fail now instead
                # of at their timeout.
                self._pg_usable = False
                self._pg.abort()
                raise
            if reduce_op == ReduceOp.AVG:
                tensor.div_(num_participants)
            return tensor

        return self.wrap_future(fut.then(normalize), tensor)

    def _join_despite_error(self) -> bool:
        """This step already failed here; decides whether to still run a collective.

        Peers would otherwise wait for this replica until the timeout. A non-participant
        (healing, spare) contributes zeros anyway, so it joins while the group works. A
        participant cannot join (its zeros would skew the peers' average): it aborts the
        group so peers fail at once and discard the step too. A broken group is left alone.
        """
        if not self._pg_usable or self._pg.errored() is not None:
            return False
        if not self.is_participating():
            return True
        self._pg_usable = False
        self._pg.abort()
        return False

    def report_error(self, e: BaseException) -> None:
        """Records an error for this step: the step will not commit and the process group is
        rebuilt on the next quorum. The first error of a step is kept (the root cause)."""
        with self._error_lock:
            first = self._errored is None
            if first:
                self._errored = ExceptionWithTraceback(e)
        self._log(
            logging.WARNING,
            f"{'error' if first else 'further error'} this step: {type(e).__name__}: {e}",
        )

    def errored(self) -> ExceptionWithTraceback | None:
        """The error recorded this step, or None."""
        return self._errored

    def wrap_future(
        self,
        fut: torch.futures.Future[T],
        default: T,
        timeout: timedelta | None = None,
    ) -> torch.futures.Future[T]:
        """A future that completes like ``fut``, or with ``default`` if ``fut`` fails or does
        not complete within ``timeout`` (default: the manager's ``timeout``); the error is
        recorded with ``report_error``. ``should_commit`` waits for these futures."""

        def swallow(f: torch.futures.Future[T]) -> T:
            try:
                return f.value()
            except Exception as e:  # recorded: errors are data
                self.report_error(e)
                return default

        wrapped = future_with_timeout(fut, timeout or self._timeout).then(swallow)
        self._pending_work.append(wrapped)
        return wrapped

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
        self.wait_quorum()
        for work in self._pending_work:
            work.wait()  # never raises: wrap_future swallows errors
        self._pending_work = []
        pg_error = self._pg.errored()
        if pg_error is not None:
            self.report_error(pg_error)
        if self._use_async_quorum:
            # Safe point: after the backward, before the optimizer step; on commit the
            # averaged gradient applies to the healed weights.
            self._heal_all_or_nothing()
        vote = local_commit_vote(
            self._errored, self._participation.vote_size, self._min_replica_size
        )
        decision = self._group_and(vote.should_commit, timeout or self._timeout)
        if not self._served_this_step:
            # An offer is withdrawn one step late: healers of the quorum that made it may
            # still be fetching after the donor commits (the donor does not wait for them),
            # and none can join the next quorum (which this commit needed) before finishing.
            self._checkpoint_transport.disallow_checkpoint()
        self._log(
            logging.INFO,
            f"should_commit={decision} (local vote {vote.should_commit}: {vote.reason})",
        )
        if decision:
            self._step += 1
            self._batches_committed += self._participation.world_size
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            with self._stats_lock:
                self._counters.steps_discarded += 1
            check_commit_failures(self._commit_failures, self._max_retries)
        return decision

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
        if self._quorum_future is None:
            return None
        self._wait_collectives_ready()
        return self._participation.rank

    def num_participants(self) -> int:
        """Number of replica groups participating this step (0 before the first quorum).
        Waits for the quorum, not for a heal transfer."""
        if self._quorum_future is None:
            return 0
        self._wait_collectives_ready()
        return self._participation.world_size

    def is_participating(self) -> bool:
        """Whether this group contributes its gradients this step (not a spare, not healing
        with an async quorum)."""
        if self._participation.rank is None:
            return False
        return not (self._healing and self._use_async_quorum)

    def stats(self) -> ManagerStats:
        """A snapshot of what this rank did so far (see ``ManagerStats``). Cheap and safe from
        any thread: it never waits for the quorum (quorum fields are the last completed one's)
        and takes no lock held across I/O."""
        result = self._quorum_result
        with self._stats_lock:
            counters = replace(self._counters)
        return ManagerStats(
            step=self._step,
            quorum_id=result.quorum_id if result is not None else -1,
            replica_world_size=result.replica_world_size if result is not None else 0,
            num_participants=self._participation.world_size,
            participating=self.is_participating(),
            commit_failures=self._commit_failures,
            **asdict(counters),
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
        if self._server is not None:
            self._server.shutdown()
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._client.close()

    def _log(self, level: int, msg: str) -> None:
        logger.log(level, "[%s/%d step %d] %s", self._replica_id, self._group_rank, self._step, msg)


def _check_healed_state(state: Any, keys: Any, step: int) -> None:
    """Rejects a received state that cannot be applied whole (before anything is loaded)."""
    if not isinstance(state, dict) or "user" not in state or "torchft" not in state:
        raise RuntimeError("received checkpoint lacks the 'user' and 'torchft' parts")
    missing = [k for k in keys if k not in state["user"]]
    if missing:
        raise RuntimeError(f"received checkpoint lacks user state {missing}")
    got = state["torchft"].get("step")
    if got != step:
        raise RuntimeError(f"received checkpoint of step {got}, expected step {step}")


def _open_store(host: str, port: int, *, host_it: bool, timeout: timedelta) -> TCPStore:
    """Group rank 0 hosts the group's TCPStore unless one already listens there (torchrun's
    agent store); other ranks connect, waiting up to ``timeout`` for it to appear. A store on a
    loopback host listens on loopback only (TCPStore alone would listen on every interface)."""
    if host_it:
        try:
            return _host_store(host, port, timeout)
        except OSError as e:  # address in use: someone (torchrun's agent) already serves it
            if port == 0:
                raise
            logger.info("TCPStore %s:%d already served (%s); connecting as a client", host, port, e)
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def _host_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    if host not in _LOOPBACK_HOSTS:
        try:
            return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        except RuntimeError as e:  # DistNetworkError: EADDRINUSE
            raise OSError(str(e)) from e
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind(("::1" if ":" in host else "127.0.0.1", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    return TCPStore(
        host,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=sock.detach(),
    )
