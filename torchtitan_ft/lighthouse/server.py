"""The lighthouse gRPC server (``torchft.LighthouseService``) and its status endpoints.

Everything runs on one asyncio event loop in a background thread (``rpc_server.ServerThread``,
as the ManagerServer's): the gRPC server, the tick that decides rounds waiting on time, and the
HTTP status server. ``LighthouseState`` is only touched from that loop, so it needs no locks.

The quorum response is serialized once per quorum and handed to every member as bytes (the
handlers use an identity serializer): with N members that is N writes of one buffer instead of
N serializations of an N-member message.

With a job token every ``LighthouseService`` call must carry it (``TokenInterceptor``): they
all change what the next quorum is (who asks, who is healthy). Connections are capped to fit the
process's file-descriptor limit, idle ones are closed, those that make no call with the token
are closed by the ``connection_guard``, requests are at most ``rpc_server.MAX_REQUEST_BYTES``
(see ``connection_limits`` and ``rpc_server.grpc_server``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from torchtitan_ft.addresses import advertised_host
from torchtitan_ft.auth import check_token
from torchtitan_ft.connection_guard import AuthenticatedPeers, ConnectionGuard, GuardPolicy
from torchtitan_ft.lighthouse import status
from torchtitan_ft.lighthouse.decision import DecisionOptions
from torchtitan_ft.lighthouse.exclusion import ExclusionOptions
from torchtitan_ft.lighthouse.groups import GroupsFile
from torchtitan_ft.lighthouse.history import DEFAULT_CAPACITY, History
from torchtitan_ft.lighthouse.last_quorum import LastQuorumFile
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.netaddr import bind_problem, join_host_port, split_host_port
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.rpc_server import (
    CannotListen,
    Malformed,
    Rpc,
    ServerThread,
    countable_descriptors,
    descriptor_limit,
    grpc_server,
    handle_loop_error,
    listen,
    parser,
)

logger = logging.getLogger(__name__)

SERVICE = "torchft.LighthouseService"

_IDLE_CONNECTION_MS = 30_000
"""A connection with no call for this long is closed; clients reconnect when they next call.
Members never idle that long: a heartbeat stream or torchft's 100 ms heartbeats keep theirs
busy."""
_GONE_POLL_S = 0.05
"""How often a waiting ``GoneMembers`` call looks at the heartbeats while no watched member
has a heartbeat record (a restarted lighthouse that has not heard from them yet); otherwise
it looks exactly when the first of them could be gone (``decision.next_gone_check``)."""
_GONE_WAKE_MARGIN_S = 0.001
"""Past that moment, so that clock rounding never finds the member a hair short of it."""
_GONE_WAIT_MAX_S = 30.0
"""Longest wait of one ``GoneMembers`` call; callers ask again."""
_FD_RESERVE = 64
"""Descriptors kept for everything but client connections (event loops, logs, kill calls)."""


def _identity(payload: bytes) -> bytes:
    return payload


class _Service:
    """The RPC handlers; all run on the server's event loop."""

    def __init__(self, state: LighthouseState) -> None:
        self.state = state

    async def _reject(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.state.metrics.bad_requests += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def _member(self, request: Any, context: grpc.aio.ServicerContext) -> QuorumMember:
        """The requester of a quorum request; aborts the call with INVALID_ARGUMENT if bad."""
        if isinstance(request, Malformed):
            await self._reject(context, request.message)
        if not request.HasField("requester"):
            await self._reject(context, "LighthouseQuorumRequest.requester is missing")
        if not request.requester.replica_id:
            await self._reject(context, "LighthouseQuorumRequest.requester.replica_id is empty")
        try:
            return QuorumMember.from_proto(request.requester)
        except ValueError as e:
            await self._reject(context, str(e))
            raise  # not reached: abort raises

    async def _answer(
        self, member: QuorumMember, request: Any, context: grpc.aio.ServicerContext
    ) -> bytes:
        """Waits for the quorum that answers ``member``'s request: the serialized response."""
        progress = request.progress if request.HasField("progress") else None
        fut = self.state.request(member, request.requester, progress)
        try:
            return await asyncio.shield(fut)
        finally:
            if not fut.done():
                self.state.cancel(member.replica_id, fut)
            elif fut.cancelled():
                # Dropped while waiting (its heartbeat stream ended): nothing to answer.
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"replica {member.replica_id} was dropped from the pending round",
                )

    async def quorum(self, request: Any, context: grpc.aio.ServicerContext) -> bytes:
        return await self._answer(await self._member(request, context), request, context)

    async def quorum_stream(
        self, requests: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # One request at a time: the next is read only after the previous one is answered,
        # so a stream holds at most one pending request, as a unary caller does.
        async for request in requests:
            yield await self._answer(await self._member(request, context), request, context)

    async def heartbeat(self, request: Any, context: grpc.aio.ServicerContext) -> bytes:
        if isinstance(request, Malformed):
            await self._reject(context, request.message)
        if not request.replica_id:
            await self._reject(context, "LighthouseHeartbeatRequest.replica_id is empty")
        if request.group_rank != 0:
            await self._reject(
                context,
                f"LighthouseHeartbeatRequest.group_rank must be 0 on a unary Heartbeat, got "
                f"{request.group_rank}; a group rank's own heartbeats go on a HeartbeatStream",
            )
        self.state.heartbeat(request.replica_id)
        return b""

    async def heartbeat_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        """Group rank 0's stream is the group's heartbeat; another rank's (``group_rank`` > 0,
        our clients only) is that rank's (``decision.group_last_seen``)."""
        sender: tuple[str, int] | None = None
        finished = False  # the client said goodbye (a dead process cannot)
        try:
            async for request in requests:
                if (
                    isinstance(request, Malformed)
                    or not request.replica_id
                    or request.group_rank < 0
                ):
                    self.state.metrics.bad_requests += 1
                    continue
                if sender is None:
                    sender = (request.replica_id, request.group_rank)
                    self._opened(*sender)
                elif (request.replica_id, request.group_rank) != sender:
                    await self._reject(
                        context,
                        f"heartbeat stream of {sender[0]!r} group rank {sender[1]} got a "
                        f"heartbeat for {request.replica_id!r} group rank {request.group_rank}; "
                        "open one stream per replica and group rank",
                    )
                elif sender[1] == 0:
                    self.state.heartbeat(sender[0])
                else:
                    self.state.rank_heartbeat(*sender)
                finished = finished or request.goodbye
        finally:
            if sender is not None:
                self._closed(*sender, finished)
        return b""

    def _opened(self, replica_id: str, group_rank: int) -> None:
        if group_rank == 0:
            self.state.stream_opened(replica_id)
        else:
            self.state.rank_stream_opened(replica_id, group_rank)

    def _closed(self, replica_id: str, group_rank: int, finished: bool) -> None:
        if group_rank == 0:
            self.state.stream_closed(replica_id, finished)
        else:
            self.state.rank_stream_closed(replica_id, group_rank)

    async def gone_members(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Long-polls (at most ``_GONE_WAIT_MAX_S``) until a watched member is gone or
        ``wait_ms`` passes, looking again when the first watched member's heartbeat timeout
        would end (``next_gone_check``; every ``_GONE_POLL_S`` while none is known)."""
        if isinstance(request, Malformed):
            await self._reject(context, request.message)
        if not request.replica_id:
            await self._reject(context, "LighthouseGoneRequest.replica_id is empty")
        if request.wait_ms < 0:
            await self._reject(
                context, f"LighthouseGoneRequest.wait_ms must be >= 0, got {request.wait_ms}"
            )
        watched = [rid for rid in request.members if rid != request.replica_id]
        deadline = time.monotonic() + min(request.wait_ms / 1000, _GONE_WAIT_MAX_S)
        asker_runs = request.wait_ms == 0
        while True:
            gone, asker_gone = self.state.gone(request.replica_id, watched, asker_runs)
            if gone or asker_gone or time.monotonic() >= deadline:
                break
            due = self.state.next_gone_check(watched)
            wake = _GONE_POLL_S if due is None else due + _GONE_WAKE_MARGIN_S
            await asyncio.sleep(min(wake, max(0.0, deadline - time.monotonic())))
        return pb.LighthouseGoneResponse(
            gone=gone,
            requester_gone=asker_gone,
            heartbeat_timeout_ms=round(self.state.opts.heartbeat_timeout * 1000),
        )

    async def link_probe(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Answers a link probe with as many bytes as it sent, and the probe settings."""
        if isinstance(request, Malformed):
            await self._reject(context, request.message)
        if not request.replica_id:
            await self._reject(context, "LinkProbeRequest.replica_id is empty")
        opts = self.state.speeds.opts
        size = len(request.payload)
        if size > opts.link_probe_bytes:
            await self._reject(
                context,
                f"LinkProbeRequest.payload has {size} bytes; this lighthouse takes at most "
                f"{opts.link_probe_bytes} (--straggler_link_probe_bytes)",
            )
        self.state.metrics.link_probe_bytes += 2 * size
        return pb.LinkProbeResponse(
            payload=bytes(size),
            probe_bytes=opts.link_probe_bytes,
            interval_ms=round(opts.link_probe_interval_s * 1000),
        )

    def rpcs(self) -> list[Rpc]:
        """The service's RPC table: every RPC needs the job token when one is set (and no
        group key: the lighthouse serves every group)."""
        return [
            Rpc(
                "Quorum",
                grpc.unary_unary_rpc_method_handler(
                    self.quorum,
                    request_deserializer=parser(pb.LighthouseQuorumRequest),
                    response_serializer=_identity,
                ),
                needs_token=True,
                needs_group_key=False,
            ),
            Rpc(
                "QuorumStream",
                grpc.stream_stream_rpc_method_handler(
                    self.quorum_stream,
                    request_deserializer=parser(pb.LighthouseQuorumRequest),
                    response_serializer=_identity,
                ),
                needs_token=True,
                needs_group_key=False,
            ),
            Rpc(
                "Heartbeat",
                grpc.unary_unary_rpc_method_handler(
                    self.heartbeat,
                    request_deserializer=parser(pb.LighthouseHeartbeatRequest),
                    response_serializer=_identity,
                ),
                needs_token=True,
                needs_group_key=False,
            ),
            Rpc(
                "HeartbeatStream",
                grpc.stream_unary_rpc_method_handler(
                    self.heartbeat_stream,
                    request_deserializer=parser(pb.LighthouseHeartbeatRequest),
                    response_serializer=_identity,
                ),
                needs_token=True,
                needs_group_key=False,
            ),
            Rpc(
                "GoneMembers",
                grpc.unary_unary_rpc_method_handler(
                    self.gone_members,
                    request_deserializer=parser(pb.LighthouseGoneRequest),
                    response_serializer=pb.LighthouseGoneResponse.SerializeToString,
                ),
                needs_token=True,
                needs_group_key=False,
            ),
            Rpc(
                "LinkProbe",
                grpc.unary_unary_rpc_method_handler(
                    self.link_probe,
                    request_deserializer=parser(pb.LinkProbeRequest),
                    response_serializer=pb.LinkProbeResponse.SerializeToString,
                ),
                needs_token=True,
                needs_group_key=False,
            ),
        ]


class LighthouseServer:
    """A lighthouse serving ``torchft.LighthouseService`` on a background thread.

    Args:
        bind: ``host:port`` for gRPC (``[::]:29510`` listens on all interfaces; port 0 picks a
            free port).
        min_replicas: fewest replica groups a quorum may have (>= 1).
        join_timeout_ms: how long a round waits for healthy replicas that have not asked yet
            before issuing without them. Longer lets slow starters join the first quorum;
            shorter gets survivors going sooner when a replica is alive but stuck.
        quorum_tick_ms: period of the decision tick for rounds that wait on time (join timeout,
            heartbeat expiry). Rounds completed by an arrival are decided at once.
        heartbeat_timeout_ms: a replica whose last heartbeat is older is not healthy. Replicas
            holding a heartbeat stream open are dropped as soon as the stream ends (process
            death); this timeout still evicts replicas that hang with their process alive.
        status_bind: ``host:port`` of the HTTP status page (``/``), JSON (``/status.json``)
            and Prometheus metrics (``/metrics``); None serves none. Read-only and without
            authentication, apart from the kill action.
        auth_token: the job token. When set, every ``LighthouseService`` call (Quorum,
            Heartbeat, HeartbeatStream) must carry ``authorization: Bearer <auth_token>``
            (UNAUTHENTICATED otherwise), and the status page gets a kill action that needs it
            too. Default None: anyone who reaches the port can join quorums (torchft 0.2.0's
            behaviour and the only mode its clients support), and there is no kill action.
            The CLI resolves it from ``--auth_token`` or ``TORCHFT_AUTH_TOKEN``.
        stragglers: when a replica group is reported as a straggler (``StragglerOptions``:
            factor, steps, window for its compute; link_factor, link_probes, link_window for
            its link; the link probes' size and interval, which the groups' ``LinkProbe``
            calls learn); default ``StragglerOptions()``. The report changes nothing for the
            job.
        exclusion: the straggler policy (``ExclusionOptions``: policy, min_excluded_s,
            max_exclusions, window_s); default off. Under ``exclude`` a reported straggler is
            left out of the quorum while the others are at least ``min_replicas``, trains
            alone without committing, and is taken back (and heals) when fast again.
        state_dir: a directory where the lighthouse keeps the job's event history
            (``events.jsonl``, at most about twice ``history_events`` lines) and the groups'
            figures (``groups.json``: time in the quorum and away, heals, discarded steps,
            committed samples, availability; rewritten every second), so that a restarted
            lighthouse shows what happened before it, and the last issued quorum
            (``last_quorum.json``), so that a restarted lighthouse's state guard acts as
            before the restart (``lighthouse.last_quorum``); None (default) keeps them in
            memory only. Quorum ids are restart-safe without it.
        history_events: events kept in memory (and shown by the status page and ``/events``);
            default 10,000, about 0.3 MB (``benchmarks/history_memory.py``).
    """

    def __init__(
        self,
        bind: str = "[::]:29510",
        min_replicas: int = 1,
        join_timeout_ms: int = 60000,
        quorum_tick_ms: int = 100,
        heartbeat_timeout_ms: int = 5000,
        status_bind: str | None = None,
        auth_token: str | None = None,
        stragglers: StragglerOptions | None = None,
        exclusion: ExclusionOptions | None = None,
        state_dir: str | None = None,
        history_events: int = DEFAULT_CAPACITY,
    ) -> None:
        validate_options(min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms)
        check_token(auth_token, "auth_token")
        self._host, _ = split_host_port(bind, "bind address")
        if status_bind is not None:
            split_host_port(status_bind, "bind address")
        self._bind = bind
        self._status_bind = status_bind
        self._tick_s = quorum_tick_ms / 1000
        self._auth_token = auth_token
        self.state = LighthouseState(
            DecisionOptions(
                min_replicas=min_replicas,
                join_timeout=join_timeout_ms / 1000,
                heartbeat_timeout=heartbeat_timeout_ms / 1000,
            ),
            stragglers=stragglers,
            exclusion=exclusion,
            history=History(history_events, state_dir, time.time),
            last_quorum=None if state_dir is None else LastQuorumFile(state_dir),
            groups_file=GroupsFile(state_dir) if state_dir is not None else None,
        )
        self._port = 0
        self._status_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._status_server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.guard: ConnectionGuard | None = None
        """Closes connections that make no authenticated call (``connection_guard``)."""
        self._thread = ServerThread("lighthouse", _LoopErrors().handle)
        self._thread.start(self._start)

    def address(self) -> str:
        """The URL clients use: ``http://host:port``."""
        return f"http://{join_host_port(advertised_host(self._host), self._port)}"

    def status_address(self) -> str | None:
        """The status page URL, or None when not served."""
        if self._status_port is None or self._status_bind is None:
            return None
        host, _ = split_host_port(self._status_bind)
        return f"http://{join_host_port(advertised_host(host), self._status_port)}"

    def run_in_loop(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the server's loop and returns its result (for tests and views)."""

        async def call() -> Any:
            return fn()

        return self._thread.call(call())

    def shutdown(self) -> None:
        """Stops serving; waiting requests fail with UNAVAILABLE. Idempotent."""
        self._thread.stop(self._stop)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until shutdown, or for ``timeout`` seconds at most (used by the CLI); True
        once the server has stopped."""
        return self._thread.wait(timeout)

    async def _start(self) -> None:
        """Starts the gRPC server, the status server and the tick."""
        grpc_connections, status_connections = connection_limits(descriptor_limit())
        authenticated = AuthenticatedPeers()
        server = grpc_server(
            SERVICE,
            _Service(self.state).rpcs(),
            max_connections=grpc_connections,
            idle_connection_ms=_IDLE_CONNECTION_MS,
            auth_token=self._auth_token,
            server_name="the lighthouse",
            authenticated=authenticated,
            on_refused=self._count_unauthenticated,
        )
        try:
            try:
                self._port = listen(server, self._bind)
            except CannotListen as e:
                raise OSError(
                    f"cannot bind the lighthouse to {self._bind}: {e.problem}; pick another --bind"
                ) from None
            await server.start()
            if self._status_bind is not None:
                self._status_server = await self._serve_status(status_connections)
                self._status_port = self._status_server.sockets[0].getsockname()[1]
        except BaseException:
            await server.stop(None)
            raise
        self._server = server
        self.guard = ConnectionGuard(
            self._port, GuardPolicy.for_cap(grpc_connections), authenticated, "the lighthouse"
        )
        self.guard.start()
        self._ticker = asyncio.create_task(self._tick())
        logger.info(
            "lighthouse serving on %s (min_replicas=%d, straggler policy %s)%s; %s",
            self.address(),
            self.state.opts.min_replicas,
            self.state.exclusion_opts.policy.value,
            f", status on {self.status_address()}" if self._status_server else "",
            "every call needs the job token"
            if self._auth_token is not None
            else "no job token: anyone who reaches the port can join quorums",
        )

    async def _stop(self) -> None:
        if self.guard is not None:
            self.guard.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self._status_server is not None:
            self._status_server.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        self.state.close()

    async def _serve_status(self, max_connections: int) -> asyncio.Server:
        status_bind = str(self._status_bind)
        problem = bind_problem(*split_host_port(status_bind, "bind address"))
        if problem is None:
            try:
                return await status.serve(
                    status_bind, self.state, self._auth_token, max_connections
                )
            except OSError as e:
                problem = e.strerror or str(e)
        raise OSError(
            f"cannot serve the status page on {status_bind}: {problem}; pick another "
            "--status_bind, or --status_bind off"
        )

    def _count_unauthenticated(self) -> None:
        self.state.metrics.unauthenticated_requests += 1

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.state.tick()


class _LoopErrors:
    """The event loop's error handler: out of descriptors, asyncio reports every failed accept
    with a traceback, up to a hundred per second; say it once a minute instead."""

    def __init__(self) -> None:
        self._last_warning = -math.inf

    def handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            handle_loop_error(loop, context)
            return
        now = time.monotonic()
        if now - self._last_warning >= 60:
            self._last_warning = now
            logger.warning(
                "the status server cannot accept connections: %s (file descriptor limit %d; "
                "raise it with ulimit -n)",
                context.get("exception"),
                descriptor_limit(),
            )


def connection_limits(fd_limit: int) -> tuple[int, int]:
    """How many gRPC and status-page connections fit in ``fd_limit`` file descriptors.

    One descriptor per connection. Without a cap a flood of idle connections takes the last
    descriptor, after which neither server can accept anyone. The status server may briefly
    hold twice its cap (a burst of accepts, and the connections they evict, closed one loop
    iteration later; see ``status.serve``). Returns ``(grpc, status)``.
    """
    fd_limit = countable_descriptors(fd_limit)
    status_connections = max(4, min(64, fd_limit // 8))
    return max(8, fd_limit - 2 * status_connections - _FD_RESERVE), status_connections


def validate_options(
    min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int
) -> None:
    """Raises ValueError naming the first option out of range."""
    if min_replicas < 1:
        raise ValueError(f"--min_replicas must be >= 1, got {min_replicas}")
    if join_timeout_ms < 0:
        raise ValueError(f"--join_timeout_ms must be >= 0, got {join_timeout_ms}")
    if quorum_tick_ms <= 0:
        raise ValueError(f"--quorum_tick_ms must be > 0, got {quorum_tick_ms}")
    if heartbeat_timeout_ms <= 0:
        raise ValueError(f"--heartbeat_timeout_ms must be > 0, got {heartbeat_timeout_ms}")
