"""The gloo process group (``torchtitan_ft.process_group.gloo``; the NCCL one is checked to
refuse CPU builds). In-process tests use world-size-1 groups; the ``multiprocess`` tests fork
real processes that build gloo groups on a TCPStore served by the test (127.0.0.1)."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from tests.process_group._workers import allreduce_value, run_workers, store_client
from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

# --------------------------------------------------------------------------------------------
# in-process tests
# --------------------------------------------------------------------------------------------


def test_gloo_misuse_is_rejected(store: dist.TCPStore) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ProcessGroupGloo(timedelta(0))
    pg = ProcessGroupGloo(timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([torch.ones(1)])
    with pytest.raises(ValueError, match="rank"):
        pg.configure(f"127.0.0.1:{store.port}/a", "r", 2, 2)
    with pytest.raises(ValueError, match="prefix"):
        pg.configure(f"127.0.0.1:{store.port}", "r", 0, 1)
    assert pg.errored() is None
    assert pg.size() == 0


def test_gloo_world_size_one(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timedelta(seconds=5))
    pg.configure(f"127.0.0.1:{store.port}/q0", "replica_0", 0, 1, quorum_id=0)
    assert (pg.size(), pg.rank(), pg.getBackendName()) == (1, 0, "torchft-gloo")
    assert isinstance(pg, dist.ProcessGroup)

    t = torch.arange(3.0)
    work = pg.allreduce([t], ReduceOp.AVG)
    assert work.wait() is True
    assert work.get_future().wait() == [t]
    dist.all_reduce(t, group=pg)  # torch.distributed API accepts it
    assert t.tolist() == [0.0, 1.0, 2.0]
    pg.broadcast_one(t, root=0).wait()
    pg.barrier().wait()

    pg.register("test_gloo_world_size_one")
    try:
        assert pg.group_name == "test_gloo_world_size_one"
        assert (funcol.all_reduce(torch.ones(2), "sum", pg) + 0).tolist() == [1.0, 1.0]
    finally:
        pg.unregister()
    pg.shutdown()
    assert pg.size() == 0


def test_gloo_peer_never_joins_is_a_clean_error(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="configure failed"):
        pg.configure(f"127.0.0.1:{store.port}/q0", "replica_0", 0, 2)
    assert time.monotonic() - start < 2.0  # the 1 s timeout, plus scheduling
    error = pg.errored()
    assert isinstance(error, RuntimeError)
    # Errored: collectives fail at once, without communicating.
    work = pg.allreduce([torch.ones(1)])
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="configure failed"):
        work.wait()
    # A new configure clears the error.
    pg.configure(f"127.0.0.1:{store.port}/q1", "replica_0", 0, 1)
    assert pg.errored() is None
    assert allreduce_value(pg, 3.0) == [3.0] * 4


def test_nccl_is_rejected_on_cpu_builds(store: dist.TCPStore) -> None:
    if hasattr(dist, "ProcessGroupNCCL"):
        pytest.skip("this torch build has NCCL")
    pg = ProcessGroupNCCL(timedelta(seconds=2))
    assert pg.getBackendName() == "torchft-nccl"
    with pytest.raises(RuntimeError, match="NCCL"):
        pg.configure(f"127.0.0.1:{store.port}/n0", "replica_0", 0, 1)


# --------------------------------------------------------------------------------------------
# multi-process tests
# --------------------------------------------------------------------------------------------


def _collectives_worker(rank: int, port: int) -> dict[str, Any]:
    """3 ranks: collectives, reconfigure to a different world size, abort and timeout."""
    addr = f"127.0.0.1:{port}"
    control = store_client(port)
    pg = ProcessGroupGloo(timedelta(seconds=5))
    out: dict[str, Any] = {}

    # Phase A: world size 3.
    pg.configure(f"{addr}/a", f"replica_{rank}", rank, 3, quorum_id=1)
    out["sum"] = allreduce_value(pg, rank + 1)
    out["avg"] = allreduce_value(pg, rank + 1, ReduceOp.AVG)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    out["max"] = allreduce_value(pg, rank + 1, opts)
    gathered = [[torch.zeros(2) for _ in range(3)]]
    pg.allgather(gathered, [torch.full((2,), float(rank))]).wait()
    out["allgather"] = [t.tolist() for t in gathered[0]]
    b = torch.full((2,), float(rank))
    bopts = BroadcastOptions()
    bopts.rootRank = 2
    pg.broadcast([b], bopts).wait()
    out["broadcast"] = b.tolist()
    rs_out = torch.zeros(1)
    pg.reduce_scatter([rs_out], [[torch.full((1,), float(r + rank)) for r in range(3)]]).wait()
    out["reduce_scatter"] = rs_out.tolist()
    rs_opts = ReduceScatterOptions()
    rs_opts.reduceOp = ReduceOp.AVG
    pg.reduce_scatter(
        [rs_out], [[torch.full((1,), float(r + rank)) for r in range(3)]], rs_opts
    ).wait()
    out["reduce_scatter_avg"] = rs_out.tolist()
    pg.barrier().wait()
    if rank == 0:
        pg.send([torch.full((2,), 7.0)], 1).wait()
    elif rank == 1:
        r = torch.zeros(2)
        pg.recv([r], 0).wait()
        out["recv"] = r.tolist()
    fut_value = pg.allreduce([torch.ones(1)]).get_future().wait()
    out["future"] = [t.tolist() for t in fut_value]

    # Phase B: rank 2 leaves; ranks 0 and 1 form a world of 2 on a new prefix, rank 2 is alone.
    if rank == 2:
        pg.configure(f"{addr}/b-solo", "replica_2", 0, 1, quorum_id=2)
        out["solo"] = allreduce_value(pg, 5)
        return out
    pg.configure(f"{addr}/b", f"replica_{rank}", rank, 2, quorum_id=2)
    out["size_b"] = pg.size()
    out["sum_b"] = allreduce_value(pg, rank + 1)

    # Phase C: rank 1 does not join a collective; abort() releases rank 0's wait at once.
    pg.configure(f"{addr}/c", f"replica_{rank}", rank, 2, quorum_id=3)
    if rank == 0:
        work = pg.allreduce([torch.ones(1)])
        threading.Timer(0.3, pg.abort).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="aborted"):
            work.wait()
        out["abort_released_after_s"] = time.monotonic() - start
        assert isinstance(pg.errored(), RuntimeError)
        with pytest.raises(RuntimeError, match="aborted"):
            pg.allreduce([torch.ones(1)]).wait()  # fails fast, no communication
        # The caller was released, but gloo is still inside the collective (rank 1 never
        # joins) until its own timeout: its tensor is not free yet.
        out["abandoned_done_at_abort"] = pg.wait_abandoned(timedelta(0))
        start = time.monotonic()
        out["abandoned_done_later"] = pg.wait_abandoned(timedelta(seconds=10))
        out["abandoned_done_after_s"] = time.monotonic() - start
        control.set("c_done", "1")
    else:
        # Keep the phase C group open: dropping it would fail rank 0's collective first.
        control.wait(["c_done"], timedelta(seconds=10))

    # Phase D: the same, released by wait()'s timeout instead.
    pg.configure(f"{addr}/d", f"replica_{rank}", rank, 2, quorum_id=4)
    if rank == 0:
        work = pg.allreduce([torch.ones(1)])
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            work.wait(timedelta(seconds=0.5))
        out["timeout_released_after_s"] = time.monotonic() - start
        assert isinstance(pg.errored(), TimeoutError)
        control.set("d_done", "1")
    else:
        control.wait(["d_done"], timedelta(seconds=10))

    # Phase E: both continue on a new group.
    pg.configure(f"{addr}/e", f"replica_{rank}", rank, 2, quorum_id=5)
    out["sum_e"] = allreduce_value(pg, 10 * (rank + 1))
    pg.shutdown()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collectives_reconfigure_abort_timeout(store: dist.TCPStore) -> None:
    results = run_workers(_collectives_worker, 3, (store.port,), timeout=45)
    for rank, out in results.items():
        assert out["sum"] == [6.0] * 4
        assert out["avg"] == [2.0] * 4
        assert out["max"] == [3.0] * 4
        assert out["allgather"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        assert out["broadcast"] == [2.0, 2.0]
        # rank r receives the sum over ranks k of (r + k)
        assert out["reduce_scatter"] == [float(3 * rank + 3)]
        assert out["reduce_scatter_avg"] == [float(rank + 1)]
        assert out["future"] == [[3.0]]
    assert results[1]["recv"] == [7.0, 7.0]
    assert results[2]["solo"] == [5.0] * 4
    for rank in (0, 1):
        assert results[rank]["size_b"] == 2
        assert results[rank]["sum_b"] == [3.0] * 4
        assert results[rank]["sum_e"] == [30.0] * 4
    assert results[0]["abort_released_after_s"] < 1.5
    assert results[0]["abandoned_done_at_abort"] is False, results[0]
    assert results[0]["abandoned_done_later"] is True
    assert 0.4 < results[0]["timeout_released_after_s"] < 1.5
    print("gloo hung collective:", {k: v for k, v in results[0].items() if k.endswith("_s")})


_BIG = 1 << 20  # floats per allreduce in the kill test (4 MB)


def _peer_death_worker(rank: int, port: int) -> dict[str, Any]:
    """Rank 2 is SIGKILLed mid-allreduce; 0 (raw group) and 1 (error-swallowing) survive."""
    addr = f"127.0.0.1:{port}"
    control = store_client(port)
    timeout = timedelta(seconds=3)
    gloo = ProcessGroupGloo(timeout)
    pg: ProcessGroup = gloo if rank != 1 else ErrorSwallowingProcessGroupWrapper(gloo)
    pg.configure(f"{addr}/q1", f"replica_{rank}", rank, 3, quorum_id=1)
    big = torch.ones(_BIG)
    for _ in range(3):
        pg.allreduce([big]).wait()
    if rank == 2:
        pg.allreduce([big])  # the others are now inside this collective
        control.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    out: dict[str, Any] = {}
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(RuntimeError):
            while True:
                pg.allreduce([big]).wait()
        detected = time.time()
        out["error"] = str(gloo.errored())
        # Errored: the next collective fails at once.
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            pg.allreduce([big]).wait()
        out["fail_fast_s"] = time.monotonic() - t0
        # gloo itself is done with the failed collective at once (a reset, not a hang).
        out["abandoned_done"] = gloo.wait_abandoned(timedelta(seconds=1))
    else:
        while pg.error() is None:  # type: ignore[attr-defined]
            assert pg.allreduce([big]).wait() is True  # never raises
        detected = time.time()
        out["error"] = str(pg.error())  # type: ignore[attr-defined]
        # Later collectives are no-ops: completed at once, tensor untouched.
        t = torch.full((4,), 5.0)
        work = pg.allreduce([t])
        out["noop_completed"] = work.is_completed() and work.wait() and t.tolist() == [5.0] * 4
    out["detect_s"] = detected - float(control.get("killed_at").decode())
    out["loop_s"] = time.monotonic() - start

    # A quorum computed before the death still lists rank 2: building fails cleanly.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="configure failed"):
        pg.configure(f"{addr}/q2", f"replica_{rank}", rank, 3, quorum_id=2)
    out["dead_peer_configure_s"] = time.monotonic() - t0
    assert pg.errored() is not None

    # The survivors continue together, then each alone.
    pg.configure(f"{addr}/q3", f"replica_{rank}", rank, 2, quorum_id=3)
    assert pg.errored() is None
    out["pair"] = allreduce_value(pg, rank + 1)
    pg.configure(f"{addr}/q4-{rank}", f"replica_{rank}", 0, 1, quorum_id=4)
    out["alone"] = allreduce_value(pg, 7, ReduceOp.AVG)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_peer_sigkilled_mid_collective(store: dist.TCPStore) -> None:
    results = run_workers(
        _peer_death_worker, 3, (store.port,), timeout=45, expect_killed=frozenset({2})
    )
    for rank in (0, 1):
        out = results[rank]
        assert out["error"] not in ("", "None")
        assert out["detect_s"] < 2.0, out  # seen as a connection error, not a timeout (3 s)
        assert out["dead_peer_configure_s"] < 4.5, out  # the 3 s timeout, plus scheduling
        assert out["pair"] == [3.0] * 4
        assert out["alone"] == [7.0] * 4
    assert results[0]["fail_fast_s"] < 0.5
    assert results[0]["abandoned_done"] is True
    assert results[1]["noop_completed"] is True
    print(
        "peer death:",
        {r: {k: v for k, v in out.items() if k.endswith("_s")} for r, out in results.items()},
    )
