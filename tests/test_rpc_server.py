"""The servers' event-loop error filter (``torchtitan_ft.rpc_server``): grpc.aio's shared
poller reports on loops an event was not for are dropped, every other error still reaches
asyncio's handler."""

from __future__ import annotations

import asyncio
import logging

import pytest

from torchtitan_ft.rpc_server import handle_loop_error, is_grpc_poller_noise


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
