"""``scripts/install.sh`` and ``scripts/install_torchtitan_env.sh`` install the TorchTitan
release asked for, one of the supported ones (``torchtitan_ft.titan.releases.Release``), and
refuse any other in one line before they touch a Python. A stand-in Python records what the
scripts ask of it and fails the package install, so that nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from torchtitan_ft.titan.releases import Release

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "scripts" / "install.sh"
ENV = ROOT / "scripts" / "install_torchtitan_env.sh"


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A ``python`` that appends its arguments to ``calls.log`` beside it and fails every
    ``pip install -e`` (the package install) and ``-m venv``; anything else succeeds and
    prints a torch version and site directory where asked."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {tmp_path}/calls.log\n'
        'case "$*" in\n'
        '  *" -e "* | "-m venv"*) exit 1 ;;\n'
        '  *getsitepackages*) echo "[]" ;;\n'
        "  *version*) echo 2.13.0 ;;\n"
        "esac\n"
    )
    python.chmod(0o755)
    return python


def run(script: Path, python: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        env={**os.environ, "PYTHON": str(python), "TORCHTITAN_ENVS": str(python.parent), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def pip_installs(python: Path) -> list[str]:
    log = python.parent / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.startswith("-m pip install")]


@pytest.mark.parametrize("release", list(Release))
def test_install_sh_installs_the_release_asked_for(fake_python: Path, release: Release) -> None:
    result = run(INSTALL, fake_python, TORCHTITAN_VERSION=release.value)
    assert result.returncode != 2, result.stderr
    assert f"torchtitan=={release.value}" in pip_installs(fake_python)[-1].split()


def test_install_sh_installs_0_3_0_by_default(fake_python: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHTITAN_VERSION"}
    result = subprocess.run(
        ["bash", str(INSTALL)],
        env={**env, "PYTHON": str(fake_python)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 2, result.stderr
    assert "torchtitan==0.3.0" in pip_installs(fake_python)[-1].split()


@pytest.mark.parametrize("release", list(Release))
def test_install_torchtitan_env_installs_the_release_asked_for(
    fake_python: Path, release: Release
) -> None:
    (fake_python.parent / "calls.log").unlink(missing_ok=True)
    result = run(ENV, fake_python, release.value)
    assert result.returncode != 2, result.stderr
    calls = (fake_python.parent / "calls.log").read_text()
    venv = fake_python.parent / f"tt{release.value.replace('.', '')}" / "venv"
    assert f"-m venv --without-pip {venv}" in calls.splitlines()


@pytest.mark.parametrize(
    ("script", "args", "env", "named"),
    [
        (INSTALL, (), {"TORCHTITAN_VERSION": "0.2.1"}, "TORCHTITAN_VERSION=0.2.1"),
        (INSTALL, (), {"TORCHTITAN_VERSION": "latest"}, "TORCHTITAN_VERSION=latest"),
        (ENV, ("0.4.0",), {}, "'0.4.0'"),
        (ENV, (), {}, "''"),
    ],
)
def test_other_releases_are_refused_in_one_line_before_any_install(
    fake_python: Path, script: Path, args: tuple[str, ...], env: dict[str, str], named: str
) -> None:
    result = run(script, fake_python, *args, **env)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr
    assert all(release.value in lines[0] for release in Release), result.stderr
    assert not (fake_python.parent / "calls.log").exists()
