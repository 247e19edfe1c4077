"""torch's own reconfigurable process group (torch >= 2.14) as the cross-replica-group group,
in every rank: :class:`NativeProcessGroup` wraps a torch group created with
``enable_reconfigure=True`` and re-forms it at each quorum with ``ProcessGroup.reconfigure``
instead of building a new group (``backend.BackendProcessGroup``, the project's own).

Facts about torch's native gloo reconfigure (2.14.1 and 2.15.0, measured on CPU, loopback):

- A handle (``get_reconfigure_handle()``) is ``gloo:<rank>:-1:<rank>:<store host:port>``: the
  rank the backend was created with and its bootstrap store. ``reconfigure`` rendezvouses on
  that store (keys ``reconfigure/<uuid>/...``), so every member must have been created over
  one shared store, with distinct ranks, and that store must live as long as the group: a
  group created over a store of its own waits for its peers there until the timeout. This is
  the safety difference from the project's group, which rendezvouses on the quorum's store
  each time (docs/performance.md, "torch's native reconfigure").
- Handles must be unique, and each uuid may be used once per process.
- ``abort()`` does not unblock a collective whose peer never joins (it returns at gloo's own
  timeout); a SIGKILLed peer fails the collective in flight within a millisecond. So
  collectives here go through :class:`backend.TimedWork` exactly as the project's group does:
  an abort or a timeout releases the waiter at once.
"""

from __future__ import annotations

import logging
import os
import uuid as uuid_module
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_ft.addresses import GLOO_SOCKET_IFNAME_ENV, gloo_bind_address
from torchtitan_ft.process_group import lifecycle
from torchtitan_ft.process_group.backend import (
    BackendProcessGroup,
    _call_with_deadline,
    _LiveGroup,
)
from torchtitan_ft.process_group.base import (
    COLLECTIVE_ERRORS,
    GroupConfig,
    ProcessGroup,
    ReconfigureOptions,
    native_reconfigure_available,
)
from torchtitan_ft.process_group.store import create_store_client, parse_store_addr

logger = logging.getLogger(__name__)

NATIVE_MISSING = (
    "torch {version} has no native reconfigurable process groups (enable_reconfigure needs "
    "torch>=2.14): use ProcessGroupGloo, the project's own reconfigurable group"
)
"""The one line a native group on an older torch is refused with."""


def require_native_reconfigure() -> None:
    """Raises ``RuntimeError`` (one line naming the installed torch) where torch has no
    native reconfigure."""
    if not native_reconfigure_available():
        raise RuntimeError(NATIVE_MISSING.format(version=torch.__version__))


def fresh_uuid() -> int:
    """A communicator uuid for ``reconfigure`` (63 bits, as torchft-nightly draws them)."""
    return uuid_module.uuid4().int & ((1 << 63) - 1)


class NativeProcessGroup(BackendProcessGroup):
    """A torch process group created with ``enable_reconfigure=True`` (gloo, or ``nccl2`` on a
    GPU), re-formed by :meth:`reconfigure` with the members' handles.

    The Manager exchanges the handles through the quorum (``exchanges_handles`` is True): each
    rank sends its own with its quorum request, and every rank reconfigures with the quorum's
    members' handles in replica-rank order and the quorum id as uuid. :meth:`configure`
    (torchft 0.2.0's call) exchanges them through the given store instead. Collectives, their
    timeout, ``abort`` and ``errored`` behave as in :class:`BackendProcessGroup`.

    Args:
        pg: the torch group; ``pg.supports_reconfigure`` must be True.
        timeout: bound of each collective and of each reconfigure. Default 60 s.

    Raises:
        RuntimeError: torch has no native reconfigure.
        ValueError: ``pg`` does not support it (not created with ``enable_reconfigure=True``).
    """

    def __init__(self, pg: dist.ProcessGroup, timeout: timedelta = timedelta(seconds=60)) -> None:
        require_native_reconfigure()
        if not supports_reconfigure(pg):
            raise ValueError(
                f"{type(pg).__name__} (backend {_backend_name(pg)}) does not support "
                "reconfigure: create it with enable_reconfigure=True"
            )
        super().__init__(timeout)
        self._native = pg
        self._BACKEND_NAME = f"native-{_backend_name(pg)}"

    # ---- reconfigure (torch's and torchft-nightly's API) ----

    def exchanges_handles(self) -> bool:
        """True: the Manager exchanges this group's handles through the quorum."""
        return True

    def get_reconfigure_handle(self) -> str:
        """torch's handle of this rank (its initial rank and bootstrap store)."""
        return self._native.get_reconfigure_handle()

    def reconfigure(self, opts: ReconfigureOptions) -> dist.Work:
        """Re-form the group with ``opts.handles`` (a list: ranks by position) under the fresh
        ``opts.uuid``; blocks until it is formed or ``opts.timeout`` (default: the group's)
        passed. Collectives in flight on the previous membership fail.

        Raises:
            ValueError: ``opts.handles`` is empty or does not hold this rank's handle.
            RuntimeError: the group could not be formed in time (also :meth:`errored`).
        """
        handles = list(opts.handles)
        own = self.get_reconfigure_handle()
        if own not in handles:
            raise ValueError(
                f"reconfigure handles {handles} do not include this rank's {own!r} (a member "
                "sent none, e.g. a torchft 0.2.0 group or lighthouse in the quorum)"
            )
        timeout = opts.timeout or self._timeout
        desc = f"uuid={opts.uuid} rank={handles.index(own)}/{len(handles)}"
        self._drop_group(RuntimeError(f"{self._BACKEND_NAME} was reconfigured ({desc})"))
        native = ReconfigureOptions()
        native.uuid = opts.uuid
        native.handles = handles
        native.timeout = timeout
        try:
            _call_with_deadline(
                lambda: self._native.reconfigure(native).wait(),
                timeout,
                f"reconfiguring {self._BACKEND_NAME}",
            )
        except COLLECTIVE_ERRORS as e:
            error = RuntimeError(f"{self._BACKEND_NAME} reconfigure failed ({desc}): {e}")
            with self._lock:
                self._errored = error
            logger.warning("%s", error)
            raise error from e
        with self._lock:
            self._group = _LiveGroup(self._native)
            self._errored = None
            self._rank = handles.index(own)
            self._world_size = len(handles)
            self._desc = desc
        logger.info("%s reconfigured: %s", self._BACKEND_NAME, desc)
        return _done_work()

    def _configure(self, config: GroupConfig) -> None:
        """torchft 0.2.0's ``configure``: the handles go through ``config.store_addr`` (fresh
        per call), then :meth:`reconfigure`."""
        reconfigure_with_store(
            self, config.store_addr, config.rank, config.world_size, self._timeout
        )

    def _create_pg(self, store: dist.Store, host: str, rank: int, world_size: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is reconfigured, never rebuilt")

    def native(self) -> dist.ProcessGroup:
        """The torch group this wraps."""
        return self._native


class ProcessGroupNativeGloo(NativeProcessGroup):
    """torch's native gloo with ``enable_reconfigure=True`` over a bootstrap store shared by
    every member for the group's whole life.

    Args:
        store_addr: ``"host:port/prefix"`` of that TCPStore, served by a process that outlives
            every replica group; the prefix (not empty) keeps this group's keys apart.
        rank: this process's rank on that store, distinct among all processes that will ever
            be members (e.g. its global rank).
        world_size: the number of such ranks (an upper bound of any membership).
        timeout: bound of each collective, reconfigure and the store connection. Default 60 s.
        heal_interfaces: the interfaces the operator pinned heals to (the group listens on
            the first one the store's host answers from, where ``GLOO_SOCKET_IFNAME`` is
            unset); ``None``: ``TORCHFT_HEAL_INTERFACES``, if set. The TorchTitan plugin
            passes ``fault_tolerance.heal_interfaces`` (else that variable).

    Raises:
        RuntimeError: torch has no native reconfigure (one line naming its version).
    """

    def __init__(
        self,
        store_addr: str,
        rank: int,
        world_size: int,
        timeout: timedelta = timedelta(seconds=60),
        heal_interfaces: Sequence[str] | None = None,
    ) -> None:
        require_native_reconfigure()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        store = create_store_client(store_addr, timeout)
        host, _, _ = parse_store_addr(store_addr)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options.enable_reconfigure = True
        # Bound as the project's gloo group binds (loopback for a loopback store; see gloo.py).
        bind = gloo_bind_address(host, os.environ, heal_interfaces)
        interface = "" if bind else os.environ.get(GLOO_SOCKET_IFNAME_ENV, "").split(",")[0]
        options._devices = [lifecycle.gloo_device(bind or "", interface)]
        pg = dist.ProcessGroup(store, rank, world_size)
        backend = dist.ProcessGroupGloo(store, rank, world_size, options)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        super().__init__(pg, timeout)


def _backend_name(pg: Any) -> str:
    try:
        return str(pg._get_backend_name())
    except (AttributeError, RuntimeError):
        return type(pg).__name__


class _DoneWork(dist.Work):
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _done_work() -> dist.Work:
    return _DoneWork()


def reconfigure_with_store(
    pg: Any,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(seconds=60),
) -> None:
    """torchft-nightly's helper: exchange reconfigure handles through the store at
    ``store_addr`` (``"host:port/prefix"``, a fresh prefix per call) and reconfigure ``pg``
    with them (rank 0 draws the uuid). For use without a Manager, which exchanges them through
    the quorum.

    Raises:
        RuntimeError: the store or the reconfigure did not answer within ``timeout``.
    """
    store = create_store_client(store_addr, timeout)
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())
    if rank == 0:
        store.set("uuid", str(fresh_uuid()))
    keys = ["uuid", *(f"handle/{peer}" for peer in range(world_size))]
    store.wait(keys, timeout)
    communicator, *handles = store.multi_get(keys)
    opts = ReconfigureOptions()
    opts.uuid = int(communicator)
    opts.handles = [h.decode("utf-8") for h in handles]
    opts.timeout = timeout
    pg.reconfigure(opts).wait()


def supports_reconfigure(pg: Any) -> bool:
    """Whether the torch group ``pg`` can be reconfigured (False also where torch cannot say:
    an older torch, a group without a backend)."""
    try:
        return bool(getattr(pg, "supports_reconfigure", False))
    except RuntimeError:  # torch raises for a group without a default backend
        return False


def as_manager_group(pg: Any, timeout: timedelta) -> Any:
    """What a Manager drives for ``pg``: a plain torch group created with
    ``enable_reconfigure=True`` wrapped in :class:`NativeProcessGroup` (``timeout``: the
    Manager's, the bound of each collective and reconfigure); anything else as is.

    Raises:
        ValueError: ``pg`` is a plain torch group without reconfigure support (as torchft-nightly
            refuses it).
    """
    if isinstance(pg, ProcessGroup) or not isinstance(pg, dist.ProcessGroup):
        return pg
    if not supports_reconfigure(pg):
        raise ValueError(
            f"the Manager's pg {pg!r} does not support reconfigure: a torch process group "
            "must be created with enable_reconfigure=True (torch>=2.14), or use "
            "torchtitan_ft.process_group.ProcessGroupGloo"
        )
    return NativeProcessGroup(pg, timeout)


def group_type_line(pg: ProcessGroup) -> str:
    """The one line a Manager logs at start, where torch has native reconfigure, saying which
    cross-group group type it drives."""
    if pg.exchanges_handles():
        return (
            f"cross-group process group: {type(pg).__name__}, torch's native reconfigure "
            "(handles exchanged through the quorum)"
        )
    return (
        f"cross-group process group: {type(pg).__name__}, rebuilt over the quorum's store "
        "at each new quorum (torch's native reconfigure is available: NativeProcessGroup)"
    )


__all__: Sequence[str] = [
    "NativeProcessGroup",
    "ProcessGroupNativeGloo",
    "as_manager_group",
    "group_type_line",
    "reconfigure_with_store",
]
