"""The global parameters of LocalSGD and DiLoCo, in the trainer of every rank: a copy of the
parameters as last agreed across replica groups (restored when a sync fails, the base of
DiLoCo's pseudo-gradients), and the flat per-dtype buffers a sync sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchtitan_ft.semi_sync.strategy import param_data


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` one after another."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as each of ``like`` (the inverse of :func:`flatten`)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def dtype_groups(params: Sequence[nn.Parameter]) -> list[list[int]]:
    """Indices of ``params`` grouped by dtype and device (one flat buffer per group)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(params):
        data = param_data(p)
        groups.setdefault((data.dtype, data.device), []).append(i)
    return list(groups.values())


class ParameterBackup:
    """A copy of some parameters on ``device`` (the last agreed, global, values), taken at
    construction.

    Args:
        named_params: the parameters, with the names ``state_dict`` keys them by.
        device: where the copy lives (None: cpu; pinned when CUDA is present).
    """

    def __init__(
        self, named_params: Sequence[tuple[str, nn.Parameter]], device: torch.device | None
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.device = device or torch.device("cpu")
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        self.tensors: list[torch.Tensor] = []
        for p in self.params:
            data = param_data(p)
            t = torch.empty(data.shape, dtype=data.dtype, device=self.device)
            self.tensors.append(t.pin_memory() if pin else t)
        self.save()

    @torch.no_grad()
    def save(self) -> None:
        """Copies the parameters into the backup."""
        for t, p in zip(self.tensors, self.params, strict=True):
            t.copy_(param_data(p))

    @torch.no_grad()
    def restore(self) -> None:
        """Copies the backup into the parameters."""
        for t, p in zip(self.tensors, self.params, strict=True):
            param_data(p).copy_(t)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The backup tensors by parameter name (clones)."""
        return {name: t.clone() for name, t in zip(self.names, self.tensors, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads backup tensors by parameter name; every name must be present."""
        missing = [name for name in self.names if name not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks global parameters {missing[:5]}")
        for name, t in zip(self.names, self.tensors, strict=True):
            t.copy_(state_dict[name])
