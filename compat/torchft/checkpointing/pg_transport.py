"""``torchft.checkpointing.pg_transport``: the process-group transport."""

from torchtitan_ft.checkpoint.pg_transport import PGTransport

__all__ = ["PGTransport"]
