"""The reconfigurable process group's base class and the Work types its collectives return,
in every rank (the cross-replica-group axis).

The replica groups of a job form a process group whose membership may change at every step. A
torch process group is fixed at construction, so the classes of this package wrap one and
rebuild it on every :meth:`ProcessGroup.configure`, under a fresh TCPStore key prefix (the
Manager passes one per quorum id). They subclass ``torch.distributed.ProcessGroup``, so they
can be passed to ``torch.distributed`` collectives and, once registered
(:meth:`ProcessGroup.register`), to functional collectives.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
    Work,
)
from torch.futures import Future

try:  # torch >= 2.14: native reconfigurable process groups
    from torch._C._distributed_c10d import ReconfigureOptions
except ImportError:

    @dataclass
    class ReconfigureOptions:  # type: ignore[no-redef]
        """torch 2.14's ``ReconfigureOptions`` where torch lacks it: the communicator's
        ``uuid`` (fresh per reconfigure), the members' ``handles`` (a list: ranks by position),
        its ``timeout`` (None: the group's) and backend ``hints``."""

        uuid: int = 0
        handles: list[str] | set[str] = field(default_factory=list)
        timeout: timedelta | None = None
        hints: dict[str, str] = field(default_factory=dict)


from torchtitan_ft.process_group.collectives import COLLECTIVES, Args, Collective
from torchtitan_ft.process_group.futures import completed_future

logger = logging.getLogger(__name__)

# Errors that a failed or timed-out collective raises (DistError and its subclasses are
# RuntimeErrors; TimeoutError and ConnectionError are OSErrors). API misuse (TypeError,
# ValueError, NotImplementedError) is deliberately not in this list.
COLLECTIVE_ERRORS = (RuntimeError, OSError)

NO_TIMEOUT = timedelta(0)
"""What ``Work.wait()`` receives when the caller gave no timeout (also from C++ callers)."""


def native_reconfigure_available() -> bool:
    """Whether this torch has native reconfigurable process groups (torch >= 2.14:
    ``init_process_group(..., enable_reconfigure=True)``, ``ProcessGroup.reconfigure``)."""
    return hasattr(dist.ProcessGroup, "reconfigure")


def is_collective_error(e: BaseException) -> bool:
    """Whether ``e`` is a collective's failure (data) rather than API misuse (raised)."""
    return isinstance(e, COLLECTIVE_ERRORS) and not isinstance(e, NotImplementedError)


@dataclass(frozen=True)
class GroupConfig:
    """What :meth:`ProcessGroup.configure` builds the next group from."""

    store_addr: str
    """``"host:port/prefix"`` of a TCPStore served elsewhere (by the replica group's primary).
    The prefix must be fresh for every call (one per quorum id): the group's rendezvous keys
    live under it."""
    replica_id: str
    """Id of this process's replica group (for logs)."""
    rank: int
    """This process's rank in the new group, in ``[0, world_size)``."""
    world_size: int
    """Number of processes in the new group."""
    quorum_id: int | None = None
    """Id of the quorum this group belongs to (for logs), if known."""
    group_rank: int | None = None
    """This process's rank inside its replica group, if known."""
    group_world_size: int | None = None
    """Number of ranks in each replica group, if known."""
    global_ranks: list[int] | None = field(default=None, hash=False)
    """Global ranks of the new group's members, if known (informational)."""

    def describe(self) -> str:
        """One line for logs and errors."""
        return (
            f"replica_id={self.replica_id} quorum_id={self.quorum_id} "
            f"rank={self.rank}/{self.world_size} "
            f"group_rank={self.group_rank}/{self.group_world_size} store={self.store_addr}"
        )


# --------------------------------------------------------------------------------------------
# Works
# --------------------------------------------------------------------------------------------


class CompletedWork(Work):
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


class FailedWork(Work):
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


class SettledWork(Work):
    """A Work completed once, by :meth:`_finish`, from whichever thread gets there first (a
    backend callback, an abort, a kill): later calls are ignored. Subclasses add ``wait()``."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: Future[Any] = Future()

    def _record(self, error: BaseException | None) -> None:
        """Called under the lock just before waiters wake; nothing by default."""

    def _finish(self, value: object, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._record(error)
            self._done.set()
        # Outside the lock: completing the future runs the caller's callbacks.
        if error is None:
            self._future.set_result(value)
        else:
            self._future.set_exception(error)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Future[Any]:
        return self._future


# --------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------


def reduce_op_of(opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None) -> Any:
    """The reduce op of ``opts`` (allreduce options, a ``ReduceOp``, or ``None``: SUM) as a
    plain ``ReduceOp.RedOpType`` (``ReduceOp.SUM`` etc.)."""
    if isinstance(opts, AllreduceOptions):
        op = opts.reduceOp
    else:
        op = ReduceOp.SUM if opts is None else opts
    for known in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
        if op == known:
            return known
    return op


class ProcessGroup(dist.ProcessGroup):
    """Base class of the reconfigurable process groups.

    A subclass of ``torch.distributed.ProcessGroup``, so ``dist.all_reduce(t, group=pg)`` calls
    :meth:`allreduce` here. The c10d-level rank and size given to the C++ base are placeholders
    (0 and 1); :meth:`size` is overridden.

    The collectives are declared once, in ``collectives.COLLECTIVES``: each gets a method here
    (``allreduce``, ``allgather``, ``send``, ...) that checks its arguments and calls
    :meth:`_collective`, the one hook a subclass implements. Collectives a subclass does not
    support raise ``NotImplementedError``.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._registered_name: str | None = None
        self._rank_info: dict[str, Any] = {}
        self._handle_id = uuid.uuid4().hex
        self._handle_store: dist.TCPStore | None = None

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
        """Rebuild the group for a new quorum; blocks until the group is built. torchft's
        signature (positional arguments work; callers here pass keywords); the arguments are
        :class:`GroupConfig`'s fields. Subclasses implement :meth:`_configure`."""
        self._configure(
            GroupConfig(
                store_addr=store_addr,
                replica_id=replica_id,
                rank=rank,
                world_size=world_size,
                quorum_id=quorum_id,
                group_rank=group_rank,
                group_world_size=group_world_size,
                global_ranks=global_ranks,
            )
        )

    def _configure(self, config: GroupConfig) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    # ---- torchft-nightly's reconfigure API (torch 2.14's names) ----

    @property
    def supports_reconfigure(self) -> bool:  # type: ignore[override]
        """True: every group here can be reconfigured (torchft-nightly's Manager asks)."""
        return True

    def exchanges_handles(self) -> bool:
        """Whether the Manager exchanges this group's handles through the quorum and calls
        :meth:`reconfigure` (a native torch group) rather than :meth:`configure` over the
        quorum's store (False: the project's groups, which rebuild over that store)."""
        return False

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: int | None = None,
    ) -> None:
        """This rank's identity, used by later :meth:`reconfigure` calls (torchft-nightly's
        Manager calls it once)."""
        self._rank_info = {
            "replica_id": replica_id,
            "group_rank": group_rank,
            "group_world_size": group_world_size,
            "global_rank": global_rank,
        }

    def get_reconfigure_handle(self) -> str:
        """This rank's handle for :meth:`reconfigure`, as torchft-nightly's groups make it:
        JSON with a per-object id and a TCPStore this object serves (on first call; peers
        dial ``MASTER_ADDR``, else 127.0.0.1), on which the reconfigure's rendezvous runs
        when this rank is the first member."""
        if self._handle_store is None:
            self._handle_store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False
            )
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        return json.dumps(
            {
                "id": self._handle_id,
                "store": f"{host}:{self._handle_store.port}",
                "global_rank": self._rank_info.get("global_rank"),
            }
        )

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        """Rebuild the group with the members whose handles (:meth:`get_reconfigure_handle`)
        ``opts.handles`` lists, this rank at its own handle's position, over the first
        member's store under ``torchft/<opts.uuid>``: :meth:`configure` with those values.

        Raises:
            ValueError: ``opts.handles`` is not a list, or lacks this rank's handle.
        """
        if not isinstance(opts.handles, list):
            raise ValueError(
                f"reconfigure needs the handles as a list (ranks by position), got "
                f"{type(opts.handles).__name__}"
            )
        peers = [json.loads(handle) for handle in opts.handles]
        ids = [peer["id"] for peer in peers]
        if self._handle_id not in ids:
            raise ValueError(
                f"reconfigure handles {opts.handles} do not include this rank's "
                f"(id {self._handle_id})"
            )
        global_ranks = [peer.get("global_rank") for peer in peers]
        self.configure(
            store_addr=f"{peers[0]['store']}/torchft/{opts.uuid}",
            replica_id=str(self._rank_info.get("replica_id", "")),
            rank=ids.index(self._handle_id),
            world_size=len(peers),
            quorum_id=opts.uuid,
            group_rank=self._rank_info.get("group_rank"),
            group_world_size=self._rank_info.get("group_world_size"),
            global_ranks=None if None in global_ranks else global_ranks,
        )
        return CompletedWork(None)

    def errored(self) -> Exception | None:
        """The error that makes this group unusable until the next ``configure``, if any."""
        return None

    def abort(self) -> None:
        """Abandon the current group: collectives in flight fail, later ones fail fast."""

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the timeout of later collectives (and of later ``configure`` calls).

        Args:
            timeout: the new bound, > 0.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement set_timeout")

    def shutdown(self) -> None:
        """Release the current group; the object can be configured again."""

    # ---- capabilities (what the Manager asks of a group) ----

    def can_wait_abandoned(self) -> bool:
        """Whether :meth:`wait_abandoned` can tell when the backend is done with the
        collectives of dropped groups (``Manager(retry_inflight_allreduce=True)`` needs it).
        False here."""
        return False

    def wait_abandoned(self, timeout: timedelta) -> bool:
        """Wait until the backend is done with every collective of the groups dropped so far
        (by ``abort``, ``configure`` or ``shutdown``): their Works failed at once for the
        caller, but the backend may still be writing into their tensors. Returns False if that
        did not happen within ``timeout``.

        Raises:
            NotImplementedError: when :meth:`can_wait_abandoned` is False.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement wait_abandoned")

    def get_timeout(self) -> timedelta | None:
        """The bound of each collective (what :meth:`set_timeout` set), or ``None`` when the
        group has none."""
        return None

    # ---- collectives ----

    # One method per entry of ``collectives.COLLECTIVES`` (allreduce, allgather, send, ...) is
    # added below the class: each checks its arguments against the table and calls this hook.

    def _collective(self, collective: Collective, args: Args) -> Work:
        """Run ``collective`` with ``args`` (in ``collective.params`` order, defaults filled
        in, options normalized) and return its Work, whose future completes with
        ``collective.value(args)``. The one method a group type implements for its
        collectives."""
        raise NotImplementedError(f"{type(self).__name__} does not implement {collective.name}")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Work:
        """Broadcast a single tensor from ``root``.

        Args:
            tensor: sent by ``root``, overwritten on the other ranks.
            root: rank that sends.
        """
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    # torch's former names of the single-tensor collectives, which some of its callers still
    # use. (c10d's C++ cannot reach the single-tensor forms, so functional collectives use the
    # coalesced forms instead; see ``register``.)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> Work:
        """torch's former name of :meth:`all_gather_single`."""
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> Work:
        """torch's former name of :meth:`reduce_scatter_single`."""
        return self.reduce_scatter_single(output, input, opts)

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

        A registered group can also be a ``DeviceMesh`` dimension
        (``DeviceMesh.from_group(pg, "cpu")``, with the default process group initialized). As
        in torchft, the mesh sees it as a dimension of size 1 holding this process's global
        rank: a mesh cannot resize, while the group's membership changes with every quorum.
        Functional collectives over that dimension run across the group's current members;
        DTensor redistributions, which read the size from the mesh, do not communicate.

        Once registered, ``torch.distributed``'s own API takes the group too
        (``dist.get_backend(pg)``, every collective with ``group=pg``,
        ``dist.destroy_process_group(pg)``, which is how torchft unregisters).

        torch's C++ routes the functional collectives that have a Python hook (all_reduce, its
        coalesced form, all_gather_single_coalesced, reduce_scatter_single_coalesced,
        all_to_all_single, broadcast) to this object. The single-tensor
        ``funcol.all_gather_tensor`` and ``funcol.reduce_scatter_tensor`` have none: c10d looks
        for a C++ backend for device ``cpu``, which a group rebuilt on every quorum cannot
        register once (c10d keeps the first backend registered for a device), so they raise
        "No backend type associated with device type cpu". Use their ``_coalesced`` forms
        with one tensor.

        Args:
            name: a name no other registered group uses.

        Raises:
            ValueError: if ``name`` is empty or taken by another group.
        """
        if not name:
            raise ValueError("register() needs a non-empty name")
        if self._registered_name == name and self in c10d._world.pg_names:
            return self
        owner = next((pg for pg, n in c10d._world.pg_names.items() if n == name), None)
        if owner is not None and owner is not self:
            raise ValueError(f"a process group is already registered under the name {name!r}")
        self.unregister()
        c10d._register_process_group(name, self)
        c10d._world.pg_names[self] = name
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        c10d._world.pg_group_ranks[self] = {global_rank: 0}
        # What torch.distributed's own API reads and clears about a group
        # (``dist.get_backend``, ``dist.destroy_process_group``); no store of c10d's.
        c10d._world.pg_map[self] = (self.getBackendName(), None)
        c10d._world.pg_backend_config[self] = self.getBackendName()
        c10d._world.pg_to_tag[self] = None
        self._registered_name = name
        return self

    def unregister(self) -> None:
        """Remove this group from c10d's registry; a no-op when it is not registered."""
        name = self._registered_name
        if name is None:
            return
        self._registered_name = None
        c10d._world.pg_names.pop(self, None)
        for table in (
            c10d._world.pg_group_ranks,
            c10d._world.pg_map,
            c10d._world.pg_backend_config,
            c10d._world.pg_to_tag,
        ):
            table.pop(self, None)
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


def _collective_method(collective: Collective) -> Callable[..., Work]:
    """``ProcessGroup``'s method for ``collective``: binds the call's arguments and hands them
    to ``self._collective``."""

    def method(self: ProcessGroup, *args: Any, **kwargs: Any) -> Work:
        return self._collective(collective, collective.bind(args, kwargs))

    method.__name__ = collective.name
    method.__qualname__ = f"ProcessGroup.{collective.name}"
    method.__doc__ = collective.doc
    method.__signature__ = collective.signature  # type: ignore[attr-defined]
    return method


for _collective_spec in COLLECTIVES:
    setattr(ProcessGroup, _collective_spec.name, _collective_method(_collective_spec))
del _collective_spec
