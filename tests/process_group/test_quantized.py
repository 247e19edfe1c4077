"""Int8 per-block quantization and the quantized allreduce
(``torchtitan_ft.process_group.quantized``): the format in process, the allreduce over real gloo
groups (threads of this process, and two spawned processes)."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import ReduceOp

from torchtitan_ft.process_group import ProcessGroupGloo
from torchtitan_ft.process_group.quantized import (
    dequantize_int8,
    quantize_int8,
    quantized_allreduce,
    quantized_nbytes,
)


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


class CountingGroup:
    """Forwards ``quantized_allreduce``'s calls to a process group, adding up the bytes that
    leave this rank: an alltoall's ``N-1`` chunks for the others, an allgather's ``N-1``
    copies of this rank's tensor (what a direct or ring allgather sends)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.sent = 0

    def rank(self) -> int:
        return self.pg.rank()

    def size(self) -> int:
        return self.pg.size()

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> Any:
        n = self.size()
        self.sent += (n - 1) * input.numel() * input.element_size() // n
        return self.pg.alltoall_base(output, input, *args)

    def allgather(self, outputs: Any, inputs: list[torch.Tensor], *args: Any) -> Any:
        self.sent += (self.size() - 1) * sum(t.numel() * t.element_size() for t in inputs)
        return self.pg.allgather(outputs, inputs, *args)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", [ReduceOp.AVG, ReduceOp.SUM])
def test_quantized_allreduce_over_gloo_groups_in_threads(
    world: int, op: ReduceOp.RedOpType
) -> None:
    """Every rank gets the same result, close to the exact reduction; bytes are ~1/4."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [CountingGroup(ProcessGroupGloo(timedelta(seconds=30))) for _ in range(world)]
    numel = 3000
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    outputs = [t.clone() for t in inputs]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            groups[r].pg.configure(f"127.0.0.1:{store.port}/q", f"replica_{r}", r, world)
            quantized_allreduce(outputs[r], groups[r], op, 256).wait()
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for g in groups:
        g.pg.shutdown()
    assert not errors, errors
    exact = torch.stack(inputs).sum(0) / (world if op == ReduceOp.AVG else 1)
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])
    # Bound: sum of the inputs' half-scales (scaled for AVG) plus the output's half-scale.
    in_scale = sum(t.abs().max() / 127 for t in inputs) / (world if op == ReduceOp.AVG else 1)
    bound = in_scale / 2 + exact.abs().max() / 127  # output block scale <= (|exact|+err)/127
    assert (outputs[0] - exact).abs().max() <= bound
    padded = -(-numel // (world * 256)) * world * 256
    expected = 2 * (world - 1) * quantized_nbytes(padded, 256) // world
    assert all(g.sent == expected for g in groups)
    fp32_ring = 2 * (world - 1) * numel * 4 / world
    assert groups[0].sent / fp32_ring == pytest.approx(0.254, abs=0.03)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, world)
    t = torch.full((1000,), float(rank + 1))
    counting = CountingGroup(pg)
    fut = quantized_allreduce(t, counting, ReduceOp.AVG, 256)
    fut.wait()
    # Plain numbers, not a tensor: a tensor travels as a descriptor the receiver fetches from
    # this process, which may have exited by then (FileNotFoundError in the parent).
    queue.put((rank, t.tolist(), counting.sent))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_quantized_allreduce_over_gloo() -> None:
    """Over torch's own gloo group in two processes: the same answer and bytes."""
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
    results = sorted((rank, torch.tensor(values), sent) for rank, values, sent in results)
    assert torch.allclose(results[0][1], torch.full((1000,), 1.5), atol=2 / 127)
    assert torch.equal(results[0][1], results[1][1])
    # 1000 elements pad to 1024 (2 ranks x 2 blocks); 2 * (N-1)/N of 1024 + 4 scales * 4 bytes.
    assert results[0][2] == quantized_nbytes(1024, 256)
