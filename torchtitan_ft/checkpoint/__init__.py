"""Live healing transports, in every rank: a healthy replica's rank sends its committed state
to a recovering peer.

torchft 0.2.0 names, importable from here (``torchft.checkpointing`` maps to this package):
``CheckpointTransport``, ``HTTPTransport``, ``PGTransport``. ``CheckpointTransferError`` is what
``recv_checkpoint`` raises on any failed transfer.
"""

from torchtitan_ft.checkpoint.http_transport import HTTPTransport
from torchtitan_ft.checkpoint.pg_transport import PGTransport
from torchtitan_ft.checkpoint.transport import CheckpointTransferError, CheckpointTransport

__all__ = ["CheckpointTransferError", "CheckpointTransport", "HTTPTransport", "PGTransport"]
