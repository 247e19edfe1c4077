"""OptimizerWrapper unit tests against a scripted manager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan_ft.optim import Optimizer, OptimizerWrapper


class ScriptedManager:
    def __init__(self, votes: list[bool]) -> None:
        self.votes = list(votes)
        self.quorums = 0

    def start_quorum(self) -> None:
        self.quorums += 1

    def should_commit(self) -> bool:
        return self.votes.pop(0)


def _train(optim: torch.optim.Optimizer, model: nn.Module, steps: int) -> None:
    for i in range(steps):
        optim.zero_grad()
        model(torch.full((1, 3), float(i))).sum().backward()
        optim.step()


def test_steps_only_on_commit_and_matches_plain_adam() -> None:
    torch.manual_seed(0)
    plain_model = nn.Linear(3, 1)
    ft_model = nn.Linear(3, 1)
    ft_model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.1)
    manager = ScriptedManager([True, False, True, True])
    ft = OptimizerWrapper(manager, torch.optim.Adam(ft_model.parameters(), lr=0.1))  # type: ignore[arg-type]

    assert ft.state == {} and ft.state_dict()["state"] == {}  # no forced initialisation
    _train(ft, ft_model, 4)
    assert manager.quorums == 4
    # the discarded step 1 is as if it never happened: replay plain Adam on steps 0, 2, 3
    for i in (0, 2, 3):
        plain.zero_grad()
        plain_model(torch.full((1, 3), float(i))).sum().backward()
        plain.step()
    for p_ft, p_plain in zip(ft_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p_ft, p_plain)
        assert ft.state[p_ft]["step"].item() == plain.state[p_plain]["step"].item() == 3


def test_delegation_and_closure_rejected() -> None:
    model = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    ft = Optimizer(ScriptedManager([True]), inner)  # type: ignore[arg-type]
    assert ft.param_groups is inner.param_groups
    ft.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    assert len(inner.param_groups) == 2
    ft.load_state_dict(ft.state_dict())
    with pytest.raises(ValueError, match="closures"):
        ft.step(closure=lambda: 0.0)
    # LR schedulers accept the wrapper
    scheduler = torch.optim.lr_scheduler.StepLR(ft, step_size=1, gamma=0.5)
    ft.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
