"""DistributedDataParallel unit tests against a scripted manager.

The real Manager's allreduce is tested in test_manager.py; survival of a SIGKILLed peer with the
real stack is tested in test_manager_integration.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from torchtitan_ft.ddp import DistributedDataParallel, _make_buckets


class ScriptedManager:
    """allreduce multiplies by ``factor`` and completes the future, optionally late from
    another thread (as gloo does)."""

    def __init__(self, factor: float = 0.5, late: bool = False) -> None:
        self.factor = factor
        self.late = late
        self.calls: list[int] = []

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.calls.append(tensor.numel())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def complete() -> None:
            tensor.mul_(self.factor)
            fut.set_result(tensor)

        if self.late:
            threading.Timer(0.05, complete).start()
        else:
            complete()
        return fut


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("late", [False, True])
def test_gradients_are_replaced_by_the_allreduced_ones(late: bool) -> None:
    reference, wrapped_module = _model(), _model()
    manager = ScriptedManager(0.5, late=late)
    ddp = DistributedDataParallel(manager, wrapped_module)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    reference(x).sum().backward()
    ddp(x).sum().backward()
    for p_ref, p in zip(reference.parameters(), wrapped_module.parameters(), strict=True):
        assert p.grad is not None and p_ref.grad is not None
        torch.testing.assert_close(p.grad, p_ref.grad * 0.5)
    assert sum(manager.calls) == sum(p.numel() for p in wrapped_module.parameters())


def test_small_buckets_and_no_sync() -> None:
    module = _model()
    manager = ScriptedManager(1.0)
    ddp = DistributedDataParallel(manager, module, bucket_cap_mb=64 / 2**20)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert manager.calls == []
    ddp(x).sum().backward()
    assert len(manager.calls) > 1  # several buckets
    assert sum(manager.calls) == sum(p.numel() for p in module.parameters())


def test_unused_parameters_get_the_average() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> Any:
            return self.used(x)

    module = TwoHeads()
    ddp = DistributedDataParallel(ScriptedManager(1.0), module)  # type: ignore[arg-type]
    ddp(torch.ones(1, 2)).sum().backward()
    assert module.unused.weight.grad is not None
    assert torch.equal(module.unused.weight.grad, torch.zeros(2, 2))


def test_make_buckets_respects_cap_and_dtype() -> None:
    params = [
        nn.Parameter(torch.zeros(10)),
        nn.Parameter(torch.zeros(10)),
        nn.Parameter(torch.zeros(10, dtype=torch.float64)),
    ]
    buckets = _make_buckets(params, cap_bytes=80)
    # reverse order; the float64 one alone, the two float32 ones together (80 bytes)
    assert [[id(p) for p in b.params] for b in buckets] == [
        [id(params[2])],
        [id(params[1]), id(params[0])],
    ]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(ScriptedManager(), _model(), bucket_cap_mb=0)  # type: ignore[arg-type]
