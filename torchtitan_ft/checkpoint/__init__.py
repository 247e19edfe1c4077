"""Live healing transports, in every rank: a healthy replica's rank sends its committed state
to a recovering peer.

torchft 0.2.0 names, importable from here (``torchft.checkpointing`` maps to this package):
``CheckpointTransport``, ``HTTPTransport``, ``PGTransport``. ``CheckpointTransferError`` is what
``recv_checkpoint`` raises on any failed transfer.

Names load lazily, on first use: a process that heals over HTTP never imports
``PGTransport``.
"""

from torchtitan_ft._lazy import lazy_exports

_PUBLIC = {
    "CheckpointTransferError": "torchtitan_ft.checkpoint.transport",
    "CheckpointTransport": "torchtitan_ft.checkpoint.transport",
    "HTTPTransport": "torchtitan_ft.checkpoint.http_transport",
    "PGTransport": "torchtitan_ft.checkpoint.pg_transport",
}

__getattr__ = lazy_exports(__name__, _PUBLIC)


__all__ = sorted(_PUBLIC)
