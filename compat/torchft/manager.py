"""``torchft.manager``: torchtitan_ft.manager's Manager and its settings' variable names."""

from torchtitan_ft.manager import ExceptionWithTraceback, Manager, WorldSizeMode
from torchtitan_ft.manager.settings import (
    CONNECT_TIMEOUT_SEC_ENV,
    MANAGER_PORT_ENV,
    QUORUM_RETRIES_ENV,
    QUORUM_TIMEOUT_SEC_ENV,
    TIMEOUT_SEC_ENV,
)

__all__ = [
    "CONNECT_TIMEOUT_SEC_ENV",
    "MANAGER_PORT_ENV",
    "QUORUM_RETRIES_ENV",
    "QUORUM_TIMEOUT_SEC_ENV",
    "TIMEOUT_SEC_ENV",
    "ExceptionWithTraceback",
    "Manager",
    "WorldSizeMode",
]
