"""``torchft.checkpointing``: torchtitan_ft.checkpoint's transports."""

from torchtitan_ft.checkpoint import CheckpointTransport, HTTPTransport

__all__ = ["CheckpointTransport", "HTTPTransport"]
