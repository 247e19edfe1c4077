"""LocalSGD and DiLoCo work with any object that has the Manager's interface, as torchft's do:
torchft's own tests (local_sgd_test.py) drive them with ``create_autospec(Manager)``. The mock
stands in for the Manager only; the real Manager with these strategies is tested in
``test_diloco_multiprocess.py`` and through the simulated replica groups."""

from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock, create_autospec

import pytest
import torch
from torch import nn

from torchtitan_ft.manager import Manager
from torchtitan_ft.process_group.futures import completed_future
from torchtitan_ft.semi_sync import DiLoCo, LocalSGD


def _mock_manager(**attrs: Any) -> MagicMock:
    manager = create_autospec(Manager)
    manager.errored.return_value = None
    manager.should_commit.return_value = True
    manager.current_step.return_value = 0
    # A 1-member allreduce: the tensor comes back unchanged.
    manager.allreduce.side_effect = lambda t, should_quantize=False: completed_future(t)
    for name, value in attrs.items():
        setattr(manager, name, value)
    return manager


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.rand(2, 3)).mean().backward()
    optimizer.step()


@pytest.mark.parametrize("attrs", [{}, {"_use_async_quorum": False}])
def test_local_sgd_with_a_mock_manager(attrs: dict[str, Any]) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = _mock_manager(**attrs)
    with LocalSGD(manager, model, optimizer, sync_every=2) as local_sgd:
        _train_step(model, optimizer)  # first step: the initial quorum, then one local step
        initial_quorums = manager.start_quorum.call_count
        assert local_sgd.local_step == 1
        _train_step(model, optimizer)  # second step: a sync
        assert local_sgd.local_step == 0
        assert manager.start_quorum.call_count == initial_quorums + 1
        assert local_sgd.stats.syncs_committed == 1
    manager.register_state_dict_fn.assert_called_once()


def test_diloco_with_a_mock_manager() -> None:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = _mock_manager(_use_async_quorum=False)
    with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
        _train_step(model, inner)
        calls_before_sync = manager.allreduce.call_count
        _train_step(model, inner)
        assert diloco.stats.syncs_committed == 1
        # One flattened allreduce per dtype: the pseudo-gradients are all fp32.
        assert manager.allreduce.call_count == calls_before_sync + 1
    # The outer optimizer stepped on every parameter.
    assert len(outer.state_dict()["state"]) == len(list(model.parameters()))


def test_mock_manager_with_async_quorum_is_refused() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match="needs a synchronous quorum"):
        DiLoCo(_mock_manager(_use_async_quorum=True), [model], inner, outer, sync_every=2)
    with pytest.raises(ValueError, match="needs a synchronous quorum"):
        LocalSGD(_mock_manager(_use_async_quorum=True), model, inner, sync_every=2)
