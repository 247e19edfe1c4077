"""docs/torchft_mapping.md stays in step with torchft 0.2.0 and with this package.

torchft's public names are enumerated from the installed reference's sources (``ast``, no
import: torchft's Python dependencies are not installed): every module, every public class,
function and constant (``__all__`` where a module has one), every ``TORCHFT_*`` variable it
reads. Each must have a row. Each equivalent given must import; each variable and flag said to
be provided must be read by this package; a name said not to be provided must not have
appeared in the corresponding module.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks._reference import REFERENCE_DIR
from torchtitan_ft.lighthouse.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
MAPPING = ROOT / "docs/torchft_mapping.md"
PACKAGE = ROOT / "torchtitan_ft"
TORCHFT = REFERENCE_DIR / "torchft"

pytestmark = pytest.mark.skipif(
    not (TORCHFT / "manager.py").exists(), reason="scripts/install_reference.sh not run"
)

# torchft's lighthouse is a Rust binary whose parser cannot be inspected from Python; these are
# its flags (torchft's README and `torchft_lighthouse --help`).
TORCHFT_LIGHTHOUSE_FLAGS = {
    "--bind",
    "--min_replicas",
    "--join_timeout_ms",
    "--quorum_tick_ms",
    "--heartbeat_timeout_ms",
    "--help",
    "--version",
}

_ROW = re.compile(r"^\| `([^`]+)` \| (.+?) \|(.*)\|$")


def _rows() -> dict[str, tuple[str, str]]:
    """First column -> (equivalent cell, notes cell), for every table row of the page."""
    rows: dict[str, tuple[str, str]] = {}
    for line in MAPPING.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            key, equivalent, notes = match.groups()
            assert key not in rows, f"{key} is listed twice"
            rows[key] = (equivalent.strip(), notes.strip())
    return rows


def _provided(equivalent: str) -> str | None:
    """The equivalent's first code span, or None for "not provided"."""
    if equivalent.startswith("not provided"):
        return None
    spans = re.findall(r"`([^`]+)`", equivalent)
    assert spans, f"equivalent {equivalent!r} names nothing and does not say 'not provided'"
    return spans[0]


# ------------------------------------------------------------------ the reference's names


def _reference_modules() -> dict[str, Path]:
    """Public torchft modules -> source file (tests, private modules and the example scripts
    shipped in the wheel excluded)."""
    modules = {}
    for path in sorted(TORCHFT.rglob("*.py")):
        parts = path.relative_to(TORCHFT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if path.name.endswith("_test.py") or any(p.startswith("_") for p in parts):
            continue
        if parts[1:2] == ("examples",):
            continue
        modules[".".join(parts)] = path
    return modules


def _is_typevar_or_logger(value: ast.expr | None) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in {"TypeVar", "getLogger"}


def _public_names(source: str) -> list[str]:
    """``__all__`` when the module has one, else its public classes, functions and
    assignments (TypeVars and loggers excluded)."""
    tree = ast.parse(source)
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Name):
                    continue
                if target.id == "__all__":
                    return list(ast.literal_eval(node.value))
                if not _is_typevar_or_logger(node.value):
                    names.append(target.id)
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def _reference_names() -> set[str]:
    names = set()
    for module, path in _reference_modules().items():
        names.update(f"{module}.{n}" for n in _public_names(path.read_text()))
    # The Rust extension's classes, from its type stub.
    stub = ast.parse((TORCHFT / "_torchft.pyi").read_text())
    names.update(f"torchft._torchft.{n.name}" for n in stub.body if isinstance(n, ast.ClassDef))
    return names


def _reference_env_vars() -> set[str]:
    found = set()
    for path in _reference_modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and re.fullmatch(r"TORCHFT_[A-Z_]+", str(node.value)):
                found.add(node.value)
    return found


# ------------------------------------------------------------------ tests


def test_every_torchft_module_and_name_has_a_row() -> None:
    rows = _rows()
    modules = set(_reference_modules()) | {"torchft._torchft"}
    assert len(modules) > 20 and len(_reference_names()) > 80  # the enumeration found torchft
    missing = sorted((modules | _reference_names()) - rows.keys())
    assert not missing, f"docs/torchft_mapping.md has no row for: {missing}"


def test_every_torchft_variable_and_flag_has_a_row() -> None:
    rows = _rows()
    missing = sorted((_reference_env_vars() | TORCHFT_LIGHTHOUSE_FLAGS) - rows.keys())
    assert not missing, f"docs/torchft_mapping.md has no row for: {missing}"


def _resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names (the longest importable module prefix, then
    attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_equivalent_given_imports() -> None:
    checked = 0
    for key, (equivalent, notes) in _rows().items():
        if not key.startswith("torchft"):
            continue
        target = _provided(equivalent)
        if target is None:
            assert notes, f"{key}: 'not provided' needs a reason"
            continue
        resolved = _resolve(target)  # raises naming the row's target
        if key.count(".") == 1 and not isinstance(resolved, ModuleType):
            # a torchft root export: importable from our root too
            assert resolved is getattr(importlib.import_module("torchtitan_ft"), key[8:])
        checked += 1
    assert checked > 50


def test_variables_and_flags_said_to_be_provided_are_read() -> None:
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    for key, (equivalent, _) in _rows().items():
        if _provided(equivalent) is None:
            continue
        if key.startswith("--"):
            assert key in flags, f"torchft_lighthouse has no {key} flag"
        elif re.fullmatch(r"[A-Z][A-Z_]+", key):
            # Quoted where the package reads it; GLOO_SOCKET_IFNAME is read by gloo itself and
            # only named in ProcessGroupGloo's documentation.
            assert f'"{key}"' in sources or (key == "GLOO_SOCKET_IFNAME" and key in sources), (
                f"the package never reads {key}"
            )


def test_nothing_marked_not_provided_exists_in_its_module() -> None:
    rows = _rows()
    ours = {k: _provided(v) for k, (v, _) in rows.items() if k.startswith("torchft")}
    stale = []
    for key, target in ours.items():
        module, _, name = key.rpartition(".")
        if target is not None or module not in ours or ours[module] is None:
            continue
        if hasattr(importlib.import_module(ours[module]), name):  # type: ignore[arg-type]
            stale.append(f"{key} (now {ours[module]}.{name})")
    assert not stale, f"marked 'not provided' but present; update the table: {stale}"


def test_manager_takes_torchfts_arguments_in_its_order_and_ours_by_keyword_only() -> None:
    """A call written for torchft 0.2.0 binds the same arguments here, and an option torchft
    lacks cannot be passed by position (a positional call would bind another meaning): it is
    ``options=ManagerOptions(...)`` or a keyword of a field's name."""
    tree = ast.parse((TORCHFT / "manager.py").read_text())
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Manager")
    init = next(n for n in manager.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    reference = [a.arg for a in init.args.args]

    from torchtitan_ft import Manager
    from torchtitan_ft.manager import ManagerOptions

    parameters = list(inspect.signature(Manager.__init__).parameters.values())
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword_only = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
    assert positional == reference
    assert keyword_only == ["options"]
    # ... and the ManagerOptions fields as keywords of the same names (ManagerOptions.of).
    assert parameters[-1].kind is parameters[-1].VAR_KEYWORD
    assert [f.name for f in dataclasses.fields(ManagerOptions)] == [
        "auth_token",
        "model_fingerprint",
        "num_replica_groups",
        "retry_inflight_allreduce",
        "events_dir",
        "samples_per_batch",
        "lighthouse_outage",
        "on_state_loss",
        "heal_interfaces",
        "heal_stall_timeout",
    ]


# ------------------------------------------------ TorchTitan 0.3.0's FT trainer on compat/

TITAN_030_TORCHFT = {
    "torchft.Manager": True,
    "torchft.Optimizer": True,
    "torchft.ProcessGroupGloo": True,
    "torchft.ProcessGroupNCCL": True,
    "torchft.process_group.ManagedProcessGroup": True,
    "torchft.local_sgd.DiLoCo": True,
    "torchft.local_sgd.LocalSGD": True,
    "torchft.torchcomms.ProcessGroupTorchComms": False,
}
"""The torchft names TorchTitan 0.3.0's ``torchtitan/experiments/torchft`` uses, and whether
the compatibility package provides them (docs/titan.md, "TorchTitan's own FT trainer on
0.3.0"): all but torchcomms, which only its ``process_group="mccl"`` (GPUs) reaches."""

TITAN_030_MANAGER_CALLS = ("set_state_dict_fns", "participating_rank", "allreduce")
"""Manager methods it calls (its FT checkpoint manager, its all-reduce hook through
``ManagedProcessGroup``)."""

TITAN_030_DILOCO_KEYWORDS = (
    "manager",
    "model_fragments",
    "inner_optimizer",
    "outer_optimizer",
    "sync_every",
    "should_quantize",
    "fragment_sync_delay",
    "fragment_update_alpha",
)
"""The keywords it builds ``local_sgd.DiLoCo`` with."""


def _titan_030_torchft_source() -> Path | None:
    """TorchTitan 0.3.0's FT experiment as the 0.3.0 venv finds it (in the venv, or in the base
    Python it sits over when that has 0.3.0 already; scripts/install_torchtitan_env.sh 0.3.0),
    located without importing it; None without that venv."""
    python = ROOT / ".cache/tt030/venv/bin/python"
    if not python.exists():
        return None
    where = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; "
            "print(u.find_spec('torchtitan').submodule_search_locations[0])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    folder = Path(where.stdout.strip()) / "experiments" / "torchft"
    return folder if where.returncode == 0 and folder.is_dir() else None


TITAN_030_TORCHFT_SOURCE = _titan_030_torchft_source()


def test_every_torchft_name_titan_0_3_0_uses_has_a_row_and_is_provided() -> None:
    rows = _rows()
    for name, provided in TITAN_030_TORCHFT.items():
        assert name in rows, f"{name}: no row"
        assert (_provided(rows[name][0]) is not None) == provided, (name, rows[name])
    from torchtitan_ft import Manager
    from torchtitan_ft.semi_sync import DiLoCo

    missing = [m for m in TITAN_030_MANAGER_CALLS if not callable(getattr(Manager, m, None))]
    assert not missing, f"Manager lacks what TorchTitan 0.3.0 calls: {missing}"
    parameters = inspect.signature(DiLoCo.__init__).parameters
    assert not [k for k in TITAN_030_DILOCO_KEYWORDS if k not in parameters]


TOP = "torchft"


def _torchft_names_used(folder: Path) -> set[str]:
    """The torchft names the non-test sources under ``folder`` import or reach as attributes
    (``torchft.x.Y`` through ``import torchft`` or ``from torchft import x``), longest only."""
    found: set[str] = set()
    for path in sorted(folder.rglob("*.py")):
        if "tests" in path.relative_to(folder).parts:
            continue
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "torchft":
                        aliases[(alias.asname or alias.name).split(".")[0]] = "torchft"
            elif isinstance(node, ast.ImportFrom) and (node.module or "x").split(".")[0] == TOP:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    found.add(f"{node.module}.{alias.name}")
        for node in ast.walk(tree):
            parts: list[str] = []
            while isinstance(node, ast.Attribute):
                parts.insert(0, node.attr)
                node = node.value
            if parts and isinstance(node, ast.Name) and node.id in aliases:
                found.add(".".join([aliases[node.id], *parts]))
    return {n for n in found if not any(o.startswith(f"{n}.") for o in found)}


@pytest.mark.skipif(
    TITAN_030_TORCHFT_SOURCE is None,
    reason="no TorchTitan 0.3.0 venv (scripts/install_torchtitan_env.sh 0.3.0)",
)
def test_the_list_is_what_titan_0_3_0_uses() -> None:
    assert _torchft_names_used(TITAN_030_TORCHFT_SOURCE) == set(TITAN_030_TORCHFT)
