"""Running process-group workers in forked processes, for the ``multiprocess`` tests.

Worker functions run in the children, report ``("ok", data)`` or ``("error", traceback)``
through a queue, and are killed if they overrun.
"""

from __future__ import annotations

import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchtitan_ft.process_group import ProcessGroup
from torchtitan_ft.testing.mlp import mp_context


def store_client(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)


def _child(
    fn: Callable[..., Any], rank: int, results: Any, args: tuple[Any, ...]
) -> None:  # runs in a forked process
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))


def run_workers(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...],
    timeout: float,
    expect_killed: frozenset[int] = frozenset(),
) -> dict[int, Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; return each rank's result.
    They fork from the tests' preloaded forkserver (``torchtitan_ft.testing.mlp``): a spawned
    child needs
    seconds to import torch on this 2-core machine, and forking the pytest process itself is
    unsafe once earlier tests have left gRPC threads running in it (seen: a segfault).
    """
    ctx = mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, results, args)) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        while len(outcome) < nprocs - len(expect_killed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            outcome[rank] = (status, value)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    missing = set(range(nprocs)) - set(outcome) - expect_killed
    assert not missing, f"ranks {sorted(missing)} did not report within {timeout}s"
    for r in expect_killed:
        assert procs[r].exitcode == -signal.SIGKILL, f"rank {r} exit code {procs[r].exitcode}"
    for r in outcome:
        assert procs[r].exitcode == 0, f"rank {r} exit code {procs[r].exitcode}"
    return {r: v for r, (_, v) in outcome.items()}


def allreduce_value(
    pg: ProcessGroup, value: float, op: Any = ReduceOp.SUM, n: int = 4
) -> list[float]:
    t = torch.full((n,), float(value))
    pg.allreduce([t], op).wait()
    return t.tolist()
