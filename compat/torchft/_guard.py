"""Refuse to load beside the real torchft.

Two packages named ``torchft`` in one interpreter would shadow each other by sys.path order,
so a program could silently run the other implementation than the one its user chose. This
module finds the real torchft without importing it: an installed distribution named
``torchft`` (its metadata), or a ``torchft`` package directory on sys.path that is not this one.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

COMPAT_DISTRIBUTION = "torchtitan-ft-torchft-compat"
HERE = Path(__file__).resolve().parent


def _distribution_locations() -> list[str]:
    """Where an installed distribution named ``torchft`` lives (its metadata's directory)."""
    found = []
    for dist in importlib.metadata.distributions(name="torchft"):
        found.append(str(Path(str(dist.locate_file(""))).resolve()))
    return found


def _package_dirs(path: list[str]) -> list[str]:
    """``torchft`` package directories on ``path`` other than this package."""
    found = []
    for entry in path:
        candidate = Path(entry or ".") / "torchft"
        if not (candidate / "__init__.py").is_file():
            continue
        resolved = candidate.resolve()
        if resolved != HERE and str(resolved) not in found:
            found.append(str(resolved))
    return found


def other_torchft(path: list[str] | None = None) -> list[str]:
    """Locations of a real torchft visible to this interpreter (empty when there is none)."""
    search = sys.path if path is None else path
    return _distribution_locations() + _package_dirs(search)


def refusal(others: list[str]) -> str:
    """The ImportError message naming both torchfts and what to do."""
    return (
        f"torchft: this is the torchft compatibility package of torchtitan_ft "
        f"({COMPAT_DISTRIBUTION}, at {HERE}), and another torchft is also visible "
        f"(at {', '.join(others)}). Both cannot be used in one interpreter: to run on "
        f"torchtitan_ft, `pip uninstall torchft` (or take its directory off sys.path / "
        f"PYTHONPATH); to run on the real torchft, `pip uninstall {COMPAT_DISTRIBUTION}`."
    )


def check() -> None:
    """Raise ImportError when a real torchft is visible."""
    others = other_torchft()
    if others:
        raise ImportError(refusal(others))
