"""Fixtures of the TorchTitan plugin tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank_group():
    """A 1-process gloo default group (FSDP on a 1-rank mesh), torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
