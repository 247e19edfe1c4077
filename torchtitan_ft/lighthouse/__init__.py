"""The lighthouse: one small gRPC server per job that decides each step's quorum.

``LighthouseServer`` and ``LighthouseClient`` keep torchft 0.2.0's names and arguments;
``torchft_lighthouse`` (``torchtitan_ft.lighthouse.cli``) runs a server from the shell.

Names load lazily, on first use: a replica group needs the client only, not the server
and its status page.
"""

from importlib import import_module
from typing import Any

_PUBLIC = {
    "LighthouseClient": "torchtitan_ft.lighthouse.client",
    "LighthouseServer": "torchtitan_ft.lighthouse.server",
    "Quorum": "torchtitan_ft.lighthouse.types",
    "QuorumMember": "torchtitan_ft.lighthouse.types",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = sorted(_PUBLIC)
