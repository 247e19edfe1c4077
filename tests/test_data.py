"""DistributedSampler tests: shards over replica groups x group ranks."""

from __future__ import annotations

import pytest

from torchtitan_ft.data import DistributedSampler


def test_shards_are_disjoint_and_cover_the_dataset() -> None:
    dataset = list(range(48))
    seen: list[int] = []
    for replica_rank in range(3):
        for group_rank in range(2):
            sampler = DistributedSampler(
                dataset,
                replica_rank=replica_rank,
                num_replica_groups=3,
                group_rank=group_rank,
                num_replicas=2,
                shuffle=False,
            )
            assert sampler.global_rank == replica_rank * 2 + group_rank
            assert sampler.global_world_size == 6
            indices = list(sampler)
            assert indices == list(range(sampler.global_rank, 48, 6))
            seen += indices
    assert sorted(seen) == dataset


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replica_rank": 3, "num_replica_groups": 3}, "replica_rank must be in"),
        ({"replica_rank": 0, "num_replica_groups": 0}, "replica_rank must be in"),
        ({"replica_rank": 0, "num_replica_groups": 1, "group_rank": 2}, "group_rank must be in"),
    ],
)
def test_invalid_ranks(kwargs: dict[str, int], match: str) -> None:
    kwargs.setdefault("group_rank", 0)
    with pytest.raises(ValueError, match=match):
        DistributedSampler(list(range(4)), num_replicas=2, **kwargs)


def test_num_replicas_in_group_alias() -> None:
    sampler = DistributedSampler(
        list(range(8)), replica_rank=1, num_replica_groups=2, group_rank=1, num_replicas_in_group=2
    )
    assert sampler.global_rank == 3 and sampler.global_world_size == 4
    with pytest.raises(ValueError, match="disagree"):
        DistributedSampler(
            list(range(8)),
            replica_rank=0,
            num_replica_groups=2,
            group_rank=0,
            num_replicas=2,
            num_replicas_in_group=3,
        )
