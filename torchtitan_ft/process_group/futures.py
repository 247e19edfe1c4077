"""Futures of collectives, in every rank: completed ones, and deadlines on them (one daemon
thread serves every deadline of the process, started on first use).

torchft 0.2.0's ``torchft.futures`` names are here with its signatures: ``future_timeout``
(also ``future_with_timeout``), ``future_wait`` and ``context_timeout``. Its ``stream_timeout``
watches a CUDA stream and is not provided (CPU only).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

import torch

T = TypeVar("T")

logger = logging.getLogger(__name__)


def completed_future(value: T) -> torch.futures.Future[T]:
    """A future already completed with ``value``."""
    fut: torch.futures.Future[T] = torch.futures.Future()
    fut.set_result(value)
    return fut


class _Deadlines:
    """One daemon thread firing callbacks at deadlines (a heap), instead of a
    ``threading.Timer`` thread per collective, which cost ~1-2 ms of CPU per step."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Calls ``fn`` after ``delay_s`` seconds unless the returned cancel is called first."""
        with self._cond:
            key = next(self._seq)
            heapq.heappush(self._heap, (time.monotonic() + delay_s, key, fn))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ft-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

        def cancel() -> None:
            with self._cond:
                self._cancelled.add(key)

        return cancel

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                    self._drop_cancelled()
                _, key, fn = heapq.heappop(self._heap)
                if key in self._cancelled:
                    self._cancelled.discard(key)
                    continue
            fn()

    def _drop_cancelled(self) -> None:
        while self._heap and self._heap[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(self._heap)[1])


_DEADLINES = _Deadlines()


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

    cancel_timeout = _DEADLINES.schedule(timeout.total_seconds(), on_timeout)

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

    cancel = _DEADLINES.schedule(timeout.total_seconds(), guarded)
    try:
        yield
    finally:
        cancel()
