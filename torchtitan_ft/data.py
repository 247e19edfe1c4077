"""In the training loop of every rank: data sharding across replica groups (torchft's
``DistributedSampler``).

The dataset is cut into ``num_replica_groups * num_replicas`` shards; the rank ``group_rank``
of replica group ``replica_rank`` reads shard ``replica_rank * num_replicas + group_rank``.
``num_replica_groups`` is the *maximum* number of groups (membership changes at run time);
while a group is down its shard is not read, and a group that rejoins resumes its own shard
only if its dataloader state is checkpointed (e.g. torchdata's StatefulDataLoader).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler


class DistributedSampler(_TorchDistributedSampler):
    """``torch.utils.data.DistributedSampler`` over replica groups x ranks in a group."""

    def __init__(
        self,
        dataset: Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        *,
        num_replicas_in_group: int | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            dataset: the dataset to shard.
            replica_rank: this replica group's number, in ``[0, num_replica_groups)``.
            num_replica_groups: the maximum number of replica groups.
            group_rank: rank inside the replica group; default ``dist.get_rank()``.
            num_replicas: ranks per replica group (torchft's name); default
                ``dist.get_world_size()``.
            num_replicas_in_group: the same, by its descriptive name; give one or the other.
            **kwargs: passed on (``shuffle``, ``seed``, ``drop_last``).
        """
        if num_replicas_in_group is not None:
            if num_replicas is not None and num_replicas != num_replicas_in_group:
                raise ValueError(
                    f"num_replicas={num_replicas} and num_replicas_in_group="
                    f"{num_replicas_in_group} disagree; pass one of them"
                )
            num_replicas = num_replicas_in_group
        if group_rank is None:
            group_rank = dist.get_rank()
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if num_replica_groups < 1 or not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank must be in [0, num_replica_groups={num_replica_groups}), "
                f"got {replica_rank}"
            )
        if num_replicas < 1 or not 0 <= group_rank < num_replicas:
            raise ValueError(
                f"group_rank must be in [0, num_replicas={num_replicas}), got {group_rank}"
            )
        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.global_rank: int = replica_rank * num_replicas + group_rank
        self.global_world_size: int = num_replica_groups * num_replicas
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
