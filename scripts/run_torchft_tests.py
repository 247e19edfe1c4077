"""Runs torchft's own shipped tests (0.2.0's, or torchft-nightly's) against torchtitan_ft, under
torchft's module names.

torchft's wheel ships its tests beside its modules (``torchft/manager_test.py``, ...). This script
copies them, at run time, from an installed torchft into a temporary directory, and runs pytest
on them with the opt-in compatibility package (``compat/``) first on ``PYTHONPATH``, so that
``import torchft`` is torchtitan_ft. None of torchft's code is kept in this repository. The
source (``--source``): ``0.2.0`` (the default), the reference that
``scripts/install_reference.sh`` installs under ``.cache/torchft_reference``; or ``nightly``, the
``torchft`` directory of an installed torchft-nightly wheel, which ``TORCHFT_NIGHTLY_DIR`` names
(its tests exercise torch's native reconfigure: run this script with a torch >= 2.14). The
source's own directory is never put on ``sys.path``; the compatibility package refuses to
import if it is.

The quick files (FAST) share one pytest process; every other file runs in its own, as
torchft's CI runs them (several initialize torch.distributed's default group and never
destroy it). A file that does not import is reported as such. The tests that cannot pass here,
each with its reason, are listed in docs/torchft_tests.md ("Excluded tests" for 0.2.0, "Excluded
tests (torchft-nightly)" for nightly); they are not run, and are reported apart. One JSON
document is printed: ``{"source": "0.2.0" | "nightly", "files": {file: {"passed": n, "failed":
n, "skipped": n, ...}}, "failed": [...], "excluded": {test: reason}, "seconds": s}``.

    python scripts/run_torchft_tests.py                  # the default files (see FILES)
    python scripts/run_torchft_tests.py --fast           # the quick ones (FAST)
    python scripts/run_torchft_tests.py manager_test.py checkpointing/pg_transport_test.py
    python scripts/run_torchft_tests.py --k test_gloo_apis process_group_test.py
    export TORCHFT_NIGHTLY_DIR=/tmp/tfnvenv/lib/python3.11/site-packages/torchft
    <venv with torch 2.14>/bin/python scripts/run_torchft_tests.py --source nightly

Exit status: 0 when every test outside the exclusions passed or was skipped, else 1.
Needs the ``parameterized`` package (torchft's tests use it; in the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat"
EXCLUSIONS_DOC = ROOT / "docs/torchft_tests.md"
REFERENCE = Path(os.environ.get("TORCHFT_REFERENCE_DIR", ROOT / ".cache/torchft_reference"))
TORCHFT = REFERENCE / "torchft"
NIGHTLY_DIR_ENV = "TORCHFT_NIGHTLY_DIR"
"""Names the ``torchft`` directory of an installed torchft-nightly wheel (``--source nightly``);
no default."""

# Quick files (a few seconds each): the subset tests/test_torchft_compat.py runs.
FAST = [
    "futures_test.py",
    "data_test.py",
    "optim_test.py",
    "ddp_test.py",
    "coordination_test.py",
    "local_sgd_test.py",
]
# The default run: the fast files, then the slower unit files in priority order. The
# integration files (manager_integ_test.py, local_sgd_integ_test.py) are named explicitly:
# they take minutes; run them on an otherwise idle machine.
FILES = [
    "manager_test.py",
    "process_group_test.py",
    *FAST,
    "checkpointing/http_transport_test.py",
    "checkpointing/pg_transport_test.py",
    "collectives_test.py",
    "lighthouse_test.py",
    "parameter_server_test.py",
    "multiprocessing_test.py",
    "quantization_test.py",
    "checkpointing/rwlock_test.py",
    "_test/managed_work_test.py",
    "fsdp_test.py",
    "torchcomms_test.py",
]
# torchft-nightly's default run: 0.2.0's files and the two it added.
NIGHTLY_FILES = [*FILES, "reconfigure_test.py", "utils_test.py"]

# torchft's private names that its test files import at module level, which this project does
# not provide. So that the other tests of such a file still run, the harness (never the
# compatibility package) binds each to a stand-in that raises when a test touches it: a test
# that uses one fails, and is listed in docs/torchft_tests.md's exclusions.
PRIVATE_STANDINS = {
    "torchft.futures": ["stream_timeout"],
    "torchft.manager": ["_ManagedWork", "MANAGER_ADDR_KEY", "REPLICA_ID_KEY"],
    "torchft.checkpointing._rwlock": ["RWLock"],
    "torchft.multiprocessing": ["_MonitoredPipe"],
    "torchft.checkpointing.http_transport_bench": ["main"],
    "torchft.process_group": ["_rendezvous"],  # torchft-nightly's reconfigure_test.py
}

# Private objects whose attributes torchft's test fixtures set and restore around every test
# (futures_test.py's setUp shortens the watchdog interval of torchft's timer thread): bound to
# an object that holds the attributes and takes the assignments, which nothing reads, so that
# the fixtures run and the tests exercise the public functions. There is no watchdog here.
INERT_STANDINS = {"torchft.futures": {"_TIMEOUT_MANAGER": {"_watchdog_interval": None}}}

# Written into the temporary directory as ``_torchft_standins.py``: ``install()`` makes
# torchft's test modules and test helpers (``torchft.process_group_test``,
# ``torchft._test_utils``, ``torchft._test.diloco_trainer``,
# ``torchft.checkpointing.transport_test``) importable as submodules of the compatibility
# package, which is how they import each other, without copying them into it; then binds the
# stand-ins. The conftest calls it in the pytest process, and ``sitecustomize.py`` in every
# process the tests start (``mp.spawn``'s workers import the test module anew).
STANDINS_MODULE = """\
import importlib
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
_installed = []


class _NotProvided:
    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"{{self._name}} is a private name of torchft that torchtitan_ft does not provide "
            "(run_torchft_tests.py stand-in)"
        )

    __call__ = __getattr__ = __setattr__ = __iter__ = _refuse


def install():
    if _installed:
        return
    _installed.append(True)
    import torchft
    import torchft.checkpointing

    if not torchft.__file__.startswith({compat!r}):
        sys.exit(f"torchft resolved to {{torchft.__file__}}, not the compatibility package")
    torchft.__path__.append(str(HERE / "torchft"))
    torchft.checkpointing.__path__.append(str(HERE / "torchft" / "checkpointing"))
    for module_name, names in {standins!r}.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = sys.modules[module_name] = types.ModuleType(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, _NotProvided(f"{{module_name}}.{{name}}"))
    for module_name, objects in {inert!r}.items():
        module = importlib.import_module(module_name)
        for name, attributes in objects.items():
            if not hasattr(module, name):
                setattr(module, name, types.SimpleNamespace(**attributes))
"""

# Written into the temporary directory, which is on the test processes' PYTHONPATH: in a
# process the tests start, installs the stand-ins before its first import of a test module.
SITECUSTOMIZE = """\
import sys


class _BeforeTestModules:
    def find_spec(self, name, path=None, target=None):
        if name.rpartition(".")[2].endswith("_test"):
            sys.meta_path.remove(self)
            import _torchft_standins

            _torchft_standins.install()
        return None


sys.meta_path.insert(0, _BeforeTestModules())
"""

CONFTEST = """\
import json
import os
import sys
from pathlib import Path

import pytest

import _torchft_standins
from scripts.run_torchft_tests import is_excluded

_torchft_standins.install()


def pytest_collection_modifyitems(config, items):
    # the excluded tests of this run, which run_torchft_tests.py writes beside this file
    keys = json.loads((Path(__file__).parent / "excluded.json").read_text())
    dropped = [item for item in items if is_excluded(item.nodeid, keys)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


def pytest_runtest_setup(item):
    # torchft's tests draw models and inputs unseeded: local_sgd_test's SimpleModel leaves its
    # first layer without a gradient in about 3% of draws (both inputs dead at the ReLU), and
    # the test then fails "Parameter model.0.weight did not change". One seed per test makes
    # every run draw the same.
    import torch

    torch.manual_seed(0)


# A failed integration test can leave non-daemon threads (replicas blocked in a quorum) that
# would keep the interpreter from exiting once pytest is done: exit at the very end.
_exit_status = {}


def pytest_sessionfinish(session, exitstatus):
    _exit_status["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status.get("code", 1))
"""


@dataclass(frozen=True)
class Source:
    """Whose tests run: ``name`` (``--source``), the installed ``torchft`` directory they are
    copied from (None: not located), the default ``files``, the headings of the exclusion
    tables in docs/torchft_tests.md that apply (a later table's row replaces an earlier one's
    for the same test), and the one line that says how to get the tests when they are
    missing."""

    name: str
    torchft: Path | None
    files: list[str]
    exclusion_tables: tuple[str, ...]
    missing: str


def source(name: str, environ: dict[str, str]) -> Source:
    """The :class:`Source` called ``name`` (``"0.2.0"`` or ``"nightly"``), located from
    ``environ``."""
    if name == "nightly":
        located = environ.get(NIGHTLY_DIR_ENV)
        return Source(
            name="nightly",
            torchft=Path(located) if located else None,
            files=NIGHTLY_FILES,
            # nightly's copy of a test 0.2.0 also ships fails here for the same reason
            exclusion_tables=("## Excluded tests", "## Excluded tests (torchft-nightly)"),
            missing=(
                f"--source nightly needs {NIGHTLY_DIR_ENV}, the torchft directory of an installed "
                f"torchft-nightly ({f'{located} has no manager.py' if located else 'unset'}): "
                "pip install --no-deps torchft_nightly==2026.10.26 into a venv of its own, then "
                f"{NIGHTLY_DIR_ENV}=<venv>/lib/python3.11/site-packages/torchft"
            ),
        )
    return Source(
        name="0.2.0",
        torchft=TORCHFT,
        files=FILES,
        exclusion_tables=("## Excluded tests",),
        missing=(
            f"the torchft 0.2.0 reference is not at {TORCHFT}: run scripts/install_reference.sh"
        ),
    )


_EXCLUSION_ROW = re.compile(r"^\| `([^`]+)` \| (.+?) \|$")


def exclusions(doc: Path = EXCLUSIONS_DOC, heading: str = "## Excluded tests") -> dict[str, str]:
    """Excluded test (``file::Class::test``, a parameterized test's stem ending in ``*``, or a
    whole ``file``) -> reason, from the doc's table under ``heading``."""
    rows: dict[str, str] = {}
    in_section = False
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            in_section = line.strip() == heading
            continue
        match = _EXCLUSION_ROW.match(line) if in_section else None
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def is_whole_file(key: str) -> bool:
    """An exclusion of a whole file (not run at all: it does not import, or hangs)."""
    return key.endswith(".py")


def is_excluded(nodeid: str, keys: list[str]) -> bool:
    """Whether the staged test ``nodeid`` (``torchft/<file>::Class::test``) is excluded by one
    of ``keys``: a test id names that test (and its pytest parameters, ``[...]``), a stem
    ending in ``*`` every test whose id starts with it. (pytest's ``--deselect`` matches every
    id with the prefix: ``TestDDP::test_ddp`` would also drop ``TestDDP::test_ddp_after_...``.)"""
    for key in keys:
        name = "torchft/" + key.rstrip("*")
        if nodeid.startswith(name) if key.endswith("*") else nodeid.split("[")[0] == name:
            return True
    return False


def stage(torchft: Path, tmp: Path) -> None:
    """Copy the tests and test helpers of the installed ``torchft`` directory into
    ``tmp/torchft``, and write the conftest and the stand-ins' modules beside it."""
    dest = tmp / "torchft"
    for path in sorted(torchft.rglob("*.py")):
        rel = path.relative_to(torchft)
        is_test = path.name.endswith("_test.py") or rel.parts[0] == "_test"
        if is_test or path.name == "_test_utils.py":
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / rel)
    (tmp / "_torchft_standins.py").write_text(
        STANDINS_MODULE.format(compat=str(COMPAT), standins=PRIVATE_STANDINS, inert=INERT_STANDINS)
    )
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp / "conftest.py").write_text(CONFTEST)


def _env(torchft: Path, tmp: Path) -> dict[str, str]:
    """The test processes' environment: the compatibility package, this checkout and the
    staging directory ``tmp`` first; any path into the directory that holds the installed
    ``torchft`` removed."""
    holder = torchft.resolve().parent
    inherited = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not Path(p).resolve().is_relative_to(holder)
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT), str(ROOT), str(tmp), *inherited])
    return env


def _test_id(classname: str, name: str) -> tuple[str, str]:
    """(file, test id) of a junit ``testcase``: its dotted ``classname`` is the module path
    (``torchft.checkpointing.pg_transport_test``) then the class, if any. A module that did not
    import shows as ``classname=""`` and ``name=<module path>``; its id is
    ``<file>::<collection>``."""
    collection = not classname
    parts = (name if collection else classname).split(".")
    ends = [i for i, part in enumerate(parts) if part.endswith("_test")]
    cut = ends[-1] + 1 if ends else len(parts)
    file = "/".join(parts[1:cut]) + ".py"
    if collection:
        return file, f"{file}::<collection>"
    return file, "::".join([file, *parts[cut:], name])


def _outcomes(report: Path) -> dict[str, dict[str, str]]:
    """File -> test id -> passed / failed / error / skipped, from a junit XML report."""
    out: dict[str, dict[str, str]] = {}
    if not report.exists():
        return out
    for case in ET.parse(report).getroot().iter("testcase"):
        file, test_id = _test_id(case.get("classname", ""), case.get("name", ""))
        if case.find("failure") is not None:
            outcome = "failed"
        elif case.find("error") is not None:
            outcome = "error"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        out.setdefault(file, {})[test_id] = outcome
    return out


def run(
    torchft: Path,
    tmp: Path,
    files: list[str],
    excluded: list[str],
    timeout: float,
    keyword: str | None,
) -> dict:
    """Run the test files staged from ``torchft`` in one pytest process (a module that does
    not import is reported, the others still run), the excluded tests deselected; file -> test
    id -> outcome. pytest's output goes to stderr."""
    report = tmp / "report.xml"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    cmd += ["--continue-on-collection-errors", f"--timeout={timeout:g}"]
    cmd += [f"--junitxml={report}", "-o", "junit_family=xunit1"]
    cmd += ["-k", keyword] if keyword else []
    (tmp / "excluded.json").write_text(json.dumps(excluded))
    cmd += [f"torchft/{file}" for file in files]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(torchft, tmp), stdout=sys.stderr, check=False)
    out = _outcomes(report)
    if proc.returncode not in (0, 1, 5):
        for file in files:
            out.setdefault(file, {f"{file}::<run>": "error"})
    return out


def summarize(results: dict[str, dict[str, str]], files: list[str], rows: dict[str, str]) -> dict:
    """The JSON document: counts per file, the failures, and the exclusions that apply to the
    files run, with their reasons (excluded tests are not run)."""
    counts: dict[str, dict[str, int]] = {}
    failed: list[str] = []
    for file in files:
        count = {"passed": 0, "failed": 0, "skipped": 0}
        for test_id, outcome in sorted(results.get(file, {}).items()):
            if outcome in ("failed", "error"):
                count["failed"] += 1
                failed.append(test_id)
            else:
                count[outcome] += 1
        counts[file] = count
    excluded = {k: r for k, r in rows.items() if k.split("::")[0] in files}
    return {"files": counts, "failed": failed, "excluded": excluded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files, relative to torchft/")
    parser.add_argument(
        "--source",
        choices=("0.2.0", "nightly"),
        default="0.2.0",
        help=f"whose tests: torchft 0.2.0's reference (default) or the torchft-nightly wheel's "
        f"(${NIGHTLY_DIR_ENV})",
    )
    parser.add_argument("--fast", action="store_true", help="only the quick files (FAST)")
    parser.add_argument("--k", dest="keyword", help="pytest -k expression")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="per-test timeout, seconds (default 120)"
    )
    args = parser.parse_args(argv)
    src = source(args.source, dict(os.environ))
    torchft = src.torchft
    if torchft is None or not (torchft / "manager.py").exists():
        print(src.missing)
        return 2
    files = args.files or (FAST if args.fast else src.files)
    unknown = [f for f in files if not (torchft / f).is_file()]
    if unknown:
        parser.error(f"no such torchft test file: {', '.join(unknown)} (under {torchft})")
    rows = {
        k: r for heading in src.exclusion_tables for k, r in exclusions(heading=heading).items()
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchft-tests-") as tmp:
        stage(torchft, Path(tmp))
        runnable = [f for f in files if not (f in rows and is_whole_file(f))]
        partial = [k for k in rows if not is_whole_file(k) and k.split("::")[0] in runnable]
        batches = [[f for f in runnable if f in FAST]]
        batches += [[f] for f in runnable if f not in FAST]
        results = {}
        for batch in filter(None, batches):
            results.update(run(torchft, Path(tmp), batch, partial, args.timeout, args.keyword))
    doc = {"source": src.name, **summarize(results, files, rows)}
    doc["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(doc, indent=1))
    return 1 if doc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
