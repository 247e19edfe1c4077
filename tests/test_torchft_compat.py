"""The opt-in torchft compatibility package (``compat/``, docs/torchft_mapping.md "The torchft
compatibility package"): its modules re-export exactly what docs/torchft_mapping.md says is
provided, as the same objects; it refuses to import, and its install script to install, beside
a real torchft; the project itself never imports it; and torchft 0.2.0's own quick test files
pass against it as docs/torchft_tests.md claims (scripts/run_torchft_tests.py); so do
torchft-nightly's where ``TORCHFT_NIGHTLY_DIR`` names its installed ``torchft`` directory.

Everything that imports ``torchft`` runs in a subprocess, so this test process never has a
``torchft`` module (TorchTitan's ``components.ft`` would otherwise pick it up).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_torchft_mapping import TORCHFT, _provided, _reference_modules, _rows

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat"
TESTS_DOC = ROOT / "docs/torchft_tests.md"

needs_reference = pytest.mark.skipif(
    not (TORCHFT / "manager.py").exists(), reason="scripts/install_reference.sh not run"
)

# Private torchft names the compatibility package keeps, each the project's own equivalent
# (documented in docs/torchft_mapping.md, "The torchft compatibility package").
PRIVATE_KEPT = {
    "torchft.work._DummyWork": "torchtitan_ft.process_group.base.CompletedWork",
    "torchft.process_group._ErrorSwallowingWork": "torchtitan_ft.process_group.wrappers."
    "_ErrorSwallowingWork",
}


def _python(code: str, *path: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``path`` (then this checkout) on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, ROOT]))}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def _expected_exports() -> dict[str, dict[str, str]]:
    """torchft module -> {name: torchtitan_ft equivalent}, from the mapping's provided rows."""
    modules = set(_reference_modules()) | {"torchft._torchft"}
    expected: dict[str, dict[str, str]] = {m: {} for m in modules}
    for key, (equivalent, _) in _rows().items():
        module, _, name = key.rpartition(".")
        target = _provided(equivalent)
        if key in modules or module not in modules or target is None:
            continue
        expected[module][name] = target
    for key, target in PRIVATE_KEPT.items():
        module, _, name = key.rpartition(".")
        expected[module][name] = target
    return expected


@pytest.fixture(scope="module")
def compat_process() -> dict:
    """What one interpreter with the compatibility package first on its path reports (one
    process for the tests below: each import of torch costs seconds of CPU). In this order:
    the ``torchft`` modules present after importing the project's own modules
    (``project_imported``); after ``import torchft`` alone, its ``__all__`` and whether its
    root has the submodules TorchTitan reaches through it (``root``); then, for every module
    of :func:`_expected_exports`, ``None`` where it does not exist, else its ``__all__`` and
    whether each expected name is the same object as its torchtitan_ft equivalent
    (``modules``; none without the reference, see ``needs_reference``)."""
    expected = _expected_exports() if (TORCHFT / "manager.py").exists() else {}
    result = _python(
        f"""
        import importlib, json, sys
        import torchtitan_ft
        from torchtitan_ft import (checkpoint, data, ddp, lighthouse, manager, optim,
                                   parameter_server, process_group, semi_sync)
        from torchtitan_ft.titan import run_module
        out = {{"project_imported": sorted(m for m in sys.modules if m.split(".")[0] == "torchft")}}
        import torchft
        out["root"] = {{
            "all": list(torchft.__all__),
            "submodules": hasattr(torchft, "manager")
            and hasattr(getattr(torchft, "process_group", None), "ManagedProcessGroup"),
        }}
        out["modules"] = {{}}
        for module, names in {expected!r}.items():
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError:
                out["modules"][module] = None
                continue
            same = {{}}
            for name, target in names.items():
                owner, _, attr = target.rpartition(".")
                try:
                    obj = getattr(importlib.import_module(owner), attr)
                except ModuleNotFoundError:
                    obj = importlib.import_module(target)
                same[name] = hasattr(mod, name) and getattr(mod, name) is obj
            out["modules"][module] = {{"all": sorted(getattr(mod, "__all__", ())), "same": same}}
        print(json.dumps(out))
        """,
        COMPAT,
    )
    return json.loads(result.stdout)


@needs_reference
def test_every_module_re_exports_what_the_mapping_provides_as_the_same_object(
    compat_process: dict,
) -> None:
    expected = _expected_exports()
    provided_modules = {
        key for key, (equivalent, _) in _rows().items() if key in expected and _provided(equivalent)
    }
    # Modules "not provided" whose names the package still keeps under torchft's module name.
    provided_modules |= {"torchft.work", "torchft.multiprocessing", "torchft.quantization"}
    found = compat_process["modules"]
    for module, names in sorted(expected.items()):
        if module not in provided_modules:
            assert found[module] is None, f"{module} is 'not provided' but the package has it"
            continue
        assert found[module] is not None, f"the compatibility package has no {module}"
        wrong = [n for n, ok in found[module]["same"].items() if not ok]
        assert not wrong, f"{module}: not the torchtitan_ft equivalent (or missing): {wrong}"
        public = sorted(n for n in names if not n.startswith("_"))
        if module != "torchft":
            assert [n for n in found[module]["all"] if not n.startswith("_")] == public, module


@needs_reference
def test_the_root_exports_what_torchft_s_root_does_but_intel_gpu_groups(
    compat_process: dict,
) -> None:
    source = (TORCHFT / "__init__.py").read_text()
    theirs = set(re.findall(r'^\s+"(\w+)",$', source.split("__all__", 1)[1], re.MULTILINE))
    assert "Manager" in theirs
    assert set(compat_process["root"]["all"]) == {n for n in theirs if "XCCL" not in n}
    # torchft's root also makes its submodules attributes (TorchTitan uses ft.process_group).
    assert compat_process["root"]["submodules"]


def _fake_torchft_package(where: Path) -> Path:
    package = where / "torchft"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise AssertionError('the fake torchft was imported')\n")
    return package


def _fake_torchft_distribution(where: Path) -> Path:
    info = where / "torchft-0.2.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchft\nVersion: 0.2.0\n")
    return info


def test_refuses_to_import_beside_a_torchft_package_dir_on_sys_path(tmp_path: Path) -> None:
    package = _fake_torchft_package(tmp_path / "site")
    result = _python("import torchft", COMPAT, tmp_path / "site", check=False)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torchft: this is the torchft compatibility package")
    assert str(COMPAT / "torchft") in last and str(package) in last
    assert "pip uninstall torchft" in last and "pip uninstall torchtitan-ft-torchft-compat" in last


def test_refuses_to_import_beside_an_installed_torchft_distribution(tmp_path: Path) -> None:
    _fake_torchft_distribution(tmp_path / "site")
    result = _python("import torchft", COMPAT, tmp_path / "site", check=False)
    assert result.returncode == 1
    assert f"(at {tmp_path / 'site'})" in result.stderr


def test_install_script_refuses_beside_an_installed_torchft(tmp_path: Path) -> None:
    _fake_torchft_distribution(tmp_path / "site")
    result = subprocess.run(
        [str(ROOT / "scripts/install_torchft_compat.sh")],
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "the real torchft is installed" in result.stderr
    assert str(tmp_path / "site") in result.stderr
    assert "pip uninstall torchft" in result.stderr


def test_install_script_is_not_run_by_the_default_install() -> None:
    assert "compat" not in (ROOT / "scripts/install.sh").read_text()


def test_the_project_never_imports_torchft(compat_process: dict) -> None:
    importing = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "torchtitan_ft").rglob("*.py")
        if re.search(r"^\s*(import|from)\s+torchft\b", path.read_text(), re.MULTILINE)
    ]
    assert not importing
    # With the compatibility package importable, loading the project still leaves it alone.
    assert compat_process["project_imported"] == []


_JOB_VARIABLES = (
    "TORCHFT_",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "REPLICA_GROUP_ID",
    "TORCHELASTIC_",
)


def _claimed_results(heading: str = "## Results") -> dict[str, dict[str, int]]:
    """file -> {"passed", "skipped", "excluded"} from the table under docs/torchft_tests.md's
    ``heading`` (0.2.0's "Results", or nightly's)."""
    section = TESTS_DOC.read_text().split(f"{heading}\n", 1)[1].split("\n## ", 1)[0]
    claimed = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `([^`]+)` \| (\d+) \| (\d+) \| (\d+) \|.*", line)
        if match:
            file, passed, skipped, excluded = match.groups()
            claimed[file] = {
                "passed": int(passed),
                "skipped": int(skipped),
                "excluded": int(excluded),
            }
    return claimed


def _run_fast(source: str, extra_env: dict[str, str]) -> tuple[dict, str]:
    """scripts/run_torchft_tests.py ``--source <source> --fast``: its JSON report and
    stderr."""
    # Without what other tests of this session may have left in the environment (torchrun's
    # and torchft's variables would change what torchft's tests construct).
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARIABLES)}
    script = str(ROOT / "scripts/run_torchft_tests.py")
    result = subprocess.run(
        [sys.executable, script, "--source", source, "--fast", "--timeout", "60"],
        env={**env, **extra_env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert result.stdout, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["source"] == source
    assert report["failed"] == [], result.stderr[-6000:]
    assert result.returncode == 0, result.stderr[-6000:]
    return report, result.stderr


def _assert_counts_as_claimed(report: dict, heading: str, stderr: str) -> None:
    from scripts.run_torchft_tests import FAST

    claimed = _claimed_results(heading)
    for file in FAST:
        counts = dict(report["files"][file])
        del counts["failed"]
        counts["excluded"] = sum(key.split("::")[0] == file for key in report["excluded"])
        assert counts == claimed[file], (file, counts, claimed[file], stderr[-6000:])


@needs_reference
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_torchft_s_quick_test_files_pass_as_the_docs_claim() -> None:
    pytest.importorskip("parameterized", reason="torchft's tests need parameterized (dev extra)")
    # the reference that needs_reference found (TORCHFT_ is among the variables left out)
    report, stderr = _run_fast("0.2.0", {"TORCHFT_REFERENCE_DIR": str(TORCHFT.parent)})
    _assert_counts_as_claimed(report, "## Results", stderr)


NIGHTLY_DIR = os.environ.get("TORCHFT_NIGHTLY_DIR", "")


@pytest.mark.skipif(
    not NIGHTLY_DIR,
    reason="TORCHFT_NIGHTLY_DIR unset (torchft-nightly's installed torchft directory; "
    "docs/torchft_tests.md)",
)
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_torchft_nightly_s_quick_test_files_pass_as_the_docs_claim() -> None:
    pytest.importorskip("parameterized", reason="torchft's tests need parameterized (dev extra)")
    report, stderr = _run_fast("nightly", {"TORCHFT_NIGHTLY_DIR": NIGHTLY_DIR})
    _assert_counts_as_claimed(report, "## Results (torchft-nightly 2026.10.26)", stderr)


def test_nightly_tests_without_their_directory_stop_with_how_to_get_them() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_NIGHTLY_DIR"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/run_torchft_tests.py"), "--source", "nightly"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "TORCHFT_NIGHTLY_DIR" in lines[0] and "(unset)" in lines[0]
    assert "pip install --no-deps torchft_nightly==2026.10.26" in lines[0]


@pytest.mark.parametrize(
    ("nodeid", "excluded"),
    [
        ("torchft/ddp_test.py::TestDDP::test_ddp", True),
        # a test whose name only starts with an excluded one's still runs
        ("torchft/ddp_test.py::TestDDP::test_ddp_after_the_manager_errored", False),
        ("torchft/ddp_test.py::TestDDP::test_ddp[cpu]", True),
        ("torchft/x_test.py::T::test_resiliency_0_allreduce", True),
        ("torchft/x_test.py::T::test_other", False),
        ("torchft/other_test.py::TestDDP::test_ddp", False),
    ],
)
def test_an_exclusion_names_a_test_or_with_a_star_a_stem(nodeid: str, excluded: bool) -> None:
    from scripts.run_torchft_tests import is_excluded

    keys = ["ddp_test.py::TestDDP::test_ddp", "x_test.py::T::test_resiliency*"]
    assert is_excluded(nodeid, keys) is excluded
