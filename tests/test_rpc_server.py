"""What the servers share (``torchtitan_ft.rpc_server``): the thread hosting a server's loop,
the diagnosis of an address it cannot listen on, the descriptor count, and the event-loop
error filter (grpc.aio's shared poller reports on loops an event was not for are dropped, every
other error still reaches asyncio's handler)."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading

import grpc
import pytest

from torchtitan_ft.rpc_server import (
    CannotListen,
    ServerThread,
    countable_descriptors,
    handle_loop_error,
    is_grpc_poller_noise,
    listen,
)


class PollerCompletionQueue:
    """Named like grpc's Cython class, whose callback handle the filter recognises."""

    def _handle_events(self) -> None:
        pass


POLLER_CALLBACK = PollerCompletionQueue()._handle_events


def _context(error: BaseException, callback=POLLER_CALLBACK) -> dict:
    loop = asyncio.new_event_loop()
    try:
        handle = asyncio.Handle(callback, (), loop)
    finally:
        loop.close()
    return {"message": "Exception in callback", "exception": error, "handle": handle}


@pytest.mark.parametrize(
    "error", [RuntimeError("Event loop is closed"), BlockingIOError(11, "would block")]
)
def test_the_pollers_reports_on_other_loops_are_noise(error: BaseException) -> None:
    assert is_grpc_poller_noise(_context(error))


@pytest.mark.parametrize(
    ("error", "callback"),
    [
        (RuntimeError("something else"), POLLER_CALLBACK),
        (ValueError("Event loop is closed"), POLLER_CALLBACK),
        (RuntimeError("Event loop is closed"), print),  # not the poller's callback
    ],
)
def test_other_errors_are_not(error: BaseException, callback) -> None:
    assert not is_grpc_poller_noise(_context(error, callback))


def test_the_handler_passes_real_errors_on(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            handle_loop_error(loop, _context(RuntimeError("Event loop is closed")))
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            handle_loop_error(loop, _context(RuntimeError("a real failure")))
    finally:
        loop.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "a real failure" in str(errors[0].exc_info[1])


# ------------------------------------------------------------------------------ scaffold


def test_a_server_thread_starts_serves_calls_and_stops_once() -> None:
    host = ServerThread("test-server")
    stops: list[str] = []

    async def startup() -> str:
        return threading.current_thread().name

    async def shutdown() -> None:
        stops.append(threading.current_thread().name)

    async def where() -> str:
        return threading.current_thread().name

    assert host.start(startup) == "test-server"
    assert host.running() and host.call(where()) == "test-server"
    host.stop(shutdown)
    host.stop(shutdown)  # idempotent
    assert stops == ["test-server"] and not host.running() and host.loop.is_closed()
    with pytest.raises(RuntimeError, match="already started"):
        host.start(startup)


def test_a_startup_error_is_raised_by_start_and_ends_the_thread() -> None:
    host = ServerThread("test-server")

    async def startup() -> None:
        raise OSError("cannot listen")

    with pytest.raises(OSError, match="cannot listen"):
        host.start(startup)
    assert not host.running() and host.loop.is_closed()
    host.stop(startup)  # nothing to stop
    host.wait()


async def _listen(bind: str) -> int:
    server = grpc.aio.server()
    try:
        return listen(server, bind)
    finally:
        await server.stop(None)


def test_listen_names_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CannotListen, match=f"port {port} is in use") as excinfo:
            asyncio.run(_listen(f"127.0.0.1:{port}"))
    assert excinfo.value.in_use and excinfo.value.bind == f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("bind", "problem"),
    [
        ("bad..host:4000", "is not a valid host"),
        ("no-port", "is not host:port"),
        ("256.0.0.1:0", "does not resolve"),
    ],
)
def test_listen_says_why_it_cannot(bind: str, problem: str) -> None:
    with pytest.raises(CannotListen, match=problem) as excinfo:
        asyncio.run(_listen(bind))
    assert not excinfo.value.in_use


def test_listen_returns_the_picked_port() -> None:
    assert asyncio.run(_listen("127.0.0.1:0")) > 0


def test_no_descriptor_limit_counts_as_linuxs_ceiling() -> None:
    assert countable_descriptors(resource.RLIM_INFINITY) == 1 << 20
    assert countable_descriptors(1024) == 1024
