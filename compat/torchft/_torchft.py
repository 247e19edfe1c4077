"""``torchft._torchft`` (torchft's Rust extension): the same classes, in Python here."""

from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer, Quorum, QuorumMember
from torchtitan_ft.manager import ManagerClient, ManagerServer, QuorumResult

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
]
