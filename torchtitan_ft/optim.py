"""In the training loop of every rank: an optimizer wrapper that ties the optimizer to the
Manager's step protocol.

``zero_grad()`` starts the step's quorum (so it overlaps with the forward) and ``step()``
applies the update only when ``Manager.should_commit()`` says the step may commit. Nothing else
changes: the wrapped optimizer's state is created lazily by its own first real ``step()`` (no
warm-up step with a zero learning rate), so e.g. Adam's step counter matches a run without
fault tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer as _TorchOptimizer

if TYPE_CHECKING:
    from torchtitan_ft.manager import Manager


class OptimizerWrapper(_TorchOptimizer):
    """Wraps ``optim`` so that it steps only on committed steps.

    Call ``zero_grad()`` at the start of each step (before the forward) and ``step()`` after
    the backward. Everything else (``param_groups``, ``state``, ``state_dict``, ...) is the
    wrapped optimizer's.
    """

    def __init__(self, manager: Manager, optim: _TorchOptimizer) -> None:
        """
        Args:
            manager: the replica group's Manager.
            optim: the optimizer to wrap; it keeps its own state and hyper-parameters.
        """
        # Deliberately no super().__init__: all state lives in the wrapped optimizer.
        self.optim = optim
        self.manager = manager

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the step's quorum, then clears the gradients."""
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        """Applies the update if the step commits; returns whether it did.

        Raises:
            ValueError: a closure was passed (re-evaluating the loss is not supported).
        """
        if closure is not None:
            raise ValueError("OptimizerWrapper.step does not support closures")
        committed = self.manager.should_commit()
        if committed:
            self.optim.step()
        return committed

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, Any]:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"


Optimizer = OptimizerWrapper
"""torchft's name for ``OptimizerWrapper``."""
