"""Futures of collectives, in every rank: completed ones, and deadlines on them (one daemon
thread serves every deadline of the process, started on first use).

torchft 0.2.0's ``torchft.futures`` names are here with its signatures: ``future_timeout``
(also ``future_with_timeout``), ``future_wait`` and ``context_timeout``. Its ``stream_timeout``
watches a CUDA stream and is not provided (CPU only).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

import torch

from torchtitan_ft.deadlines import DEADLINES

T = TypeVar("T")

logger = logging.getLogger(__name__)


def completed_future(value: T) -> torch.futures.Future[T]:
    """A future already completed with ``value``."""
    fut: torch.futures.Future[T] = torch.futures.Future()
    fut.set_result(value)
    return fut


def future_with_timeout(
    fut: torch.futures.Future[T], timeout: timedelta
) -> torch.futures.Future[T]:
    """A future completing like ``fut``, or with TimeoutError after ``timeout``."""
    out: torch.futures.Future[T] = torch.futures.Future()
    lock = threading.Lock()
    finished = False

    def claim() -> bool:
        nonlocal finished
        with lock:
            first, finished = not finished, True
        return first

    def on_timeout() -> None:
        if claim():
            out.set_exception(TimeoutError(f"future did not complete within {timeout}"))

    cancel_timeout = DEADLINES.schedule(timeout.total_seconds(), on_timeout)

    def on_done(f: torch.futures.Future[T]) -> None:
        cancel_timeout()
        try:
            value = f.value()
        except Exception as e:  # the future's error, handed on as data
            if claim():
                out.set_exception(e)
            return
        if claim():
            out.set_result(value)

    fut.add_done_callback(on_done)
    return out


def future_timeout(fut: torch.futures.Future[T], timeout: timedelta) -> torch.futures.Future[T]:
    """torchft's name for :func:`future_with_timeout`."""
    return future_with_timeout(fut, timeout)


def future_wait(fut: torch.futures.Future[T], timeout: timedelta) -> T:
    """Waits up to ``timeout`` for ``fut`` and returns its value.

    Raises:
        TimeoutError: ``fut`` did not complete within ``timeout``.
        Exception: the error ``fut`` completed with.
    """
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(timeout.total_seconds()):
        raise TimeoutError(f"future did not complete within {timeout}")
    return fut.value()


@contextmanager
def context_timeout(
    callback: Callable[[], None], timeout: timedelta
) -> Generator[None, None, None]:
    """Calls ``callback`` if the ``with`` block has not exited within ``timeout``.

    The callback runs on the process's deadline thread (it should not block: other deadlines
    wait for it), e.g. to abort a process group whose collective hangs. Leaving the block in
    time cancels it. An error the callback raises is logged.
    """

    def guarded() -> None:
        try:
            callback()
        except Exception:  # a user callback must not end the thread every deadline runs on
            logger.exception("context_timeout callback failed")

    cancel = DEADLINES.schedule(timeout.total_seconds(), guarded)
    try:
        yield
    finally:
        cancel()
