"""The lighthouse gRPC server (``torchft.LighthouseService``) and its status endpoints.

Everything runs on one asyncio event loop in a background thread: the gRPC server, the tick
that decides rounds waiting on time, and the HTTP status server. ``LighthouseState`` is only
touched from that loop, so it needs no locks.

The quorum response is serialized once per quorum and handed to every member as bytes (the
handlers use an identity serializer): with N members that is N writes of one buffer instead of
N serializations of an N-member message.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from torchtitan_ft.lighthouse import status
from torchtitan_ft.lighthouse.decision import DecisionOptions
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.netaddr import advertised_host, join_host_port, split_host_port
from torchtitan_ft.proto import torchft_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE = "torchft.LighthouseService"
M = TypeVar("M", bound=Message)


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can say so."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"malformed {kind}: {error}"


def _parser(cls: type[M]) -> Callable[[bytes], M | _Malformed]:
    def parse(data: bytes) -> M | _Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _Malformed(cls.__name__, e)

    return parse


def _identity(payload: bytes) -> bytes:
    return payload


class _Service:
    """The RPC handlers; all run on the server's event loop."""

    def __init__(self, state: LighthouseState) -> None:
        self.state = state

    async def _reject(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.state.metrics.bad_requests += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def quorum(self, request: Any, context: grpc.aio.ServicerContext) -> bytes:
        if isinstance(request, _Malformed):
            await self._reject(context, request.message)
        if not request.HasField("requester"):
            await self._reject(context, "LighthouseQuorumRequest.requester is missing")
        if not request.requester.replica_id:
            await self._reject(context, "LighthouseQuorumRequest.requester.replica_id is empty")
        try:
            member = QuorumMember.from_proto(request.requester)
        except ValueError as e:
            await self._reject(context, str(e))
        fut = self.state.request(member, request.requester)
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

    async def heartbeat(self, request: Any, context: grpc.aio.ServicerContext) -> bytes:
        if isinstance(request, _Malformed):
            await self._reject(context, request.message)
        if not request.replica_id:
            await self._reject(context, "LighthouseHeartbeatRequest.replica_id is empty")
        self.state.heartbeat(request.replica_id)
        return b""

    async def heartbeat_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        replica_id: str | None = None
        try:
            async for request in requests:
                if isinstance(request, _Malformed) or not request.replica_id:
                    self.state.metrics.bad_requests += 1
                    continue
                if replica_id is None:
                    replica_id = request.replica_id
                    self.state.stream_opened(replica_id)
                elif request.replica_id != replica_id:
                    await self._reject(
                        context,
                        f"heartbeat stream of {replica_id!r} got a heartbeat for "
                        f"{request.replica_id!r}; open one stream per replica",
                    )
                else:
                    self.state.heartbeat(replica_id)
        finally:
            if replica_id is not None:
                self.state.stream_closed(replica_id)
        return b""

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Quorum": grpc.unary_unary_rpc_method_handler(
                    self.quorum,
                    request_deserializer=_parser(pb.LighthouseQuorumRequest),
                    response_serializer=_identity,
                ),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(
                    self.heartbeat,
                    request_deserializer=_parser(pb.LighthouseHeartbeatRequest),
                    response_serializer=_identity,
                ),
                "HeartbeatStream": grpc.stream_unary_rpc_method_handler(
                    self.heartbeat_stream,
                    request_deserializer=_parser(pb.LighthouseHeartbeatRequest),
                    response_serializer=_identity,
                ),
            },
        )


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
            and Prometheus metrics (``/metrics``); None serves none.
        auth_token: enables the status page's kill action, which then needs this token.
            Without a token there is no kill action at all.
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
    ) -> None:
        validate_options(min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms)
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
            )
        )
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._port = 0
        self._status_port: int | None = None
        self._thread = threading.Thread(target=self._run, name="lighthouse", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            self._thread.join()
            raise self._startup_error

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

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def shutdown(self) -> None:
        """Stops serving; waiting requests fail with UNAVAILABLE. Idempotent."""
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()

    def wait(self) -> None:
        """Blocks until shutdown (used by the CLI)."""
        self._thread.join()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", 1 << 20),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ]
        )
        server.add_generic_rpc_handlers((_Service(self.state).handler(),))
        status_server: asyncio.Server | None = None
        try:
            try:
                self._port = server.add_insecure_port(self._bind)
            except RuntimeError:
                self._port = 0
            if self._port == 0:
                raise OSError(
                    f"cannot bind the lighthouse to {self._bind} (port in use? another "
                    "lighthouse?); pick a free port with --bind"
                )
            await server.start()
            if self._status_bind is not None:
                try:
                    status_server = await status.serve(
                        self._status_bind, self.state, self._auth_token
                    )
                except OSError as e:
                    raise OSError(
                        f"cannot serve the status page on {self._status_bind} ({e.strerror}); "
                        "pick a free port with --status_bind, or --status_bind off"
                    ) from e
                self._status_port = status_server.sockets[0].getsockname()[1]
        except BaseException as e:
            self._startup_error = e
            await server.stop(None)
            self._started.set()
            return
        logger.info(
            "lighthouse serving on %s (min_replicas=%d)%s",
            self.address(),
            self.state.opts.min_replicas,
            f", status on {self.status_address()}" if status_server else "",
        )
        self._started.set()
        ticker = asyncio.create_task(self._tick())
        await self._stop.wait()
        ticker.cancel()
        if status_server is not None:
            status_server.close()
        await server.stop(grace=0.5)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.state.tick()


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
