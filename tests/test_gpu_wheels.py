"""scripts/gpu_wheels.py: the requirement closure and the chunking as pure functions; the real
download for Python 3.12 (network) in --full."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from torchtitan_ft.titan.releases import Release

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_wheels.py"


MANYLINUX = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)]
MANYLINUX += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
CP312_LINUX = {
    *cpython_tags((3, 12), platforms=MANYLINUX),
    *compatible_tags((3, 12), "cp312", platforms=MANYLINUX),
}
"""The wheel tags CPython 3.12 on an x86_64 Linux with glibc 2.28 or later installs."""


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_wheels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _script()

INDEX = {
    "app": (
        "1.0",
        ["lib>=2", "torch>=2.5", "nvidia-nccl-cu12", "pillow", "win; sys_platform == 'win32'"],
    ),
    "lib": ("2.1", ["leaf<2", "old; python_version < '3.10'", "extra-only; extra == 'dev'"]),
    "other": ("1.0", ["lib<2"]),
    "leaf": ("1.5", []),
}
"""A hand-made index: {name: (version, Requires-Dist lines)}."""


def _fetch(fetched: list[str]):
    def fetch(req: Requirement) -> tuple[Version, list[str]]:
        fetched.append(req.name)
        version, requires = INDEX[req.name]
        assert req.specifier.contains(version)
        return Version(version), requires

    return fetch


def test_closure_follows_requirements_for_python_312_on_linux() -> None:
    fetched: list[str] = []
    got, unmet = gpu_wheels.closure(("app",), _fetch(fetched))
    # torch and its nvidia stack come with the machine's torch; pillow is unused; markers for
    # Windows, old Pythons and extras are false there.
    assert got == {"app": Version("1.0"), "lib": Version("2.1"), "leaf": Version("1.5")}
    assert fetched == ["app", "lib", "leaf"] and unmet == []


def test_closure_reports_a_version_outside_a_later_range() -> None:
    _, unmet = gpu_wheels.closure(("app", "other"), _fetch([]))
    assert unmet == ["other 1.0 needs lib<2, the set has lib 2.1"]


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, None, "0.3.0"),  # scripts/install.sh's default
        (None, "0.2.2", "0.2.2"),  # TORCHTITAN_VERSION, as install.sh reads it
        ("0.3.0", "0.2.2", "0.3.0"),  # the flag wins
        ("0.2.2", None, "0.2.2"),
    ],
)
def test_the_set_follows_the_release_asked_for(
    flag: str | None, env: str | None, expected: str
) -> None:
    release = gpu_wheels.release_asked(flag, env)
    assert release == Release(expected)
    assert gpu_wheels.roots(release)[0] == f"torchtitan=={expected}"


@pytest.mark.parametrize(
    ("flag", "env", "named"),
    [("0.2.1", None, "--torchtitan-version=0.2.1"), (None, "0.4.0", "TORCHTITAN_VERSION=0.4.0")],
)
def test_an_unsupported_release_is_refused_naming_it(
    flag: str | None, env: str | None, named: str
) -> None:
    with pytest.raises(ValueError) as refused:
        gpu_wheels.release_asked(flag, env)
    line = str(refused.value)
    assert line.startswith(f"{named} is not a supported TorchTitan release")
    assert all(release.value in line for release in Release) and "\n" not in line


def test_main_fetches_the_release_s_torchtitan_and_says_which(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """main() with a stand-in download (records what it asks for, writes nothing): the JSON
    names the release, whose TorchTitan is the first wheel asked for; a bad one exits 2."""
    asked: list[str] = []

    def downloader(_dest: Path):
        def fetch(req: Requirement) -> tuple[Version, list[str]]:
            asked.append(str(req))
            pinned = [spec.version for spec in req.specifier if spec.operator == "=="]
            return Version(pinned[0] if pinned else "100"), []

        return fetch

    monkeypatch.setattr(gpu_wheels, "_downloader", downloader)
    monkeypatch.setenv("TORCHTITAN_VERSION", "0.2.2")
    assert gpu_wheels.main(["--dest", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["torchtitan"] == "0.2.2" and asked[0] == "torchtitan==0.2.2"
    assert summary["packages"]["torchtitan"] == "0.2.2"
    assert gpu_wheels.main(["--dest", str(tmp_path), "--torchtitan-version", "0.9"]) == 2
    assert "--torchtitan-version=0.9" in capsys.readouterr().err


def test_chunks_pack_largest_first_within_the_limit() -> None:
    sizes = {"big.whl": 52, "mid.whl": 15, "a.whl": 7, "b.whl": 5, "huge.whl": 80}
    expected = [["huge.whl"], ["big.whl", "a.whl"], ["mid.whl", "b.whl"]]
    assert gpu_wheels.chunks(sizes, 60) == expected
    assert gpu_wheels.chunks({}, 60) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_downloads_a_python_312_set_that_resolves(tmp_path: Path) -> None:
    """Needs the network (pip download from the package index): --full only."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dest", str(tmp_path), "--chunk-mib", "60"],
        capture_output=True, text=True, timeout=880, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    # The default release, as scripts/install.sh's (the test's environment may name another).
    assert summary["unmet"] == [] and summary["packages"]["torchtitan"] == summary["torchtitan"]
    assert "torch" not in summary["packages"]
    assert all(size <= 60 for size in summary["folders"].values())
    for wheel in tmp_path.glob("chunk*/*.whl"):
        assert parse_wheel_filename(wheel.name)[3] & CP312_LINUX, wheel.name
