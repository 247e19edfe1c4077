"""The TCPStore the process-group tests build their groups on."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def store() -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1 (as the replica group's primary would serve it)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
