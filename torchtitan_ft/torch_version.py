"""Which torch releases this package supports, checked when ``torchtitan_ft`` is imported.

torch 2.13, 2.14 and 2.15 (any build of them, a CUDA one included; pyproject.toml's
``torch>=2.13,<2.16``): the process groups, the checkpoint transport and the TorchTitan plugin
use ``torch.distributed`` internals that change between minor releases, and these are the
releases the suite runs on (README, "Tested versions"). The version is read from the installed
distribution's metadata, so the check imports no torch (the lighthouse needs none and may run
where none is installed).
"""

from __future__ import annotations

import re
from importlib import metadata

SUPPORTED = ((2, 13), (2, 14), (2, 15))
"""The supported (major, minor) releases, oldest first: a contiguous range."""

RANGE = f">={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[-1][0]}.{SUPPORTED[-1][1] + 1}"
"""``SUPPORTED`` as a pip version range (the one pyproject.toml states)."""


class UnsupportedTorchError(ImportError):
    """The installed torch is not one of the supported releases."""


def torch_version_error(version: str | None) -> str | None:
    """The one line that refuses torch ``version`` (its installed version string, e.g.
    ``2.14.1+cu130``), or None when it is supported or not installed (None)."""
    if version is None:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) in SUPPORTED:
        return None
    releases = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED)
    return (
        f"torchtitan_ft supports torch {releases} (torch{RANGE}), but torch {version} is "
        f"installed; install a supported one: pip install 'torch{RANGE}'"
    )


def check_installed_torch() -> None:
    """Raises :class:`UnsupportedTorchError` (one line) when the installed torch is not
    supported; nothing when it is, or when none is installed."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        version = None
    if (error := torch_version_error(version)) is not None:
        raise UnsupportedTorchError(error)
