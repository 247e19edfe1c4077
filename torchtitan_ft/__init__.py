"""Per-step fault tolerance for TorchTitan: ``lighthouse/`` (one per job), ``manager/`` and
``process_group/`` (every rank of a replica group; the ManagerServer on group rank 0),
``checkpoint/`` (live healing), ``semi_sync/`` and ``titan/`` (the trainer), torchft's
training-loop wrappers ``ddp``, ``optim`` and ``data``, and its ``parameter_server``.
Importing it refuses an unsupported torch (``torch_version``).

The public names of torchft 0.2.0 are importable from here (``from torchtitan_ft import Manager``)
and from their modules; see docs/torchft_mapping.md. Attributes load lazily so that the
lighthouse (which needs no torch) starts fast.
"""

import os

# grpc's C core logs through absl, which by default prints INFO lines such as
# "chttp2_transport.cc ... Got goaway" whenever a peer closes a channel (routine at shutdown)
# into the training log. Errors only, unless the user chose a verbosity; grpc reads it once when
# it is imported, so it is set here, before any module of this package imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from torchtitan_ft._lazy import lazy_exports
from torchtitan_ft.torch_version import check_installed_torch

# An unsupported torch stops here, in one line, before any module uses its internals.
check_installed_torch()

_PUBLIC = {
    "LighthouseServer": "torchtitan_ft.lighthouse",
    "LighthouseClient": "torchtitan_ft.lighthouse",
    "Quorum": "torchtitan_ft.lighthouse",
    "QuorumMember": "torchtitan_ft.lighthouse",
    "ManagerServer": "torchtitan_ft.manager",
    "ManagerClient": "torchtitan_ft.manager",
    "QuorumResult": "torchtitan_ft.manager",
    "Manager": "torchtitan_ft.manager",
    "WorldSizeMode": "torchtitan_ft.manager",
    "ManagerStats": "torchtitan_ft.manager",
    "ReplicaGroupMismatchError": "torchtitan_ft.manager",
    "AddressInUseError": "torchtitan_ft.manager",
    "DistributedDataParallel": "torchtitan_ft.ddp",
    "PureDistributedDataParallel": "torchtitan_ft.ddp",
    "Optimizer": "torchtitan_ft.optim",
    "OptimizerWrapper": "torchtitan_ft.optim",
    "DistributedSampler": "torchtitan_ft.data",
    "ProcessGroup": "torchtitan_ft.process_group",
    "ProcessGroupGloo": "torchtitan_ft.process_group",
    "ProcessGroupNCCL": "torchtitan_ft.process_group",
    "ProcessGroupBabyGloo": "torchtitan_ft.process_group",
    "ProcessGroupBabyNCCL": "torchtitan_ft.process_group",
    "ProcessGroupDummy": "torchtitan_ft.process_group",
    "FakeProcessGroupWrapper": "torchtitan_ft.process_group",
    "ManagedProcessGroup": "torchtitan_ft.process_group",
    "ErrorSwallowingProcessGroupWrapper": "torchtitan_ft.process_group",
    "CheckpointTransport": "torchtitan_ft.checkpoint",
    "HTTPTransport": "torchtitan_ft.checkpoint",
    "PGTransport": "torchtitan_ft.checkpoint",
    "ParameterServer": "torchtitan_ft.parameter_server",
    "LocalSGD": "torchtitan_ft.semi_sync",
    "DiLoCo": "torchtitan_ft.semi_sync",
}

__getattr__ = lazy_exports(__name__, _PUBLIC)


__all__ = sorted(_PUBLIC)
