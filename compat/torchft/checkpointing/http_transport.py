"""``torchft.checkpointing.http_transport``: the HTTP transport."""

from torchtitan_ft.checkpoint.http_transport import HTTPTransport

__all__ = ["HTTPTransport"]
