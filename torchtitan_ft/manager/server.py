"""The replica group's ManagerServer, on group rank 0: ``torchft.ManagerService`` over gRPC,
speaking to the lighthouse once for the whole group.

What each RPC does is in docs/architecture.md ("The pieces", "One step" and "Group
consistency"). Wire-compatible with torchft 0.2.0 in both directions. It runs grpc.aio on its
own event-loop thread, so it keeps answering while the training thread is busy. Its lighthouse
quorum requests run on that loop too (``AsyncLighthouseClient``: no thread hand-off; shutdown
cancels them), and its blocking calls (address checks, which may look names up) on kept daemon
threads, so that shutdown never waits for them.

The rounds themselves (who has joined, who voted, what is recorded, who is refused) are
``rounds.GroupRounds``: each handler feeds its call in, then only does what the decision says
(ask the lighthouse, wait for the round's end, answer or abort).

Who may call what (docs/operations.md, "Security"): with a job token every call that changes
or reveals the group's state (``Quorum``, ``ShouldCommit``, ``CheckpointMetadata``, ``Kill``)
must carry it (``TokenInterceptor``, UNAUTHENTICATED before the request is parsed). Token or
not, a group rank is bound to its client once it has joined a quorum: to the connection of its
Quorum call and to a session (``rounds.SESSION_METADATA``) sent back in that call's trailing
metadata, which our ``ManagerClient`` presents on its later calls. Another client cannot join
the same round as that rank, its vote for the rank is refused (PERMISSION_DENIED), and its
Quorum call for the rank between rounds is held: refused if the rank's client joins that round,
and counted in its place (a restarted rank taking it over) only once the connection guard's
listing shows the rank's recorded connection closed. A rank's checkpoint metadata (where healers
fetch its state) is recorded only from the Quorum call the round counted for it, when that
round succeeds. A healer that asks for a rank's metadata while the rank's first round is still
with the lighthouse waits for that round.
Malformed requests get INVALID_ARGUMENT; connections are capped, idle ones closed, requests at
most ``rpc_server.MAX_REQUEST_BYTES``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn, TypeVar

import grpc
from grpc import aio

from torchtitan_ft.addresses import AddressProblem, Advertised, QuorumAddressCheck
from torchtitan_ft.auth import RefusalLog, check_token, peer_host, resolve_group_key
from torchtitan_ft.connection_guard import AuthenticatedPeers, ConnectionGuard, GuardPolicy
from torchtitan_ft.lighthouse.client import AsyncLighthouseClient, LighthouseClient
from torchtitan_ft.lighthouse.types import GroupSpeed, Quorum
from torchtitan_ft.manager.client import QuorumTimeoutError, ReplicaGroupMismatchError
from torchtitan_ft.manager.decisions import QuorumGate, QuorumResult, compute_quorum_results
from torchtitan_ft.manager.identity import GroupIdentity, identity_conflict
from torchtitan_ft.manager.linkprobe import LinkProber
from torchtitan_ft.manager.outage import (
    OUTAGE_GRACE_S,
    LighthouseOutage,
    OutageRound,
    go_on_without_lighthouse,
    previous_quorum_round,
)
from torchtitan_ft.manager.rounds import (
    SESSION_METADATA,
    Ask,
    Ballot,
    Decided,
    GroupRounds,
    Held,
    Joined,
    Refused,
    Unknown,
    Waiting,
)
from torchtitan_ft.manager.steptimes import group_progress, with_link_probes
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.rpc_server import (
    CannotListen,
    Malformed,
    Rpc,
    ServerThread,
    countable_descriptors,
    descriptor_limit,
    grpc_server,
    listen,
    parser,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Our own lighthouse budget ends this much (at most a quarter of the time left) before the
# waiting ranks' deadline, so that they receive the server's explanation rather than a bare
# client-side deadline. The answer crosses this process's event loop and the rank's, which a
# busy trainer thread holding the GIL can delay by hundreds of milliseconds (0.2 s was not
# enough beside a loaded TorchTitan rank: "DEADLINE_EXCEEDED: Stream removed").
_ERROR_MARGIN_S = 1.0
_ERROR_MARGIN_SHARE = 0.25
_RETRY_BACKOFF_S = (0.1, 1.0)  # first, max
# An in-process call whose handler asks the lighthouse waits for that request's own answer
# (``_LocalContext.answered_by``) up to this long past its deadline: a net for a request that
# hangs, not a deadline a working one meets (it ends before the call's deadline).
_LOCAL_NET_S = 30.0
_KILL_EXIT_FALLBACK_S = 1.0

SERVICE = "torchft.ManagerService"
_IDLE_CONNECTION_MS = 60 * 60 * 1000
"""A connection with no call for an hour is closed. Much longer than the lighthouse's 30 s: a
torchft client's vote must come on the connection of its Quorum call (ours also presents its
session; see the module doc), and between the two lies a whole step, so the server must not
close it in between."""


class AddressInUseError(RuntimeError):
    """The manager server's port is already taken by another process."""

    def __init__(self, bind: str, message: str | None = None) -> None:
        super().__init__(message or f"manager server cannot listen on {bind!r}: address in use")
        self.bind = bind


class _RpcFailure(Exception):
    """A failure to report to waiting callers as a gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclasses.dataclass(frozen=True)
class _QuorumOutcome:
    """What a quorum round's waiting calls get: the lighthouse's quorum, and the answer (or
    why there is none) of each call the round counted."""

    quorum: Quorum
    answers: dict[Joined, QuorumResult | ValueError]
    sessions: dict[Joined, str]
    """The session of each call that succeeded and takes sessions."""
    speed: GroupSpeed | None = None
    """This group's speed as the lighthouse judged it with the quorum."""


class _DaemonThreads:
    """Daemon threads for blocking calls (a quorum's address check, which may look names
    up), each kept for the next call once it is done: starting a thread waits until it runs,
    a scheduling delay on busy cores, paid on the path every rank waits on. A call that blocks
    long (a slow name lookup) does not hold up the next: it gets another thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` (which must not raise) on an idle thread, or a new one."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(inbox,), name=self._name)
            thread.daemon = True
            thread.start()
        inbox.put(fn)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (fn := inbox.get()) is not None:
            fn()
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        """Ends the idle threads, and each busy one when its call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


class ManagerServer:
    """Serves ``torchft.ManagerService`` for one replica group (normally on group rank 0).

    Starts serving before the constructor returns and keeps a streaming heartbeat to the
    lighthouse, so the lighthouse notices at once when this process dies.

    Args:
        replica_id: this replica group's id in the lighthouse (unique per group and
            incarnation, e.g. ``"train_0:<uuid>"``).
        lighthouse_addr: lighthouse URL, ``http://host:port``.
        hostname: host name advertised in ``address()`` (and so to other replica groups that
            heal from this one). Default ``None``: ``socket.gethostname()``, looked up when the
            server is constructed. Set it when that name resolves to a slow or unreachable
            network.
        bind: ``host:port`` to listen on; port 0 picks a free port. Default ``"[::]:0"`` (all
            interfaces).
        store_addr: ``host:port`` of this replica group's TCPStore, advertised to the lighthouse;
            when this group is the primary for a group rank, the cross-group process group of
            that rank rendezvouses there.
        world_size: number of group ranks in this replica group; a ``Quorum`` round and a
            ``ShouldCommit`` round complete when this many distinct ranks have called.
        heartbeat_interval: interval between heartbeats on the lighthouse stream.
        connect_timeout: how long the lighthouse client waits to (re)connect.
        quorum_retries: how many times a failed lighthouse quorum request is retried (with a
            short backoff, within the waiting ranks' deadline) before the ranks get the error.
            Default 0.
        auth_token: the job token. When set, every call (``Quorum``, ``ShouldCommit``,
            ``CheckpointMetadata``, ``Kill``) must carry ``authorization: Bearer <auth_token>``
            (UNAUTHENTICATED otherwise; ``ManagerClient(auth_token=...)`` sends it), and this
            server presents it to the lighthouse. Default ``None``: anyone who reaches the port
            may call everything but ``Kill``, which is refused (torchft 0.2.0's clients send no
            token and work only in this mode).
        lighthouse_outage: what the group does while the lighthouse cannot be reached:
            ``LighthouseOutage.PREVIOUS_QUORUM`` (default) goes on committing steps on the
            group's previous quorum while that is sound (``outage.previous_quorum_round``;
            docs/lighthouse.md, "A lighthouse outage"), ``WAIT`` waits for it as torchft 0.2.0
            does.
        group_key: this replica group's key, a secret only its own ranks received at launch
            (``auth.group_key``). When set, ``Quorum`` and ``ShouldCommit`` must also carry it
            (UNAUTHENTICATED otherwise; ``ManagerClient`` sends it), so a process of another
            group that holds the job token cannot act for this group's ranks. Default
            ``None``: ``$TORCHFT_GROUP_KEY`` if set, else none.

    Raises:
        ValueError: an argument is out of range.
        AddressInUseError: the port of ``bind`` is taken.
        RuntimeError: ``bind`` cannot be listened on for another reason.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str | None = None,
        bind: str = "[::]:0",
        *,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int = 0,
        auth_token: str | None = None,
        lighthouse_outage: LighthouseOutage = LighthouseOutage.PREVIOUS_QUORUM,
        group_key: str | None = None,
    ) -> None:
        if not replica_id:
            raise ValueError("replica_id must be a non-empty string")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {quorum_retries}")
        if heartbeat_interval <= timedelta(0):
            raise ValueError(f"heartbeat_interval must be positive, got {heartbeat_interval}")
        if not isinstance(lighthouse_outage, LighthouseOutage):
            raise ValueError(
                f"lighthouse_outage must be a LighthouseOutage, got {lighthouse_outage!r}"
            )
        check_token(auth_token, "auth_token")
        self._group_key = resolve_group_key(group_key)

        self._replica_id = replica_id
        self._lighthouse_addr = lighthouse_addr
        self._hostname = socket.gethostname() if hostname is None else hostname
        self._store_addr = store_addr
        self._world_size = world_size
        self._quorum_retries = quorum_retries
        self._auth_token = auth_token
        self._identity: GroupIdentity | None = None
        self._outage_mode = lighthouse_outage

        # Only touched on the event-loop thread.
        self._rounds = GroupRounds(replica_id, world_size)
        self._round_ends: dict[int, asyncio.Future[Any]] = {}
        """round number -> what its waiting calls get (created by the first to wait)."""
        self._forming_changed: asyncio.Future[None] | None = None
        """Done when the forming quorum round changes (held calls wait for it)."""
        self._impostors = RefusalLog(f"the manager server of replica {replica_id!r}")
        self._thread = ServerThread(f"manager-server-{replica_id}")
        self._loop = self._thread.loop
        self._tasks: set[asyncio.Task[None]] = set()
        self._gate = QuorumGate()
        self._address_check = QuorumAddressCheck()
        self._blocking = _DaemonThreads("manager-blocking-call")
        self._previous: tuple[Quorum, bool] | None = None
        """The last quorum this group's ranks were answered with, and whether the straggler
        policy had left the group out of it (for ``outage.previous_quorum_round``)."""
        self._outage_steps: int | None = None
        """Rounds answered without the lighthouse since it last answered; None: no outage."""
        self._outage_cause = ""
        """Why the last round went on without the lighthouse, in words."""
        self._breaks_seen = 0
        """The heartbeat stream's ``breaks`` when the lighthouse last answered a round: more
        now means the lighthouse went away since (``outage.go_on_without_lighthouse``)."""

        self._closed = False
        self._lighthouse = LighthouseClient(lighthouse_addr, connect_timeout, auth_token)
        """The heartbeat stream's client (its own thread)."""
        self._lighthouse_quorums: AsyncLighthouseClient | None = None
        """Quorum requests, on this server's event loop (created there by ``_start``)."""

        self._prober = LinkProber(lighthouse_addr, replica_id, auth_token)
        self._server: aio.Server | None = None
        self._guard: ConnectionGuard | None = None
        try:
            self._port = self._thread.start(lambda: self._start(bind))
        except BaseException:
            self._prober.close()
            self._lighthouse.close()
            raise
        try:
            self._heartbeat = self._lighthouse.heartbeat_stream(
                replica_id, interval=heartbeat_interval
            )
        except BaseException:
            self._closed = True
            self._thread.stop(self._stop)
            self._prober.close()
            self._lighthouse.close()
            raise
        logger.info(
            "manager server of replica %s listening on %s (world_size=%d, lighthouse %s)",
            replica_id,
            self.address(),
            world_size,
            lighthouse_addr,
        )

    def address(self) -> str:
        """This server's URL, ``http://{hostname}:{port}``."""
        return f"http://{self._hostname}:{self._port}"

    def set_identity(self, identity: GroupIdentity) -> None:
        """What this group sends in ``QuorumMember.data`` from the next lighthouse request on,
        and checks the other members against (see the module doc)."""
        self._identity = identity

    def shutdown(self) -> None:
        """Stops serving (in-flight calls are cancelled) and leaves the lighthouse. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.close()
        self._thread.stop(self._stop)
        self._blocking.close()
        self._prober.close()
        self._lighthouse.close()
        logger.info("manager server of replica %s stopped", self._replica_id)

    # ----------------------------------------------------------------------------- event loop

    async def _start(self, bind: str) -> int:
        cap = connection_cap(descriptor_limit())
        authenticated = AuthenticatedPeers()
        name = f"the manager server of replica {self._replica_id!r}"
        server = grpc_server(
            SERVICE,
            self._rpcs(),
            max_connections=cap,
            idle_connection_ms=_IDLE_CONNECTION_MS,
            auth_token=self._auth_token,
            group_key=self._group_key,
            server_name=name,
            authenticated=authenticated,
        )
        try:
            port = listen(server, bind)
        except CannotListen as e:
            if e.in_use:
                raise AddressInUseError(bind) from None
            raise RuntimeError(f"manager server cannot listen on {bind!r}: {e.problem}") from None
        await server.start()
        self._server = server
        self._lighthouse_quorums = AsyncLighthouseClient(self._lighthouse_addr, self._auth_token)
        self._guard = ConnectionGuard(
            port, GuardPolicy.for_cap(cap), authenticated, name, on_listed=self._listed
        )
        self._guard.start()
        return port

    async def _stop(self) -> None:
        if self._guard is not None:
            self._guard.stop()
        if self._server is not None:
            await self._server.stop(grace=None)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._lighthouse_quorums is not None:
            await self._lighthouse_quorums.close()

    def _listed(self, peers: frozenset[str], listed_at: float) -> None:
        """The guard's listing of this server's open connections (on the guard's thread):
        held Quorum calls decide again when it shows a rank's holder gone."""

        def apply() -> None:
            if self._rounds.connections_listed(peers | {LOCAL_PEER}, listed_at):
                self._changed()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
            self._loop.call_soon_threadsafe(apply)

    def _new_future(self) -> asyncio.Future[Any]:
        fut = self._loop.create_future()
        # Every waiter may have given up already; don't warn about an unretrieved error.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error(
                "replica %s: manager server task failed",
                self._replica_id,
                exc_info=(type(error), error, error.__traceback__),
            )

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Runs blocking ``fn`` on a daemon thread (never delays shutdown or process exit),
        one kept from an earlier call when one is idle."""
        fut: asyncio.Future[T] = self._new_future()

        def deliver(setter: Callable[[Any], object], value: Any) -> None:
            if not fut.done():
                setter(value)

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting coroutine, which re-raises it
                outcome: tuple[Callable[[Any], object], Any] = (fut.set_exception, e)
            else:
                outcome = (fut.set_result, result)
            # RuntimeError: the server shut down meanwhile and nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(deliver, *outcome)

        self._blocking.run(run)
        return await fut

    def _rpcs(self) -> list[Rpc]:
        """``torchft.ManagerService``'s RPC table, requests parsed by ``rpc_server.parser``:
        every RPC needs the job token when one is set (``Kill`` is refused without one)."""

        def unary(method: Callable[..., Any], request_type: type) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=parser(request_type),
                response_serializer=lambda response: response.SerializeToString(),
            )

        # Quorum and ShouldCommit act for one of the group's ranks: the group's key too.
        # CheckpointMetadata: other groups' healers; Kill: the lighthouse.
        return [
            Rpc(
                "Quorum",
                unary(self.quorum, pb.ManagerQuorumRequest),
                needs_token=True,
                needs_group_key=True,
            ),
            Rpc(
                "ShouldCommit",
                unary(self.should_commit, pb.ShouldCommitRequest),
                needs_token=True,
                needs_group_key=True,
            ),
            Rpc(
                "CheckpointMetadata",
                unary(self.checkpoint_metadata, pb.CheckpointMetadataRequest),
                needs_token=True,
                needs_group_key=False,
            ),
            Rpc("Kill", unary(self.kill, pb.KillRequest), needs_token=True, needs_group_key=False),
        ]

    # ------------------------------------------------------------------------------ validation

    def _group_rank_error(self, group_rank: int) -> str | None:
        if 0 <= group_rank < self._world_size:
            return None
        return (
            f"group_rank {group_rank} is out of range for replica {self._replica_id!r} "
            f"with world_size {self._world_size} (expected 0..{self._world_size - 1})"
        )

    # ---------------------------------------------------------------------------------- quorum

    async def _refuse(
        self, context: aio.ServicerContext, action: str, group_rank: int, refused: Refused
    ) -> NoReturn:
        """Aborts with PERMISSION_DENIED: this call may not ``action`` as ``group_rank``."""
        what = f"a call to {action} as group rank {group_rank}"
        bound = f"that rank is bound to {refused.bound_peer}"
        self._impostors.refused(peer_host(context.peer()), what, bound)
        await _abort(context, grpc.StatusCode.PERMISSION_DENIED, refused.reason)

    def _round_end(self, round: int) -> asyncio.Future[Any]:
        if round not in self._round_ends:
            self._round_ends[round] = self._new_future()
        return self._round_ends[round]

    def _changed(self) -> None:
        """The forming quorum round changed, or a holder is gone: held calls decide again."""
        fut, self._forming_changed = self._forming_changed, None
        if fut is not None:
            fut.set_result(None)

    async def _hold(self) -> None:
        """Waits until the forming quorum round changes or a holder is gone (``_changed``)."""
        if self._forming_changed is None:
            self._forming_changed = self._new_future()
        await asyncio.shield(self._forming_changed)

    def _end_round(self, round: int, outcome: Any) -> None:
        """Wakes the calls waiting for ``round`` with ``outcome`` (an exception: raised)."""
        fut = self._round_ends.pop(round, None)
        if fut is None:
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    async def quorum(
        self, request: pb.ManagerQuorumRequest | Malformed, context: aio.ServicerContext
    ) -> pb.ManagerQuorumResponse:
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        remaining = context.time_remaining()
        if remaining is None:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "ManagerService/Quorum requires a deadline (set a timeout on the call)",
            )
        group_rank = request.group_rank
        if (error := self._group_rank_error(group_rank)) is not None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)

        call = Joined(
            group_rank=group_rank,
            peer=context.peer(),
            session=_session(context),
            step=request.step,
            shrink_only=request.shrink_only,
            commit_failures=request.commit_failures,
            checkpoint_metadata=request.checkpoint_metadata,
            init_sync=request.init_sync,
            progress=request.progress if request.HasField("progress") else None,
            reconfigure_handle=request.reconfigure_handle,
        )
        decision = self._rounds.join(call)
        self._changed()
        held = None
        while isinstance(decision, Held):
            held = decision
            try:
                await self._hold()
            except BaseException:  # cancelled: the caller gave up
                self._rounds.withdraw(held.round, call)
                self._changed()
                raise
            decision = self._rounds.retry(call, held.round)
            if not isinstance(decision, Held):  # counted (or refused): the round changed
                self._changed()
        if isinstance(decision, Refused):
            await self._refuse(context, "join the quorum", group_rank, decision)
        if held is not None:
            logger.warning(
                "replica %s: group rank %d taken over by the connection %s: the connection of "
                "the rank's client (%s) has closed",
                self._replica_id,
                group_rank,
                call.peer,
                held.bound_peer,
            )
        logger.debug(
            "replica %s: group rank %d joined quorum round (%d/%d)",
            self._replica_id,
            group_rank,
            len(decision.calls) if isinstance(decision, Ask) else decision.count,
            self._world_size,
        )
        if isinstance(decision, Ask):
            if held is not None:  # it waited: less time is left
                remaining = context.time_remaining() or 0.0
            budget = max(remaining - min(_ERROR_MARGIN_S, _ERROR_MARGIN_SHARE * remaining), 0.0)
            self._spawn(self._run_lighthouse_quorum(decision, budget))
            if isinstance(context, _LocalContext):  # this call ends with the request it made
                context.answered_by(asyncio.get_running_loop().time() + budget)
        end = self._round_end(decision.round)
        try:
            outcome: _QuorumOutcome = await asyncio.shield(end)
        except _RpcFailure as e:
            await _abort(context, e.code, e.details)
        finally:
            self._rounds.withdraw(decision.round, call)  # counts only while the round forms
            self._changed()

        answer = outcome.answers.get(call)
        if answer is None:  # a same-connection retry replaced this call in the round
            answer = _answer(
                self._replica_id, group_rank, outcome.quorum, request.init_sync, outcome.speed
            )
        if isinstance(answer, ValueError):
            await _abort(context, grpc.StatusCode.INTERNAL, str(answer))
        if (session := outcome.sessions.get(call)) is not None:
            context.set_trailing_metadata(((SESSION_METADATA, session),))
        if answer.heal:
            logger.info(
                "replica %s group rank %d: heals from replica rank %s (step %d -> max_step %d)",
                self._replica_id,
                group_rank,
                answer.recover_src_replica_rank,
                request.step,
                answer.max_step,
            )
        return answer.to_proto()

    async def _run_lighthouse_quorum(self, ask: Ask, budget_s: float) -> None:
        """Asks the lighthouse for quorum round ``ask``, records the ranks that succeeded and
        wakes the round's calls (with an ``_RpcFailure`` if it failed)."""
        outcome: _QuorumOutcome | _RpcFailure = _RpcFailure(
            grpc.StatusCode.UNAVAILABLE,
            f"manager server of replica {self._replica_id!r} stopped or failed "
            "while asking the lighthouse for a quorum; see its log",
        )
        previous, excluded = self._previous if self._previous is not None else (None, False)
        outage = previous_quorum_round(
            self._outage_mode,
            previous,
            excluded,
            self._replica_id,
            [call.step for call in ask.calls.values()],
            ask.commit_failures,
            datetime.now(UTC),
        )
        try:
            quorum, speed = await self._lighthouse_quorum(
                step=ask.step,
                shrink_only=ask.shrink_only,
                commit_failures=ask.commit_failures,
                progress=with_link_probes(
                    group_progress(call.progress for call in ask.calls.values()),
                    self._prober.take(),
                ),
                reconfigure_handles=ask.reconfigure_handles,
                budget_s=budget_s,
                outage=outage,
            )
            if quorum is not outage.quorum:  # an outage round's members were checked before
                await self._admit(quorum)
            self._previous = (quorum, speed is not None and speed.excluded)
        except _RpcFailure as e:
            log = logger.error if e.code is grpc.StatusCode.FAILED_PRECONDITION else logger.warning
            log("replica %s: %s", self._replica_id, e.details)
            outcome = e
        else:
            answers = {
                call: _answer(self._replica_id, call.group_rank, quorum, call.init_sync, speed)
                for call in ask.calls.values()
            }
            outcome = _QuorumOutcome(quorum, answers, sessions={}, speed=speed)
        finally:  # also when cancelled by shutdown, or on an unexpected error
            answers = outcome.answers if isinstance(outcome, _QuorumOutcome) else {}
            succeeded = [c.group_rank for c, a in answers.items() if isinstance(a, QuorumResult)]
            sessions = self._rounds.finish_quorum(ask.round, succeeded, time.monotonic())
            if isinstance(outcome, _QuorumOutcome):
                issued = {ask.calls[rank]: session for rank, session in sessions.items()}
                outcome = dataclasses.replace(outcome, sessions=issued)
            self._end_round(ask.round, outcome)

    async def _admit(self, quorum: Quorum) -> None:
        """Checks a quorum from the lighthouse before the ranks get it (``_check_identities``);
        starts the link probes for the next one."""
        self._prober.kick()  # while the group computes, before its cross-group traffic
        members = [
            Advertised(m.replica_id, m.address, m.store_address) for m in quorum.participants
        ]
        me = Advertised(self._replica_id, self.address(), self._store_addr)
        if self._address_check.known(me, members):  # the same members: no name lookups
            addresses = self._address_check(me, members)
        else:
            addresses = await self._in_thread(lambda: self._address_check(me, members))
        self._check_identities(quorum, addresses)

    def _check_identities(self, quorum: Quorum, addresses: AddressProblem | None) -> None:
        """Fails this group's round when the gate refuses the quorum (``QuorumGate``: an
        identity conflict of a newcomer, or this group advertising loopback beside a member on
        another host); logs a conflict it carries on with, and an address warning, once."""
        admission = self._gate.admit(identity_conflict(self._replica_id, quorum), addresses)
        if admission.warning is not None:
            logger.warning("replica %s: %s", self._replica_id, admission.warning)
        if admission.refusal is not None:
            raise _RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, admission.refusal)
        if admission.error is not None:
            logger.error(
                "replica %s: quorum %d: %s (this group carries on; the step may be discarded)",
                self._replica_id,
                quorum.quorum_id,
                admission.error,
            )

    async def _lighthouse_quorum(
        self,
        step: int,
        shrink_only: bool,
        commit_failures: int,
        progress: pb.GroupProgress | None,
        reconfigure_handles: tuple[str, ...],
        budget_s: float,
        outage: OutageRound,
    ) -> tuple[Quorum, GroupSpeed | None]:
        """One lighthouse quorum for the whole group, retried ``quorum_retries`` times; with
        this group's speed as the lighthouse judges it (None: not judged, or torchft's). With
        an ``outage.quorum``, that quorum itself (speed None) once the round may go on
        without the lighthouse (``_ask_or_go_on``)."""
        deadline = time.monotonic() + budget_s
        backoff, max_backoff = _RETRY_BACKOFF_S
        attempts = 0
        logger.info(
            "replica %s: all %d group ranks joined; asking lighthouse for a quorum at step %d",
            self._replica_id,
            self._world_size,
            step,
        )
        identity = self._identity
        data = identity.to_data() if identity is not None else None
        while True:
            attempts += 1
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                asked = self._lighthouse_quorums.quorum_with_speeds(
                    replica_id=self._replica_id,
                    timeout=timedelta(seconds=remaining),
                    address=self.address(),
                    store_address=self._store_addr,
                    step=step,
                    world_size=self._world_size,
                    shrink_only=shrink_only,
                    data=data,
                    commit_failures=commit_failures,
                    progress=progress,
                    reconfigure_handles=reconfigure_handles,
                )
                if outage.quorum is None:
                    quorum, speeds = await asked
                elif (answer := await self._ask_or_go_on(asked)) is not None:
                    quorum, speeds = answer
                else:
                    self._went_on(outage)
                    return outage.quorum, None
            except TimeoutError as e:
                code, error = grpc.StatusCode.DEADLINE_EXCEEDED, e
            except (OSError, RuntimeError, ValueError, grpc.RpcError) as e:
                code, error = grpc.StatusCode.UNAVAILABLE, e
            else:
                logger.info(
                    "replica %s: lighthouse issued quorum %d with %d members",
                    self._replica_id,
                    quorum.quorum_id,
                    len(quorum.participants),
                )
                self._lighthouse_answered()
                return quorum, speeds.get(self._replica_id)
            left = deadline - time.monotonic()
            if attempts > self._quorum_retries or left <= backoff:
                raise _RpcFailure(
                    code,
                    f"lighthouse quorum at {self._lighthouse_addr} failed after {attempts} "
                    f"attempt(s) within {budget_s:.3f} s: {type(error).__name__}: {error}",
                )
            logger.warning(
                "replica %s: lighthouse quorum attempt %d failed (%s); retrying in %.2f s",
                self._replica_id,
                attempts,
                error,
                backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff)

    async def _ask_or_go_on(
        self, asked: Coroutine[Any, Any, tuple[Quorum, dict[str, GroupSpeed]]]
    ) -> tuple[Quorum, dict[str, GroupSpeed]] | None:
        """The lighthouse's answer to ``asked``, or None (the request cancelled) once the
        round may go on without it (``outage.go_on_without_lighthouse``)."""
        loop = asyncio.get_running_loop()
        request = asyncio.ensure_future(asked)
        request.add_done_callback(lambda f: f.cancelled() or f.exception())
        unreachable = asyncio.ensure_future(self._lighthouse_quorums.wait_unreachable())
        unreachable.add_done_callback(lambda f: f.cancelled() or f.exception())
        started = loop.time()
        try:
            while not request.done():
                outage_known = (
                    self._outage_steps is not None or self._heartbeat.breaks != self._breaks_seen
                )
                waited = loop.time() - started
                if go_on_without_lighthouse(unreachable.done(), outage_known, waited):
                    self._outage_cause = (
                        "cannot connect to it"
                        if unreachable.done()
                        else f"it did not answer within {OUTAGE_GRACE_S} s"
                    )
                    return None
                await asyncio.wait(
                    [request, unreachable],
                    timeout=max(OUTAGE_GRACE_S - waited, 0.0) if outage_known else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            return request.result()
        finally:
            unreachable.cancel()
            request.cancel()

    def _went_on(self, outage: OutageRound) -> None:
        """Notes a round answered without the lighthouse; says so when an outage starts."""
        if self._outage_steps is None:
            self._outage_steps = 0
            logger.warning(
                "replica %s: the lighthouse at %s does not answer (%s); %s without it (not "
                "torchft 0.2.0's behaviour, which waits for the lighthouse: "
                "lighthouse_outage='wait')",
                self._replica_id,
                self._lighthouse_addr,
                self._outage_cause,
                outage.reason,
            )
        self._outage_steps += 1

    def _lighthouse_answered(self) -> None:
        """Ends a known outage (says how many rounds went on without the lighthouse)."""
        self._breaks_seen = self._heartbeat.breaks
        if self._outage_steps is not None:
            logger.warning(
                "replica %s: the lighthouse answers again after %d round(s) on the previous quorum",
                self._replica_id,
                self._outage_steps,
            )
            self._outage_steps = None

    # ------------------------------------------------------------------- checkpoint metadata

    async def checkpoint_metadata(
        self, request: pb.CheckpointMetadataRequest | Malformed, context: aio.ServicerContext
    ) -> pb.CheckpointMetadataResponse:
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        while isinstance(answer := self._rounds.checkpoint_metadata(request.rank), Waiting):
            # The rank's first quorum is with the lighthouse: its metadata comes when it ends.
            with contextlib.suppress(_RpcFailure):
                await asyncio.shield(self._round_end(answer.round))
        if isinstance(answer, Unknown):
            await _abort(context, grpc.StatusCode.NOT_FOUND, answer.reason)
        return pb.CheckpointMetadataResponse(checkpoint_metadata=answer.checkpoint_metadata)

    # ---------------------------------------------------------------------------- should_commit

    async def should_commit(
        self, request: pb.ShouldCommitRequest | Malformed, context: aio.ServicerContext
    ) -> pb.ShouldCommitResponse:
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        group_rank, step = request.group_rank, request.step
        if (error := self._group_rank_error(group_rank)) is not None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        ballot = Ballot(group_rank, step, request.should_commit, context.peer(), _session(context))
        decision = self._rounds.vote(ballot)
        if isinstance(decision, Refused):
            await self._refuse(context, "vote", group_rank, decision)
        if isinstance(decision, Decided):
            logger.info(
                "replica %s: step %d should_commit=%s (votes %s)",
                self._replica_id,
                step,
                decision.should_commit,
                dict(decision.votes),
            )
            self._end_round(decision.round, decision.should_commit)
            return pb.ShouldCommitResponse(should_commit=decision.should_commit)
        end = self._round_end(decision.round)
        try:
            should_commit = await asyncio.shield(end)
        finally:
            if not end.done() and self._rounds.withdraw_vote(decision.round, ballot):
                del self._round_ends[decision.round]
        return pb.ShouldCommitResponse(should_commit=should_commit)

    # ------------------------------------------------------------------------------------ kill

    async def kill(
        self, request: pb.KillRequest | Malformed, context: aio.ServicerContext
    ) -> pb.KillResponse:
        # With a token, TokenInterceptor has already refused calls without it.
        if self._auth_token is None:
            await _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"Kill is disabled on the manager server of replica {self._replica_id!r}: "
                "no auth_token is configured",
            )
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        logger.warning(
            "replica %s: killed on request from %s: %s",
            self._replica_id,
            context.peer(),
            request.msg,
        )
        # Exit once the reply is on its way; the timer covers a callback that never runs.
        context.add_done_callback(lambda _: _exit_process())
        self._loop.call_later(_KILL_EXIT_FALLBACK_S, _exit_process)
        return pb.KillResponse()


def connection_cap(fd_limit: int) -> int:
    """How many connections the ManagerServer accepts with ``fd_limit`` file descriptors.

    Its callers are the group's ranks, one healing rank per group rank of each group that
    heals, and the lighthouse's kill: far fewer than 1024. It shares the process with the
    training (gloo, TCPStore, data loaders), so it takes at most a quarter of the descriptors.
    """
    return max(16, min(1024, countable_descriptors(fd_limit) // 4))


def _exit_process() -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def _session(context: aio.ServicerContext) -> str | None:
    """The session a call presented (``Joined.session``)."""
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA and isinstance(value, str):
            return value
    return None


def _answer(
    replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool, speed: GroupSpeed | None
) -> QuorumResult | ValueError:
    """``group_rank``'s view of ``quorum`` (with the group's ``speed``), or why there is none
    (answered as INTERNAL)."""
    try:
        result = compute_quorum_results(replica_id, group_rank, quorum, init_sync)
    except ValueError as e:
        return e
    return dataclasses.replace(result, speed=speed)


async def _abort(context: aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: ServicerContext.abort() raises")


class _LocalAbort(Exception):
    """A handler called for the in-process client aborted with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _LocalContext:
    """The part of ``aio.ServicerContext`` the ``Quorum`` and ``ShouldCommit`` handlers use,
    for a call from this process (``LocalManagerClient``)."""

    def __init__(self, deadline: float, session: str | None) -> None:
        self._deadline = deadline
        self._metadata = () if session is None else ((SESSION_METADATA, session),)
        self.trailing: tuple[tuple[str, str], ...] = ()
        self.guard: asyncio.Timeout | None = None
        """The call's deadline on the server's loop (``_guarded``); None until it starts."""

    def answered_by(self, when: float) -> None:
        """The handler will answer by itself, by loop time ``when`` (the end of the lighthouse
        request it made, which ends before the deadline): the guard moves to ``_LOCAL_NET_S``
        after the later of ``when`` and the deadline, so that it fires only if that request
        hangs. However late a starved loop runs, the caller then gets the request's own error
        (e.g. "no quorum from the lighthouse at ...") rather than the deadline, whose timer a
        loop waking after both would otherwise run before the failure's callbacks."""
        if self.guard is not None and (at := self.guard.when()) is not None:
            self.guard.reschedule(max(at, when) + _LOCAL_NET_S)

    def time_remaining(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    def peer(self) -> str:
        return LOCAL_PEER

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _LocalAbort(code, details)


LOCAL_PEER = "in-process:manager-server"
"""The peer name the ManagerServer gives calls from its own process."""


class LocalManagerClient:
    """``ManagerClient``'s ``_quorum`` and ``should_commit`` for the rank in the ManagerServer's
    own process (group rank 0): the server's handlers run on its event loop without gRPC, so a
    quorum costs no serialization and no trip through the network stack each way (about half
    the ManagerServer's part of a quorum round trip, docs/performance.md). The rank binds to
    the server as any client does (``LOCAL_PEER`` and the session it is given); errors are
    ``ManagerClient``'s. Healing peers and the other ranks still use gRPC.
    """

    def __init__(self, server: ManagerServer, addr: str) -> None:
        self._server = server
        self._addr = addr
        self._sessions: dict[int, str] = {}

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int = 0,
        init_sync: bool = True,
        progress: pb.GroupProgress | None = None,
        reconfigure_handle: str = "",
    ) -> QuorumResult:
        """As ``ManagerClient._quorum``."""
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            init_sync=init_sync,
            commit_failures=commit_failures,
            progress=progress,
            reconfigure_handle=reconfigure_handle,
        )
        context = _LocalContext(
            time.monotonic() + timeout.total_seconds(), self._sessions.get(group_rank)
        )
        try:
            response = self._call("Quorum", self._server.quorum, request, context, timeout)
        except TimeoutError as e:
            raise QuorumTimeoutError(str(e)) from None
        for key, value in context.trailing:
            if key == SESSION_METADATA:
                self._sessions[group_rank] = value
        return QuorumResult.from_proto(response)

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """As ``ManagerClient.should_commit``."""
        request = pb.ShouldCommitRequest(
            should_commit=should_commit, group_rank=group_rank, step=step
        )
        context = _LocalContext(
            time.monotonic() + timeout.total_seconds(), self._sessions.get(group_rank)
        )
        response = self._call("ShouldCommit", self._server.should_commit, request, context, timeout)
        return response.should_commit

    def close(self, wait: bool = True) -> None:
        """Nothing to close (the server is the rendezvous's to stop)."""

    def _call(
        self,
        name: str,
        handler: Callable[[Any, Any], Any],
        request: Any,
        context: _LocalContext,
        timeout: timedelta,
    ) -> Any:
        handling = handler(request, context)
        call = _guarded(context, timeout.total_seconds(), handling)
        try:
            future = asyncio.run_coroutine_threadsafe(call, self._server._loop)
        except RuntimeError:  # the server's loop is closed: neither coroutine will run
            call.close()
            handling.close()
            raise
        try:
            return future.result()
        except TimeoutError:
            text = f"ManagerService/{name} at {self._addr} failed: DEADLINE_EXCEEDED: in process"
            raise TimeoutError(text) from None
        except _LocalAbort as e:
            text = f"ManagerService/{name} at {self._addr} failed: {e.code.name}: {e.details}"
            if e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise TimeoutError(text) from None
            if e.code is grpc.StatusCode.FAILED_PRECONDITION:
                raise ReplicaGroupMismatchError(e.details) from None
            raise RuntimeError(text) from None
        except concurrent.futures.CancelledError:
            text = f"ManagerService/{name} at {self._addr} failed: CANCELLED: server stopped"
            raise TimeoutError(text) from None


async def _guarded(context: _LocalContext, timeout_s: float, coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result, or ``TimeoutError`` after ``timeout_s`` (later where the handler
    says it answers by itself, ``_LocalContext.answered_by``): ``asyncio.wait_for`` without its
    extra task (one event-loop turn less on a quorum's path)."""
    async with asyncio.timeout(timeout_s) as context.guard:
        return await coro
