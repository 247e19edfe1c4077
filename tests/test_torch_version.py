"""Importing ``torchtitan_ft`` refuses an unsupported torch in one line that names the installed
version and the supported range; the range is the one pyproject.toml states."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from torchtitan_ft.torch_version import RANGE, torch_version_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("2.13.0", True),
        ("2.13.0+cpu", True),
        ("2.14.1+cu130", True),
        ("2.15.0", True),
        ("2.15.1", True),
        ("2.12.1", False),
        ("2.16.0", False),
        ("2.16.0.dev20261101+cpu", False),
        ("3.13.0", False),
        ("nonsense", False),
    ],
)
def test_supported_releases(version: str, supported: bool) -> None:
    error = torch_version_error(version)
    assert (error is None) == supported
    if error is not None:
        assert version in error and RANGE in error and "\n" not in error


def test_no_torch_is_not_an_error() -> None:
    assert torch_version_error(None) is None


def test_the_range_is_pyprojects() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch{RANGE}" in dependencies


@pytest.mark.parametrize("version", ["2.12.0", "2.16.0"])
def test_import_stops_on_an_unsupported_torch(tmp_path: Path, version: str) -> None:
    # A torch distribution's metadata first on the path: what importlib.metadata reports.
    dist = tmp_path / f"torch-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    result = subprocess.run(
        [sys.executable, "-c", "import torchtitan_ft"],
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("torchtitan_ft.torch_version.UnsupportedTorchError: ")
    assert version in last and RANGE in last
