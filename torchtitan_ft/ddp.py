"""DistributedDataParallel across replica groups, through the Manager.

Gradients are averaged over the participating replica groups by ``Manager.allreduce``, bucket
by bucket while the backward runs (a bucket is launched as soon as all of its parameters have
their gradient), and copied back at the end of the backward.

Survival is the point of this module: ``Manager.allreduce`` returns a future that always
completes with a tensor (a failed or timed-out collective is recorded as the step's error), so
the end-of-backward wait cannot raise or hang past the manager's ``timeout`` even when a peer
is SIGKILLed mid-allreduce. The gradients are then garbage, ``should_commit`` votes no, and the
step is discarded. (The reference's comm hook asserted on an inner future that a swallowed
error had left unset and crashed the survivor.)

No broadcast happens at construction: the Manager makes replicas identical by healing
(``init_sync``), not this wrapper.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torchtitan_ft.manager import Manager


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.future: torch.futures.Future[torch.Tensor] | None = None

    def reset(self) -> None:
        self.ready.clear()
        self.flat = None
        self.future = None


class DistributedDataParallel(nn.Module):
    """Wraps ``module`` so each backward averages its gradients across replica groups.

    Use with ``OptimizerWrapper`` (which starts the quorum in ``zero_grad`` and steps only when
    ``should_commit``). ``module`` is reachable as ``.module``; ``no_sync()`` skips the
    exchange for gradient accumulation.

    Parameters that received no gradient in a backward take part with zeros and get the
    averaged gradient afterwards, so every replica ends the backward with the same set of
    gradients even when control flow differs between them.
    """

    def __init__(self, manager: Manager, module: nn.Module, bucket_cap_mb: float = 25.0) -> None:
        """
        Args:
            manager: the replica group's Manager; its ``allreduce`` does the averaging.
            module: the model; its trainable parameters are synchronised.
            bucket_cap_mb: bucket size in MiB (default 25): larger buckets mean fewer
                collectives, smaller ones start communicating earlier in the backward.
        """
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self._manager = manager
        self._sync = True
        self._in_backward = False
        params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
        self._buckets = _make_buckets(params, int(bucket_cap_mb * 1024 * 1024))
        self._bucket_of: dict[int, _Bucket] = {
            id(p): bucket for bucket in self._buckets for p in bucket.params
        }
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._in_backward = False  # a backward that raised midway never ran its callback
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside this context only accumulate local gradients."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            for bucket in self._buckets:
                bucket.reset()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if len(bucket.params) == 1:
            p = bucket.params[0]
            if p.grad is not None and p.grad.is_contiguous():
                # A bucket of one (large) gradient: reduce it in place, no flattening copies.
                bucket.flat = p.grad
                bucket.future = self._manager.allreduce(p.grad)
                return
        grads = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in bucket.params
        ]
        bucket.flat = torch.cat(grads)
        bucket.future = self._manager.allreduce(bucket.flat)

    def _finish_backward(self) -> None:
        self._in_backward = False
        for bucket in self._buckets:
            if bucket.future is None:
                self._launch(bucket)  # some parameters got no gradient this backward
        for bucket in self._buckets:
            future, flat = bucket.future, bucket.flat
            if future is None or flat is None:
                raise RuntimeError("internal error: bucket not launched")
            future.wait()  # never raises: Manager.allreduce swallows errors
            if len(bucket.params) == 1 and flat is bucket.params[0].grad:
                bucket.reset()
                continue
            offset = 0
            for p in bucket.params:
                n = p.numel()
                averaged = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = averaged.clone()
                else:
                    p.grad.copy_(averaged)
                offset += n
            bucket.reset()


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Groups parameters in reverse definition order (the order backward produces them),
    one dtype/device per bucket, each bucket up to ``cap_bytes``."""
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        mismatch = current and (p.dtype != current[0].dtype or p.device != current[0].device)
        if current and (mismatch or size + nbytes > cap_bytes):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets
