"""Per-step sync (FT-HSDP), in the trainer of every rank: gradients averaged across replica
groups every step, commit per step.

The default strategy and a thin one: the Manager does the work. ``start_step`` starts the
quorum (overlapped with the forward in async mode), ``before_step`` averages the gradients
through ``Manager.allreduce`` (unless a DDP wrapper already did) and returns the commit vote;
the inner optimizer steps only on commit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from torchtitan_ft.semi_sync.strategy import (
    CommStats,
    ManagerLike,
    SyncStrategy,
    local_tensor,
    wait_future,
)


class PerStepSync(SyncStrategy):
    """Synchronous per-step commit.

    Args:
        manager: the replica group's Manager.
        params: the parameters whose gradients are averaged (ignored when
            ``allreduce_gradients`` is False).
        allreduce_gradients: average gradients here (default). False when the model is wrapped
            in ``torchtitan_ft.ddp.DistributedDataParallel``, which averages them in backward.
    """

    def __init__(
        self,
        manager: ManagerLike,
        params: Iterable[nn.Parameter] = (),
        allreduce_gradients: bool = True,
    ) -> None:
        self._manager = manager
        self._params = list(params)
        self._allreduce_gradients = allreduce_gradients
        self.stats = CommStats()

    def start_step(self) -> None:
        """Starts this step's quorum."""
        self._manager.start_quorum()

    def before_step(self) -> bool:
        """Averages gradients across replica groups; returns the group-wide commit vote."""
        if self._allreduce_gradients:
            futures = []
            for p in self._params:
                if p.grad is None:
                    continue
                grad = local_tensor(p.grad)
                futures.append(self._manager.allreduce(grad))
                self.stats.allreduce_calls += 1
                self.stats.payload_bytes += grad.numel() * grad.element_size()
            for fut in futures:
                wait_future(self._manager, fut)
        committed = self._manager.should_commit()
        if committed:
            self.stats.syncs_committed += 1
        else:
            self.stats.syncs_failed += 1
        return committed

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-step sync owns no state (the Manager heals the model and optimizer)."""
        return {}
