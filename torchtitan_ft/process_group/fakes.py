"""Process groups for tests, with torchft 0.2.0's names and semantics: ``ProcessGroupDummy``
(a one-process group that communicates nothing and completes every collective at once) and
``FakeProcessGroupWrapper`` (a ``ProcessGroupWrapper`` that fails the next allreduce on
request, to test what a failed collective does to the code around it)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from torch.distributed.distributed_c10d import (
    Work,
)
from torch.futures import Future

from torchtitan_ft.process_group.base import (
    NO_TIMEOUT,
    CompletedWork,
    GroupConfig,
    ProcessGroup,
    ReconfigureOptions,
)
from torchtitan_ft.process_group.collectives import Args, Collective
from torchtitan_ft.process_group.wrappers import ProcessGroupWrapper


class ProcessGroupDummy(ProcessGroup):
    """A group of one process: every collective completes at once, as it would with one rank.

    Results are what a one-rank group computes (each collective's ``one_rank`` in
    :data:`~torchtitan_ft.process_group.collectives.COLLECTIVES`): allreduce and broadcast
    leave the tensors as they are; allgather, reduce_scatter and alltoall copy the input to the
    output. send and recv do nothing. Futures complete with what the real groups' do. Useful
    to run code that needs a process group (e.g. torch's DDP) without communicating.
    :meth:`configure` only counts its calls (``configure_count``), and so does
    :meth:`reconfigure` (``reconfigure_count``, torchft-nightly's name).

    Args:
        rank: must be 0.
        world: must be 1.

    Raises:
        ValueError: for any other rank or world size.
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        if rank != 0 or world != 1:
            raise ValueError(
                f"ProcessGroupDummy is a group of one process: need rank=0, world=1, "
                f"got rank={rank}, world={world}"
            )
        self._rank = rank
        self._world = world
        self.configure_count = 0
        """How many times :meth:`configure` was called."""
        self.reconfigure_count = 0
        """How many times :meth:`reconfigure` was called."""

    def _configure(self, config: GroupConfig) -> None:
        self.configure_count += 1

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        """Counts the call; ``opts`` is not used (a group of one has no peers to find)."""
        self.reconfigure_count += 1
        return CompletedWork(None)

    def set_timeout(self, timeout: timedelta) -> None:
        """Nothing to time out: accepted and ignored."""

    def size(self) -> int:
        """Always 1."""
        return self._world

    def rank(self) -> int:
        """Always 0."""
        return self._rank

    def getBackendName(self) -> str:
        """``"torchft-dummy"``, as torchft names it."""
        return "torchft-dummy"

    def _collective(self, collective: Collective, args: Args) -> Work:
        """Does what the collective does in a group of one (``collective.one_rank``) and
        completes at once."""
        collective.one_rank(args)
        return CompletedWork(collective.value(args))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Forwards everything to ``pg`` (a :class:`ProcessGroupWrapper`);
    :meth:`report_future_error` makes the next allreduce fail.

    The failing allreduce still runs on ``pg`` (so the peers are not left waiting); its Work's
    ``wait()`` and future then fail with the reported error. :meth:`configure` forgets a
    reported error that no allreduce consumed yet.

    Args:
        pg: the group that communicates (e.g. ``ProcessGroupGloo`` or ``ProcessGroupDummy``).
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._lock = threading.Lock()
        self._future_error: Exception | None = None

    def report_future_error(self, e: Exception) -> None:
        """Make the next allreduce fail with ``e`` (once).

        Args:
            e: the error its Work raises from ``wait()`` and its future completes with.
        """
        with self._lock:
            self._future_error = e

    def _configure(self, config: GroupConfig) -> None:
        with self._lock:
            self._future_error = None
        super()._configure(config)

    def _collective(self, collective: Collective, args: Args) -> Work:
        """Forwarded; an allreduce fails with the reported error, if any."""
        work = super()._collective(collective, args)
        if collective.name != "allreduce":
            return work
        with self._lock:
            error, self._future_error = self._future_error, None
        return work if error is None else _InjectedErrorWork(work, error)


class _InjectedErrorWork(Work):
    """``work``, then ``error``: waits for the real collective and fails with the error."""

    def __init__(self, work: Work, error: Exception) -> None:
        super().__init__()
        self._work = work
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None or timeout == NO_TIMEOUT:
            self._work.wait()
        else:
            self._work.wait(timeout)
        raise self._error

    def get_future(self) -> Future[Any]:
        error = self._error

        def fail(_: Future[Any]) -> Any:
            raise error

        return self._work.get_future().then(fail)
