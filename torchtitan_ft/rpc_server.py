"""What the job's gRPC servers (the lighthouse and the ManagerServer) share: request parsing
that turns bytes which are not the expected message into ``INVALID_ARGUMENT``, the limits
that keep a flood of connections from taking the server's file descriptors, and the filter
for grpc.aio's spurious event-loop errors.

gRPC's generated servicers parse requests themselves and answer a malformed one with
``UNKNOWN`` and an ERROR traceback in the log; handlers registered with ``parser`` receive a
``Malformed`` instead and say what was wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)
logger = logging.getLogger(__name__)

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
