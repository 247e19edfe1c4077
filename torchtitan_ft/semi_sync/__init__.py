"""Sync strategies across replica groups, in the trainer of every rank: per-step (FT-HSDP),
LocalSGD, DiLoCo, Streaming DiLoCo.

torchft 0.2.0's ``torchft.local_sgd.LocalSGD`` and ``DiLoCo`` map to the classes of the same
name here. The trainer builds one with ``build_strategy(SyncConfig(...), manager, model,
optimizer)`` and drives it through ``SyncStrategy`` (see ``strategy.py``). LocalSGD and DiLoCo
(``local_sgd.py``) carry out the sync schedule of ``schedule.py`` (DiLoCo's overlapped outer
round: ``overlap.py``); DiLoCo's outer optimizers are in ``outer_optimizer.py``, the global
parameters in ``backup.py``.
"""

from torchtitan_ft.semi_sync.builder import build_strategy
from torchtitan_ft.semi_sync.config import (
    OuterOptimizerConfig,
    OuterOptimizerType,
    QuorumMode,
    SyncConfig,
    SyncMethod,
)
from torchtitan_ft.semi_sync.fragments import ModelFragment, fragments_from_fqns, split_model
from torchtitan_ft.semi_sync.local_sgd import DiLoCo, LocalSGD
from torchtitan_ft.semi_sync.overlap import OuterOverlap
from torchtitan_ft.semi_sync.per_step import PerStepSync
from torchtitan_ft.semi_sync.strategy import (
    CommStats,
    ManagerLike,
    SyncStrategy,
    extract_local_tensor,
)

__all__ = [
    "CommStats",
    "DiLoCo",
    "LocalSGD",
    "ManagerLike",
    "ModelFragment",
    "OuterOptimizerConfig",
    "OuterOptimizerType",
    "OuterOverlap",
    "PerStepSync",
    "QuorumMode",
    "SyncConfig",
    "SyncMethod",
    "SyncStrategy",
    "build_strategy",
    "extract_local_tensor",
    "fragments_from_fqns",
    "split_model",
]
