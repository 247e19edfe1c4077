"""Deadlines of the whole process on one daemon thread (collective timeouts, the lighthouse
client's quorum stream requests): no ``torch`` import, so the lighthouse and its clients can
use it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class Deadlines:
    """One daemon thread firing callbacks at deadlines (a heap), instead of a
    ``threading.Timer`` thread per collective or quorum request, which cost ~1-2 ms of CPU per
    step (starting a thread waits until it runs: on busy cores, a scheduling delay). A callback
    must be quick: they run one after another on that thread."""

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
            if self._heap[0][1] == key:
                # The thread sleeps until the earliest deadline: it needs waking only when
                # that is this one. (Waking it for every collective, most of which are
                # scheduled behind an earlier one, cost a thread switch each.)
                self._cond.notify()

        def cancel() -> None:
            with self._cond:
                self._cancelled.add(key)
                # Drop it now if it is next (deadlines are mostly cancelled in the order they
                # were set), so that its callback and what that holds (a collective's
                # result) are not kept until its deadline; the thread is not woken for it.
                self._drop_cancelled()

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


DEADLINES = Deadlines()
"""The process's deadlines (its thread starts on first use)."""
