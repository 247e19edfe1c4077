"""Which TorchTitan release this process trains with, and where the code that differs between
releases lives (docs/titan.md, "TorchTitan releases"):

* :mod:`~torchtitan_ft.titan.releases.v0_2`: what differs on TorchTitan 0.2.2 (TOML configs,
  ``JobConfig``, ``TrainSpec``) beyond ``titan/`` itself, which was written against 0.2.2: its
  0.2.2 parse (``config_cli``), trainer (``titan/trainer.py``) and entry point (``train``) are
  there, not here;
* :mod:`~torchtitan_ft.titan.releases.v0_3`: TorchTitan 0.3.0 (``--module``/``--config`` config
  registries, tyro, ``Trainer.Config`` dataclasses that ``build()`` their components), with its
  own parse, TOML reader, trainer and entry point, and TorchTitan's own trainers on a CPU;
* :mod:`~torchtitan_ft.titan.releases.commands`: run_train.sh's choice of trainer module on
  0.3.0 (a 0.2.x ``TRAIN_FILE`` stops with one line giving the 0.3.0 form);
* :mod:`~torchtitan_ft.titan.releases.job`: a job this project's tools launch, spelled as
  either release's ``run_train.sh`` command (the releases' command-line differences).

The rest of ``titan/`` (replica axis, healing, data ledger, semi-sync, metrics, the trainer
hooks both releases mix in) does not look at the release.

The release is chosen by what is installed (``importlib.metadata``), never configured;
``python -m torchtitan_ft.titan.releases`` prints its name (run_train.sh reads it).
Importing this module imports neither torch nor TorchTitan.
"""

from __future__ import annotations

import enum
import importlib
import sys
from importlib import metadata
from types import ModuleType


class Release(enum.Enum):
    """A supported TorchTitan release; the value is its version string."""

    V0_2 = "0.2.2"
    V0_3 = "0.3.0"

    @property
    def module(self) -> ModuleType:
        """This release's module (imported on first use)."""
        return importlib.import_module(f"{__name__}.{self.name.lower()}")


class UnsupportedReleaseError(RuntimeError):
    """The installed TorchTitan is missing or of a release this package does not support."""


def release_for_version(version: str | None) -> Release:
    """The supported release ``version`` (TorchTitan's installed version string) is.

    A local suffix (``0.3.0+cpu``) is ignored. Raises :class:`UnsupportedReleaseError` naming
    the version and the supported ones for anything else (None: not installed).
    """
    supported = ", ".join(r.value for r in Release)
    if version is None:
        raise UnsupportedReleaseError(
            f"torchtitan is not installed; torchtitan_ft supports TorchTitan {supported} "
            "(scripts/install.sh installs one)"
        )
    public = version.split("+", 1)[0]
    for release in Release:
        if release.value == public:
            return release
    raise UnsupportedReleaseError(
        f"TorchTitan {version} is installed; torchtitan_ft supports TorchTitan {supported}"
    )


def installed_version() -> str | None:
    """TorchTitan's installed version, None when it is not installed."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def installed() -> Release:
    """The release installed in this Python (see :func:`release_for_version`)."""
    return release_for_version(installed_version())


def describe(release: Release) -> str:
    """The one line a trainer logs at start."""
    return f"torchtitan_ft: training with TorchTitan {release.value} ({release.module.__name__})"


def main() -> None:
    """Print the installed release's version (exit 2 with one line when unsupported)."""
    try:
        print(installed().value)
    except UnsupportedReleaseError as e:
        sys.stderr.write(f"torchtitan_ft: {e}\n")
        raise SystemExit(2) from None
