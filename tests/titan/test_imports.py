"""The modules of ``torchtitan_ft.titan`` import each other without a circle, counting the
imports inside functions too (read from the source, nothing is imported)."""

import ast
from pathlib import Path

PACKAGE = "torchtitan_ft.titan"
TITAN = Path(__file__).resolve().parents[2] / "torchtitan_ft" / "titan"


def titan_imports(source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` (names inside the package) that ``source`` imports, at
    module level or anywhere else."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            head, _, rest = name.partition(f"{PACKAGE}.")
            if not head and rest.split(".")[0] in modules:
                found.add(rest.split(".")[0])
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in TITAN.glob("*.py") if p.stem != "__init__"}
    return {m: titan_imports((TITAN / f"{m}.py").read_text(), modules) - {m} for m in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as the path that closes it (first module repeated), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            cycle = visit(imported, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module, [])
        if cycle:
            return cycle
    return None


def test_titan_modules_import_without_a_circle() -> None:
    graph = import_graph()
    assert {"config", "config_schema", "config_cli", "preflight"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_schema_imports_no_other_titan_module() -> None:
    """Everything that reads the config (replica axis, semi-sync, trainer) imports the schema
    alone, not the parser or the checks."""
    assert import_graph()["config_schema"] == set()
    for reader in ("replica_axis", "semi_sync_axis", "trainer"):
        assert not import_graph()[reader] & {"config", "config_cli", "preflight"}, reader


def test_a_circle_is_found() -> None:
    source = f"from {PACKAGE}.b import x\ndef f():\n    from {PACKAGE} import c\n"
    assert titan_imports(source, {"a", "b", "c"}) == {"b", "c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None
