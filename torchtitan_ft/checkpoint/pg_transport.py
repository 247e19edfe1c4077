"""Live healing over a process group: the donor pushes header and tensors with send/recv.

Same wire content as ``HTTPTransport`` (a JSON header, then each tensor's raw bytes), carried by
point-to-point ``send``/``recv`` on a ``torch.distributed`` process group that contains the
donor and the receivers (gloo on CPU; NCCL would take the same calls with ``device="cuda"``).
Messages, in order: the header length (one int64), the header bytes (uint8), then every
non-empty tensor as uint8 bytes. Unlike ``HTTPTransport``, ``send_checkpoint`` blocks until
the destinations received everything (the process group's ``send`` is the transport), so the
donor stalls for the transfer; prefer ``HTTPTransport`` where that matters. DTensors are sent
as their local shard and rebuilt on the receiver's device mesh, as by ``HTTPTransport``.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchtitan_ft.checkpoint._serialization import (
    Header,
    check_header_length,
    check_receivable,
    flatten,
    layout,
    unflatten,
)
from torchtitan_ft.checkpoint._staging import as_bytes
from torchtitan_ft.checkpoint.transport import (
    CheckpointTransferError,
    CheckpointTransport,
    log_received,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TAG = 0


class PGTransport(CheckpointTransport[T]):
    """Sends and receives checkpoints with ``send``/``recv`` on a process group.

    Args:
        pg: a ``torch.distributed.ProcessGroup`` (or one of this package's process groups)
            holding the donor and the receivers; ``dst_ranks`` and ``src_rank`` are ranks in
            this group.
        timeout: default time limit of each send or receive of one transfer (a call's own
            ``timeout`` replaces it; None or omitted there: this one).
        device: where received tensors are allocated and what the process group moves
            (``cpu`` for gloo, ``cuda`` for NCCL).
    """

    def __init__(self, pg: dist.ProcessGroup, timeout: timedelta, device: torch.device) -> None:
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive timedelta, got {timeout!r}")
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)

    def metadata(self) -> str:
        """Nothing to advertise: the process group already connects the ranks."""
        return "<n/a>"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Sends ``state_dict`` as ``step`` to each of ``dst_ranks`` in turn; blocks until done.

        Raises TypeError for unsupported leaves and CheckpointTransferError when a send fails
        or does not complete within ``timeout`` (None: the transport's).
        """
        timeout = self._timeout if timeout is None else timeout
        started = time.perf_counter()
        tree, tensors = flatten(state_dict)
        specs = layout(tensors)
        header = Header(step=step, tree=tree, tensors=specs).to_bytes()
        length = torch.tensor([len(header)], dtype=torch.int64, device=self._device)
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self._device)
        payload = [as_bytes(t).to(self._device).contiguous() for t in tensors if t.numel()]
        for dst in dst_ranks:
            try:
                for t in (length, header_t, *payload):
                    self._pg.send([t], dst, _TAG).wait(timeout)
            except TimeoutError as e:
                raise CheckpointTransferError(
                    f"sending step {step} to rank {dst} timed out after {timeout}: {e}"
                ) from e
            except RuntimeError as e:
                raise CheckpointTransferError(
                    f"sending step {step} to rank {dst} failed: {e}"
                ) from e
        logger.info(
            "sent step %d to ranks %s over the process group: %.1f MB in %.3f s",
            step,
            dst_ranks,
            sum(s.nbytes for s in specs) / 1e6,
            time.perf_counter() - started,
        )

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None
    ) -> T:
        """Receives the state of ``step`` from ``src_rank`` (``metadata`` is unused).

        Raises CheckpointTransferError when the source fails, nothing arrives within
        ``timeout`` (None: the transport's), or the source sends another step (its tensors are
        drained first so the process group stays in sync).
        """
        timeout = self._timeout if timeout is None else timeout
        started = time.perf_counter()
        try:
            length = torch.zeros(1, dtype=torch.int64, device=self._device)
            self._recv(length, src_rank, timeout)
            check_header_length(int(length.item()))
            header_t = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
            self._recv(header_t, src_rank, timeout)
            header = Header.from_bytes(header_t.cpu().numpy().tobytes())
            check_receivable(header)
            tensors = [
                torch.empty(s.shape, dtype=s.dtype, device=self._device) for s in header.tensors
            ]
            for t in tensors:
                if t.numel():
                    self._recv(as_bytes(t), src_rank, timeout)
        except TimeoutError as e:
            raise CheckpointTransferError(
                f"receiving step {step} from rank {src_rank} timed out after {timeout}: {e}"
            ) from e
        except (RuntimeError, ValueError) as e:
            raise CheckpointTransferError(
                f"receiving step {step} from rank {src_rank} failed: {e}"
            ) from e
        if header.step != step:
            raise CheckpointTransferError(
                f"rank {src_rank} sent step {header.step}, requested step {step}"
            )
        try:
            state_dict = unflatten(header.tree, tensors)
        except ValueError as e:
            raise CheckpointTransferError(f"step {step} from rank {src_rank}: {e}") from e
        log_received(logger, step, src_rank, header.total_bytes, started, " over the process group")
        return state_dict

    def _recv(self, t: torch.Tensor, src: int, timeout: timedelta) -> Any:
        self._pg.recv([t], src, _TAG).wait(timeout)
