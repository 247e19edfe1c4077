"""In the training loop of every rank: ``DistributedDataParallel`` across replica groups,
averaging gradients through the Manager (and ``PureDistributedDataParallel``, torchft's simpler
one-allreduce-per-parameter variant, at the end of this module).

Gradients live in flat buffers allocated once, one per bucket (parameters of one dtype and
device, up to ``bucket_cap_mb``): after a backward each parameter's ``.grad`` is a view into its
bucket's buffer. ``Manager.allreduce`` averages a bucket's buffer in place over the
participating replica groups as soon as all of its parameters have their gradient, while the
rest of the backward runs, so nothing is flattened or copied back.

A gradient reaches its view in one of two ways. If ``.grad`` already is the view
(``zero_grad(set_to_none=False)``, or gradients accumulated over several backwards), autograd
accumulates straight into it. If autograd allocated a new gradient because ``.grad`` was None
(``zero_grad()``'s default), that gradient is copied into the view once and ``.grad`` is
re-pointed at the view. Backwards inside ``no_sync()`` do the same, so accumulated gradients are
already in place when a synchronising backward comes.

Survival is the point of this module: ``Manager.allreduce`` returns a future that always
completes with a tensor (a failed or timed-out collective is recorded as the step's error), so
the end-of-backward wait cannot raise or hang past the manager's ``timeout`` even when a peer
is SIGKILLed mid-allreduce. The gradients are then garbage, ``should_commit`` votes no, and the
step is discarded. (The reference's comm hook asserted on an inner future that a swallowed
error had left unset and crashed the survivor.) After such a step the gradients move to fresh
buffers: an abandoned collective may still write into the old ones, which must not leak into a
later step.

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
    """Parameters of one dtype and device whose gradients are views into one flat buffer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.views = self._views_of(self.flat)
        self.ready: set[int] = set()  # indices into params that got their gradient
        self.future: torch.futures.Future[torch.Tensor] | None = None

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in self.params:
            # The strides autograd gives p's gradient (p's own if dense, else contiguous), so
            # accumulating into the view and copying a new gradient in need no restriding.
            strides = torch.empty_like(p, device="meta").stride()
            views.append(flat.as_strided(p.shape, strides, offset))
            offset += p.numel()
        return views

    def reset(self) -> None:
        self.ready.clear()
        self.future = None

    def adopt(self, i: int) -> None:
        """Makes parameter ``i``'s gradient its view, with the same value (zeros if None)."""
        p, view = self.params[i], self.views[i]
        grad = p.grad
        if grad is view:
            return  # autograd accumulated in place
        if grad is None:
            view.zero_()  # the buffer still holds an earlier step's gradient
        else:
            view.copy_(grad)  # whatever the gradient's layout
        p.grad = view

    def adopt_missing(self) -> None:
        """Adopts the gradients of the parameters that got none in this backward."""
        for i in range(len(self.params)):
            if i not in self.ready:
                self.adopt(i)

    def move_to_new_buffer(self) -> None:
        """Moves the gradients to a copy of the buffer and leaves the old one to whatever
        collective may still write into it."""
        self.flat = self.flat.clone()
        self.views = self._views_of(self.flat)
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view


class DistributedDataParallel(nn.Module):
    """Wraps ``module`` so each backward averages its gradients across replica groups.

    Use with ``OptimizerWrapper`` (which starts the quorum in ``zero_grad`` and steps only when
    ``should_commit``). ``module`` is reachable as ``.module``; ``no_sync()`` skips the
    exchange for gradient accumulation. Move ``module`` to its device and dtype before
    wrapping: the gradient buffers are allocated here.

    Parameters that received no gradient in a backward take part with the gradient they hold
    (zeros if None) and get the averaged gradient afterwards, so every replica ends the backward
    with the same set of gradients even when control flow differs between them.
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
        self._slot_of: dict[int, tuple[_Bucket, int]] = {
            id(p): (bucket, i) for bucket in self._buckets for i, p in enumerate(bucket.params)
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
        bucket, i = self._slot_of[id(param)]
        bucket.adopt(i)
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            for b in self._buckets:
                b.reset()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if i in bucket.ready:
            # Its bucket may be in flight already, and the peers would run fewer collectives.
            raise RuntimeError(
                "a parameter got its gradient twice in one backward (reentrant checkpointing "
                "of a parameter also used outside the checkpoint?); DistributedDataParallel "
                "needs one gradient per parameter per backward: use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> torch.futures.Future[torch.Tensor]:
        bucket.future = self._manager.allreduce(bucket.flat)  # in place
        return bucket.future

    def _finish_backward(self) -> None:
        self._in_backward = False
        futures = []
        for bucket in self._buckets:
            if bucket.future is None:  # some parameters got no gradient this backward
                bucket.adopt_missing()
                futures.append(self._launch(bucket))
            else:
                futures.append(bucket.future)
        for future in futures:
            future.wait()  # never raises: Manager.allreduce swallows errors
        # A step the Manager retries re-runs the allreduces in these buffers (once gloo is
        # done with them); a discarded one leaves them to the abandoned collectives.
        if self._manager.errored() is not None and not self._manager.retry_decision().retry:
            for bucket in self._buckets:
                bucket.move_to_new_buffer()


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


class PureDistributedDataParallel(nn.Module):
    """torchft's plain variant: one ``Manager.allreduce`` per gradient, no buckets.

    As each parameter's gradient is accumulated, its ``.grad`` is averaged in place over the
    participating replica groups (the collective starts at once, while the backward goes on);
    the backward's end waits for all of them, so the gradients are final when ``backward()``
    returns. Failures are data, as with :class:`DistributedDataParallel`: the futures never
    raise, the step's error is recorded and ``should_commit`` discards it.

    Simpler and slower than :class:`DistributedDataParallel` (one collective per parameter
    instead of one per bucket; use that one for real models). Every replica group must produce
    gradients for the same parameters in each backward: a parameter without a gradient is
    skipped, and replicas that skip different ones issue different collectives. There is no
    ``no_sync()``. After a failed step, an abandoned collective may still write into the
    ``.grad`` it was given; ``zero_grad()`` (``set_to_none=True``, the default) gives the next
    step new tensors.

    Args:
        manager: the replica group's Manager; its ``allreduce`` does the averaging.
        module: the model; its trainable parameters are synchronised (reachable as ``.module``).
    """

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._manager = manager
        self._futures: list[torch.futures.Future[torch.Tensor]] = []
        self._in_backward = False
        params = dict.fromkeys(p for p in module.parameters() if p.requires_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._in_backward = False  # a backward that raised midway never ran its callback
        self._futures = []
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._futures.append(self._manager.allreduce(param.grad))  # in place

    def _finish_backward(self) -> None:
        self._in_backward = False
        futures, self._futures = self._futures, []
        for future in futures:
            future.wait()  # never raises: Manager.allreduce swallows errors
