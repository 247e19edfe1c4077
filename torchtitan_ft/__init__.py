"""Per-step fault tolerance for TorchTitan.

The public names of torchft 0.2.0 are importable from here (``from torchtitan_ft import Manager``)
and from their modules; see docs/torchft_mapping.md. Attributes load lazily so that the
lighthouse (which needs no torch) starts fast.
"""

from importlib import import_module
from typing import Any

_PUBLIC = {
    "LighthouseServer": "torchtitan_ft.lighthouse",
    "LighthouseClient": "torchtitan_ft.lighthouse",
    "Quorum": "torchtitan_ft.lighthouse",
    "QuorumMember": "torchtitan_ft.lighthouse",
    "ManagerServer": "torchtitan_ft.manager_server",
    "ManagerClient": "torchtitan_ft.manager_server",
    "QuorumResult": "torchtitan_ft.manager_server",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'torchtitan_ft' has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = sorted(_PUBLIC)
