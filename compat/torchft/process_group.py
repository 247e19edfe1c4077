"""``torchft.process_group``: torchtitan_ft.process_group's groups and wrappers, with
torchft-nightly's reconfigure API (``ReconfigureOptions``, ``reconfigure_with_store``; every
group's ``set_rank_info``, ``get_reconfigure_handle`` and ``reconfigure``) beside 0.2.0's
``configure``."""

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
    ReconfigureOptions,
    create_store_client,
    reconfigure_with_store,
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
    "ReconfigureOptions",
    "create_store_client",
    "reconfigure_with_store",
]
