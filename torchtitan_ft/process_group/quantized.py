"""Int8 per-block quantization and a quantized allreduce that counts the bytes it sends.

Used by DiLoCo (``should_quantize=True``) to shrink pseudo-gradient traffic across replica groups
by about 4x. Works on CPU (and on any device torch supports; no custom kernels).

Format: a flat tensor is cut into blocks of ``block_size`` elements (default 256). Each block
gets one fp32 scale ``max|x| / 127`` and its values become ``round(x / scale)`` in int8
([-127, 127]; symmetric, so zero is exact). Dequantizing multiplies back. Per element the error
is at most ``scale / 2`` of its block. Wire size: 1 byte per element plus 4 bytes per block
(``quantized_nbytes``), i.e. ~25.4% of fp32 with 256-element blocks.

Quantized allreduce (``quantized_allreduce``) is a reduce-scatter followed by an allgather, both
carrying int8 payloads, so each rank sends ``2 (N-1)/N`` of the quantized size — a quarter of
what a ring allreduce of the fp32 tensor sends:

1. quantize the whole (padded) tensor; ``alltoall``: rank ``r`` receives every rank's chunk ``r``;
2. dequantize those N chunks in fp32 and sum them (divide by N for AVG);
3. quantize the reduced chunk; ``allgather`` the reduced chunks; dequantize.

Every rank dequantizes the same gathered bytes, so all ranks end with bit-identical results
(no divergence between replica groups). The error is bounded by the sum of the input blocks'
half-scales plus the reduced block's half-scale.

Every byte handed to a collective for another rank is added to a ``BytesCounter``
(``bytes_sent()`` reads the process-wide one): an alltoall counts the ``N-1`` chunks that leave
the rank; an allgather counts ``N-1`` copies of the rank's own chunk (what a ring or direct
allgather sends from each rank).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions
from torch.distributed import ReduceOp

DEFAULT_BLOCK_SIZE = 256
"""Elements per quantization block (one fp32 scale per block)."""

_INT8_MAX = 127


class BytesCounter:
    """A thread-safe running total of bytes sent (``BYTES_SENT`` is the process-wide one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, nbytes: int) -> None:
        """Adds ``nbytes`` (must be >= 0) to the total."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._total += nbytes

    @property
    def total(self) -> int:
        """Bytes counted since creation or the last ``reset``."""
        with self._lock:
            return self._total

    def reset(self) -> int:
        """Sets the total to zero and returns the value it had."""
        with self._lock:
            total, self._total = self._total, 0
            return total


BYTES_SENT = BytesCounter()
"""Process-wide counter of bytes sent by ``quantized_allreduce`` (unless given another one)."""


def bytes_sent() -> int:
    """Bytes this process has sent through ``quantized_allreduce`` with the default counter."""
    return BYTES_SENT.total


@dataclass(frozen=True)
class QuantizedTensor:
    """An int8 block-quantized flat tensor.

    Attributes:
        values: int8, ``num_blocks * block_size`` elements (the tail of the last block is 0).
        scales: fp32, one per block.
        numel: number of meaningful elements (before padding).
        block_size: elements per block.
    """

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    block_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 values plus the fp32 scales (what goes on the wire)."""
        return self.values.numel() * self.values.element_size() + self.scales.numel() * 4


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def quantized_nbytes(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Wire size in bytes of ``numel`` elements quantized with ``block_size``-element blocks."""
    _check_block_size(block_size)
    num_blocks = -(-numel // block_size)
    return num_blocks * block_size + 4 * num_blocks


def quantize_int8(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedTensor:
    """Quantizes ``x`` (any shape, floating point) to int8 with one fp32 scale per block.

    Args:
        x: the tensor; it is flattened (and not modified).
        block_size: elements per block; the last block is zero-padded.

    Returns:
        A ``QuantizedTensor``; ``dequantize_int8`` inverts it within ``scale / 2`` per element.
    """
    _check_block_size(block_size)
    if not x.is_floating_point():
        raise TypeError(f"quantize_int8 needs a floating point tensor, got {x.dtype}")
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    num_blocks = -(-numel // block_size)
    padded = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    blocks = padded.view(num_blocks, block_size)
    scales = blocks.abs().amax(dim=1) / _INT8_MAX
    # An all-zero block has scale 0; divide by 1 there (its values are 0 anyway).
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / safe.unsqueeze(1)).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return QuantizedTensor(values.view(-1), scales, numel, block_size)


def dequantize_int8(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Returns the flat tensor (``q.numel`` elements, ``dtype``) that ``q`` encodes."""
    blocks = q.values.view(-1, q.block_size).to(torch.float32) * q.scales.unsqueeze(1)
    return blocks.view(-1)[: q.numel].to(dtype)


class Exchange(Protocol):
    """The two collectives the quantized allreduce needs, over some group of ``world_size`` ranks.

    ``ProcessGroupExchange`` implements it over a ``torch.distributed`` process group; the
    in-process simulator (``torchtitan_ft.semi_sync.simulated``) implements it across threads.
    """

    @property
    def rank(self) -> int:
        """This member's rank in the group."""
        ...

    @property
    def world_size(self) -> int:
        """Number of members in the group."""
        ...

    def alltoall(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sends ``chunks[r]`` to rank ``r``; returns what each rank sent here (equal shapes)."""
        ...

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Returns every rank's ``tensor`` (equal shapes), in rank order."""
        ...


class ProcessGroupExchange:
    """``Exchange`` over a ``torch.distributed.ProcessGroup`` (gloo on CPU, nccl on GPU).

    Args:
        pg: the process group; uses its ``alltoall_base`` and ``allgather`` methods.
    """

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg = pg

    @property
    def rank(self) -> int:
        """This process's rank in ``pg``."""
        return self._pg.rank()

    @property
    def world_size(self) -> int:
        """Size of ``pg``."""
        return self._pg.size()

    def alltoall(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``alltoall_base`` of the concatenated equal-size chunks."""
        send = torch.cat([c.reshape(-1) for c in chunks])
        recv = torch.empty_like(send)
        self._pg.alltoall_base(recv, send, [], [], AllToAllOptions()).wait()
        return list(recv.chunk(len(chunks)))

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """One ``allgather`` into ``world_size`` fresh tensors."""
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._pg.allgather([outputs], [tensor], AllgatherOptions()).wait()
        return outputs


def _alltoall_counted(
    exchange: Exchange, chunks: list[torch.Tensor], counter: BytesCounter
) -> list[torch.Tensor]:
    rank = exchange.rank
    counter.add(sum(c.numel() * c.element_size() for i, c in enumerate(chunks) if i != rank))
    return exchange.alltoall(chunks)


def _allgather_counted(
    exchange: Exchange, tensor: torch.Tensor, counter: BytesCounter
) -> list[torch.Tensor]:
    counter.add((exchange.world_size - 1) * tensor.numel() * tensor.element_size())
    return exchange.allgather(tensor)


def quantized_allreduce_with(
    tensor: torch.Tensor,
    exchange: Exchange,
    reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    block_size: int = DEFAULT_BLOCK_SIZE,
    counter: BytesCounter | None = None,
) -> torch.Tensor:
    """Quantized allreduce of ``tensor`` in place over ``exchange``; returns ``tensor``.

    Blocking. See the module docstring for the algorithm, error bound and byte accounting.

    Args:
        tensor: floating point, any shape; overwritten with the (approximate) reduction.
        exchange: the group to reduce over.
        reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.AVG`` (divides by ``exchange.world_size``).
        block_size: elements per quantization block.
        counter: where sent bytes are added (default: the process-wide ``BYTES_SENT``).
    """
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"quantized allreduce supports ReduceOp.SUM and AVG, got {reduce_op}")
    counter = BYTES_SENT if counter is None else counter
    world = exchange.world_size
    numel = tensor.numel()
    # Pad so that every rank owns a whole number of blocks.
    unit = world * block_size
    padded_numel = -(-numel // unit) * unit
    flat = torch.zeros(padded_numel, dtype=torch.float32, device=tensor.device)
    flat[:numel] = tensor.detach().reshape(-1).to(torch.float32)
    q = quantize_int8(flat, block_size)
    blocks_per_rank = padded_numel // unit

    # 1. reduce-scatter: rank r receives every rank's chunk r.
    recv_values = _alltoall_counted(exchange, list(q.values.chunk(world)), counter)
    recv_scales = _alltoall_counted(exchange, list(q.scales.chunk(world)), counter)
    chunk_numel = blocks_per_rank * block_size
    reduced = torch.zeros(chunk_numel, dtype=torch.float32, device=tensor.device)
    for values, scales in zip(recv_values, recv_scales, strict=True):
        reduced += dequantize_int8(QuantizedTensor(values, scales, chunk_numel, block_size))
    if reduce_op == ReduceOp.AVG:
        reduced /= world

    # 2. allgather the re-quantized reduced chunks.
    rq = quantize_int8(reduced, block_size)
    all_values = _allgather_counted(exchange, rq.values, counter)
    all_scales = _allgather_counted(exchange, rq.scales, counter)
    gathered = QuantizedTensor(
        torch.cat(all_values), torch.cat(all_scales), padded_numel, block_size
    )
    result = dequantize_int8(gathered)[:numel]
    with torch.no_grad():
        tensor.copy_(result.view_as(tensor).to(tensor.dtype))
    return tensor


def quantized_allreduce(
    tensor: torch.Tensor,
    pg: dist.ProcessGroup,
    reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    block_size: int = DEFAULT_BLOCK_SIZE,
    counter: BytesCounter | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """Quantized allreduce of ``tensor`` in place over process group ``pg``.

    Runs the collectives on the calling thread (so their order on ``pg`` is the caller's order)
    and returns a completed future holding ``tensor``, or a future holding the error if a
    collective failed, matching how the Manager reports allreduce results.

    Args:
        tensor: floating point, any shape; overwritten with the reduction.
        pg: the process group (its ``alltoall_base`` and ``allgather`` are used).
        reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        block_size: elements per quantization block.
        counter: where sent bytes are added (default ``BYTES_SENT``).
    """
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    try:
        quantized_allreduce_with(tensor, ProcessGroupExchange(pg), reduce_op, block_size, counter)
    except RuntimeError as e:  # c10d errors (DistBackendError, timeouts) are RuntimeErrors
        fut.set_exception(e)
        return fut
    fut.set_result(tensor)
    return fut
