"""Compatibility names: ``ManagerServer``, ``ManagerClient`` and friends live in ``manager/``."""

from torchtitan_ft.manager import (  # noqa: F401
    AddressInUseError,
    ManagerClient,
    ManagerServer,
    QuorumResult,
    QuorumTimeoutError,
    ReplicaGroupMismatchError,
)
