"""Building the configured sync strategy for a model, in the trainer of every rank."""

from __future__ import annotations

import torch
from torch import nn, optim

from torchtitan_ft.semi_sync.config import QuorumMode, SyncConfig, SyncMethod
from torchtitan_ft.semi_sync.fragments import fragments_from_fqns, split_model
from torchtitan_ft.semi_sync.local_sgd import DiLoCo, LocalSGD
from torchtitan_ft.semi_sync.per_step import PerStepSync
from torchtitan_ft.semi_sync.strategy import ManagerLike, SyncStrategy, quorum_mode_of


def build_strategy(
    config: SyncConfig,
    manager: ManagerLike,
    model: nn.Module,
    inner_optimizer: optim.Optimizer,
) -> SyncStrategy:
    """The strategy ``config`` asks for, wired to ``manager``, ``model`` and ``inner_optimizer``.

    ``config`` was checked when it was built; the strategies check their own arguments.

    Raises:
        ValueError: a Manager whose quorum mode differs from ``config.quorum_mode``.
    """
    quorum_mode_of(manager, config.quorum_mode)
    backup_device = torch.device(config.backup_device) if config.backup_device else None
    method = SyncMethod(config.method)
    if method is SyncMethod.PER_STEP:
        return PerStepSync(manager, model.parameters(), config.allreduce_gradients)
    if method is SyncMethod.LOCAL_SGD:
        return LocalSGD(
            manager,
            model,
            inner_optimizer,
            config.sync_every,
            backup_device,
            quorum_mode=QuorumMode(config.quorum_mode),
        )
    fragments = (
        fragments_from_fqns(model, config.fragment_fqns)
        if config.fragment_fqns
        else split_model(model, config.num_fragments)
    )
    return DiLoCo(
        manager,
        fragments,
        inner_optimizer,
        config.outer_optimizer,
        config.sync_every,
        backup_device,
        should_quantize=config.should_quantize,
        fragment_sync_delay=config.fragment_sync_delay,
        fragment_update_alpha=config.fragment_update_alpha,
        outer_overlap=config.outer_overlap,
        quorum_mode=QuorumMode(config.quorum_mode),
    )
