"""The lighthouse: one small gRPC server per job that decides each step's quorum.

``LighthouseServer`` and ``LighthouseClient`` keep torchft 0.2.0's names and arguments;
``torchft_lighthouse`` (``torchtitan_ft.lighthouse.cli``) runs a server from the shell.

Names load lazily, on first use: a replica group needs the client only, not the server
and its status page.
"""

from torchtitan_ft._lazy import lazy_exports

_PUBLIC = {
    "LighthouseClient": "torchtitan_ft.lighthouse.client",
    "LighthouseServer": "torchtitan_ft.lighthouse.server",
    "Quorum": "torchtitan_ft.lighthouse.types",
    "QuorumMember": "torchtitan_ft.lighthouse.types",
}

__getattr__ = lazy_exports(__name__, _PUBLIC)


__all__ = sorted(_PUBLIC)
