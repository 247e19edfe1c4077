"""Configuration of the sync strategies (pure): which one, how often, the quorum mode and the
outer optimizer.

Everything a user may choose is a field here with its meaning, unit and default, so that the
TorchTitan config (``fault_tolerance`` section) can map onto it one to one. A ``SyncConfig``
is checked once, when it is built (``SyncConfig.validate``): combinations that cannot work (e.g.
DiLoCo with an asynchronous quorum) are refused with an error that names the bad value and what
is expected, so whoever receives one (``build_strategy``) need not check it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import optim

from torchtitan_ft.semi_sync.overlap import OuterOverlap, check_outer_overlap
from torchtitan_ft.semi_sync.schedule import SyncSchedule


class SyncMethod(StrEnum):
    """How replica groups keep their weights in agreement."""

    PER_STEP = "per_step"
    """FT-HSDP: gradients averaged across replica groups every step, commit per step."""
    LOCAL_SGD = "local_sgd"
    """Each group steps alone; parameters are averaged every ``sync_every`` steps."""
    DILOCO = "diloco"
    """Inner optimizer for ``sync_every`` steps, then an outer optimizer step on the averaged
    pseudo-gradient; with fragments (``num_fragments > 1``) this is Streaming DiLoCo."""


class QuorumMode(StrEnum):
    """When the Manager's quorum (and healing) completes relative to the step: the one
    spelling of the choice everywhere but torchft's ``Manager(use_async_quorum=...)`` bool,
    which is ``quorum_mode is ASYNC``. The strategies check that they agree with it
    (``semi_sync.strategy.quorum_mode_of``).
    """

    SYNC = "sync"
    """``start_quorum`` blocks until the quorum is known and any healing is done. Required by
    LocalSGD and DiLoCo: their state must be in place before a replica joins a sync."""
    ASYNC = "async"
    """``start_quorum`` returns at once; the quorum (and healing) overlaps the forward pass.
    Lower per-step overhead for per-step sync; a healing replica sits out that step."""

    @classmethod
    def of(cls, use_async_quorum: bool) -> QuorumMode:
        """The mode of a ``Manager(use_async_quorum=...)``."""
        return cls.ASYNC if use_async_quorum else cls.SYNC


class OuterOptimizerType(StrEnum):
    """The outer optimizer DiLoCo applies to the averaged pseudo-gradient."""

    SGD = "sgd"
    ADAMW = "adamw"


@dataclass(frozen=True)
class OuterOptimizerConfig:
    """The DiLoCo outer optimizer (not hard-coded: torchft fixed it to SGD 0.7/0.9/Nesterov).

    The defaults are the DiLoCo paper's (SGD, lr 0.7, momentum 0.9, Nesterov).
    """

    type: OuterOptimizerType = OuterOptimizerType.SGD
    """``sgd`` or ``adamw``."""
    lr: float = 0.7
    """Outer learning rate (unitless; 1.0 with SGD and no momentum = plain averaging)."""
    momentum: float = 0.9
    """SGD momentum; ignored by AdamW."""
    nesterov: bool = True
    """SGD Nesterov momentum (needs ``momentum > 0``); ignored by AdamW."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas; ignored by SGD."""
    eps: float = 1e-8
    """AdamW epsilon; ignored by SGD."""

    def validate(self) -> None:
        """Raises ``ValueError`` for values no optimizer accepts (including inf and nan)."""
        kind = OuterOptimizerType(self.type)
        numbers = {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        numbers |= {"eps": self.eps, "betas[0]": self.betas[0], "betas[1]": self.betas[1]}
        for name, value in numbers.items():
            if not math.isfinite(value):
                raise ValueError(f"outer optimizer {name} must be a finite number, got {value}")
        if self.lr <= 0:
            raise ValueError(f"outer optimizer lr must be > 0, got {self.lr}")
        if kind is OuterOptimizerType.SGD:
            if self.momentum < 0:
                raise ValueError(f"outer SGD momentum must be >= 0, got {self.momentum}")
            if self.nesterov and self.momentum <= 0:
                raise ValueError("outer SGD nesterov=True needs momentum > 0")
        if self.weight_decay < 0:
            raise ValueError(f"outer weight_decay must be >= 0, got {self.weight_decay}")

    def build(self, params: Iterable[torch.nn.Parameter]) -> optim.Optimizer:
        """Returns a fresh outer optimizer over ``params``."""
        self.validate()
        if OuterOptimizerType(self.type) is OuterOptimizerType.SGD:
            return optim.SGD(
                params,
                lr=self.lr,
                momentum=self.momentum,
                nesterov=self.nesterov,
                weight_decay=self.weight_decay,
            )
        return optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )


@dataclass(frozen=True)
class SyncConfig:
    """Which sync strategy the trainer uses, and its knobs; checked when built (frozen, so it
    stays valid).

    Raises:
        ValueError: at construction, as :meth:`validate`.
    """

    method: SyncMethod = SyncMethod.PER_STEP
    """``per_step`` (default), ``local_sgd`` or ``diloco``."""
    quorum_mode: QuorumMode = QuorumMode.ASYNC
    """``async`` (default, as torchft) or ``sync``. LocalSGD and DiLoCo require ``sync``."""
    sync_every: int = 20
    """LocalSGD/DiLoCo: inner steps between two syncs of the same parameters (H). With
    ``num_fragments = F`` one fragment is synced every ``sync_every / F`` steps. Ignored by
    per-step."""
    num_fragments: int = 1
    """DiLoCo: split the model into this many fragments (Streaming DiLoCo), by contiguous
    ranges of ``model.layers``. Ignored when ``fragment_fqns`` is set."""
    fragment_fqns: list[list[str]] | None = None
    """DiLoCo: explicit fragments, each a list of module names (e.g. ``["tok_embeddings",
    "layers.0"]``). Every parameter must fall in exactly one fragment."""
    fragment_sync_delay: int = 0
    """DiLoCo: tau, inner steps between starting a fragment's (asynchronous) allreduce and
    applying it; overlaps communication with compute. Must be < ``sync_every / F``."""
    fragment_update_alpha: float = 0.0
    """DiLoCo: alpha in [0, 1]; after a sync the fragment is ``(1 - alpha) * global +
    alpha * local``. 0 (default) takes the global parameters."""
    outer_overlap: OuterOverlap = OuterOverlap.NONE
    """DiLoCo: ``none`` (default) blocks on each outer round at its sync point; ``delayed``
    lets each round's allreduce run during the next ``sync_every / F`` inner steps and applies
    it one outer step late, keeping the inner progress made meanwhile (``overlap.py``);
    ``eager`` does the same but starts each round from the outer step taken with this group's
    own share of the average in flight, which the exact average replaces when it arrives. Both
    hide the link behind compute at some cost in loss (staleness; ``eager`` less, see
    docs/performance.md); both need ``fragment_sync_delay = 0`` and
    ``fragment_update_alpha = 0``. Only DiLoCo (LocalSGD refuses an overlap)."""
    should_quantize: bool = False
    """DiLoCo: send pseudo-gradients as int8 with per-block scales (~4x fewer bytes)."""
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    """DiLoCo: the outer optimizer."""
    backup_device: str | None = None
    """LocalSGD/DiLoCo: device of the global-parameter backup (default ``cpu``)."""
    allreduce_gradients: bool = True
    """Per-step: average gradients in the strategy. Set False when the model is wrapped in
    ``torchtitan_ft.ddp.DistributedDataParallel`` (which already averages them)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first invalid field or combination (runs at
        construction)."""
        method = SyncMethod(self.method)
        check_quorum_mode(method, QuorumMode(self.quorum_mode))
        if method is SyncMethod.PER_STEP:
            return
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if method is SyncMethod.LOCAL_SGD:
            if OuterOverlap(self.outer_overlap).overlapped:
                raise ValueError(
                    f"outer_overlap={self.outer_overlap!r} is for DiLoCo only; LocalSGD needs "
                    "'none'"
                )
            return
        check_outer_overlap(
            self.outer_overlap, self.fragment_sync_delay, self.fragment_update_alpha
        )
        num_fragments = len(self.fragment_fqns) if self.fragment_fqns else self.num_fragments
        validate_diloco_schedule(
            self.sync_every, num_fragments, self.fragment_sync_delay, self.fragment_update_alpha
        )
        self.outer_optimizer.validate()


def check_quorum_mode(method: SyncMethod, mode: QuorumMode, name: str | None = None) -> None:
    """Raises ``ValueError`` unless ``method`` can run with quorum ``mode``: LocalSGD and
    DiLoCo need a synchronous one. ``name`` says what chose the method in the message
    (default: the method's own name)."""
    if method is SyncMethod.PER_STEP or mode is QuorumMode.SYNC:
        return
    raise ValueError(
        f"{name or method.value} needs a synchronous quorum (quorum_mode='sync', "
        "Manager(use_async_quorum=False)): a replica must heal (global parameters, "
        "outer-optimizer state, step counter) and join its peers' sync before it trains; "
        f"got {mode.value!r}"
    )


def validate_diloco_schedule(
    sync_every: int, num_fragments: int, fragment_sync_delay: int, fragment_update_alpha: float
) -> int:
    """Checks a (Streaming) DiLoCo schedule (``SyncSchedule``) and its ``fragment_update_alpha``;
    returns the steps between two fragment syncs.

    Raises:
        ValueError: naming the bad value and the constraint it breaks.
    """
    cycle = SyncSchedule(sync_every, num_fragments, fragment_sync_delay).cycle
    check_fragment_update_alpha(fragment_update_alpha)
    return cycle


def check_fragment_update_alpha(fragment_update_alpha: float) -> None:
    """Raises ``ValueError`` unless ``fragment_update_alpha`` is in [0, 1]."""
    if not 0.0 <= fragment_update_alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}")
