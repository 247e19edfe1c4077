"""One step's collectives on every rank: the fault-tolerant allreduce over the cross-group
process group, and the step's first error (errors are data).

Docs: architecture.md, "One step" (step 7) and "Where errors become data".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions
from torch.profiler import record_function

from torchtitan_ft.events import EventKind, EventWriter
from torchtitan_ft.manager.stats import Counters
from torchtitan_ft.process_group.futures import completed_future, future_with_timeout
from torchtitan_ft.process_group.quantized import quantized_allreduce

T = TypeVar("T")


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function(name)`` while a torch profiler runs (on any thread), else a no-op
    context.

    The Manager's spans carry torchft's names (``torchft::manager::allreduce`` etc.) in a
    profile. Entering and leaving ``record_function`` costs two dispatcher calls even when
    nothing records; per collective, inside the backward, that is worth skipping (in a
    profile of the overlapped per-step row, ``record_function.__exit__`` was a tenth of the
    training thread's Python time).
    """
    if torch.autograd.profiler._is_profiler_enabled:  # torch's flag for such quick checks
        return record_function(name)
    return contextlib.nullcontext()


class ExceptionWithTraceback(Exception):
    """An error recorded by ``report_error``, with the traceback where it was caught."""

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace: str = "".join(traceback.format_exception(e))
        super().__init__(f"{type(e).__name__}: {e}")


@dataclass(frozen=True)
class _Call:
    """One ``allreduce`` of the step, as called (to re-run it)."""

    tensor: torch.Tensor
    should_quantize: bool
    reduce_op: ReduceOp.RedOpType


class StepCollectives:
    """The current step's collectives of one rank and the first error recorded in the step.

    Threads: ``report_error`` runs on any thread (the training thread, the quorum thread,
    collective callbacks) and takes the lock; ``usable`` is written by the quorum thread, by
    the training thread and by a failed allreduce's callback; everything else runs on the
    training thread.

    Args:
        pg: the cross-replica-group process group.
        timeout: default deadline of ``wrap_future``.
        counters: where allreduce bytes are counted.
        events: the event stream; the step's first error is a ``FAULT`` event.
        log: the Manager's logger (level, message).
        keep_inputs: copy every allreduce's input before it is reduced, so a failed step can
            re-run its allreduces over a new quorum (``Manager``'s
            ``retry_inflight_allreduce``); costs one copy of the step's allreduced bytes.
    """

    def __init__(
        self,
        pg: Any,
        *,
        timeout: timedelta,
        counters: Counters,
        events: EventWriter,
        log: Callable[[int, str], None],
        keep_inputs: bool = False,
    ) -> None:
        self._pg = pg
        self._timeout = timeout
        self._counters = counters
        self._events = events
        self._log = log
        self._keep_inputs = keep_inputs
        self._lock = threading.Lock()
        self._error: ExceptionWithTraceback | None = None
        self._pending: list[torch.futures.Future[Any]] = []
        self._calls: list[_Call] = []
        self._kept: list[torch.Tensor] = []
        """Copies of the inputs, by call index, reused from step to step (no page faults)."""
        self._replaying = False
        self.first_error_is_collective = False
        """The step's first error was raised by an allreduce in the process group."""
        self.inputs_kept = keep_inputs
        """Every allreduce of this step kept a copy of its input (see ``keep_inputs``)."""
        self.usable = False
        """Whether the process group may run this step's collectives (configured for this
        quorum and not aborted)."""

    def new_step(self) -> None:
        """Forgets the previous step's error and work (training thread, before the quorum)."""
        with self._lock:
            self._error = None
            self.first_error_is_collective = False
        self._pending = []
        self._calls = []
        self.inputs_kept = self._keep_inputs
        self.usable = False

    @property
    def kept_bytes(self) -> int:
        """Bytes held by the kept input copies (the memory cost of ``keep_inputs``)."""
        return sum(t.numel() * t.element_size() for t in self._kept)

    def report_error(self, e: BaseException, *, collective: bool = False) -> None:
        """Records ``e`` unless the step already has an error (the first is the root cause);
        ``collective``: ``e`` was raised by an allreduce in the process group."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = ExceptionWithTraceback(e)
                self.first_error_is_collective = collective
        if first:
            self._events.emit(
                EventKind.FAULT, error=type(e).__name__, message=str(e), collective=collective
            )
        self._log(
            logging.WARNING,
            f"{'error' if first else 'further error'} this step: {type(e).__name__}: {e}",
        )

    @property
    def error(self) -> ExceptionWithTraceback | None:
        """The step's first error, or None."""
        return self._error

    def wrap_future(
        self, fut: torch.futures.Future[T], default: T, timeout: timedelta | None
    ) -> torch.futures.Future[T]:
        """See ``Manager.wrap_future``."""

        def swallow(f: torch.futures.Future[T]) -> T:
            try:
                return f.value()
            except Exception as e:  # recorded: errors are data
                self.report_error(e)
                return default

        wrapped = future_with_timeout(fut, timeout or self._timeout).then(swallow)
        self._pending.append(wrapped)
        return wrapped

    def wait_pending(self) -> None:
        """Waits for every future of ``wrap_future`` (they never raise)."""
        for work in self._pending:
            work.wait()
        self._pending = []

    def allreduce(
        self,
        tensor: torch.Tensor,
        *,
        participants: int,
        participating: bool,
        should_quantize: bool,
        reduce_op: ReduceOp.RedOpType,
    ) -> torch.futures.Future[torch.Tensor]:
        """See ``Manager.allreduce``; the quorum is known (``participants`` groups average,
        this one among them if ``participating``)."""
        if not self._replaying:
            self._keep(tensor, participating, should_quantize, reduce_op)
        try:
            if self._error is not None and not self._join_despite_error(participating):
                return completed_future(tensor)
            if participants < 1:
                raise RuntimeError("quorum has no participants; cannot average")
            if not participating:
                tensor.zero_()
            self._counters.add(allreduce_bytes=tensor.numel() * tensor.element_size())
            if should_quantize:
                fut = quantized_allreduce(tensor, self._pg, ReduceOp.SUM)
            else:
                opts = AllreduceOptions()
                opts.reduceOp = ReduceOp.SUM if reduce_op == ReduceOp.AVG else reduce_op
                fut = self._pg.allreduce([tensor], opts).get_future()
        except Exception as e:  # recorded: the step is discarded, the future completes
            self.report_error(e)
            return completed_future(tensor)

        def normalize(fut: torch.futures.Future[Any]) -> torch.Tensor:
            with profiled("torchft::manager::allreduce::callback"):
                return finish(fut)

        def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()  # raises the collective's error, swallowed by wrap_future
            except Exception as e:
                self.report_error(e, collective=True)
                # Peers blocked on this replica (a ring passes through it) fail now instead
                # of at their timeout.
                self.usable = False
                self._pg.abort()
                raise
            if reduce_op == ReduceOp.AVG:
                tensor.div_(participants)
            return tensor

        return self.wrap_future(fut.then(normalize), tensor, None)

    def _keep(
        self,
        tensor: torch.Tensor,
        participating: bool,
        should_quantize: bool,
        reduce_op: ReduceOp.RedOpType,
    ) -> None:
        """Records the call and, with ``keep_inputs``, copies its input (before the collective
        mutates it) into a buffer reused by the call of the same index next step."""
        i = len(self._calls)
        self._calls.append(_Call(tensor, should_quantize, reduce_op))
        if not self.inputs_kept:
            return
        if not participating:  # zeros are sent: nothing of ours to re-send
            self.inputs_kept = False
            return
        if i == len(self._kept):
            self._kept.append(torch.empty_like(tensor))
        kept = self._kept[i]
        if (kept.shape, kept.dtype, kept.device) != (tensor.shape, tensor.dtype, tensor.device):
            kept = self._kept[i] = torch.empty_like(tensor)
        kept.copy_(tensor)

    def replay(self, *, participants: int, participating: bool) -> None:
        """Re-runs this step's allreduces, in order, over the current (new) quorum: each
        tensor gets its kept input back (zeros if this group no longer participates) and is
        reduced again, averaging over ``participants``. Call ``begin_retry`` and wait for the
        new quorum first; the futures join ``wait_pending``."""
        self._replaying = True
        try:
            for i, call in enumerate(self._calls):
                if participating:
                    call.tensor.copy_(self._kept[i])
                self.allreduce(
                    call.tensor,
                    participants=participants,
                    participating=participating,
                    should_quantize=call.should_quantize,
                    reduce_op=call.reduce_op,
                )
        finally:
            self._replaying = False

    def begin_retry(self) -> None:
        """Forgets the failed attempt's error and work, keeping its calls and their inputs
        (training thread, before the retry's quorum)."""
        with self._lock:
            self._error = None
            self.first_error_is_collective = False
        self._pending = []
        self.usable = False

    def _join_despite_error(self, participating: bool) -> bool:
        """This step already failed here; decides whether to still run a collective.

        Peers would otherwise wait for this replica until the timeout. A non-participant
        (healing, spare) contributes zeros anyway, so it joins while the group works. A
        participant cannot join (its zeros would skew the peers' average): it aborts the
        group so peers fail at once and discard the step too. A broken group is left alone.
        """
        if not self.usable or self._pg.errored() is not None:
            return False
        if not participating:
            return True
        self.usable = False
        self._pg.abort()
        return False
