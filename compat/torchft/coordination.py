"""``torchft.coordination``: the lighthouse and manager servers and clients."""

from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer, Quorum, QuorumMember
from torchtitan_ft.manager import ManagerClient, ManagerServer

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
]
