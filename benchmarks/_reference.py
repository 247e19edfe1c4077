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
