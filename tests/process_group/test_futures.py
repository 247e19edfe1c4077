"""``torchtitan_ft.process_group.futures``: futures with deadlines, under our names and
torchft's."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from torchtitan_ft.process_group.futures import (
    completed_future,
    context_timeout,
    future_timeout,
    future_wait,
    future_with_timeout,
)


def test_future_with_timeout() -> None:
    ok: torch.futures.Future[int] = torch.futures.Future()
    wrapped = future_with_timeout(ok, timedelta(seconds=5))
    ok.set_result(3)
    assert wrapped.wait() == 3

    failing: torch.futures.Future[int] = torch.futures.Future()
    wrapped = future_with_timeout(failing, timedelta(seconds=5))
    failing.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        wrapped.wait()

    never: torch.futures.Future[int] = torch.futures.Future()
    start = time.monotonic()
    wrapped = future_with_timeout(never, timedelta(milliseconds=50))
    with pytest.raises(TimeoutError):
        wrapped.wait()
    assert time.monotonic() - start < 2
    never.set_result(1)  # late completion is ignored


def test_torchft_future_timeout_and_wait() -> None:
    pending: torch.futures.Future[int] = torch.futures.Future()
    with pytest.raises(TimeoutError, match="future did not complete within"):
        future_timeout(pending, timedelta(milliseconds=10)).wait()

    done: torch.futures.Future[int] = torch.futures.Future()
    timed = future_timeout(done, timedelta(seconds=10))
    done.set_result(4)
    assert timed.wait() == 4

    with pytest.raises(TimeoutError, match="future did not complete within"):
        future_wait(torch.futures.Future(), timedelta(milliseconds=10))
    assert future_wait(completed_future(1), timedelta(seconds=1)) == 1
    failed: torch.futures.Future[int] = torch.futures.Future()
    failed.set_exception(RuntimeError("collective failed"))
    with pytest.raises(RuntimeError, match="collective failed"):
        future_wait(failed, timedelta(seconds=1))


def test_context_timeout_fires_only_when_the_block_overruns() -> None:
    fired = threading.Event()
    with context_timeout(fired.set, timedelta(milliseconds=10)):
        # The block stays until the callback has run on the deadline thread.
        assert fired.wait(5.0)

    def must_not_run() -> None:
        raise AssertionError("the deadline of a finished block fired")

    late = threading.Event()
    with context_timeout(must_not_run, timedelta(milliseconds=50)):
        pass
    # A later deadline firing shows the cancelled one (earlier) was skipped.
    with context_timeout(late.set, timedelta(milliseconds=100)):
        assert late.wait(5.0)
