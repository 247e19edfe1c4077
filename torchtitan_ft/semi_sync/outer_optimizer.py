"""DiLoCo's outer optimizers and their state, in the trainer of every rank: one per fragment
(or one shared), their state copied for healing peers, and created before the first outer
step for disk checkpoints.

The state is always the torch optimizer's own: healing moves it with ``state_dict`` /
``load_state_dict``, and the state a checkpoint needs before the first outer step is made by
the optimizer itself (:func:`initial_optimizer_state`), never written out by hand.
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

    Made by the optimizer's own code: a scratch optimizer of the same type and param group
    options takes one real step of a zero copy of ``p`` with a zero gradient, which leaves
    every moment at zero; its step counter is then set back to 0. The tensors thus have the
    dtype, device and layout (a DTensor for a DTensor ``p``) torch gives them.

    Supported: SGD without dampening (a zero momentum buffer: ``0 * momentum + grad`` is the
    first buffer), Adam and AdamW, neither fused nor capturable (zero moments, step 0, as their
    own first step creates them).

    Raises:
        ValueError: ``p`` not in ``optimizer``, another optimizer type, or an unsupported
            option.
    """
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), None)
    if group is None:
        raise ValueError("the parameter is not in the outer optimizer's param_groups")
    _check_neutral_initial_state(optimizer, group)
    scratch_param = torch.zeros_like(p).detach()
    scratch_param.grad = torch.zeros_like(scratch_param)
    options = {key: value for key, value in group.items() if key != "params"}
    scratch = type(optimizer)([{**options, "params": [scratch_param]}])
    scratch.step()
    state = dict(scratch.state[scratch_param])
    if "step" in state:
        state["step"].zero_()
    return state


def _check_neutral_initial_state(optimizer: optim.Optimizer, group: dict[str, Any]) -> None:
    """Raises ``ValueError`` unless ``optimizer``'s first step with the state of a zero-gradient
    step from zero parameters (step counter 0) is the same as its first step with no state."""
    if isinstance(optimizer, optim.SGD):
        if group["momentum"] != 0 and group["dampening"] != 0:
            raise ValueError(
                f"outer SGD dampening={group['dampening']}: a checkpoint cannot hold its state "
                "before the first outer step (dampening must be 0)"
            )
        return
    if isinstance(optimizer, optim.Adam | optim.AdamW):
        if group.get("fused") or group.get("capturable"):
            raise ValueError(
                f"outer {type(optimizer).__name__} with fused or capturable: a checkpoint cannot "
                "hold its state before the first outer step (use the default implementation)"
            )
        return
    raise ValueError(
        f"outer optimizer {type(optimizer).__name__} is not supported by disk checkpoints of "
        "DiLoCo (supported: SGD, Adam, AdamW)"
    )
