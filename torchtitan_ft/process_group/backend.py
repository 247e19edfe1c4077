"""A reconfigurable process group over a torch c10d backend (gloo or NCCL), in every rank:
:class:`BackendProcessGroup` rebuilds the torch group on every ``configure`` and wraps each
collective in a :class:`TimedWork` that gives up at the group's timeout. ``gloo`` and ``nccl``
subclass it with the backend they build; the gloo facts that shaped it are in ``gloo``'s
docstring.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Work
from torch.futures import Future

from torchtitan_ft.process_group import lifecycle
from torchtitan_ft.process_group.base import (
    COLLECTIVE_ERRORS,
    NO_TIMEOUT,
    FailedWork,
    GroupConfig,
    ProcessGroup,
    SettledWork,
    is_collective_error,
)
from torchtitan_ft.process_group.collectives import Args, Collective
from torchtitan_ft.process_group.store import connect, is_alive, parse_store_addr

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Helper threads are not daemons, on purpose: each blocks in torch/gloo C++ code for at most
# about the group's timeout, and a daemon thread still inside it when the interpreter finalizes
# aborts the process ("terminate called without an active exception", measured). Non-daemon
# threads make the interpreter wait for them at exit instead.


class _LiveGroup:
    """A built torch group and the backend works started on it (until they complete)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg: dist.ProcessGroup | None = pg
        self._works: list[Work] = []
        self._lock = threading.Lock()
        self.released = threading.Event()
        """Set once the backend is done with every work started here (``release`` returned)."""

    def track(self, work: Work) -> None:
        with self._lock:
            self._works = [w for w in self._works if not w.is_completed()]
            self._works.append(work)

    def release(self) -> None:
        """Wait until the backend is done with every work started here, then drop the group.

        Blocks up to the backend's timeout for a hung collective. Freeing a group while its worker
        threads still run a collective aborted processes here ("Resource deadlock avoided"),
        so teardown waits for them first.
        """
        while True:
            with self._lock:
                works, self._works = self._works, []
            if not works:
                break
            for work in works:
                # A failure was already reported to the caller through its own Work.
                with contextlib.suppress(*COLLECTIVE_ERRORS):
                    work.wait()
        self.pg = None
        self.released.set()


def _release_in_background(group: _LiveGroup | None) -> None:
    """Release ``group`` on a helper thread, so the caller never waits for a hung collective.

    The thread waits without holding the GIL.
    """
    if group is not None:
        threading.Thread(target=group.release, name="torchtitan_ft-pg-release").start()


def _call_with_deadline(fn: Callable[[], T], timeout: timedelta, what: str) -> T:
    """Run ``fn`` on a helper thread and give up after ``timeout``.

    A late result is dropped by the helper thread.
    """
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            result = fn()
        except Exception as e:  # handed to the caller, not swallowed
            with lock:
                box["error"] = e
            return
        with lock:
            if box.get("abandoned"):
                return  # result dropped here, on this thread
            box["result"] = result

    thread = threading.Thread(target=run, name="torchtitan_ft-pg-build")
    thread.start()
    thread.join(timeout.total_seconds())
    with lock:
        if "error" in box:
            raise box["error"]
        if "result" in box:
            return box["result"]
        box["abandoned"] = True
    raise TimeoutError(
        f"{what} did not finish within {timeout} (a peer did not join the rendezvous, or the "
        "store is unreachable)"
    )


def torch_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend_type: dist.ProcessGroup.BackendType,
    device: str,
    backend: Any,
) -> dist.ProcessGroup:
    """A torch ``ProcessGroup`` whose only backend, ``backend`` (of type ``backend_type``),
    serves tensors of ``device`` (what :meth:`BackendProcessGroup._create_pg` returns)."""
    pg = dist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(backend_type)
    pg._register_backend(torch.device(device), backend_type, backend)
    return pg


class TimedWork(SettledWork):
    """A collective in flight on a :class:`BackendProcessGroup`, with a timeout and abort.

    Completion is tracked on our own future, set from the backend future's callback (on a gloo
    worker thread) or failed by :meth:`BackendProcessGroup.abort`, whichever comes first. So a
    caller blocked in ``wait()`` is released by an abort even though gloo itself cannot cancel
    the collective.
    """

    def __init__(self, pg: BackendProcessGroup, op: str, timeout: timedelta) -> None:
        super().__init__()
        self._pg = pg
        self._op = op
        self._timeout = timeout

    def _attach(self, backend_work: Work, result: object) -> None:
        """Complete with ``result`` (the collective's declared future value) when
        ``backend_work`` succeeds, or fail with its error."""
        try:
            fut = backend_work.get_future()
        except RuntimeError:
            # gloo's reduce_scatter, send and recv works have no future (torch 2.13): wait for
            # them on a helper thread, which blocks without holding the GIL.
            threading.Thread(
                target=self._wait_backend,
                args=(backend_work, result),
                name=f"torchtitan_ft-{self._op}",
            ).start()
        else:
            fut.add_done_callback(lambda done: self._on_backend_done(done, result))

    def _wait_backend(self, backend_work: Work, result: object) -> None:
        try:
            backend_work.wait()
        except COLLECTIVE_ERRORS as e:
            self._fail(e)
        else:
            self._finish(result, None)

    def _on_backend_done(self, fut: Future[Any], result: object) -> None:
        try:
            fut.value()
        except COLLECTIVE_ERRORS as e:
            self._fail(e)
        else:
            self._finish(result, None)

    def _fail(self, error: BaseException) -> None:
        self._finish(None, error)

    def _record(self, error: BaseException | None) -> None:
        # On the group before waking waiters: they may ask errored().
        self._pg._work_done(self, error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = self._timeout if timeout is None or timeout == NO_TIMEOUT else timeout
        if not self._done.wait(limit.total_seconds()):
            error = TimeoutError(
                f"{self._pg.getBackendName()} {self._op} did not complete within {limit}"
            )
            # The group is unusable once a collective hangs: fail everything in flight.
            self._pg.abort(error)
        if self._error is not None:
            raise self._error
        return True


class BackendProcessGroup(ProcessGroup):
    """A torch process group rebuilt on every :meth:`configure`; subclasses say which backend
    (:meth:`_create_pg`).

    Every collective returns a Work whose ``wait()`` returns within the timeout: it raises the
    collective's error, or ``TimeoutError`` when the timeout passes (and then aborts the group).
    Failed collectives are recorded in :meth:`errored`; once errored, collectives fail at once
    with that error, without communicating, until the next :meth:`configure`. Errors are raised
    here, not swallowed: wrap the group in :class:`ErrorSwallowingProcessGroupWrapper` (or use a
    Manager) to turn them into data. Successive groups reuse one TCPStore connection per store
    address.

    Args:
        timeout: bound for building a group in :meth:`configure` (store connection and
            rendezvous with every peer) and for each collective (the backend's own timeout and
            ``Work.wait()``). Default 60 s.
    """

    _BACKEND_NAME: ClassVar[str]
    """Name of the backend in logs and ``getBackendName()``, e.g. ``"torchft-gloo"``."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__()
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._timeout = timeout
        self._lock = threading.Lock()
        self._group: _LiveGroup | None = None
        self._store: tuple[tuple[str, int], dist.TCPStore] | None = None
        self._errored: Exception | None = None
        self._pending: set[TimedWork] = set()
        self._dropped: list[_LiveGroup] = []
        self._rank = 0
        self._world_size = 0
        self._desc = "unconfigured"
        lifecycle.track(self)

    # ---- lifecycle ----

    def _configure(self, config: GroupConfig) -> None:
        """Drop the current group and build a new one; see :meth:`ProcessGroup.configure`.

        Collectives still in flight on the old group fail with an error. Building waits for
        every peer to join the rendezvous, at most ``timeout``.

        Raises:
            ValueError: if the address, rank or world size is malformed.
            RuntimeError: if the group could not be built within the timeout (e.g. a peer died
                before joining, or the store is unreachable). The error is also returned by
                :meth:`errored` until the next successful ``configure``.
        """
        host, port, prefix = parse_store_addr(config.store_addr)
        rank, world_size = config.rank, config.world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        desc = config.describe()
        self._drop_group(RuntimeError(f"{self._BACKEND_NAME} was reconfigured ({desc})"))

        def build() -> dist.ProcessGroup:
            store = dist.PrefixStore(prefix, self._store_client(host, port))
            return self._create_pg(store, host, rank, world_size)

        try:
            pg = _call_with_deadline(build, self._timeout, f"building {self._BACKEND_NAME}")
        except COLLECTIVE_ERRORS as e:
            self._store = None  # it may be broken or stalled: reconnect next time
            error = RuntimeError(f"{self._BACKEND_NAME} configure failed ({desc}): {e}")
            with self._lock:
                self._errored = error
            logger.warning("%s", error)
            raise error from e
        with self._lock:
            self._group = _LiveGroup(pg)
            self._errored = None
            self._rank = rank
            self._world_size = world_size
            self._desc = desc
        logger.info("%s configured: %s", self._BACKEND_NAME, desc)

    def _store_client(self, host: str, port: int) -> dist.TCPStore:
        """This group's TCPStore client for ``host:port``, reconnecting when needed."""
        cached = self._store
        if cached is not None and cached[0] == (host, port) and is_alive(cached[1]):
            return cached[1]
        client = connect(host, port, self._timeout)
        self._store = ((host, port), client)
        return client

    def _create_pg(
        self, store: dist.Store, host: str, rank: int, world_size: int
    ) -> dist.ProcessGroup:
        """Build the torch group of ``world_size`` ranks over ``store`` (``host`` is the
        store's host); the one method a backend implements."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _create_pg")

    def _detach_group(self, error: Exception) -> tuple[_LiveGroup | None, list[TimedWork]]:
        """Detach the current group and fail its pending works."""
        with self._lock:
            group, self._group = self._group, None
            pending = list(self._pending)
            self._pending.clear()
            if group is not None:  # under the same lock: wait_abandoned sees it at once
                self._dropped = [g for g in self._dropped if not g.released.is_set()] + [group]
        for work in pending:
            work._fail(error)
        return group, pending

    def _drop_group(self, error: Exception) -> list[TimedWork]:
        """Detach the current group and fail its works; the group is freed in the background."""
        group, pending = self._detach_group(error)
        _release_in_background(group)
        return pending

    def can_wait_abandoned(self) -> bool:
        """True: see :meth:`wait_abandoned`."""
        return True

    def get_timeout(self) -> timedelta:
        """The timeout of later collectives and ``configure`` calls."""
        return self._timeout

    def wait_abandoned(self, timeout: timedelta) -> bool:
        """Waits until the backend is done with every collective of the groups dropped so far
        (by ``abort``, ``configure`` or ``shutdown``): their works failed at once for the
        caller, but the backend may still be writing into their tensors until its own timeout.
        Returns False if that did not happen within ``timeout``. The Manager calls it before
        reusing a failed collective's tensors."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            groups = list(self._dropped)
        return all(g.released.wait(max(0.0, deadline - time.monotonic())) for g in groups)

    def __del__(self) -> None:
        # The last reference may go on a gloo worker thread (a completed work's callback holds
        # this object): freeing the group there would make the thread join itself, which
        # aborted processes here ("Resource deadlock avoided"). Free it on a helper thread.
        group = getattr(self, "_group", None)
        if group is None:
            return
        self._group = None
        try:
            _release_in_background(group)
        except RuntimeError:  # interpreter shutting down: no new threads
            lifecycle.keep_forever(group)

    def forget_after_fork(self) -> None:
        """Set aside the group and store inherited through fork (``lifecycle``): their threads
        do not exist in this process. ``configure`` must be called again."""
        self._lock = threading.Lock()
        lifecycle.keep_forever(*(x for x in (self._group, self._store) if x is not None))
        self._group = None
        self._store = None
        self._dropped = []  # their release threads do not exist in this process
        self._pending.clear()
        self._errored = RuntimeError(
            f"{self._BACKEND_NAME} was inherited through fork: call configure() again"
        )

    def close_at_exit(self) -> None:
        """Detach and free the current group on this thread, waiting for a hung collective
        (``lifecycle``, at interpreter exit)."""
        group, _ = self._detach_group(RuntimeError(f"{self._BACKEND_NAME} closed at exit"))
        if group is not None:
            group.release()

    def errored(self) -> Exception | None:
        """The first collective or configure error since the last successful ``configure``.

        ``None`` while the group is healthy (or not configured yet). After an error the group is
        unusable: collectives fail at once with this error until ``configure`` succeeds.
        """
        with self._lock:
            return self._errored

    def abort(self, error: Exception | None = None) -> None:
        """Give up on the current group now.

        Every collective in flight fails with ``error`` (its ``wait()`` returns at once, raising
        it), :meth:`errored` reports it, later collectives fail fast, and the torch group is
        freed on a background thread (a collective hung in the backend keeps that thread until
        the backend's timeout; the caller does not wait for it). Call :meth:`configure` to
        continue.

        Args:
            error: the reason recorded; default ``RuntimeError("... aborted")``.
        """
        reason = error or RuntimeError(f"{self._BACKEND_NAME} aborted ({self._desc})")
        with self._lock:
            if self._errored is None:
                self._errored = reason
        pending = self._drop_group(reason)
        logger.warning("%s aborted (%d in flight): %s", self._BACKEND_NAME, len(pending), reason)

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the timeout of later collectives, of the current group's backend operations
        and of later ``configure`` calls; collectives in flight keep theirs.

        Raises:
            ValueError: if ``timeout`` is not positive.
        """
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        with self._lock:
            self._timeout = timeout
            group = self._group
        if group is not None and group.pg is not None:
            group.pg.set_timeout(timeout)

    def shutdown(self) -> None:
        """Free the current group; in-flight collectives fail. ``configure`` may follow."""
        self._drop_group(RuntimeError(f"{self._BACKEND_NAME} was shut down"))
        with self._lock:
            self._world_size = 0
            self._desc = "unconfigured"

    def size(self) -> int:
        """World size of the current group (0 before the first ``configure``)."""
        return self._world_size

    def rank(self) -> int:
        """This process's rank in the current group."""
        return self._rank

    def getBackendName(self) -> str:
        """``"torchft-gloo"`` or ``"torchft-nccl"``, as torchft names them."""
        return self._BACKEND_NAME

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._desc}, timeout={self._timeout})"

    # ---- collectives ----

    def _run(
        self, op: str, start: Callable[[dist.ProcessGroup], Work], result: object = None
    ) -> Work:
        """Start a collective on the current group and wrap it in a timed, abortable Work
        whose future completes with ``result``."""
        with self._lock:
            group = self._group
            if self._errored is not None:
                return FailedWork(self._errored)
            if group is None or group.pg is None:
                raise RuntimeError(f"{self._BACKEND_NAME} is not configured: call configure()")
            work = TimedWork(self, op, self._timeout)
            self._pending.add(work)
        try:
            backend_work = start(group.pg)
            group.track(backend_work)
            work._attach(backend_work, result)
        except COLLECTIVE_ERRORS as e:
            if not is_collective_error(e):
                raise
            work._fail(e)
        return work

    def _work_done(self, work: TimedWork, error: BaseException | None) -> None:
        with self._lock:
            self._pending.discard(work)
            if error is not None and self._errored is None and isinstance(error, Exception):
                self._errored = error
        if error is not None:
            logger.warning("%s %s failed: %s", self._BACKEND_NAME, work._op, error)

    def _collective(self, collective: Collective, args: Args) -> Work:
        return self._run(
            collective.name, lambda pg: collective.call(pg, args), collective.value(args)
        )
