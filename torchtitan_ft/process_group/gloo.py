"""The reconfigurable gloo process group, in every rank: CPU collectives across replica groups,
each returning a Work that gives up at the group's timeout.

Facts about gloo in torch 2.13 that shaped this module (measured on CPU, loopback, 2 cores):

- A SIGKILLed peer surfaces on every survivor as "Connection closed by peer" / "Connection reset
  by peer" within milliseconds (13-110 ms from the kill under heavy load), in the collective in
  flight and in every later one on that group. A peer that drops its group does the same.
- A peer that is alive but never joins a collective is only noticed at gloo's own timeout.
  ``abort()`` and ``shutdown()`` of the gloo backend return at once but do **not** unblock such
  a collective, and dropping the last reference to the group blocks the caller until the hung
  collective times out (the destructor joins gloo's worker threads). So :meth:`abort` here
  completes the pending works with an error itself (the waiter is released at once) and frees
  the old group on a helper thread, which does not hold the GIL while it waits.
- If a peer dies before the group is built, construction waits for it until the store timeout
  and raises ``DistStoreError``; a store that cannot be reached takes about twice the timeout
  (the TCPStore client retries). :meth:`ProcessGroupGloo.configure` therefore builds under a
  hard deadline.
- Freeing a gloo group on one of its own worker threads (where a completed work's Python
  callback may hold the last reference) aborts the process ("Resource deadlock avoided"), and
  so does a gloo thread that needs the GIL after interpreter finalization began. Groups are
  therefore always freed on a helper thread, after gloo is done with their works, and closed
  at exit (``lifecycle``).
- gloo supports ``ReduceOp.AVG`` natively in torch 2.13 (allreduce and reduce_scatter); it
  rejects ``PREMUL_SUM``. Its reduce_scatter, send and recv works have no future.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
)

from torchtitan_ft.addresses import GLOO_SOCKET_IFNAME_ENV, gloo_bind_address
from torchtitan_ft.process_group import lifecycle
from torchtitan_ft.process_group.base import (
    COLLECTIVE_ERRORS,
    FailedWork,
    GroupConfig,
    ProcessGroup,
    TimedWork,
    allreduce_options,
    is_collective_error,
)
from torchtitan_ft.process_group.store import connect, is_alive, parse_store_addr

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Helper threads are not daemons, on purpose: each blocks in torch/gloo C++ code for at most
# about the group's timeout, and a daemon thread still inside it when the interpreter finalizes
# aborts the process ("terminate called without an active exception", measured). Non-daemon
# threads make the interpreter wait for them at exit instead.


class _LiveGroup:
    """A built gloo group and the backend works started on it (until they complete)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg: dist.ProcessGroup | None = pg
        self._works: list[Work] = []
        self._lock = threading.Lock()
        self.released = threading.Event()
        """Set once gloo is done with every work started here (``release`` returned)."""

    def track(self, work: Work) -> None:
        with self._lock:
            self._works = [w for w in self._works if not w.is_completed()]
            self._works.append(work)

    def release(self) -> None:
        """Wait until gloo is done with every work started here, then drop the group.

        Blocks up to gloo's timeout for a hung collective. Freeing a group while its worker
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


class ProcessGroupGloo(ProcessGroup):
    """A gloo process group rebuilt on every :meth:`configure`.

    Every collective returns a Work whose ``wait()`` returns within the timeout: it raises the
    collective's error, or ``TimeoutError`` when the timeout passes (and then aborts the group).
    Failed collectives are recorded in :meth:`errored`; once errored, collectives fail at once
    with that error, without communicating, until the next :meth:`configure`. Errors are raised
    here, not swallowed: wrap the group in :class:`ErrorSwallowingProcessGroupWrapper` (or use a
    Manager) to turn them into data.

    The gloo transport binds 127.0.0.1 when the store host is a loopback address; otherwise
    this host's address on the route towards the store, or the interface ``GLOO_SOCKET_IFNAME``
    names (:func:`torchtitan_ft.addresses.gloo_bind_address`).
    Successive groups reuse one TCPStore connection per store address; all groups of the process
    share one gloo device.

    Args:
        timeout: bound for building a group in :meth:`configure` (store connection and
            rendezvous with every peer) and for each collective (gloo's own timeout and
            ``Work.wait()``). Default 60 s.
    """

    _BACKEND_NAME = "torchft-gloo"

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
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self._timeout
        # Peers dial the address the device binds: loopback when the store is on loopback
        # (then every peer is on this host), else this host's address on the route towards the
        # store (gloo's default, the address of this machine's name, is often loopback and
        # would be told to peers on other machines), or GLOO_SOCKET_IFNAME's interface.
        bind = gloo_bind_address(host, os.environ)
        interface = "" if bind else os.environ.get(GLOO_SOCKET_IFNAME_ENV, "").split(",")[0]
        options._devices = [lifecycle.gloo_device(bind or "", interface)]
        backend = dist.ProcessGroupGloo(store, rank, world_size, options)
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

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

    def wait_abandoned(self, timeout: timedelta) -> bool:
        """Waits until gloo is done with every collective of the groups dropped so far (by
        ``abort``, ``configure`` or ``shutdown``): their works failed at once for the caller,
        but gloo may still be writing into their tensors until its own timeout. Returns False
        if that did not happen within ``timeout``. The Manager calls it before reusing a failed
        collective's tensors."""
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

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        lifecycle.keep_forever(*(x for x in (self._group, self._store) if x is not None))
        self._group = None
        self._store = None
        self._dropped = []  # their release threads do not exist in this process
        self._pending.clear()
        self._errored = RuntimeError(
            f"{self._BACKEND_NAME} was inherited through fork: call configure() again"
        )

    def _close_now(self) -> None:
        """Detach and free the current group on this thread (waits for a hung collective)."""
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
        it), :meth:`errored` reports it, later collectives fail fast, and the gloo group is freed
        on a background thread (a collective hung in gloo keeps that thread until gloo's
        timeout; the caller does not wait for it). Call :meth:`configure` to continue.

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
        """Change the timeout of later collectives, of the current group's gloo operations
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
        """``"torchft-gloo"``, as torchft names it."""
        return self._BACKEND_NAME

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._desc}, timeout={self._timeout})"

    # ---- collectives ----

    def _run(
        self, op: str, start: Callable[[dist.ProcessGroup], Work], result: object = None
    ) -> Work:
        """Start a collective on the current group and wrap it in a timed, abortable Work.

        ``result`` is the future's value for backend works that have no future of their own.
        """
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

    def allreduce(
        self,
        tensors: list[torch.Tensor],
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.allreduce`. SUM, AVG, MAX, MIN, PRODUCT are supported."""
        options = allreduce_options(opts)
        return self._run("allreduce", lambda pg: pg.allreduce(tensors, options))

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> Work:
        """See :meth:`ProcessGroup.allreduce_coalesced`."""
        options = opts if opts is not None else AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", lambda pg: pg.allreduce_coalesced(tensors, options))

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.allgather`."""
        options = opts if opts is not None else AllgatherOptions()
        return self._run(
            "allgather", lambda pg: pg.allgather(output_tensors, input_tensors, options)
        )

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.allgather_into_tensor_coalesced`."""
        options = opts if opts is not None else AllgatherOptions()
        return self._run(
            "allgather_into_tensor_coalesced",
            lambda pg: pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, options),
            output_tensors,
        )

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> Work:
        """See :meth:`ProcessGroup.broadcast`."""
        options = opts if opts is not None else BroadcastOptions()
        return self._run("broadcast", lambda pg: pg.broadcast(tensor_list, options))

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.reduce_scatter`."""
        options = opts if opts is not None else ReduceScatterOptions()
        return self._run(
            "reduce_scatter",
            lambda pg: pg.reduce_scatter(output_tensors, input_tensors, options),
            output_tensors,
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.reduce_scatter_tensor_coalesced`."""
        options = opts if opts is not None else ReduceScatterOptions()
        return self._run(
            "reduce_scatter_tensor_coalesced",
            lambda pg: pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, options),
            output_tensors,
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.alltoall_base`."""
        options = opts if opts is not None else AllToAllOptions()
        return self._run(
            "alltoall_base",
            lambda pg: pg.alltoall_base(
                output, input, output_split_sizes, input_split_sizes, options
            ),
            [output],
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> Work:
        """See :meth:`ProcessGroup.all_gather_single`."""
        options = opts if opts is not None else AllgatherOptions()
        return self._run(
            "all_gather_single", lambda pg: pg.all_gather_single(output, input, options), output
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> Work:
        """See :meth:`ProcessGroup.reduce_scatter_single`."""
        options = opts if opts is not None else ReduceScatterOptions()
        return self._run(
            "reduce_scatter_single",
            lambda pg: pg.reduce_scatter_single(output, input, options),
            output,
        )

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: GatherOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.gather`."""
        options = opts if opts is not None else GatherOptions()
        return self._run(
            "gather", lambda pg: pg.gather(output_tensors, input_tensors, options), output_tensors
        )

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ScatterOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.scatter`."""
        options = opts if opts is not None else ScatterOptions()
        return self._run(
            "scatter", lambda pg: pg.scatter(output_tensors, input_tensors, options), output_tensors
        )

    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions | None = None) -> Work:
        """See :meth:`ProcessGroup.reduce`."""
        options = opts if opts is not None else ReduceOptions()
        return self._run("reduce", lambda pg: pg.reduce(tensors, options), tensors)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:
        """See :meth:`ProcessGroup.send`."""
        return self._run("send", lambda pg: pg.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:
        """See :meth:`ProcessGroup.recv`."""
        return self._run("recv", lambda pg: pg.recv(tensors, src_rank, tag), tensors)

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        """See :meth:`ProcessGroup.barrier`."""
        options = opts if opts is not None else BarrierOptions()
        return self._run("barrier", lambda pg: pg.barrier(options))
