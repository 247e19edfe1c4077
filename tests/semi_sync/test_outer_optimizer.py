"""DiLoCo's outer-optimizer state made before the first outer step, against torch's own first
``step()``: same tensors (keys, dtypes, shapes), and the same step when it is there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
from torch import nn

from torchtitan_ft.semi_sync.outer_optimizer import initial_optimizer_state

Build = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Build] = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    "sgd-weight-decay": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, weight_decay=0.1),
    "sgd-no-momentum": lambda ps: torch.optim.SGD(ps, lr=0.7),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-amsgrad-weight-decay": lambda ps: torch.optim.Adam(
        ps, lr=0.01, amsgrad=True, weight_decay=0.1
    ),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.95)),
}


@pytest.fixture(params=[torch.float32, torch.float64], ids=["float32", "float64"])
def default_dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    """Runs the test under each default dtype (Adam's step counter follows it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    yield request.param
    torch.set_default_dtype(before)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("build", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_initial_state_has_the_tensors_of_torchs_first_step(
    build: Build, default_dtype: torch.dtype
) -> None:
    stepped, early = _model(), _model()
    stepped_opt, early_opt = build(stepped.parameters()), build(early.parameters())
    _step(stepped, stepped_opt)
    for p, q in zip(stepped.parameters(), early.parameters(), strict=True):
        created = initial_optimizer_state(early_opt, q)
        real = stepped_opt.state[p]
        assert created.keys() == real.keys()
        for key, tensor in created.items():
            assert tensor.dtype == real[key].dtype, key
            assert tensor.shape == real[key].shape, key
            assert tensor.device == real[key].device, key
            assert not tensor.any(), key  # zero moments, step counter 0


@pytest.mark.parametrize("build", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_first_step_with_the_initial_state_is_torchs_first_step(
    build: Build, default_dtype: torch.dtype
) -> None:
    lazy, early = _model(), _model()
    lazy_opt, early_opt = build(lazy.parameters()), build(early.parameters())
    for q in early.parameters():
        early_opt.state[q] = initial_optimizer_state(early_opt, q)
    _step(lazy, lazy_opt)
    _step(early, early_opt)
    for p, q in zip(lazy.parameters(), early.parameters(), strict=True):
        assert torch.equal(p, q)
        assert lazy_opt.state[p].keys() == early_opt.state[q].keys()
        for key, tensor in lazy_opt.state[p].items():
            assert torch.equal(tensor, early_opt.state[q][key]), key


def test_making_the_initial_state_touches_neither_the_parameter_nor_the_optimizer() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    p = next(model.parameters())
    before = p.detach().clone()
    state = initial_optimizer_state(optimizer, p)
    assert torch.equal(p, before) and p.grad is None
    assert not optimizer.state
    assert all(t is not p for t in state.values())
