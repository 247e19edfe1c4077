"""``torchft.process_group``: torchtitan_ft.process_group's groups and wrappers."""

from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    create_store_client,
)

# The Work type the error-swallowing wrapper returns: private in torchft and here, kept under
# torchft's name so that code checking a wrapper's Works by type runs unchanged.
from torchtitan_ft.process_group.wrappers import _ErrorSwallowingWork  # noqa: F401

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
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
]
