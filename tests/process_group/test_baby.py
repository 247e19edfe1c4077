"""Process groups whose collectives run in a child process (``torchtitan_ft.process_group.baby``).

The wire format is checked alone (``test_baby_wire.py``); these tests spawn real children
(each imports torch: seconds on this machine), so most are ``multiprocess``. The hang test
SIGSTOPs a real peer (its trainer and its child) in the middle of a collective.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchtitan_ft.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from torchtitan_ft.testing.mlp import mp_context


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped is a zombie: gone for our purposes. The process may vanish
    # between the kill and the read: /proc then raises FileNotFoundError or ProcessLookupError
    # (both OSErrors), or gives an empty stat line.
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[-1].split()
    except OSError:
        return False
    return bool(fields) and fields[0] != "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pid_exists(pid):
            return True
        time.sleep(0.05)
    return False


def test_misuse_is_rejected_before_spawning() -> None:
    with pytest.raises(ValueError, match="timeout must be positive"):
        ProcessGroupBabyGloo(timeout=0)
    pg = ProcessGroupBabyGloo(timeout=5)
    with pytest.raises(OSError, match="handle is closed"):
        pg.allreduce([torch.ones(1)])
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        pg.configure("127.0.0.1:1/p", "r", 2, 2)
    assert pg.child_pid() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_baby_nccl_says_it_needs_cuda() -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=5))
    assert pg.getBackendName() == "torchft-baby-nccl"
    with pytest.raises(
        RuntimeError, match=r"ProcessGroupBabyNCCL needs CUDA.*ProcessGroupBabyGloo"
    ):
        pg.configure("127.0.0.1:1/p", "r", 0, 1)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_one_rank_collectives_reconfigure_shutdown_and_configure_timeout(
    store: dist.TCPStore,
) -> None:
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    try:
        started = time.monotonic()
        pg.configure(f"127.0.0.1:{store.port}/q0", "r", 0, 1)
        child_start_s = time.monotonic() - started  # a child's start, which no timeout counts
        assert (pg.size(), pg.rank(), pg.getBackendName()) == (1, 0, "torchft-baby-gloo")
        first_child = pg.child_pid()
        assert first_child is not None and first_child != os.getpid()

        t = torch.arange(4.0)
        work = pg.allreduce([t], ReduceOp.SUM)
        assert work.wait() and work.is_success()
        assert work.get_future().wait()[0] is t
        assert t.is_shared()  # moved to shared memory in place, so the child wrote into it

        # The child's writes reach the parent's tensors.
        src = torch.arange(4.0) + 10
        out = [[torch.zeros(4)]]
        pg.allgather(out, [src]).wait()
        torch.testing.assert_close(out[0][0], src)
        a2a = torch.zeros(4)
        pg.alltoall_base(a2a, src * 2, [], []).wait()
        torch.testing.assert_close(a2a, src * 2)
        rs = [torch.zeros(4)]
        pg.reduce_scatter(rs, [[src + 1]]).wait()
        torch.testing.assert_close(rs[0], src + 1)
        assert pg.barrier().wait()
        assert pg.broadcast_one(t, 0).wait()
        assert pg.num_active_work() == 0

        # A bad argument fails that collective (in the child), not the process.
        with pytest.raises(RuntimeError, match="allgather failed"):
            pg.allgather([[torch.zeros(4), torch.zeros(4)]], [src]).wait()
        assert pg.errored() is not None

        # Reconfigure: a new child, the old one is gone, the error is cleared.
        pg.configure(f"127.0.0.1:{store.port}/q1", "r", 0, 1)
        assert pg.errored() is None
        assert pg.child_pid() not in (None, first_child)
        assert _wait_gone(first_child, 10)
        pg.allreduce([t]).wait()

        second_child = pg.child_pid()
        assert second_child is not None
        pg.shutdown()
        assert _wait_gone(second_child, 10)
        with pytest.raises(OSError, match="handle is closed"):
            pg.allreduce([t]).wait()
    finally:
        pg.shutdown()

    # A peer that never comes: configure gives up at the timeout and kills the child.
    lonely = ProcessGroupBabyGloo(timeout=timedelta(seconds=8))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 8 seconds"):
        lonely.configure(f"127.0.0.1:{store.port}/q2", "r", 0, 2)
    # It gave up rather than waiting on: the timeout, plus the child's start (outside the
    # timeout; a busy machine's load changes, and once it took 6x the start above), plus killing
    # and scheduling. The timeout itself is the error's "after 8 seconds".
    assert time.monotonic() - start < 8 + 8 * child_start_s + 10
    assert isinstance(lonely.errored(), TimeoutError)
    assert lonely.child_pid() is None


# --------------------------------------------------------------------------------------------
# A peer SIGSTOPped mid-collective
# --------------------------------------------------------------------------------------------


def _peer(port: int, prefix: str, value: float, results: Any) -> None:  # runs in a forked process
    """Rank 1: one allreduce with rank 0, report it and the child's pid, then idle."""
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{port}/{prefix}", "peer", 1, 2)
    t = torch.full((4,), value)
    pg.allreduce([t], ReduceOp.SUM).wait()
    results.put((os.getpid(), pg.child_pid(), t.tolist()))
    time.sleep(600)  # until the test kills it


def _start_peer(port: int, prefix: str, value: float) -> tuple[Any, Any]:
    ctx = mp_context()
    results = ctx.Queue()
    # Not a daemon: a daemonic process may not start children (its baby group spawns one).
    proc = ctx.Process(target=_peer, args=(port, prefix, value, results))
    proc.start()
    return proc, results


def _kill_all(*pids: int | None) -> None:
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigstopped_peer_the_child_is_killed_and_the_group_reconfigures(
    store: dist.TCPStore,
) -> None:
    """Rank 0 (this process) and rank 1 (a forked peer) allreduce once; the peer and its child
    are SIGSTOPped; rank 0's next allreduce hangs until wait()'s timeout, which kills rank 0's
    child while this process goes on; then the group is rebuilt with a fresh peer."""
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))
    peer_pids: list[int | None] = []
    try:
        peer, results = _start_peer(store.port, "q0", 2.0)
        pg.configure(f"127.0.0.1:{store.port}/q0", "trainer", 0, 2)
        t = torch.full((4,), 1.0)
        pg.allreduce([t], ReduceOp.SUM).wait()
        torch.testing.assert_close(t, torch.full((4,), 3.0))
        peer_pid, peer_child, peer_result = results.get(timeout=60)
        peer_pids += [peer_pid, peer_child]
        assert peer_result == [3.0] * 4

        os.kill(peer_child, signal.SIGSTOP)
        os.kill(peer_pid, signal.SIGSTOP)
        our_child = pg.child_pid()
        assert our_child is not None

        # This process stays responsive while its collective is wedged: a thread keeps ticking.
        ticks = 0
        stop = threading.Event()

        def tick() -> None:
            nonlocal ticks
            while not stop.wait(0.05):
                ticks += 1

        ticker = threading.Thread(target=tick)
        ticker.start()
        hung = pg.allreduce([t], ReduceOp.SUM)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="allreduce timed out after 0:00:03"):
            hung.wait(timedelta(seconds=3))
        waited = time.monotonic() - start
        stop.set()
        ticker.join()
        assert 2.9 < waited < 3 + 3, waited  # the timeout, plus killing and scheduling
        assert ticks >= 20, ticks  # ~60 expected in 3 s; the process was never frozen
        assert _wait_gone(our_child, 10), "the wedged child was not killed"
        assert isinstance(pg.errored(), TimeoutError)
        # Failed fast until reconfigured, without touching the dead transport.
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            pg.allreduce([t]).wait()
        assert time.monotonic() - start < 1.0
        assert pg.num_active_work() == 0

        # The wedged peer is replaced; the group is rebuilt and works again.
        _kill_all(*peer_pids)
        peer.join(timeout=10)
        peer, results = _start_peer(store.port, "q1", 5.0)
        pg.configure(f"127.0.0.1:{store.port}/q1", "trainer", 0, 2)
        assert pg.errored() is None
        t = torch.full((4,), 1.0)
        pg.allreduce([t], ReduceOp.SUM).wait()
        torch.testing.assert_close(t, torch.full((4,), 6.0))
        peer_pid, peer_child, peer_result = results.get(timeout=60)
        peer_pids += [peer_pid, peer_child]
        assert peer_result == [6.0] * 4
    finally:
        pg.shutdown()
        _kill_all(*peer_pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_extra_collectives_run_in_the_child(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    try:
        pg.configure(f"127.0.0.1:{store.port}/x", "r", 0, 1)
        src = torch.arange(4.0)
        out = [torch.zeros(4)]
        pg.allgather_into_tensor_coalesced(out, [src]).wait()
        torch.testing.assert_close(out[0], src)
        pg.reduce_scatter_tensor_coalesced(out, [src + 1]).wait()
        torch.testing.assert_close(out[0], src + 1)
        single = torch.zeros(4)
        pg.all_gather_single(single, src + 2).wait()
        torch.testing.assert_close(single, src + 2)
        pg.reduce_scatter_single(single, src + 3).wait()
        torch.testing.assert_close(single, src + 3)
        assert pg.num_active_work() == 0 and pg.errored() is None
    finally:
        pg.shutdown()
