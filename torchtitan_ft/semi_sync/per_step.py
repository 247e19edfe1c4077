"""Per-step sync (FT-HSDP), in the trainer of every rank: gradients averaged across replica
groups every step, commit per step.

The default strategy and a thin one: the Manager does the work. ``start_step`` starts the
quorum (overlapped with the forward in async mode), ``before_step`` averages the gradients
through ``Manager.allreduce`` (unless a DDP wrapper already did) and returns the commit vote;
the inner optimizer steps only on commit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from torchtitan_ft.semi_sync.strategy import (
    CommStats,
    ManagerLike,
    SyncStrategy,
    local_tensor,
    wait_future,
)


class PerStepSync(SyncStrategy):
    """Synchronous per-step commit.

    Args:
        manager: the replica group's Manager.
        params: the parameters whose gradients are averaged (ignored when
            ``allreduce_gradients`` is False).
        allreduce_gradients: average gradients here (default). False when the model is wrapped
            in ``torchtitan_ft.ddp.DistributedDataParallel``, which averages them in backward.
        bucket_cap_mb: gradients of one dtype and device are copied into flat buckets of up to
            this many MiB (default 25), one ``Manager.allreduce`` per bucket, and copied back:
            each collective costs ~1 ms of Python and a round trip, so a model of many small
            tensors is far cheaper in a few buckets (one gradient larger than the cap is a
            bucket of its own). The buckets are extra memory of up to the gradients' size.
    """

    def __init__(
        self,
        manager: ManagerLike,
        params: Iterable[nn.Parameter] = (),
        allreduce_gradients: bool = True,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 (MiB), got {bucket_cap_mb}")
        self._manager = manager
        self._params = list(params)
        self._allreduce_gradients = allreduce_gradients
        self._bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.stats = CommStats()

    def start_step(self) -> None:
        """Starts this step's quorum."""
        self._manager.start_quorum()

    def before_step(self) -> bool:
        """Averages gradients across replica groups; returns the group-wide commit vote.

        The averaged buckets are copied back into the gradients only on commit:
        ``should_commit`` may re-run a failed allreduce into them (``retry_inflight_allreduce``),
        and a discarded step's gradients are not used.
        """
        buckets = []
        if self._allreduce_gradients:
            grads = [local_tensor(p.grad) for p in self._params if p.grad is not None]
            for bucket in gradient_buckets(grads, self._bucket_cap_bytes):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                buckets.append((bucket, flat, self._manager.allreduce(flat)))
                self.stats.allreduce_calls += 1
                self.stats.payload_bytes += flat.numel() * flat.element_size()
            for _, _, fut in buckets:
                wait_future(self._manager, fut)
        committed = self._manager.should_commit()
        if committed:
            self.stats.syncs_committed += 1
            for bucket, flat, _ in buckets:
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        else:
            self.stats.syncs_failed += 1
        return committed

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-step sync owns no state (the Manager heals the model and optimizer)."""
        return {}


def gradient_buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """``grads`` in order, grouped into runs of one dtype and device of at most ``cap_bytes``
    each (a gradient larger than the cap alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = buckets[-1] if buckets else None
        if (
            last is None
            or g.dtype != last[0].dtype
            or g.device != last[0].device
            or size + nbytes > cap_bytes
        ):
            buckets.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return buckets
