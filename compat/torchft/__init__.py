"""torchft 0.2.0's module names over torchtitan_ft (the opt-in compatibility package).

Each ``torchft.<module>`` here re-exports torchtitan_ft's equivalents of that torchft module's
public names (docs/torchft_mapping.md lists them, and says why a name is missing). Nothing here
implements behaviour. The root exports what torchft 0.2.0's root does, except its Intel GPU
(XCCL) process groups; torchft also sets up OpenTelemetry loggers at import, which this package
does not (no OpenTelemetry export here).

Importing this package fails with an ImportError when the real torchft is also visible
(installed, or on sys.path): see ``torchft._guard``.
"""

from torchft import _guard

_guard.check()

# Through this package's own submodules, as torchft's root does, so that they are attributes of
# the package after ``import torchft`` (TorchTitan uses ``torchft.process_group`` so).
from torchft.data import DistributedSampler  # noqa: E402
from torchft.ddp import DistributedDataParallel  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.optim import OptimizerWrapper as Optimizer  # noqa: E402
from torchft.process_group import (  # noqa: E402
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

__all__ = (
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
)
