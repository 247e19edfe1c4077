"""Reconfigurable process groups for the cross-replica-group axis, in every rank.

``base`` (the base class and Work types), ``gloo`` and ``nccl`` (the backends), ``baby`` (the
backends in a child process that is killed when a collective hangs), ``wrappers`` (errors as
data, routing through the Manager), ``fakes`` (groups for tests), ``store`` (the quorum's
TCPStore), ``futures`` and ``quantized`` (what collectives return and an int8 allreduce),
``lifecycle`` (process-wide state, hooks installed on first use). torchft 0.2.0's names are
importable here.
"""

from torchtitan_ft.process_group.baby import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from torchtitan_ft.process_group.base import GroupConfig, ProcessGroup
from torchtitan_ft.process_group.fakes import FakeProcessGroupWrapper, ProcessGroupDummy
from torchtitan_ft.process_group.gloo import ProcessGroupGloo
from torchtitan_ft.process_group.nccl import ProcessGroupNCCL
from torchtitan_ft.process_group.store import create_store_client, parse_store_addr
from torchtitan_ft.process_group.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupWrapper,
)

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "GroupConfig",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "create_store_client",
    "parse_store_addr",
]
