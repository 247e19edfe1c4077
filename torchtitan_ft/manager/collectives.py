"""One step's collectives on every rank: the fault-tolerant allreduce over the cross-group
process group, and the step's first error (errors are data).

Docs: architecture.md, "One step" (step 7) and "Where errors become data".
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions
from torch.profiler import record_function

from torchtitan_ft.manager.stats import Counters
from torchtitan_ft.process_group.futures import completed_future, future_with_timeout
from torchtitan_ft.process_group.quantized import quantized_allreduce

T = TypeVar("T")


class ExceptionWithTraceback(Exception):
    """An error recorded by ``report_error``, with the traceback where it was caught."""

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace: str = "".join(traceback.format_exception(e))
        super().__init__(f"{type(e).__name__}: {e}")


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
        log: the Manager's logger (level, message).
    """

    def __init__(
        self, pg: Any, *, timeout: timedelta, counters: Counters, log: Callable[[int, str], None]
    ) -> None:
        self._pg = pg
        self._timeout = timeout
        self._counters = counters
        self._log = log
        self._lock = threading.Lock()
        self._error: ExceptionWithTraceback | None = None
        self._pending: list[torch.futures.Future[Any]] = []
        self.usable = False
        """Whether the process group may run this step's collectives (configured for this
        quorum and not aborted)."""

    def new_step(self) -> None:
        """Forgets the previous step's error and work (training thread, before the quorum)."""
        with self._lock:
            self._error = None
        self._pending = []
        self.usable = False

    def report_error(self, e: BaseException) -> None:
        """Records ``e`` unless the step already has an error (the first is the root cause)."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = ExceptionWithTraceback(e)
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
            with record_function("torchft::manager::allreduce::callback"):
                return finish(fut)

        def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()  # raises the collective's error, swallowed by wrap_future
            except Exception:
                # Peers blocked on this replica (a ring passes through it) fail now instead
                # of at their timeout.
                self.usable = False
                self._pg.abort()
                raise
            if reduce_op == ReduceOp.AVG:
                tensor.div_(participants)
            return tensor

        return self.wrap_future(fut.then(normalize), tensor, None)

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
