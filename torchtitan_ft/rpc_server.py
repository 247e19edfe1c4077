"""What the job's gRPC servers (the lighthouse and the ManagerServer) share: the thread that
hosts a server's event loop, the server itself (connection limits, job-token interceptor, the
marking of authenticated peers for its ``connection_guard``, request parsing), its table of
RPCs (``Rpc``: each with its handler and whether it needs the job token, checked against the
proto's service so that no RPC is left out), the daemon threads for its blocking calls
(``DaemonThreads``), the diagnosis of an address it cannot listen on, and the filter for
grpc.aio's spurious event-loop errors. Each server picks its own connection cap from the
descriptors it may use (``descriptor_limit``, ``countable_descriptors``) and its own idle
timeout.

gRPC's generated servicers parse requests themselves and answer a malformed one with
``UNKNOWN`` and an ERROR traceback in the log; handlers registered with ``parser`` receive a
``Malformed`` instead and say what was wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import resource
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from torchtitan_ft.auth import GroupKeyInterceptor, TokenInterceptor
from torchtitan_ft.connection_guard import AuthenticatedPeers, MarkingInterceptor
from torchtitan_ft.netaddr import bind_problem, port_in_use, split_host_port
from torchtitan_ft.proto import torchft_pb2 as pb

M = TypeVar("M", bound=Message)
R = TypeVar("R")
logger = logging.getLogger(__name__)

_UNLIMITED_DESCRIPTORS = 1 << 20
"""What no descriptor limit counts as: Linux's default ceiling on descriptors per process."""

MAX_REQUEST_BYTES = 1 << 20
"""Largest request accepted (RESOURCE_EXHAUSTED beyond). A lighthouse member's request is a
few hundred bytes plus its ``data``; a ManagerService request is a few hundred bytes."""
HANDSHAKE_TIMEOUT_MS = 5_000
"""A connection that has not completed the HTTP/2 handshake by then is closed (gRPC's default
is 120 s, long enough for a flood of idle connections to hold every descriptor)."""


class Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can say so."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"malformed {kind}: {error}"


def parser(cls: type[M]) -> Callable[[bytes], M | Malformed]:
    """A request deserializer for ``cls`` that returns ``Malformed`` instead of raising."""

    def parse(data: bytes) -> M | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Malformed(cls.__name__, e)

    return parse


def unary(method: Callable[..., Any], request_type: type[Message]) -> grpc.RpcMethodHandler:
    """The handler of a unary RPC served by ``method``, its request parsed by ``parser``."""
    return grpc.unary_unary_rpc_method_handler(
        method,
        request_deserializer=parser(request_type),
        response_serializer=lambda response: response.SerializeToString(),
    )


@dataclass(frozen=True)
class Rpc:
    """One row of a server's RPC table: the only place that says what an RPC runs and who may
    call it."""

    name: str
    """The method's name in the proto's service (``Quorum``)."""
    handler: grpc.RpcMethodHandler
    needs_token: bool
    """Whether a call must carry the job token when the server has one (``UNAUTHENTICATED``
    otherwise, before its request is parsed: ``auth.TokenInterceptor``)."""
    needs_group_key: bool
    """Whether a call must also carry the replica group's key when the server has one (the
    calls that act for one of the group's ranks: ``auth.GroupKeyInterceptor``)."""


def rpc_table(
    service: str, rpcs: Sequence[Rpc]
) -> tuple[grpc.GenericRpcHandler, list[str], list[str]]:
    """The generic handler of ``service`` (``torchft.LighthouseService``) for ``rpcs``, and
    the full names (``/torchft.LighthouseService/Quorum``) of those that need the token, and
    of those that need the group key.

    Raises ValueError unless ``rpcs`` names every RPC of the service in the proto once and
    nothing else: an RPC added to the proto cannot be served without a row saying whether it
    needs the token."""
    package, _, name = service.rpartition(".")
    descriptor = pb.DESCRIPTOR.services_by_name.get(name)
    if descriptor is None or pb.DESCRIPTOR.package != package:
        raise ValueError(f"{service!r} is not a service of torchft.proto")
    in_proto = sorted(method.name for method in descriptor.methods)
    in_table = sorted(rpc.name for rpc in rpcs)
    if in_table != in_proto:
        raise ValueError(
            f"the RPC table of {service} has {in_table}, and the proto's service has "
            f"{in_proto}: give every RPC of the proto one row"
        )
    handler = grpc.method_handlers_generic_handler(service, {rpc.name: rpc.handler for rpc in rpcs})
    return (
        handler,
        [f"/{service}/{rpc.name}" for rpc in rpcs if rpc.needs_token],
        [f"/{service}/{rpc.name}" for rpc in rpcs if rpc.needs_group_key],
    )


def server_options(max_connections: int, idle_connection_ms: int) -> list[tuple[str, int]]:
    """gRPC server options: at most ``max_connections`` connections, each closed after
    ``idle_connection_ms`` without a call, ``HANDSHAKE_TIMEOUT_MS`` to complete its HTTP/2
    handshake, requests of at most ``MAX_REQUEST_BYTES``; client keepalive pings allowed."""
    return [
        ("grpc.max_concurrent_streams", 1 << 20),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", idle_connection_ms),
    ]


def is_grpc_poller_noise(context: dict[str, Any]) -> bool:
    """Whether an event-loop error report is grpc.aio's process-wide poller waking a loop the
    event was not for. grpc keeps one completion queue per process and every event loop that
    served gRPC stays bound to it (grpc/grpc#25364): a wake-up runs the poller's callback in
    each bound loop, one of which consumes it (the others raise ``BlockingIOError``), and a
    loop of a server already shut down in this process raises "Event loop is closed". The
    event itself reaches the loop it belongs to, so neither report is an error."""
    if "PollerCompletionQueue" not in repr(context.get("handle")):
        return False
    error = context.get("exception")
    return isinstance(error, BlockingIOError) or (
        isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    )


def handle_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An event loop's exception handler for the servers' loops: grpc.aio's poller noise
    (:func:`is_grpc_poller_noise`) at DEBUG, everything else to asyncio's default handler."""
    if is_grpc_poller_noise(context):
        logger.debug("grpc.aio poller: %s (spurious, grpc/grpc#25364)", context.get("exception"))
        return
    loop.default_exception_handler(context)


LoopErrorHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]


class ServerThread:
    """An asyncio event loop on a daemon thread of its own, hosting one server, so that it keeps
    answering while the threads of its process are busy.

    The loop exists from the constructor on (handlers may use ``loop`` as soon as the server
    serves); ``start`` runs the server's start-up on it, then the loop runs until ``stop``.

    Args:
        name: the thread's name.
        loop_errors: the loop's exception handler. Default: ``handle_loop_error``.
    """

    def __init__(self, name: str, loop_errors: LoopErrorHandler = handle_loop_error) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(loop_errors)
        self._name = name
        self._thread: threading.Thread | None = None
        self._abandoned = threading.Event()
        """``start`` was interrupted: the loop must not run on once start-up is done."""

    def start(self, startup: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """Runs ``startup()`` on the loop's thread and returns its result. If it raises, the
        thread and the loop end and the error is raised here."""
        if self._thread is not None:
            raise RuntimeError(f"server thread {self._name!r} was already started")
        started: concurrent.futures.Future[R] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(startup, started), name=self._name, daemon=True
        )
        self._thread.start()
        try:
            return started.result()
        except BaseException:
            if not started.done() or started.exception() is None:
                # Interrupted here (a signal handler's SystemExit, KeyboardInterrupt), not a
                # failed start-up: end the loop, which would otherwise run on and keep this
                # join, and so the process, waiting forever. The flag covers a start-up that
                # finishes before the stop is seen; the stop, a loop already running forever.
                self._abandoned.set()
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            raise

    def _run(
        self,
        startup: Callable[[], Coroutine[Any, Any, R]],
        started: concurrent.futures.Future[R],
    ) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            result = self.loop.run_until_complete(startup())
        except BaseException as e:  # handed to start(), which re-raises it
            started.set_exception(e)
            self.loop.close()
            return
        started.set_result(result)
        if not self._abandoned.is_set():
            self.loop.run_forever()
        self.loop.close()

    def call(self, coro: Coroutine[Any, Any, R]) -> R:
        """Runs ``coro`` on the loop and blocks for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self, shutdown: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs ``shutdown()`` (the server's own) on the loop, then ends the loop and waits for
        its thread. Does nothing if the loop is not running (never started, failed to start or
        already stopped)."""
        if not self.running():
            return
        self.call(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.wait()

    def running(self) -> bool:
        """Whether the loop's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the loop has stopped (returns at once if it never started), or for
        ``timeout`` seconds at most; True once it has stopped."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running()


class DaemonThreads:
    """Daemon threads for a server's blocking calls (the ManagerServer's quorum address check,
    which may look names up), off its event loop, each kept for the next call once it is done:
    starting a thread waits until it runs, a scheduling delay on busy cores, paid on the path
    every rank waits on. A call that blocks long (a slow name lookup) does not hold up the
    next: it gets another thread. Daemon threads never delay shutdown or process exit."""

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

    async def call(self, fn: Callable[[], R]) -> R:
        """Runs blocking ``fn`` on one of these threads (``run``) and returns its result (or
        raises its error) on the running event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        # The caller may be cancelled meanwhile; don't warn about an unretrieved error.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

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
            # RuntimeError: the loop closed meanwhile and nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, *outcome)

        self.run(run)
        return await fut

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


def grpc_server(
    service: str,
    rpcs: Sequence[Rpc],
    *,
    max_connections: int,
    idle_connection_ms: int,
    auth_token: str | None,
    server_name: str,
    authenticated: AuthenticatedPeers,
    on_refused: Callable[[], None] = lambda: None,
    group_key: str | None = None,
) -> aio.Server:
    """A grpc.aio server of ``service`` with the RPC table ``rpcs`` (``rpc_table``) and the
    limits of ``server_options``, not yet listening (see ``listen``).

    With ``auth_token`` set, calls to the RPCs that need it must carry it
    (``auth.TokenInterceptor``, which names the server ``server_name`` and calls
    ``on_refused`` per refused call). With ``group_key`` set, calls to the RPCs that need it
    must carry it too (``auth.GroupKeyInterceptor``). The peer of every call that reaches its
    handler is marked in ``authenticated``, for the server's
    ``connection_guard.ConnectionGuard``.
    """
    handler, need_token, need_key = rpc_table(service, rpcs)
    interceptors: list[aio.ServerInterceptor] = []
    if auth_token is not None:
        interceptors.append(
            TokenInterceptor(auth_token, need_token, server_name, on_refused=on_refused)
        )
    if group_key is not None:
        interceptors.append(GroupKeyInterceptor(group_key, need_key, server_name))
    interceptors.append(MarkingInterceptor(authenticated))
    server = aio.server(
        interceptors=interceptors, options=server_options(max_connections, idle_connection_ms)
    )
    server.add_generic_rpc_handlers((handler,))
    return server


class CannotListen(OSError):
    """A server cannot listen on ``bind``; ``problem`` says why, in words."""

    def __init__(self, bind: str, problem: str, in_use: bool) -> None:
        super().__init__(f"cannot listen on {bind}: {problem}")
        self.bind = bind
        self.problem = problem
        self.in_use = in_use
        """Whether the port is taken by another process."""


def listen(server: aio.Server, bind: str) -> int:
    """Makes ``server`` listen on ``host:port`` ``bind`` and returns the port (port 0: the one
    picked). Raises ``CannotListen`` saying why not.

    The address is tried first with a test bind (``netaddr.bind_problem``): gRPC's own failure
    is a bare "port 0" and a raw log line that cannot say what is wrong.
    """
    try:
        host, port = split_host_port(bind, "bind address")
    except ValueError as e:
        raise CannotListen(bind, str(e), in_use=False) from None
    problem = bind_problem(host, port)
    if problem is None:
        try:
            picked = server.add_insecure_port(bind)
        except RuntimeError:
            picked = 0
        if picked:
            return picked
        problem = "gRPC cannot listen there"
    raise CannotListen(bind, problem, in_use=port_in_use(host, port))


def descriptor_limit() -> int:
    """This process's (soft) limit on file descriptors, ``resource.RLIM_INFINITY`` if none."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def countable_descriptors(fd_limit: int) -> int:
    """``fd_limit`` as a number to divide among connections: no limit counts as 2**20."""
    return _UNLIMITED_DESCRIPTORS if fd_limit == resource.RLIM_INFINITY else fd_limit
