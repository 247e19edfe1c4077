"""The parent side of a baby process group, in every rank: ``ProcessGroupBaby`` spawns the
child (``child.child_main``) on every configure, sends it each collective and completes the
Works as it replies; a collective that overruns the timeout gets the child SIGKILLed. Also the
registry that stops the children at exit."""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import multiprocessing.util
import threading
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Work
from torch.futures import Future

from torchtitan_ft.process_group.baby.child import child_main
from torchtitan_ft.process_group.baby.wire import (
    ErrorInfo,
    Reply,
    ReplyMessage,
    Request,
    share,
    to_wire,
)
from torchtitan_ft.process_group.backend import BackendProcessGroup
from torchtitan_ft.process_group.base import FailedWork, GroupConfig, ProcessGroup, SettledWork
from torchtitan_ft.process_group.collectives import Args, Collective
from torchtitan_ft.process_group.futures import future_with_timeout
from torchtitan_ft.process_group.gloo import ProcessGroupGloo
from torchtitan_ft.process_group.nccl import ProcessGroupNCCL

logger = logging.getLogger(__name__)

CHILD_START_TIMEOUT_S = 120.0
"""How long ``configure`` waits for the spawned child to start (a new Python process importing
torch: about a second on an idle machine, many on a busy one, more when several groups spawn at
once), in seconds. Not counted against the group's ``timeout``, which bounds building the group
with its peers; a child that dies while starting is noticed at once."""


class _BabyWork(SettledWork):
    """A collective sent to the child. ``wait()`` gives up at the timeout and kills the child."""

    def __init__(self, pg: ProcessGroupBaby, child: _Child, op: str, result: object) -> None:
        super().__init__()
        self._pg = pg
        self._child = child
        self._op = op
        self._result = result

    def _error_from(self, error: ErrorInfo) -> Exception:
        """The exception this Work raises for the child's ``(type name, message)``."""
        name, message = error
        kind = TimeoutError if name == "TimeoutError" else RuntimeError
        return kind(f"{self._pg.getBackendName()} {self._op} failed: {name}: {message}")

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = timeout or self._pg._timeout  # timedelta(0): no timeout given
        if not self._done.wait(limit.total_seconds()):
            self._pg._kill_child(
                self._child,
                TimeoutError(
                    f"{self._pg.getBackendName()} {self._op} timed out after {limit}; "
                    "its child process was killed"
                ),
            )
        if self._error is not None:
            raise self._error
        return True


class _Child:
    """One spawned child: its process, the two pipe ends and the collectives in flight."""

    def __init__(self, process: Any, requests: Connection, replies: Connection) -> None:
        self.process = process
        self.requests = requests
        self.replies = replies
        self.send_lock = threading.Lock()
        self.pending: dict[int, _BabyWork] = {}
        self.reader: threading.Thread | None = None
        self._killed = False

    def fail_all(self, error: BaseException) -> int:
        """Fail every collective in flight with ``error``; returns how many there were."""
        pending, self.pending = self.pending, {}
        for work in pending.values():
            work._finish(work._result, error)
        return len(pending)

    def kill(self) -> None:
        """SIGKILL the child and close the request pipe; idempotent. The child is reaped on a
        helper thread; the reply pipe is closed by its reader when the child's end closes
        (closing it here, under a blocked reader, would race with fd reuse)."""
        with self.send_lock:
            if self._killed:
                return
            self._killed = True
            self.requests.close()
        if self.process.is_alive():
            self.process.kill()
        threading.Thread(target=self.process.join, name="torchtitan_ft-baby-reap").start()


_live: weakref.WeakSet[ProcessGroupBaby] = weakref.WeakSet()
_exit_hook_installed = False


def _shutdown_all() -> None:
    for pg in list(_live):
        pg.shutdown()


def _track(pg: ProcessGroupBaby) -> None:
    """Shuts ``pg`` down at exit (the hook is installed on first use). multiprocessing's exit
    handler (which also runs in its own worker processes, where atexit does not) runs
    finalizers of priority >= 0 before it terminates daemonic children: the children are then
    stopped quietly, not terminated under a live reply reader that would log them as lost."""
    global _exit_hook_installed
    _live.add(pg)
    if not _exit_hook_installed:
        _exit_hook_installed = True
        multiprocessing.util.Finalize(None, _shutdown_all, exitpriority=10)


class ProcessGroupBaby(ProcessGroup):
    """Base class of the process groups whose collectives run in a child process.

    :meth:`configure` SIGKILLs the previous child (collectives still in flight fail) and spawns
    a new one, which builds the real group. Every collective returns a Work whose ``wait()``
    returns within the timeout: it raises the collective's error, or ``TimeoutError`` when the
    timeout passes, and then the child is killed. A collective nobody waits for is given up on
    at the same timeout. After an error, :meth:`errored` reports it and collectives fail at
    once until the next ``configure``. After :meth:`shutdown` (or before the first
    ``configure``), collectives raise ``OSError``.

    The Work's future completes with the collective's declared value
    (:meth:`~torchtitan_ft.process_group.collectives.Collective.value`), as
    :class:`ProcessGroupGloo`'s does: the tensors it writes (those it sends, for send), in a
    list for the single-tensor forms; ``None`` for barrier.

    Args:
        timeout: seconds (float) or ``timedelta``; bounds ``configure`` (building the child's
            group with every peer, once the child has started: its start is bounded by
            :data:`CHILD_START_TIMEOUT_S` apart) and each collective. Default 60 s.
    """

    _BACKEND: ClassVar[type[BackendProcessGroup]] = ProcessGroupGloo
    """The group class the child builds."""
    _BACKEND_NAME: ClassVar[str] = "torchft-baby"

    def __init__(self, timeout: float | timedelta = 60.0) -> None:
        super().__init__()
        timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._timeout = timeout
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._errored: Exception | None = None
        self._ids = itertools.count()
        self._rank = 0
        self._world_size = 0

    # ---- lifecycle ----

    def _check_platform(self) -> None:
        """Raise when this machine cannot run the backend (see ProcessGroupBabyNCCL)."""

    def _configure(self, config: GroupConfig) -> None:
        """Kill the current child and spawn one that builds the group for ``config``.

        Raises:
            TimeoutError: if the child did not build its group within the timeout (a peer did
                not join, or the store is unreachable); the child is killed.
            RuntimeError: if the child failed to build its group.
        """
        self._check_platform()
        if mp.current_process().daemon:
            raise RuntimeError(
                f"{type(self).__name__} starts a child process, which a daemonic "
                f"multiprocessing process ({mp.current_process().name}) may not do: start "
                "this process with daemon=False, or use ProcessGroupGloo"
            )
        if config.world_size < 1 or not 0 <= config.rank < config.world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={config.rank}, "
                f"world_size={config.world_size}"
            )
        self._stop_child(RuntimeError(f"{self._BACKEND_NAME} was reconfigured"))
        _track(self)
        ctx = mp.get_context("spawn")
        requests_child, requests_parent = ctx.Pipe(duplex=False)  # (read end, write end)
        replies_parent, replies_child = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=child_main,
            args=(
                self._BACKEND,
                config,
                self._timeout.total_seconds(),
                requests_child,
                replies_child,
            ),
            name=f"{self._BACKEND_NAME}-{config.replica_id}-{config.rank}",
            daemon=True,
        )
        process.start()
        # The child holds its ends now; closing ours makes a dead child show up as EOF.
        requests_child.close()
        replies_child.close()
        child = _Child(process, requests_parent, replies_parent)
        try:
            ready = self._await_ready(child, config)
        except BaseException:
            child.kill()
            replies_parent.close()
            raise
        if ready is not None:
            child.kill()
            replies_parent.close()
            error = RuntimeError(
                f"{self._BACKEND_NAME} configure failed ({config.describe()}): "
                f"{ready[0]}: {ready[1]}"
            )
            with self._lock:
                self._errored = error
            raise error
        child.reader = threading.Thread(
            target=self._read_replies, args=(child,), name="torchtitan_ft-baby-replies", daemon=True
        )
        with self._lock:
            self._child = child
            self._errored = None
            self._rank = config.rank
            self._world_size = config.world_size
        child.reader.start()
        logger.info(
            "%s configured: %s (child pid %d)", self._BACKEND_NAME, config.describe(), process.pid
        )

    def _await_ready(self, child: _Child, config: GroupConfig) -> ErrorInfo | None:
        """Wait for the child's first reply: ``None`` when its group is built, else the error."""
        seconds = self._timeout.total_seconds()
        try:
            # The child's start (spawn, imports) does not count against the timeout.
            started = child.replies.poll(CHILD_START_TIMEOUT_S)
            if started and ReplyMessage(*child.replies.recv()).kind is Reply.STARTED:
                arrived = child.replies.poll(seconds)
                message = ReplyMessage(*child.replies.recv()) if arrived else None
            else:
                message = None
                seconds = CHILD_START_TIMEOUT_S
        except (EOFError, OSError):
            code = child.process.exitcode
            return ("ChildExited", f"the child exited (code {code}) before building its group")
        if message is None:
            error = TimeoutError(
                f"{self._BACKEND_NAME} configure timed out after {seconds:g} seconds "
                f"({config.describe()}): "
                + (
                    "a peer did not join, or the store is unreachable"
                    if started
                    else "the child process did not start"
                )
            )
            with self._lock:
                self._errored = error
            raise error
        return None if message.kind is Reply.READY else message.error

    def _read_replies(self, child: _Child) -> None:
        """Complete the Works as the child reports them; fail them all if it dies."""
        while True:
            try:
                kind, op_id, err = ReplyMessage(*child.replies.recv())
            except (EOFError, OSError):
                child.replies.close()
                break
            with self._lock:
                work = child.pending.pop(op_id, None)
            if work is None:
                continue  # already failed by a timeout or a kill
            if kind is Reply.DONE:
                work._finish(work._result, None)
            else:
                error = work._error_from(err)
                self._record(error)  # before waking the waiter, who may ask errored()
                work._finish(work._result, error)
        self._kill_child(
            child, RuntimeError(f"{self._BACKEND_NAME} child process exited unexpectedly")
        )

    def _record(self, error: Exception) -> None:
        with self._lock:
            if self._errored is None:
                self._errored = error
        logger.warning("%s collective failed: %s", self._BACKEND_NAME, error)

    def _kill_child(self, child: _Child, error: Exception) -> None:
        """Kill ``child`` and fail its collectives with ``error``; recorded in
        :meth:`errored` if it is still the current child."""
        with self._lock:
            current = self._child is child
            if current:
                self._child = None
                if self._errored is None:
                    self._errored = error
            failed = child.fail_all(error)
        child.kill()
        if current:
            logger.warning(
                "%s killed its child process (%d collectives in flight): %s",
                self._BACKEND_NAME,
                failed,
                error,
            )

    def _stop_child(self, error: Exception) -> None:
        """Kill the current child, if any, without recording an error."""
        with self._lock:
            child, self._child = self._child, None
            if child is not None:
                child.fail_all(error)
        if child is not None:
            child.kill()

    def errored(self) -> Exception | None:
        """The first collective or configure error since the last successful ``configure``."""
        with self._lock:
            return self._errored

    def abort(self) -> None:
        """Kill the child now: collectives in flight fail, later ones fail fast until the next
        ``configure``."""
        child = self._child
        if child is not None:
            self._kill_child(child, RuntimeError(f"{self._BACKEND_NAME} aborted"))

    def shutdown(self) -> None:
        """Kill the child; collectives raise ``OSError`` until ``configure`` is called again."""
        self._stop_child(RuntimeError(f"{self._BACKEND_NAME} was shut down"))
        with self._lock:
            self._world_size = 0

    def __del__(self) -> None:
        child = getattr(self, "_child", None)
        if child is not None:
            with contextlib.suppress(Exception):  # interpreter teardown: best effort
                child.kill()

    def size(self) -> int:
        """World size of the current group (0 before ``configure`` and after ``shutdown``)."""
        return self._world_size

    def rank(self) -> int:
        """This process's rank in the current group."""
        return self._rank

    def getBackendName(self) -> str:
        """``"torchft-baby-gloo"`` or ``"torchft-baby-nccl"``, as torchft names them."""
        return self._BACKEND_NAME

    def num_active_work(self) -> int:
        """Number of collectives sent to the child that have not completed."""
        with self._lock:
            child = self._child
            return len(child.pending) if child is not None else 0

    def child_pid(self) -> int | None:
        """Process id of the current child (``None`` when there is none)."""
        child = self._child
        return child.process.pid if child is not None else None

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the timeout of later collectives and configures."""
        self._timeout = timeout

    def get_timeout(self) -> timedelta:
        """The timeout of later collectives and configures."""
        return self._timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self._world_size}, timeout={self._timeout})"

    # ---- collectives ----

    def _run(self, op: str, args: tuple[Any, ...], result: object) -> Work:
        """Send ``op(*args)`` to the child; ``result`` is the Work future's value."""
        share(args)
        wire_args = to_wire(args)
        with self._lock:
            if self._errored is not None:
                return FailedWork(self._errored)
            child = self._child
            if child is None:
                raise OSError(
                    f"{self._BACKEND_NAME}: the handle is closed (not configured, or shut "
                    "down): call configure()"
                )
            op_id = next(self._ids)
            work = _BabyWork(self, child, op, result)
            child.pending[op_id] = work
        try:
            with child.send_lock:
                child.requests.send(Request(op_id, op, wire_args))
        except (OSError, ValueError) as e:  # the child died, or was killed meanwhile
            self._kill_child(child, RuntimeError(f"{self._BACKEND_NAME} child is gone: {e}"))
            return work
        # Give up on it at the timeout even if nobody waits: kill the child then.
        future_with_timeout(work.get_future(), self._timeout).add_done_callback(
            lambda fut: self._on_deadline(child, work, fut)
        )
        return work

    def _on_deadline(self, child: _Child, work: _BabyWork, fut: Future[Any]) -> None:
        if work.is_completed():
            return
        try:
            fut.wait()
        except TimeoutError:
            self._kill_child(
                child,
                TimeoutError(
                    f"{self._BACKEND_NAME} {work._op} timed out after {self._timeout}; "
                    "its child process was killed"
                ),
            )

    def _collective(self, collective: Collective, args: Args) -> Work:
        """Run ``collective`` on the child's group (a :class:`ProcessGroupGloo` or
        :class:`ProcessGroupNCCL`, which implements every collective of the table)."""
        return self._run(collective.name, args, collective.value(args))


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """:class:`ProcessGroupGloo` in a child process that is killed when a collective hangs.

    See :class:`ProcessGroupBaby`. CPU tensors are moved to shared memory on first use.

    Args:
        timeout: seconds or ``timedelta``, for ``configure`` and each collective. Default 60 s.
    """

    _BACKEND = ProcessGroupGloo
    _BACKEND_NAME = "torchft-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """:class:`ProcessGroupNCCL` in a child process that is killed when a collective hangs.

    UNTESTED: this platform has no GPU. ``configure`` raises ``RuntimeError`` on a machine
    without CUDA. CUDA tensors reach the child by CUDA IPC; completion is reported when the
    child's work completes (the parent does not receive CUDA events, unlike torchft, so
    ``wait()`` synchronizes on the CPU). The child has its own CUDA context (about 1 GB).

    Args:
        timeout: seconds or ``timedelta``, for ``configure`` and each collective. Default 60 s.
    """

    _BACKEND = ProcessGroupNCCL
    _BACKEND_NAME = "torchft-baby-nccl"

    def _check_platform(self) -> None:
        if not torch.cuda.is_available() or getattr(dist, "ProcessGroupNCCL", None) is None:
            raise RuntimeError(
                "ProcessGroupBabyNCCL needs CUDA and a torch build with NCCL; this machine has "
                f"neither a usable GPU nor NCCL (torch {torch.__version__}, "
                f"cuda available={torch.cuda.is_available()}). Use ProcessGroupBabyGloo for "
                "CPU tensors."
            )
