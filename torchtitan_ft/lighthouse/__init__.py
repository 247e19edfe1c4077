"""The lighthouse: one small gRPC server per job that decides each step's quorum.

``LighthouseServer`` and ``LighthouseClient`` keep torchft 0.2.0's names and arguments;
``torchft_lighthouse`` (``torchtitan_ft.lighthouse.cli``) runs a server from the shell.
"""

from torchtitan_ft.lighthouse.client import LighthouseClient
from torchtitan_ft.lighthouse.server import LighthouseServer
from torchtitan_ft.lighthouse.types import Quorum, QuorumMember

__all__ = ["LighthouseClient", "LighthouseServer", "Quorum", "QuorumMember"]
