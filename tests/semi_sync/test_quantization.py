"""Int8 per-block quantization and the quantized allreduce (torchtitan_ft/quantization.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import ReduceOp

from torchtitan_ft.process_group.quantized import (
    BytesCounter,
    dequantize_int8,
    quantize_int8,
    quantized_allreduce,
    quantized_allreduce_with,
    quantized_nbytes,
)
from torchtitan_ft.semi_sync.simulated import SimulatedReplicaGroups

from ._helpers import run_threads


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 5000])
@pytest.mark.parametrize("block_size", [16, 256])
def test_error_within_half_scale_per_block(numel: int, block_size: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-3, 3, numel)  # blocks of very different ranges
    q = quantize_int8(x, block_size)
    deq = dequantize_int8(q)
    assert deq.shape == (numel,)
    padded = torch.zeros(q.scales.numel() * block_size)
    padded[:numel] = x - deq
    err = padded.view(-1, block_size).abs().amax(dim=1)
    # scale / 2 is the rounding bound; 1e-6 relative slack for fp32 arithmetic.
    assert torch.all(err <= q.scales / 2 * (1 + 1e-6) + 1e-12)


def test_scale_is_block_absmax_over_127_and_zero_block_exact() -> None:
    x = torch.cat([torch.zeros(4), torch.tensor([1.0, -2.54, 0.5, 0.0])])
    q = quantize_int8(x, block_size=4)
    assert q.values.dtype == torch.int8
    assert torch.equal(q.scales, torch.tensor([0.0, 2.54 / 127]))
    assert torch.equal(dequantize_int8(q)[:4], torch.zeros(4))
    assert q.values[4:].tolist() == [50, -127, 25, 0]


def test_wire_size() -> None:
    q = quantize_int8(torch.randn(1000), 256)
    assert q.nbytes == quantized_nbytes(1000, 256) == 4 * 256 + 4 * 4
    assert quantized_nbytes(256 * 100) / (256 * 100 * 4) == pytest.approx(0.2539, abs=1e-4)


def test_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="floating point"):
        quantize_int8(torch.arange(4))
    with pytest.raises(ValueError, match="block_size"):
        quantize_int8(torch.randn(4), 0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", [ReduceOp.AVG, ReduceOp.SUM])
def test_quantized_allreduce_in_process(world: int, op: ReduceOp.RedOpType) -> None:
    """Every rank gets the same result, close to the exact reduction; bytes are ~1/4."""
    groups = SimulatedReplicaGroups(world)
    managers = [groups.manager(str(r)) for r in range(world)]
    numel = 3000
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    outputs = [t.clone() for t in inputs]
    counters = [BytesCounter() for _ in range(world)]

    def replica(r: int) -> None:
        managers[r].start_quorum()
        from torchtitan_ft.semi_sync.simulated import _ThreadExchange

        quantized_allreduce_with(
            outputs[r], _ThreadExchange(groups, managers[r]), op, 256, counters[r]
        )

    run_threads([lambda r=r: replica(r) for r in range(world)])
    exact = torch.stack(inputs).sum(0) / (world if op == ReduceOp.AVG else 1)
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])
    # Bound: sum of the inputs' half-scales (scaled for AVG) plus the output's half-scale.
    in_scale = sum(t.abs().max() / 127 for t in inputs) / (world if op == ReduceOp.AVG else 1)
    bound = in_scale / 2 + exact.abs().max() / 127  # output block scale <= (|exact|+err)/127
    assert (outputs[0] - exact).abs().max() <= bound
    padded = -(-numel // (world * 256)) * world * 256
    expected = 2 * (world - 1) * quantized_nbytes(padded, 256) // world
    assert all(c.total == expected for c in counters)
    fp32_ring = 2 * (world - 1) * numel * 4 / world
    assert counters[0].total / fp32_ring == pytest.approx(0.254, abs=0.03)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, world)
    t = torch.full((1000,), float(rank + 1))
    counter = BytesCounter()
    fut = quantized_allreduce(t, pg, ReduceOp.AVG, 256, counter)
    fut.wait()
    queue.put((rank, t.clone(), counter.total))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_quantized_allreduce_over_gloo() -> None:
    """The process-group path (alltoall_base + allgather over gloo) gives the same answer."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world, port = 2, _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=100) for _ in range(world)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    results.sort(key=lambda r: r[0])
    assert torch.allclose(results[0][1], torch.full((1000,), 1.5), atol=2 / 127)
    assert torch.equal(results[0][1], results[1][1])
    # 1000 elements pad to 1024 (2 ranks x 2 blocks); 2 * (N-1)/N of 1024 + 4 scales * 4 bytes.
    assert results[0][2] == quantized_nbytes(1024, 256)
