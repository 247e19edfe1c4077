"""Shared pieces of the semi-sync tests: a tiny model, deterministic data, replica threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan_ft.semi_sync.strategy import SyncStrategy


class TinyLM(nn.Module):
    """A llama-shaped toy: ``tok_embeddings`` (a Linear here), ``layers`` (ModuleDict), ``norm``,
    ``output``; small enough that tests run in milliseconds."""

    def __init__(self, dim: int = 4, num_layers: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(3, dim)
        self.layers = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(num_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.output(self.norm(h))


def make_model(seed: int = 0, **kwargs: Any) -> TinyLM:
    """A ``TinyLM`` with parameters fixed by ``seed``."""
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) of ``replica`` at inner step ``step`` (1-based), deterministic."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(8, 3, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def loss_fn(model: nn.Module, replica: int, step: int) -> torch.Tensor:
    """Mean squared error of ``model`` on ``batch(replica, step)``."""
    x, y = batch(replica, step)
    return ((model(x) - y) ** 2).mean()


def train_steps(
    strategy: SyncStrategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    replica: int,
    steps: range,
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Runs the training-loop contract of ``SyncStrategy`` for ``steps`` (1-based numbers)."""
    for step in steps:
        strategy.start_step()
        loss_fn(model, replica, step).backward()
        if strategy.before_step():
            optimizer.step()
        strategy.after_step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step(step)


def run_threads(fns: list[Callable[[], None]], timeout: float = 60.0) -> None:
    """Runs each callable in its own thread; re-raises the first error; fails on timeout."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # collected and re-raised in the test thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a replica thread did not finish")
    if errors:
        raise errors[0]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s parameters by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}
