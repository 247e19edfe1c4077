"""Reconfigurable process groups for the cross-replica-group axis.

The replica groups of a job form a process group whose membership may change at every step: a
group dies, a replacement joins. torch's process groups are fixed at construction, so the
classes here wrap one and rebuild it on every :meth:`ProcessGroup.configure` call, on a fresh
TCPStore key prefix (the manager passes one prefix per quorum id). They subclass
``torch.distributed.ProcessGroup`` so they can be passed to ``torch.distributed`` collectives
and, once registered (:meth:`ProcessGroup.register`), to functional collectives.

- :class:`ProcessGroupGloo`: CPU collectives over gloo, each returning a :class:`Work` whose
  ``wait()`` gives up at the group's timeout; failures are recorded (:meth:`errored`) and the
  group fails fast until it is configured again.
- :class:`ErrorSwallowingProcessGroupWrapper`: errors are data. The first error is recorded,
  later collectives complete at once without communicating, nothing raises out of ``wait()``.
- :class:`ManagedProcessGroup`: allreduce routed through a ``Manager`` (participants, averaging
  over participants, error reporting), registered with c10d under a name.
- :class:`ProcessGroupNCCL`: the same interface over NCCL. Untested: no GPU here.

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
  by an ``atexit`` hook.
- gloo supports ``ReduceOp.AVG`` natively in torch 2.13 (allreduce and reduce_scatter); it
  rejects ``PREMUL_SUM``. Its reduce_scatter, send and recv works have no future.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
    Work,
)
from torch.futures import Future

from torchtitan_ft.addresses import GLOO_SOCKET_IFNAME_ENV, gloo_bind_address
from torchtitan_ft.futures import completed_future

if TYPE_CHECKING:
    from torchtitan_ft.manager import Manager

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "create_store_client",
    "parse_store_addr",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that a failed or timed-out collective raises (DistError and its subclasses are
# RuntimeErrors; TimeoutError and ConnectionError are OSErrors). API misuse (TypeError,
# ValueError, NotImplementedError) is deliberately not in this list.
_COLLECTIVE_ERRORS = (RuntimeError, OSError)

_NO_TIMEOUT = timedelta(0)
"""What ``Work.wait()`` receives when the caller gave no timeout (also from C++ callers)."""


def _is_collective_error(e: BaseException) -> bool:
    return isinstance(e, _COLLECTIVE_ERRORS) and not isinstance(e, NotImplementedError)


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Split ``"host:port/prefix"`` into ``(host, port, prefix)``.

    Args:
        store_addr: TCPStore address with a key prefix, e.g. ``"127.0.0.1:29600/torchft/3/0"``.
            An IPv6 host may be bracketed (``"[::1]:29600/p"``). The prefix must not be empty:
            every group built on the store needs its own keys.

    Raises:
        ValueError: if the address does not have that shape.
    """
    addr, sep, prefix = store_addr.partition("/")
    host, colon, port_text = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not prefix or not colon or not host or not port_text.isdigit():
        raise ValueError(
            f"store_addr must look like 'host:port/prefix' with a non-empty prefix, "
            f"got {store_addr!r}"
        )
    return host, int(port_text), prefix


def create_store_client(store_addr: str, timeout: timedelta) -> dist.Store:
    """Connect to a TCPStore served elsewhere and scope it to the address's prefix.

    Args:
        store_addr: ``"host:port/prefix"`` (see :func:`parse_store_addr`).
        timeout: timeout of the connection and of every store operation (``get``/``wait``).

    Returns:
        a ``PrefixStore`` over a ``TCPStore`` client.
    """
    host, port, prefix = parse_store_addr(store_addr)
    client = dist.TCPStore(
        host_name=host,
        port=port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )
    return dist.PrefixStore(prefix, client)


# TCPStore connections are reused: each ProcessGroupGloo keeps one client per store address
# (its own: a TCPStore client serializes its operations, and a rendezvous ``wait`` holds it).
# torchft opens a new connection per configure, but with torch 2.13 on this platform the store
# server intermittently leaves a new client's handshake unanswered for the whole client
# timeout (measured: the 25th connection to a fresh server stalled in 3 of 3 runs), which
# would cost a reconfigure the full timeout.
#
# One gloo device (transport context with its own event-loop thread) per bind address is
# shared by every group of the process: a device created per group is destroyed with it, and
# tearing groups down on both ends of a connection at once aborted processes here.
_cache_lock = threading.Lock()
_gloo_devices: dict[str, Any] = {}


def _connect_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(
        host_name=host, port=port, is_master=False, wait_for_workers=False, timeout=timeout
    )


def _is_alive(client: dist.TCPStore) -> bool:
    try:
        client.num_keys()  # one round trip: a dead server fails here at once
    except _COLLECTIVE_ERRORS:
        return False
    return True


def _gloo_device(store_host: str) -> Any:
    """The gloo device for groups whose store is on ``store_host``.

    Binds 127.0.0.1 when the store is on a loopback address (then every peer is on this host);
    otherwise this host's address on the route towards the store (the network its peers
    share), or the interface named by ``GLOO_SOCKET_IFNAME``
    (:func:`torchtitan_ft.addresses.gloo_bind_address`). gloo's default, the address of this
    machine's name, is often loopback and would be told to peers on other machines.
    """
    bind = gloo_bind_address(store_host, os.environ)
    ifname = "" if bind else os.environ.get(GLOO_SOCKET_IFNAME_ENV, "").split(",")[0]
    key = bind or (f"interface {ifname}" if ifname else "")
    with _cache_lock:
        device = _gloo_devices.get(key)
        if device is None:
            if bind:
                device = dist.ProcessGroupGloo.create_device(hostname=bind)
            elif ifname:
                device = dist.ProcessGroupGloo.create_device(interface=ifname)
            else:
                device = dist.ProcessGroupGloo.create_default_device()
            _gloo_devices[key] = device
        return device


# --------------------------------------------------------------------------------------------
# Works
# --------------------------------------------------------------------------------------------


class _CompletedWork(Work):
    """A Work that is already done, with ``value`` as its future's result."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self._value = value

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future[Any]:
        return completed_future(self._value)


class _FailedWork(Work):
    """A Work that already failed with ``error`` (raised by ``wait()`` and the future)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self._error

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_exception(self._error)
        return fut


class _TimedWork(Work):
    """A collective in flight on a :class:`ProcessGroupGloo`, with a timeout and abort.

    Completion is tracked on our own future, set from the backend future's callback (on a gloo
    worker thread) or failed by :meth:`ProcessGroupGloo.abort`, whichever comes first. So a
    caller blocked in ``wait()`` is released by an abort even though gloo itself cannot cancel
    the collective.
    """

    def __init__(self, pg: ProcessGroupGloo, op: str, timeout: timedelta) -> None:
        super().__init__()
        self._pg = pg
        self._op = op
        self._timeout = timeout
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: Future[Any] = Future()

    def _attach(self, backend_work: Work, result: object) -> None:
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
            fut.add_done_callback(self._on_backend_done)

    def _wait_backend(self, backend_work: Work, result: object) -> None:
        try:
            backend_work.wait()
        except _COLLECTIVE_ERRORS as e:
            self._fail(e)
        else:
            self._finish(result, None)

    def _on_backend_done(self, fut: Future[Any]) -> None:
        try:
            value = fut.value()
        except _COLLECTIVE_ERRORS as e:
            self._fail(e)
        else:
            self._finish(value, None)

    def _fail(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, value: object, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            # Record the error on the group before waking waiters: they may ask errored().
            self._pg._work_done(self, error)
            self._done.set()
        # Outside the lock: completing the future runs the caller's callbacks.
        if error is None:
            self._future.set_result(value)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = self._timeout if timeout is None or timeout == _NO_TIMEOUT else timeout
        if not self._done.wait(limit.total_seconds()):
            error = TimeoutError(
                f"{self._pg.getBackendName()} {self._op} did not complete within {limit}"
            )
            # The group is unusable once a collective hangs: fail everything in flight.
            self._pg.abort(error)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Future[Any]:
        return self._future


class _ErrorSwallowingWork(Work):
    """Waits on ``work``; a failure is reported to the wrapper and never raised."""

    def __init__(
        self, wrapper: ErrorSwallowingProcessGroupWrapper, work: Work, default: object
    ) -> None:
        super().__init__()
        self._wrapper = wrapper
        self._work = work
        self._default = default

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            if timeout is None or timeout == _NO_TIMEOUT:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except _COLLECTIVE_ERRORS as e:
            if not _is_collective_error(e):
                raise
            self._wrapper.report_error(e)
        return True

    def get_future(self) -> Future[Any]:
        def swallow(fut: Future[Any]) -> object:
            try:
                return fut.value()
            except _COLLECTIVE_ERRORS as e:
                self._wrapper.report_error(e)
                return self._default

        return self._work.get_future().then(swallow)


class _ManagedWork(Work):
    """Waits on the manager's futures; results are copied into the caller's tensors."""

    def __init__(
        self, manager: Manager, futures: list[Future[Any]], tensors: list[torch.Tensor]
    ) -> None:
        super().__init__()
        self._manager = manager
        self._futures = futures
        self._tensors = tensors

    def _apply(self, fut: Future[Any], tensor: torch.Tensor) -> None:
        try:
            result = fut.wait()
        except _COLLECTIVE_ERRORS as e:
            self._manager.report_error(e)
            return
        if isinstance(result, torch.Tensor) and result is not tensor:
            tensor.copy_(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for fut, tensor in zip(self._futures, self._tensors, strict=True):
            self._apply(fut, tensor)
        return True

    def get_future(self) -> Future[Any]:
        def finish(_: Future[Any]) -> list[torch.Tensor]:
            self.wait()
            return self._tensors

        return torch.futures.collect_all(self._futures).then(finish)


# --------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------


def _allreduce_options(opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None) -> Any:
    """Accept what callers pass for an allreduce: options, a ReduceOp, or nothing (SUM)."""
    if isinstance(opts, AllreduceOptions):
        return opts
    options = AllreduceOptions()
    if opts is not None:
        options.reduceOp = opts
    return options


def _reduce_op(opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None) -> Any:
    """The reduce op of ``opts`` as a plain ``ReduceOp.RedOpType`` (``ReduceOp.SUM`` etc.)."""
    op = _allreduce_options(opts).reduceOp
    for known in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
        if op == known:
            return known
    return op


class ProcessGroup(dist.ProcessGroup):
    """Base class of the reconfigurable process groups.

    A subclass of ``torch.distributed.ProcessGroup``, so ``dist.all_reduce(t, group=pg)`` calls
    :meth:`allreduce` here. The c10d-level rank and size given to the C++ base are placeholders
    (0 and 1); :meth:`size` is overridden. Collectives not implemented by a subclass raise
    ``NotImplementedError``.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._registered_name: str | None = None

    # ---- lifecycle ----

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Rebuild the group for a new quorum; blocks until the group is built.

        Args:
            store_addr: ``"host:port/prefix"`` of a TCPStore served elsewhere (by the replica
                group's primary). The prefix must be fresh for every call (one per quorum id):
                the group's rendezvous keys live under it.
            replica_id: id of this process's replica group (for logs).
            rank: this process's rank in the new group, in ``[0, world_size)``.
            world_size: number of processes in the new group.
            quorum_id: id of the quorum this group belongs to (for logs), if known.
            group_rank: this process's rank inside its replica group, if known.
            group_world_size: number of ranks in each replica group, if known.
            global_ranks: global ranks of the new group's members, if known (informational).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    def errored(self) -> Exception | None:
        """The error that makes this group unusable until the next ``configure``, if any."""
        return None

    def abort(self) -> None:
        """Abandon the current group: collectives in flight fail, later ones fail fast."""

    def shutdown(self) -> None:
        """Release the current group; the object can be configured again."""

    # ---- collectives ----

    def allreduce(
        self,
        tensors: list[torch.Tensor],
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """Reduce ``tensors`` in place across the group (``dist.all_reduce``).

        Args:
            tensors: tensors to reduce; each is overwritten with the result.
            opts: ``AllreduceOptions`` or a ``ReduceOp``; ``None`` means SUM.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement allreduce")

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> Work:
        """Reduce several tensors in one collective (``dist.all_reduce_coalesced``).

        Args:
            tensors: tensors to reduce; each is overwritten with the result.
            opts: reduce op (default SUM) and timeout.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement allreduce_coalesced")

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """Gather every rank's input into ``output_tensors`` (``dist.all_gather``).

        Args:
            output_tensors: ``output_tensors[i][r]`` receives rank ``r``'s ``input_tensors[i]``.
            input_tensors: this rank's contribution.
            opts: collective options (timeout).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement allgather")

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> Work:
        """Copy the root's tensors to every rank (``dist.broadcast``).

        Args:
            tensor_list: tensors sent by the root and overwritten on the other ranks.
            opts: ``rootRank`` (default 0) and timeout.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Work:
        """Broadcast a single tensor from ``root``.

        Args:
            tensor: sent by ``root``, overwritten on the other ranks.
            root: rank that sends.
        """
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """Reduce ``input_tensors[i][r]`` over ranks into rank ``r``'s ``output_tensors[i]``.

        Args:
            output_tensors: receive this rank's reduced chunk.
            input_tensors: ``input_tensors[i]`` has one chunk per rank.
            opts: reduce op (default SUM) and timeout.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement reduce_scatter")

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        """Rank ``r`` receives every rank's ``r``-th slice of ``input`` into ``output``
        (``dist.all_to_all_single``); empty split sizes mean equal slices.

        Args:
            output: receives one slice from each rank, in rank order.
            input: split along dim 0 into one slice per rank.
            output_split_sizes: rows received from each rank; [] for equal slices.
            input_split_sizes: rows sent to each rank; [] for equal slices.
            opts: timeout.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement alltoall_base")

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:
        """Send ``tensors`` to ``dst_rank`` (``dist.send``).

        Args:
            tensors: tensors to send.
            dst_rank: receiving rank in this group.
            tag: matches the receiver's tag.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement send")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:
        """Receive into ``tensors`` from ``src_rank`` (``dist.recv``).

        Args:
            tensors: overwritten with the received data.
            src_rank: sending rank in this group.
            tag: matches the sender's tag.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement recv")

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        """Complete once every rank has entered the barrier.

        Args:
            opts: collective options (timeout).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement barrier")

    def size(self) -> int:
        """Number of processes in the current group."""
        raise NotImplementedError(f"{type(self).__name__} does not implement size")

    def getBackendName(self) -> str:
        """Name of the backend, e.g. ``"torchft-gloo"``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement getBackendName")

    # ---- c10d registration ----

    def register(self, name: str) -> ProcessGroup:
        """Register this group with c10d under ``name`` and return it.

        Functional collectives (``torch.distributed._functional_collectives``, used by
        TorchTitan's ``dist_sum``/``dist_max``) look groups up by name in c10d's registry; an
        unregistered Python process group is rejected. A group has at most one name: registering
        again moves it to the new name.

        Args:
            name: a name no other registered group uses.

        Raises:
            ValueError: if ``name`` is empty or taken by another group.
        """
        if not name:
            raise ValueError("register() needs a non-empty name")
        if self._registered_name == name:
            return self
        owner = next((pg for pg, n in c10d._world.pg_names.items() if n == name), None)
        if owner is not None and owner is not self:
            raise ValueError(f"a process group is already registered under the name {name!r}")
        self.unregister()
        c10d._register_process_group(name, self)
        c10d._world.pg_names[self] = name
        self._registered_name = name
        return self

    def unregister(self) -> None:
        """Remove this group from c10d's registry; a no-op when it is not registered."""
        name = self._registered_name
        if name is None:
            return
        self._registered_name = None
        c10d._world.pg_names.pop(self, None)
        try:
            c10d._unregister_process_group(name)
        except RuntimeError:
            logger.debug("process group %r was already unregistered", name)

    @property
    def group_name(self) -> str:
        """The name given to :meth:`register` (c10d's ``ProcessGroup.group_name``)."""
        if self._registered_name is None:
            raise RuntimeError(
                f"{type(self).__name__} has no group name: call register(name) first"
            )
        return self._registered_name

    def _set_group_name(self, name: str) -> None:
        self.register(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# --------------------------------------------------------------------------------------------
# Gloo
# --------------------------------------------------------------------------------------------


# Helper threads are not daemons, on purpose: each blocks in torch/gloo C++ code for at most
# about the group's timeout, and a daemon thread still inside it when the interpreter finalizes
# aborts the process ("terminate called without an active exception", measured). Non-daemon
# threads make the interpreter wait for them at exit instead.


_live_gloo_groups: weakref.WeakSet[ProcessGroupGloo] = weakref.WeakSet()


@atexit.register
def _close_gloo_groups_at_exit() -> None:
    """Free every gloo group while the interpreter is still whole.

    A gloo worker thread that needs the GIL after finalization has begun (e.g. to drop the
    Python callback of a work it just completed) is ended by CPython inside C++ code, which
    aborts the process ("terminate called without an active exception", measured at exit in
    1 of 4 runs of 100 configures). Freeing the groups here joins those threads first.
    """
    for pg in list(_live_gloo_groups):
        pg._close_now()


_kept_forever: list[object] = []
"""Objects that must never be freed: inherited through fork, or orphaned at interpreter exit."""


def _after_fork_in_child() -> None:
    """Make this module usable in a forked child.

    The child inherits the parent's gloo devices, groups and store connections, but none of
    their threads (and shares the sockets): using them would hang, and freeing them would join
    threads that do not exist. They are set aside for good (a forked multiprocessing child ends
    with ``os._exit``),
    and every inherited :class:`ProcessGroupGloo` must be configured again.
    """
    global _cache_lock
    _cache_lock = threading.Lock()
    _kept_forever.extend(_gloo_devices.values())
    _gloo_devices.clear()
    for pg in list(_live_gloo_groups):
        pg._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _LiveGroup:
    """A built gloo group and the backend works started on it (until they complete)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg: dist.ProcessGroup | None = pg
        self._works: list[Work] = []
        self._lock = threading.Lock()

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
                with contextlib.suppress(*_COLLECTIVE_ERRORS):
                    work.wait()
        self.pg = None


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
    names.
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
        self._pending: set[_TimedWork] = set()
        self._rank = 0
        self._world_size = 0
        self._desc = "unconfigured"
        _live_gloo_groups.add(self)

    # ---- lifecycle ----

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Drop the current group and build a new one; see :meth:`ProcessGroup.configure`.

        Collectives still in flight on the old group fail with an error. Building waits for
        every peer to join the rendezvous, at most ``timeout``.

        Raises:
            ValueError: if the address, rank or world size is malformed.
            RuntimeError: if the group could not be built within the timeout (e.g. a peer died
                before joining, or the store is unreachable). The error is also returned by
                :meth:`errored` until the next successful ``configure``.
        """
        host, port, prefix = parse_store_addr(store_addr)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        desc = (
            f"replica_id={replica_id} quorum_id={quorum_id} rank={rank}/{world_size} "
            f"group_rank={group_rank}/{group_world_size} store={store_addr}"
        )
        self._drop_group(RuntimeError(f"{self._BACKEND_NAME} was reconfigured ({desc})"))

        def build() -> dist.ProcessGroup:
            store = dist.PrefixStore(prefix, self._store_client(host, port))
            return self._create_pg(store, host, rank, world_size)

        try:
            pg = _call_with_deadline(build, self._timeout, f"building {self._BACKEND_NAME}")
        except _COLLECTIVE_ERRORS as e:
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
        if cached is not None and cached[0] == (host, port) and _is_alive(cached[1]):
            return cached[1]
        client = _connect_store(host, port, self._timeout)
        self._store = ((host, port), client)
        return client

    def _create_pg(
        self, store: dist.Store, host: str, rank: int, world_size: int
    ) -> dist.ProcessGroup:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self._timeout
        options._devices = [_gloo_device(host)]
        backend = dist.ProcessGroupGloo(store, rank, world_size, options)
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

    def _detach_group(self, error: Exception) -> tuple[_LiveGroup | None, list[_TimedWork]]:
        """Detach the current group and fail its pending works."""
        with self._lock:
            group, self._group = self._group, None
            pending = list(self._pending)
            self._pending.clear()
        for work in pending:
            work._fail(error)
        return group, pending

    def _drop_group(self, error: Exception) -> list[_TimedWork]:
        """Detach the current group and fail its works; the group is freed in the background."""
        group, pending = self._detach_group(error)
        _release_in_background(group)
        return pending

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
            _kept_forever.append(group)

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        _kept_forever.extend(x for x in (self._group, self._store) if x is not None)
        self._group = None
        self._store = None
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
                return _FailedWork(self._errored)
            if group is None or group.pg is None:
                raise RuntimeError(f"{self._BACKEND_NAME} is not configured: call configure()")
            work = _TimedWork(self, op, self._timeout)
            self._pending.add(work)
        try:
            backend_work = start(group.pg)
            group.track(backend_work)
            work._attach(backend_work, result)
        except _COLLECTIVE_ERRORS as e:
            if not _is_collective_error(e):
                raise
            work._fail(e)
        return work

    def _work_done(self, work: _TimedWork, error: BaseException | None) -> None:
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
        options = _allreduce_options(opts)
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


class ProcessGroupNCCL(ProcessGroupGloo):
    """The same reconfigurable group over NCCL, for CUDA tensors.

    UNTESTED: this platform has no GPU, and ``torch.distributed.ProcessGroupNCCL`` does not
    exist in CPU builds of torch (``configure`` then raises ``RuntimeError``). It only swaps the
    backend; timeouts rely on the work's future completing, and abort does not call
    ``ncclCommAbort``.

    Args:
        timeout: as for :class:`ProcessGroupGloo`. Default 60 s.
    """

    _BACKEND_NAME = "torchft-nccl"

    def _create_pg(
        self, store: dist.Store, host: str, rank: int, world_size: int
    ) -> dist.ProcessGroup:
        backend_class = getattr(dist, "ProcessGroupNCCL", None)
        if backend_class is None:
            raise RuntimeError("this torch build has no NCCL support")
        backend = backend_class(store, rank, world_size)
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        return pg


# --------------------------------------------------------------------------------------------
# Error swallowing
# --------------------------------------------------------------------------------------------


class ErrorSwallowingProcessGroupWrapper(ProcessGroup):
    """Errors are data: a process group whose collectives never raise.

    The first error of a collective (raised when it starts, or by its ``wait()`` or future) is
    recorded and returned by :meth:`error`; from then on every collective returns an already
    completed Work without communicating (tensors are left as they are), until
    :meth:`configure` clears the error. ``wait()`` always returns ``True``; a future completes
    with the collective's usual value, or with its input/output tensors after an error.

    Args:
        pg: the process group that does the communication (e.g. :class:`ProcessGroupGloo`).
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__()
        self._pg = pg
        self._error: Exception | None = None
        self._lock = threading.Lock()

    @property
    def parent(self) -> ProcessGroup:
        """The wrapped process group."""
        return self._pg

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Clear the recorded error and configure the wrapped group.

        Arguments as for :meth:`ProcessGroup.configure`. A configure failure is recorded as the
        error (so collectives become no-ops) and raised: the caller must know the group is not
        usable.
        """
        with self._lock:
            self._error = None
        try:
            self._pg.configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id=quorum_id,
                group_rank=group_rank,
                group_world_size=group_world_size,
                global_ranks=global_ranks,
            )
        except _COLLECTIVE_ERRORS as e:
            if _is_collective_error(e):
                self.report_error(e)
            raise

    def report_error(self, e: Exception) -> None:
        """Record ``e`` unless an error is already recorded; later collectives are skipped.

        Args:
            e: the error to record.
        """
        with self._lock:
            if self._error is None:
                self._error = e
                logger.warning("collective error recorded, skipping until reconfigured: %s", e)

    def error(self) -> Exception | None:
        """The first error recorded since the last ``configure``, or ``None``."""
        with self._lock:
            return self._error

    def errored(self) -> Exception | None:
        """The recorded error, else the wrapped group's :meth:`ProcessGroup.errored`."""
        return self.error() or self._pg.errored()

    def abort(self) -> None:
        """Abort the wrapped group."""
        self._pg.abort()

    def shutdown(self) -> None:
        """Shut the wrapped group down."""
        self._pg.shutdown()

    def size(self) -> int:
        """The wrapped group's size."""
        return self._pg.size()

    def getBackendName(self) -> str:
        """The wrapped group's backend name."""
        return self._pg.getBackendName()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg!r}, error={self._error!r})"

    def _forward(self, start: Callable[[], Work], default: object) -> Work:
        if self.error() is not None:
            return _CompletedWork(default)
        try:
            work = start()
        except _COLLECTIVE_ERRORS as e:
            if not _is_collective_error(e):
                raise
            self.report_error(e)
            return _CompletedWork(default)
        return _ErrorSwallowingWork(self, work, default)

    def allreduce(
        self,
        tensors: list[torch.Tensor],
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.allreduce`."""
        return self._forward(lambda: self._pg.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> Work:
        """See :meth:`ProcessGroup.allreduce_coalesced`."""
        return self._forward(lambda: self._pg.allreduce_coalesced(tensors, opts), tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.allgather`."""
        return self._forward(
            lambda: self._pg.allgather(output_tensors, input_tensors, opts), output_tensors
        )

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> Work:
        """See :meth:`ProcessGroup.broadcast`."""
        return self._forward(lambda: self._pg.broadcast(tensor_list, opts), tensor_list)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """See :meth:`ProcessGroup.reduce_scatter`."""
        return self._forward(
            lambda: self._pg.reduce_scatter(output_tensors, input_tensors, opts), output_tensors
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
        return self._forward(
            lambda: self._pg.alltoall_base(
                output, input, output_split_sizes, input_split_sizes, opts
            ),
            [output],
        )

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:
        """See :meth:`ProcessGroup.send`."""
        return self._forward(lambda: self._pg.send(tensors, dst_rank, tag), None)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:
        """See :meth:`ProcessGroup.recv`."""
        return self._forward(lambda: self._pg.recv(tensors, src_rank, tag), tensors)

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        """See :meth:`ProcessGroup.barrier`."""
        return self._forward(lambda: self._pg.barrier(opts), None)


# --------------------------------------------------------------------------------------------
# Managed
# --------------------------------------------------------------------------------------------

_managed_names = itertools.count()


class ManagedProcessGroup(ProcessGroup):
    """The cross-replica-group axis as the Manager sees it, for model code and TorchTitan.

    ``allreduce`` goes through ``manager.allreduce(tensor, reduce_op=...)``: the Manager waits
    for the quorum, lets non-participants contribute zeros, averages over participants and
    records errors as data (the step is then discarded by ``should_commit``). ``size()`` is the
    number of participants of the current quorum. ``wait()`` never raises; a failure is passed
    to ``manager.report_error``.

    The group is registered with c10d at construction (under ``name``, or a generated unique
    name), so it can be passed to ``dist.all_reduce``, to functional collectives (TorchTitan's
    ``dist_sum``/``dist_max(x, mesh, extra_pg)``) and used from an FSDP ``set_all_reduce_hook``.
    Call :meth:`unregister` when done with it: the registry keeps it (and the manager) alive.

    Only allreduce is supported; other collectives raise ``NotImplementedError``.

    Args:
        manager: the replica group's ``Manager``. Used: ``allreduce(tensor, reduce_op=op)``
            returning a ``Future`` of the reduced tensor, ``num_participants()`` and
            ``report_error(e)``. ``reduce_op`` is passed as given (the Manager takes SUM, AVG,
            MAX and MIN; ``dist_max`` uses MAX).
        name: c10d group name; default ``"torchtitan_ft_managed_<n>"``. :meth:`register` can
            rename it later (TorchTitan calls ``register("dp_replicate")``).
    """

    def __init__(self, manager: Manager, name: str | None = None) -> None:
        super().__init__()
        self._manager = manager
        self.register(name if name is not None else f"torchtitan_ft_managed_{next(_managed_names)}")

    @property
    def manager(self) -> Manager:
        """The Manager the collectives go through."""
        return self._manager

    def allreduce(
        self,
        tensors: list[torch.Tensor] | torch.Tensor,
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """Reduce each tensor in place through the Manager; see :meth:`ProcessGroup.allreduce`.

        Args:
            tensors: tensors to reduce (a single tensor is accepted too).
            opts: ``AllreduceOptions`` or ``ReduceOp``; ``None`` means SUM (as in c10d).
        """
        tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = _reduce_op(opts)
        futures: list[Future[Any]] = []
        for tensor in tensor_list:
            try:
                futures.append(self._manager.allreduce(tensor, reduce_op=op))
            except _COLLECTIVE_ERRORS as e:
                if not _is_collective_error(e):
                    raise
                self._manager.report_error(e)
                futures.append(completed_future(tensor))
        return _ManagedWork(self._manager, futures, tensor_list)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> Work:
        """One Manager allreduce per tensor; see :meth:`ProcessGroup.allreduce_coalesced`."""
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        return self.allreduce(tensors, op)

    def size(self) -> int:
        """Number of participants in the current quorum (``manager.num_participants()``)."""
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        """``"torchft-managed"``."""
        return "torchft-managed"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._registered_name!r})"
