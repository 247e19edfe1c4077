"""Every collective of torchft 0.2.0's process groups, on ours, the way torchft's own tests
(process_group_test.py) exercise them: each one gives the right values across real gloo
processes, fails cleanly when a peer's group goes away, and works again after a reconfigure to
the survivors. Also what torchft's test checks in-process: the coalesced collectives,
``set_timeout``, the wrapper forwarding them, and functional collectives and a DeviceMesh over a
registered group."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)
from torch.distributed.tensor import DTensor, Partial, Replicate

from tests.process_group._workers import run_workers, store_client
from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupGloo,
)

# ----------------------------------------------------------------- checks, one per collective
# Each runs on every rank of a group of ``n`` and raises AssertionError on a wrong value.


def _close(got: torch.Tensor, expected: list[float]) -> None:
    assert got.tolist() == expected, f"got {got.tolist()}, expected {expected}"


def _allreduce(pg: ProcessGroup, r: int, n: int) -> None:
    t = torch.tensor([float(r + 1)])
    pg.allreduce([t], ReduceOp.SUM).wait()
    _close(t, [float(sum(range(1, n + 1)))])


def _allreduce_coalesced(pg: ProcessGroup, r: int, n: int) -> None:
    a, b = torch.tensor([float(r + 1)]), torch.tensor([float(r + 2)])
    pg.allreduce_coalesced([a, b], AllreduceCoalescedOptions()).wait()
    _close(a, [float(sum(k + 1 for k in range(n)))])
    _close(b, [float(sum(k + 2 for k in range(n)))])


def _allgather(pg: ProcessGroup, r: int, n: int) -> None:
    out = [torch.zeros(2) for _ in range(n)]
    pg.allgather([out], [torch.tensor([r + 1.0, r + 2.0])], AllgatherOptions()).wait()
    for k in range(n):
        _close(out[k], [k + 1.0, k + 2.0])


def _allgather_into_tensor_coalesced(pg: ProcessGroup, r: int, n: int) -> None:
    out0, out1 = torch.zeros(n), torch.zeros(n)
    work = pg.allgather_into_tensor_coalesced(
        [out0, out1], [torch.tensor([r + 1.0]), torch.tensor([r + 10.0])], AllgatherOptions()
    )
    work.wait()
    _close(out0, [k + 1.0 for k in range(n)])
    _close(out1, [k + 10.0 for k in range(n)])


def _alltoall_base(pg: ProcessGroup, r: int, n: int) -> None:
    sent = torch.arange(r * n + 1, r * n + 1 + n, dtype=torch.float32)
    out = torch.zeros(n)
    pg.alltoall_base(out, sent, [1] * n, [1] * n, AllToAllOptions()).wait()
    _close(out, [float(k * n + r + 1) for k in range(n)])


def _barrier(pg: ProcessGroup, r: int, n: int) -> None:
    assert pg.barrier(BarrierOptions()).wait()


def _broadcast(pg: ProcessGroup, r: int, n: int) -> None:
    t = torch.tensor([5.0]) if r == 0 else torch.zeros(1)
    pg.broadcast([t], BroadcastOptions()).wait()
    _close(t, [5.0])


def _broadcast_one(pg: ProcessGroup, r: int, n: int) -> None:
    t = torch.tensor([6.0]) if r == 0 else torch.zeros(1)
    pg.broadcast_one(t, 0).wait()
    _close(t, [6.0])


def _rows(n: int, offset: float) -> torch.Tensor:
    """An n x n matrix, row k = [k*n + offset, ..., k*n + offset + n - 1] (same on every rank)."""
    return torch.arange(n * n, dtype=torch.float32).reshape(n, n) + offset


def _reduce_scatter(pg: ProcessGroup, r: int, n: int) -> None:
    out = torch.zeros(n)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.reduce_scatter([out], [list(_rows(n, 1.0))], opts).wait()
    _close(out, (_rows(n, 1.0)[r] * n).tolist())


def _reduce_scatter_tensor_coalesced(pg: ProcessGroup, r: int, n: int) -> None:
    out0, out1 = torch.zeros(n), torch.zeros(n)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.reduce_scatter_tensor_coalesced(
        [out0, out1], [_rows(n, 1.0).flatten(), _rows(n, 100.0).flatten()], opts
    ).wait()
    _close(out0, (_rows(n, 1.0)[r] * n).tolist())
    _close(out1, (_rows(n, 100.0)[r] * n).tolist())


def _send_recv(pg: ProcessGroup, r: int, n: int) -> None:
    if r == 0:
        pg.send([torch.tensor([7.0])], 1, 0).wait()
    elif r == 1:
        t = torch.zeros(1)
        pg.recv([t], 0, 0).wait()
        _close(t, [7.0])


CHECKS: dict[str, Callable[[ProcessGroup, int, int], None]] = {
    "allreduce": _allreduce,
    "allreduce_coalesced": _allreduce_coalesced,
    "allgather": _allgather,
    "allgather_into_tensor_coalesced": _allgather_into_tensor_coalesced,
    "alltoall_base": _alltoall_base,
    "barrier": _barrier,
    "broadcast": _broadcast,
    "broadcast_one": _broadcast_one,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_tensor_coalesced,
    "send/recv": _send_recv,
}

# ----------------------------------------------------------------- in-process (world of 1)


def test_torchft_collectives_world_of_one_and_through_the_wrapper(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timedelta(seconds=5))
    pg.configure(f"127.0.0.1:{store.port}/one", "0", 0, 1)
    wrapper = ErrorSwallowingProcessGroupWrapper(pg)
    for group in (pg, wrapper):
        for name, check in CHECKS.items():
            if name != "send/recv":  # needs two ranks
                check(group, 0, 1)
    wrapper.set_timeout(timedelta(seconds=3))
    assert pg._timeout == timedelta(seconds=3)
    with pytest.raises(ValueError, match="timeout must be positive"):
        pg.set_timeout(timedelta(0))
    # A DDP over the group works (torchft's test_gloo_apis).
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 4), process_group=pg)
    model(torch.rand(2, 3)).sum().backward()
    pg.shutdown()


# ----------------------------------------------------------------- across processes


def _collectives_survive_a_lost_peer(rank: int, port: int) -> dict[str, Any]:
    """3 ranks. For each collective: all three run it; rank 2 drops its group; ranks 0 and 1
    see the next one fail, reconfigure to a group of two and run it again."""
    addr = f"127.0.0.1:{port}"
    control = store_client(port)
    pg = ProcessGroupGloo(timedelta(seconds=10))
    out: dict[str, Any] = {}
    for name, check in CHECKS.items():
        pg.configure(f"{addr}/{name}/3", f"replica_{rank}", rank, 3)
        check(pg, rank, 3)
        if rank == 2:
            pg.shutdown()
            control.wait([f"{name}/done"], timedelta(seconds=30))
            continue
        # Only the failure matters now: a hang is bounded by a short timeout.
        pg.set_timeout(timedelta(seconds=2))
        try:
            check(pg, rank, 3)
        except (RuntimeError, OSError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        else:
            out[name] = "no error"
        out[f"{name}/errored"] = pg.errored() is not None
        pg.set_timeout(timedelta(seconds=10))
        pg.configure(f"{addr}/{name}/2", f"replica_{rank}", rank, 2)
        check(pg, rank, 2)
        pg.barrier().wait()
        if rank == 0:
            control.set(f"{name}/done", "1")
    pg.shutdown()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_every_torchft_collective_survives_a_lost_peer_and_reconfigure(
    store: dist.TCPStore,
) -> None:
    # Per collective: two configures (loopback, tens of ms) and at most one 2 s timeout.
    results = run_workers(_collectives_survive_a_lost_peer, 3, (store.port,), timeout=150)
    for rank in (0, 1):
        for name in CHECKS:
            outcome = results[rank][name]
            if name == "send/recv" or (name.startswith("broadcast") and rank == 1):
                # These do not involve the lost rank on this rank's side: gloo may finish them.
                continue
            assert outcome != "no error", f"rank {rank} {name} did not notice the lost peer"
            assert results[rank][f"{name}/errored"], f"rank {rank} {name}: errored() is None"


def _functional_collectives_over_a_mesh(rank: int, port: int) -> dict[str, Any]:
    """2 ranks, each its own world of 1 (like two replica groups): functional collectives over
    the registered group, by object or as a DeviceMesh dimension, reduce across both."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    pg = ProcessGroupGloo(timedelta(seconds=10)).register("ft_replicate")
    out: dict[str, Any] = {}
    for quorum, world in ((1, 2), (2, 2)):  # the mesh keeps working after a reconfigure
        pg.configure(f"127.0.0.1:{port}/mesh{quorum}", f"replica_{rank}", rank, world)
        mesh = DeviceMesh.from_group(pg, "cpu")
        local = torch.full((3,), float(rank + 1))
        out[f"mesh{quorum}"] = funcol.all_reduce(local, "sum", (mesh, 0)).tolist()
        # A DTensor sees a dimension of size 1: its redistributions do not communicate.
        replicated = DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Replicate()])
        out[f"dtensor{quorum}"] = replicated.to_local().tolist()
        out[f"all_reduce{quorum}"] = funcol.all_reduce(local, "sum", pg).tolist()
        out[f"broadcast{quorum}"] = funcol.broadcast(local, 1, pg).tolist()
        (gathered,) = funcol.all_gather_single_coalesced([local], pg)
        out[f"all_gather_coalesced{quorum}"] = gathered.tolist()
        # torch.distributed's own API with group=pg, single-tensor and rooted collectives too.
        whole = torch.zeros(6)
        dist.all_gather_into_tensor(whole, local, group=pg)
        out[f"dist_all_gather{quorum}"] = whole.tolist()
        part = torch.zeros(3)
        dist.reduce_scatter_tensor(part, torch.arange(6.0) * (rank + 1), group=pg)
        out[f"dist_reduce_scatter{quorum}"] = part.tolist()
        reduced = local.clone()
        dist.reduce(reduced, dst=0, group=pg)
        out[f"dist_reduce{quorum}"] = reduced.tolist()
        pieces = [torch.zeros(3) for _ in range(2)] if rank == 1 else None
        dist.gather(local, pieces, group=pg, group_dst=1)
        out[f"dist_gather{quorum}"] = [p.tolist() for p in pieces] if pieces else None
        received = torch.zeros(3)
        sent = [torch.full((3,), 10.0 + r) for r in range(2)] if rank == 0 else None
        dist.scatter(received, sent, group=pg, group_src=0)
        out[f"dist_scatter{quorum}"] = received.tolist()
    # torchft's unregister is c10d's destroy_process_group; both work, and it can come back.
    dist.destroy_process_group(pg)
    pg.register("ft_replicate").unregister()
    pg.shutdown()
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_functional_collectives_and_device_mesh_use_the_group(store: dist.TCPStore) -> None:
    results = run_workers(_functional_collectives_over_a_mesh, 2, (store.port,), timeout=60)
    for rank, out in results.items():
        for quorum in (1, 2):
            assert out[f"mesh{quorum}"] == [3.0] * 3
            assert out[f"dtensor{quorum}"] == [float(rank + 1)] * 3
            assert out[f"all_reduce{quorum}"] == [3.0] * 3
            assert out[f"broadcast{quorum}"] == [2.0] * 3
            assert out[f"all_gather_coalesced{quorum}"] == [1.0] * 3 + [2.0] * 3
            assert out[f"dist_all_gather{quorum}"] == [1.0] * 3 + [2.0] * 3
            # rank r gets chunk r of (arange(6) * 1 + arange(6) * 2)
            assert out[f"dist_reduce_scatter{quorum}"] == [
                3.0 * k for k in range(3 * rank, 3 * rank + 3)
            ]
            if rank == 0:
                assert out[f"dist_reduce{quorum}"] == [3.0] * 3
            else:
                assert out[f"dist_gather{quorum}"] == [[1.0] * 3, [2.0] * 3]
            assert out[f"dist_scatter{quorum}"] == [10.0 + rank] * 3
