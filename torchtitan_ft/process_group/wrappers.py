"""Process groups that wrap another, in every rank: the base that forwards every call
(``ProcessGroupWrapper``), errors as data (``ErrorSwallowingProcessGroupWrapper``) and
collectives routed through the Manager (``ManagedProcessGroup``, for model code and
TorchTitan)."""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed.distributed_c10d import (
    ReduceOp,
    Work,
)
from torch.futures import Future

from torchtitan_ft.process_group.base import (
    COLLECTIVE_ERRORS,
    NO_TIMEOUT,
    CompletedWork,
    GroupConfig,
    ProcessGroup,
    ReconfigureOptions,
    is_collective_error,
    reduce_op_of,
)
from torchtitan_ft.process_group.collectives import Args, Collective
from torchtitan_ft.process_group.futures import completed_future

logger = logging.getLogger(__name__)


class ManagerLike(Protocol):
    """What ``ManagedProcessGroup`` uses of a ``Manager`` (any object with these works)."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Future[torch.Tensor]: ...

    def num_participants(self) -> int: ...

    def report_error(self, e: BaseException) -> None: ...


# --------------------------------------------------------------------------------------------
# Forwarding
# --------------------------------------------------------------------------------------------


class ProcessGroupWrapper(ProcessGroup):
    """A process group that hands everything to another one, ``pg``: configure, abort, errors,
    timeouts, the capabilities the Manager asks about (:meth:`can_wait_abandoned`,
    :meth:`get_timeout`) and every collective of the table
    (:data:`~torchtitan_ft.process_group.collectives.COLLECTIVES`). The base of wrappers that
    change what some calls do: subclasses override :meth:`_collective`, which every collective
    goes through, or single methods. As it is, it changes nothing.

    Args:
        pg: the process group that does the communication.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__()
        self._pg = pg

    @property
    def parent(self) -> ProcessGroup:
        """The wrapped process group."""
        return self._pg

    def _configure(self, config: GroupConfig) -> None:
        self._pg.configure(**asdict(config))

    def exchanges_handles(self) -> bool:
        """The wrapped group's :meth:`ProcessGroup.exchanges_handles`."""
        return self._pg.exchanges_handles()

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: int | None = None,
    ) -> None:
        """Set the wrapped group's rank info."""
        self._pg.set_rank_info(replica_id, group_rank, group_world_size, global_rank)

    def get_reconfigure_handle(self) -> str:
        """The wrapped group's handle."""
        return self._pg.get_reconfigure_handle()

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        """Reconfigure the wrapped group."""
        return self._pg.reconfigure(opts)

    def errored(self) -> Exception | None:
        """The wrapped group's :meth:`ProcessGroup.errored`."""
        return self._pg.errored()

    def abort(self) -> None:
        """Abort the wrapped group."""
        self._pg.abort()

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the wrapped group's timeout."""
        self._pg.set_timeout(timeout)

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
        return f"{type(self).__name__}(pg={self._pg!r})"

    def can_wait_abandoned(self) -> bool:
        """The wrapped group's :meth:`ProcessGroup.can_wait_abandoned`."""
        return self._pg.can_wait_abandoned()

    def wait_abandoned(self, timeout: timedelta) -> bool:
        """The wrapped group's :meth:`ProcessGroup.wait_abandoned`."""
        return self._pg.wait_abandoned(timeout)

    def get_timeout(self) -> timedelta | None:
        """The wrapped group's :meth:`ProcessGroup.get_timeout`."""
        return self._pg.get_timeout()

    def _collective(self, collective: Collective, args: Args) -> Work:
        """Run ``collective`` on the wrapped group, unchanged."""
        return collective.call(self._pg, args)


# --------------------------------------------------------------------------------------------
# Error swallowing
# --------------------------------------------------------------------------------------------


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
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
        super().__init__(pg)
        self._error: Exception | None = None
        self._lock = threading.Lock()

    def _configure(self, config: GroupConfig) -> None:
        """Clear the recorded error and configure the wrapped group.

        A configure failure is recorded as the error (so collectives become no-ops) and raised:
        the caller must know the group is not usable.
        """
        with self._lock:
            self._error = None
        try:
            self._pg.configure(**asdict(config))
        except COLLECTIVE_ERRORS as e:
            if is_collective_error(e):
                self.report_error(e)
            raise

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        """Clear the recorded error and reconfigure the wrapped group (a failure is recorded
        and raised, as in :meth:`configure`)."""
        with self._lock:
            self._error = None
        try:
            return self._pg.reconfigure(opts)
        except COLLECTIVE_ERRORS as e:
            if is_collective_error(e):
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg!r}, error={self._error!r})"

    def _collective(self, collective: Collective, args: Args) -> Work:
        """Run ``collective`` on the wrapped group; after an error, complete at once with the
        collective's usual future value (:meth:`Collective.value`)."""
        default = collective.value(args)
        if self.error() is not None:
            return CompletedWork(default)
        try:
            work = collective.call(self._pg, args)
        except COLLECTIVE_ERRORS as e:
            if not is_collective_error(e):
                raise
            self.report_error(e)
            return CompletedWork(default)
        return _ErrorSwallowingWork(self, work, default)


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
            if timeout is None or timeout == NO_TIMEOUT:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except COLLECTIVE_ERRORS as e:
            if not is_collective_error(e):
                raise
            self._wrapper.report_error(e)
        return True

    def get_future(self) -> Future[Any]:
        def swallow(fut: Future[Any]) -> object:
            try:
                return fut.value()
            except COLLECTIVE_ERRORS as e:
                self._wrapper.report_error(e)
                return self._default

        return self._work.get_future().then(swallow)


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

    Only allreduce and allreduce_coalesced are supported; other collectives raise
    ``NotImplementedError``.

    Args:
        manager: the replica group's ``Manager``. Used: ``allreduce(tensor, reduce_op=op)``
            returning a ``Future`` of the reduced tensor, ``num_participants()`` and
            ``report_error(e)``. ``reduce_op`` is passed as given (the Manager takes SUM, AVG,
            MAX and MIN; ``dist_max`` uses MAX).
        name: c10d group name; default ``"torchtitan_ft_managed_<n>"``. :meth:`register` can
            rename it later (TorchTitan calls ``register("dp_replicate")``).
    """

    def __init__(self, manager: ManagerLike, name: str | None = None) -> None:
        super().__init__()
        self._manager = manager
        self.register(name if name is not None else f"torchtitan_ft_managed_{next(_managed_names)}")

    @property
    def manager(self) -> ManagerLike:
        """The Manager the collectives go through."""
        return self._manager

    def _collective(self, collective: Collective, args: Args) -> Work:
        """``allreduce`` and ``allreduce_coalesced``: one Manager allreduce per tensor, each
        reduced in place (a single tensor is accepted in place of the list; ``opts`` is
        ``AllreduceOptions`` or a ``ReduceOp``, ``None`` means SUM, as in c10d). The Work's
        future completes with the list of tensors. Other collectives raise
        ``NotImplementedError``."""
        if collective.name not in ("allreduce", "allreduce_coalesced"):
            raise NotImplementedError(
                f"{type(self).__name__} supports allreduce and allreduce_coalesced only, "
                f"not {collective.name}"
            )
        tensors, opts = args
        tensor_list = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = reduce_op_of(opts.reduceOp)
        futures: list[Future[Any]] = []
        for tensor in tensor_list:
            try:
                futures.append(self._manager.allreduce(tensor, reduce_op=op))
            except COLLECTIVE_ERRORS as e:
                if not is_collective_error(e):
                    raise
                self._manager.report_error(e)
                futures.append(completed_future(tensor))
        return _ManagedWork(self._manager, futures, tensor_list)

    def size(self) -> int:
        """Number of participants in the current quorum (``manager.num_participants()``)."""
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        """``"torchft-managed"``."""
        return "torchft-managed"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._registered_name!r})"


class _ManagedWork(Work):
    """Waits on the manager's futures; results are copied into the caller's tensors."""

    def __init__(
        self, manager: ManagerLike, futures: list[Future[Any]], tensors: list[torch.Tensor]
    ) -> None:
        super().__init__()
        self._manager = manager
        self._futures = futures
        self._tensors = tensors

    def _apply(self, fut: Future[Any], tensor: torch.Tensor) -> None:
        try:
            result = fut.wait()
        except COLLECTIVE_ERRORS as e:
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
