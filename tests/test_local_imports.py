"""Imports inside functions are the exception in the package (docs/development.md, "Imports"):
at most :data:`LIMIT`, each with a comment giving its reason (load order, an optional or costly
dependency, a release switch), on its line or on the comment lines just above it (one comment
may head a run of consecutive imports)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_ft"
LIMIT = 41


def local_imports(path: Path) -> list[int]:
    """Line numbers of the ``import`` statements inside any function of the file at ``path``."""
    tree = ast.parse(path.read_text())
    found: set[int] = set()
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            found.update(
                node.lineno
                for node in ast.walk(func)
                if isinstance(node, ast.Import | ast.ImportFrom)
            )
    return sorted(found)


def has_reason(lines: list[str], lineno: int) -> bool:
    """Whether the import starting at 1-based ``lineno`` has a comment: on one of its own lines,
    on the line above it, or above the run of imports it ends."""
    index = lineno - 1
    while True:
        statement = [lines[index]]
        while not statement[-1].rstrip().endswith(")") and "(" in statement[0]:
            statement.append(lines[index + len(statement)])
        if any("#" in line for line in statement):
            return True
        above = lines[index - 1].strip() if index > 0 else ""
        if above.startswith("#"):
            return True
        if not above.startswith(("import ", "from ")):
            return False
        index -= 1


def package_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "_pb2" not in p.name]


def test_few_function_local_imports_each_with_its_reason() -> None:
    found = {p: local_imports(p) for p in package_files()}
    total = sum(len(lines) for lines in found.values())
    where = {str(p.relative_to(PACKAGE)): len(n) for p, n in found.items() if n}
    assert total <= LIMIT, f"{total} function-local imports (at most {LIMIT}): {where}"
    unexplained = [
        f"{p.relative_to(PACKAGE)}:{n}"
        for p, numbers in found.items()
        for n in numbers
        if not has_reason(p.read_text().splitlines(), n)
    ]
    assert not unexplained, f"function-local imports without a reason comment: {unexplained}"


def test_the_rule_counts_nested_functions_once_and_wants_a_comment(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "def f():\n"
        "    import json  # why\n"
        "    def g():\n"
        "        import re\n"
        "    # why both\n"
        "    import a\n"
        "    import b\n"
    )
    assert local_imports(source) == [3, 5, 7, 8]
    lines = source.read_text().splitlines()
    assert [has_reason(lines, n) for n in (3, 5, 7, 8)] == [True, False, True, True]
