"""Process groups for tests, with torchft 0.2.0's names and semantics: ``ProcessGroupDummy``
(a one-process group that communicates nothing and completes every collective at once) and
``FakeProcessGroupWrapper`` (forwards to a real group and fails the next allreduce on request,
to test what a failed collective does to the code around it)."""

from __future__ import annotations

import threading
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
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

from torchtitan_ft.process_group.base import NO_TIMEOUT, CompletedWork, GroupConfig, ProcessGroup


class ProcessGroupDummy(ProcessGroup):
    """A group of one process: every collective completes at once, as it would with one rank.

    Results are what a one-rank group computes: allreduce and broadcast leave the tensors as
    they are; allgather, reduce_scatter and alltoall copy the input to the output. send and
    recv do nothing. Useful to run code that needs a process group (e.g. torch's DDP) without
    communicating. :meth:`configure` only counts its calls (``configure_count``).

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

    def _configure(self, config: GroupConfig) -> None:
        self.configure_count += 1

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

    def allreduce(
        self,
        tensors: list[torch.Tensor],
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """Leaves ``tensors`` as they are."""
        return CompletedWork(tensors)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> Work:
        """Leaves ``tensors`` as they are."""
        return CompletedWork(tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """Copies each input into its (single) output slot."""
        for outputs, tensor in zip(output_tensors, input_tensors, strict=True):
            outputs[0].copy_(tensor)
        return CompletedWork(output_tensors)

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> Work:
        """Leaves ``tensor_list`` as it is."""
        return CompletedWork(tensor_list)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """Copies each input's single chunk to its output."""
        for output, chunks in zip(output_tensors, input_tensors, strict=True):
            output.copy_(chunks[0])
        return CompletedWork(output_tensors)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        """Copies ``input`` to ``output``."""
        output.copy_(input)
        return CompletedWork([output])

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        """Copies each input to its output."""
        for output, tensor in zip(output_tensors, input_tensors, strict=True):
            output.copy_(tensor)
        return CompletedWork(output_tensors)

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        """Copies each input to its output."""
        for output, tensor in zip(output_tensors, input_tensors, strict=True):
            output.copy_(tensor)
        return CompletedWork(output_tensors)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:
        """Does nothing."""
        return CompletedWork(None)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:
        """Does nothing (``tensors`` are left as they are)."""
        return CompletedWork(None)

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        """Completes at once."""
        return CompletedWork(None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FakeProcessGroupWrapper(ProcessGroup):
    """Forwards every collective to ``pg``; :meth:`report_future_error` makes the next
    allreduce fail.

    The failing allreduce still runs on ``pg`` (so the peers are not left waiting); its Work's
    ``wait()`` and future then fail with the reported error. :meth:`configure` forgets a
    reported error that no allreduce consumed yet.

    Args:
        pg: the group that communicates (e.g. ``ProcessGroupGloo`` or ``ProcessGroupDummy``).
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__()
        self._pg = pg
        self._lock = threading.Lock()
        self._future_error: Exception | None = None

    @property
    def parent(self) -> ProcessGroup:
        """The wrapped group."""
        return self._pg

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
        self._pg.configure(**asdict(config))

    def allreduce(
        self,
        tensors: list[torch.Tensor],
        opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType | None = None,
    ) -> Work:
        """Forwarded; fails with the reported error, if any."""
        work = self._pg.allreduce(tensors, opts)
        with self._lock:
            error, self._future_error = self._future_error, None
        return work if error is None else _InjectedErrorWork(work, error)

    def errored(self) -> Exception | None:
        return self._pg.errored()

    def abort(self) -> None:
        self._pg.abort()

    def shutdown(self) -> None:
        self._pg.shutdown()

    def set_timeout(self, timeout: timedelta) -> None:
        self._pg.set_timeout(timeout)

    def size(self) -> int:
        return self._pg.size()

    def getBackendName(self) -> str:
        return self._pg.getBackendName()

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
    ) -> Work:
        return self._pg.allreduce_coalesced(tensors, opts)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        return self._pg.allgather(output_tensors, input_tensors, opts)

    def broadcast(
        self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | None = None
    ) -> Work:
        return self._pg.broadcast(tensor_list, opts)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        return self._pg.reduce_scatter(output_tensors, input_tensors, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions | None = None,
    ) -> Work:
        return self._pg.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions | None = None,
    ) -> Work:
        return self._pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts)

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions | None = None,
    ) -> Work:
        return self._pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:
        return self._pg.send(tensors, dst_rank, tag)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:
        return self._pg.recv(tensors, src_rank, tag)

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        return self._pg.barrier(opts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg!r})"


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
