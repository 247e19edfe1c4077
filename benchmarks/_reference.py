"""Loads torchft 0.2.0's native extension (the reference) for side-by-side runs and
wire-compatibility tests.

torchft is not a dependency of torchtitan_ft. ``scripts/install_reference.sh`` puts the
torchft 0.2.0 wheel (no dependencies) under ``.cache/torchft_reference``; only its compiled
``_torchft`` module (lighthouse and manager servers and clients, in Rust) is loaded, so none of
torchft's Python dependencies are needed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REFERENCE_DIR = Path(
    os.environ.get(
        "TORCHFT_REFERENCE_DIR", Path(__file__).resolve().parent.parent / ".cache/torchft_reference"
    )
)


def load_reference() -> ModuleType | None:
    """torchft's ``_torchft`` extension module, or None when the reference is not installed."""
    found = sorted(REFERENCE_DIR.glob("torchft/_torchft*.so"))
    if not found:
        return None
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(found[0]))
    spec = importlib.util.spec_from_loader("torchft._torchft", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


RUNTIME_DEPS_DIR = Path(
    os.environ.get("TORCHFT_REFERENCE_DEPS_DIR", REFERENCE_DIR.parent / "torchft_reference_deps")
)
"""torchft's Python dependencies besides torch (OpenTelemetry), installed apart by
``scripts/install_reference.sh`` so that importing the reference's Python runtime works."""


def import_torchft() -> ModuleType:
    """torchft 0.2.0's Python package (Manager, DDP, process groups, ...) for side-by-side
    benchmark workers: its directories are appended to ``sys.path`` (after site-packages, so
    that this environment's packages win). Call only in a process of its own, never beside
    ``torchtitan_ft``'s torchft compatibility package.

    Raises:
        RuntimeError: the reference or its dependencies are not installed.
    """
    if not sorted(REFERENCE_DIR.glob("torchft/_torchft*.so")) or not RUNTIME_DEPS_DIR.is_dir():
        raise RuntimeError(
            f"torchft 0.2.0 is not installed under {REFERENCE_DIR} (with its dependencies in "
            f"{RUNTIME_DEPS_DIR}); run scripts/install_reference.sh"
        )
    for directory in (REFERENCE_DIR, RUNTIME_DEPS_DIR):
        if str(directory) not in sys.path:
            sys.path.append(str(directory))
    import torchft

    return torchft
