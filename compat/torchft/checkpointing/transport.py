"""``torchft.checkpointing.transport``: the transport contract."""

from torchtitan_ft.checkpoint.transport import CheckpointTransport

__all__ = ["CheckpointTransport"]
