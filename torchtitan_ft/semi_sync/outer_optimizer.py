"""DiLoCo's outer optimizers and their state, in the trainer of every rank: one per fragment
(or one shared), their state copied for healing peers, and created before the first outer
step for disk checkpoints.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor

from torchtitan_ft.semi_sync.config import OuterOptimizerConfig
from torchtitan_ft.semi_sync.strategy import local_tensor

OuterOptimizerArg = optim.Optimizer | Sequence[optim.Optimizer] | OuterOptimizerConfig
"""DiLoCo's ``outer_optimizer`` argument: one optimizer over every fragment, one per
fragment, or a config that builds one per fragment."""


def build_outer_optimizers(
    outer_optimizer: OuterOptimizerArg, fragments: Sequence[nn.Module]
) -> list[optim.Optimizer]:
    """The outer optimizer of each fragment (the same object for all when one is shared).

    Raises:
        ValueError: a sequence of optimizers whose length is not the number of fragments.
    """
    if isinstance(outer_optimizer, OuterOptimizerConfig):
        return [outer_optimizer.build(f.parameters()) for f in fragments]
    if isinstance(outer_optimizer, optim.Optimizer):
        return [outer_optimizer] * len(fragments)
    optimizers = list(outer_optimizer)
    if len(optimizers) != len(fragments):
        raise ValueError(
            f"got {len(optimizers)} outer optimizers for {len(fragments)} fragments; pass one, "
            "one per fragment, or an OuterOptimizerConfig"
        )
    return optimizers


def local_copy(value: Any) -> Any:
    """A deep copy of ``value`` with every DTensor replaced by a copy of its local shard."""
    if isinstance(value, torch.Tensor):
        return local_tensor(value).clone()
    if isinstance(value, dict):
        return {k: local_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(local_copy(v) for v in value)
    return copy.deepcopy(value)


def shard_like_params(optimizer: optim.Optimizer) -> None:
    """After loading local shards (:func:`local_copy`) into ``optimizer``: each state tensor
    of a sharded (DTensor) parameter that has the parameter's local shape becomes a DTensor
    laid out like the parameter, as the optimizer's own step would have created it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            state = optimizer.state.get(p, {})
            local_shape = p.to_local().shape
            for key, value in state.items():
                if type(value) is torch.Tensor and value.shape == local_shape and value.dim():
                    state[key] = DTensor.from_local(
                        value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )


def initial_optimizer_state(optimizer: optim.Optimizer, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """The state ``optimizer`` would create for ``p`` at its first step, with values its step
    treats exactly as no state: creating it early changes no numerics.

    Supported: SGD without dampening (a zero momentum buffer: ``0 * momentum + grad`` is the
    first buffer), Adam and AdamW, neither fused nor capturable (zero moments, step 0, as their
    own first step creates them).

    Raises:
        ValueError: another optimizer type, or an unsupported option.
    """
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), None)
    if group is None:
        raise ValueError("the parameter is not in the outer optimizer's param_groups")
    if isinstance(optimizer, optim.SGD):
        if group["momentum"] == 0:
            return {}
        if group["dampening"] != 0:
            raise ValueError(
                f"outer SGD dampening={group['dampening']}: a checkpoint cannot hold its state "
                "before the first outer step (dampening must be 0)"
            )
        return {"momentum_buffer": torch.zeros_like(p).detach()}
    if isinstance(optimizer, optim.Adam | optim.AdamW):
        if group.get("fused") or group.get("capturable"):
            raise ValueError(
                f"outer {type(optimizer).__name__} with fused or capturable: a checkpoint cannot "
                "hold its state before the first outer step (use the default implementation)"
            )
        state = {
            "step": torch.tensor(0.0, dtype=_scalar_dtype()),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format).detach(),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format).detach(),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p).detach()
        return state
    raise ValueError(
        f"outer optimizer {type(optimizer).__name__} is not supported by disk checkpoints of "
        "DiLoCo (supported: SGD, Adam, AdamW)"
    )


def _scalar_dtype() -> torch.dtype:
    """The dtype of Adam's ``step`` counter (float64 only under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
