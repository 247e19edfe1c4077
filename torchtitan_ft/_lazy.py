"""Lazy package exports: a package's public names are imported from their modules on first
use, so a process imports only what it touches (a trainer never loads the lighthouse server or
the baby process groups)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: each name in ``names`` (name -> the module
    that defines it) is imported from its module on first access."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(module), name)

    return __getattr__
