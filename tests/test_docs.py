"""The docs stay true to the code: the generated configuration reference and tables are
current, every config field and lighthouse flag is documented, links resolve, the code blocks
of the README and docs parse (Python compiles and its imports exist, a ``Manager(...)`` binds
to the real signature, the parameter server's example runs, bash passes ``bash -n``), the
commands name files, modules and flags that exist, and the configuration mistakes a user can
make stop the job with one line naming the key."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
import subprocess
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", ROOT / "scripts" / "gen_config_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _generator()


# ------------------------------------------------------------------ generated configuration


def test_configuration_md_is_current(gen: ModuleType) -> None:
    committed = (DOCS / "configuration.md").read_text()
    assert committed == gen.render(), (
        "docs/configuration.md is stale (a config docstring or a lighthouse flag changed); "
        "regenerate it with: python scripts/gen_config_docs.py"
    )


@pytest.mark.parametrize(
    "page", ["docs/lighthouse.md", "docs/timeouts.md", "docs/torchft_mapping.md"]
)
def test_generated_tables_are_current(gen: ModuleType, page: str) -> None:
    assert (ROOT / page).read_text() == gen.render_page(page), (
        f"a generated table of {page} is stale (a lighthouse flag, a TORCHFT_* variable or "
        "torchtitan_ft/timeouts.py changed); regenerate it with: python scripts/gen_config_docs.py"
    )


def test_splice_replaces_only_between_the_markers(gen: ModuleType) -> None:
    text = "hand\n<!-- BEGIN GENERATED t: note -->\nold\n<!-- END GENERATED t -->\nhand\n"
    assert gen.splice(text, "t", "new\n") == text.replace("old\n", "new\n")
    with pytest.raises(LookupError, match="'other'"):
        gen.splice(text, "other", "new\n")
    swapped = "<!-- END GENERATED t -->\n<!-- BEGIN GENERATED t -->\n"
    with pytest.raises(LookupError):
        gen.splice(swapped, "t", "new\n")


def test_generated_tables_list_every_variable_flag_and_subcommand(gen: ModuleType) -> None:
    from torchtitan_ft.lighthouse.cli import build_parser, build_status_parser
    from torchtitan_ft.manager import settings

    env = gen.render_env_section()
    for var in settings._ENV_SETTINGS:
        assert f"| `{var}` |" in env, var
    assert env.count("| `TORCHFT_") == len(settings._ENV_SETTINGS)
    mapping, flags = gen.render_torchft_flags(), gen.render_lighthouse_section()
    for prefix, parser in (("", build_parser()), ("status ", build_status_parser())):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert f"`{prefix}{flag}`" in mapping, (prefix, flag)
                assert f"| `{flag}`" in flags, (prefix, flag)


def test_generated_torchft_columns_agree_with_torchft(gen: ModuleType) -> None:
    """The generator's lists of torchft 0.2.0's lighthouse flags and of the ``TORCHFT_*``
    variables its Manager reads are those tests/test_torchft_mapping.py finds."""
    from tests import test_torchft_mapping as mapping
    from torchtitan_ft.manager import settings

    assert set(gen.TORCHFT_LIGHTHOUSE_FLAGS) == mapping.TORCHFT_LIGHTHOUSE_FLAGS
    if not (mapping.TORCHFT / "manager.py").exists():
        pytest.skip("scripts/install_reference.sh not run")
    read_here = set(settings._ENV_SETTINGS)
    assert set(gen.TORCHFT_ENV) == mapping._reference_env_vars() & read_here


def test_every_config_field_has_a_docstring(gen: ModuleType) -> None:
    missing = gen.undocumented_fields()
    assert not missing, (
        f"fault_tolerance fields without a docstring right under them in "
        f"torchtitan_ft/titan/config_schema.py: {missing}"
    )


def test_field_docstrings_are_read_from_source(gen: ModuleType) -> None:
    source = textwrap.dedent(
        '''
        class FaultTolerance:
            documented: int = 1
            """First line.

            Second paragraph."""

            undocumented: str = ""
            other: bool = False
            """Other."""
        '''
    )
    docs = gen.field_docstrings(source)
    assert docs == {"documented": "First line.\n\nSecond paragraph.", "other": "Other."}


def test_rendered_reference_lists_every_field_and_flag(gen: ModuleType) -> None:
    from torchtitan_ft.lighthouse.cli import build_parser

    text = gen.render()
    for f in gen.config_fields():
        assert f"### {f.name}\n" in text, f.name
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in text, flag


# ------------------------------------------------------------------------------- hand docs


def test_timeouts_guide_names_every_timeout(gen: ModuleType) -> None:
    from torchtitan_ft.lighthouse.cli import build_parser

    text = (DOCS / "timeouts.md").read_text()
    names = [f.name for f in gen.config_fields() if "timeout" in f.name]
    names += [
        a.option_strings[0]
        for a in build_parser()._actions
        if a.option_strings and "timeout" in a.option_strings[0]
    ]
    missing = [n for n in names if n not in text]
    assert not missing, f"docs/timeouts.md does not explain {missing}"


@pytest.mark.parametrize(
    "name", ["architecture.md", "configuration.md", "timeouts.md", "operations.md"]
)
def test_relative_links_resolve(name: str) -> None:
    text = (DOCS / name).read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (DOCS / target).exists(), f"docs/{name} links to missing {target}"


# ------------------------------------------------- configuration mistakes: one line, named


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


_ENABLED = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]


@pytest.mark.parametrize(
    ("toml", "args", "names"),
    [
        # a misspelt TOML key: named, with the closest real key
        ("[fault_tolerance]\nreplica_idx = 1\n", [], ["replica_idx", "replica_id?"]),
        # a value of the wrong type or outside the choices: named, with what is expected
        ('[fault_tolerance]\nquorum_mode = "asynchronous"\n', [], ["quorum_mode", "'async'"]),
        ('[fault_tolerance]\nstep_timeout_ms = "60s"\n', [], ["step_timeout_ms", "integer"]),
        # replica_id >= group_size
        ("", [*_ENABLED, "--fault_tolerance.replica_id=2"], ["replica_id=2", "group_size=2"]),
        # FT on without group_size
        ("", ["--fault_tolerance.enable"], ["group_size must be set"]),
        # timeouts in the wrong order: says which one to raise
        (
            "",
            [*_ENABLED, "--fault_tolerance.process_group_timeout_ms=120000"],
            ["raise fault_tolerance.step_timeout_ms to at least 120000"],
        ),
        # a quorum timeout below the process-group timeout (it started, then failed as "no
        # quorum from the lighthouse")
        (
            "",
            [
                *_ENABLED,
                "--fault_tolerance.process_group_timeout_ms=30000",
                "--fault_tolerance.quorum_timeout_ms=5000",
                "--fault_tolerance.connect_timeout_ms=5000",
            ],
            ["quorum_timeout_ms=5000", "process_group_timeout_ms=30000", "at least 30000"],
        ),
    ],
)
def test_config_mistake_stops_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    toml: str,
    args: list[str],
    names: list[str],
) -> None:
    from torchtitan_ft.titan.train import main

    if toml:
        args = ["--job.config_file", _toml(tmp_path, toml), *args]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.removesuffix("\n")
    assert message.startswith("torchtitan_ft: config error: "), message
    assert "\n" not in message, f"not one line: {message!r}"
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


def test_every_default_is_a_valid_config() -> None:
    from torchtitan_ft.titan.config import FaultTolerance, validate_fault_tolerance

    ft = FaultTolerance()
    validate_fault_tolerance(ft)
    enabled = dataclasses.replace(ft, enable=True, group_size=1)
    validate_fault_tolerance(enabled)  # the default timeouts are in the required order


# ------------------------------------------------------------ code blocks of README and docs

DOC_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
_FENCE = re.compile(r"^(\s*)(```+)([\w-]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its language, its text (dedented) and where it starts."""

    lang: str
    text: str
    where: str


def fenced_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, ticks, lang = opening.groups()
        start = i + 1
        i = start
        while i < len(lines) and lines[i].strip() != ticks:
            i += 1
        assert i < len(lines), f"{path.name}:{start}: code block never closed"
        body = [line.removeprefix(indent) for line in lines[start:i]]
        blocks.append(Block(lang, "\n".join(body) + "\n", f"{path.relative_to(ROOT)}:{start}"))
        i += 1
    return blocks


def _blocks(*langs: str) -> list[Block]:
    return [b for page in DOC_PAGES for b in fenced_blocks(page) if b.lang in langs]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def test_fenced_blocks_are_found() -> None:
    text = "a\n```python\nx = 1\n```\n  ```bash\n  ls\n  ```\n"
    path = DOCS / "_probe.md"
    try:
        path.write_text(text)
        blocks = fenced_blocks(path)
    finally:
        path.unlink()
    assert [(b.lang, b.text) for b in blocks] == [("python", "x = 1\n"), ("bash", "ls\n")]


PYTHON_BLOCKS = _blocks("python")
SHELL_BLOCKS = _blocks("bash", "sh")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_ids(PYTHON_BLOCKS))
def test_python_blocks_compile_and_import(block: Block) -> None:
    tree = ast.parse(block.text, block.where)  # a SyntaxError names the block
    compile(tree, block.where, "exec")
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(imports, []), block.where, "exec"), {})  # the names it imports exist


def _package_calls(tree: ast.Module) -> list[tuple[str, ast.Call, Any]]:
    """The calls of names the block imports from torchtitan_ft: the name, the call, and what
    the name is."""
    imported: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan_ft"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    return [
        (node.func.id, node, imported[node.func.id])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in imported
    ]


def test_calls_in_python_blocks_bind_to_the_signatures() -> None:
    """Every call of a torchtitan_ft name in a Python block (the README's ``Manager(...)``
    among them) passes only arguments the callee takes, and every one it requires: a required
    one left out would be a TypeError when the example is run."""
    calls = [(b, *c) for b in PYTHON_BLOCKS for c in _package_calls(ast.parse(b.text))]
    assert any(name == "Manager" for _, name, _, _ in calls), "the README's Manager example is gone"
    for block, name, call, target in calls:
        args = [object() for _ in call.args]
        kwargs = {k.arg: object() for k in call.keywords if k.arg is not None}
        try:
            inspect.signature(target).bind(*args, **kwargs)
        except TypeError as e:
            pytest.fail(f"{block.where}: {name}(...) does not bind: {e}")


def test_the_parameter_server_example_runs() -> None:
    """docs/parameter_server.md's example, run as written (the server and its client in one
    process), then one request of the client: it pushes a delta and fetches the sum."""
    import torch

    (block,) = [b for b in fenced_blocks(DOCS / "parameter_server.md") if b.lang == "python"]
    names: dict[str, Any] = {"__name__": "parameter_server_md"}
    exec(compile(block.text, block.where, "exec"), names)
    server, pg = names["server"], names["pg"]
    try:
        pg.broadcast_one(torch.ones(4), root=1).wait()  # the client pushes
        params = torch.zeros(4)
        pg.broadcast_one(params, root=0).wait()  # and fetches
        assert params.tolist() == [1.0] * 4
    finally:
        pg.shutdown()
        server.shutdown()


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_ids(SHELL_BLOCKS))
def test_shell_blocks_parse(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.sh"
    script.write_text(block.text)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, f"{block.where}: {result.stderr}"


def _doc_texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in DOC_PAGES]


_REPO_PATH = re.compile(r"(?<![\w/.-])(?:\./)?((?:scripts|examples|benchmarks|configs)/[\w./-]*\w)")
_SCRIPT = re.compile(r"(?<![\w/.-])\./(\w+\.sh)\b")
_MODULE = re.compile(r"python3? -m ((?:benchmarks|torchtitan_ft)(?:\.\w+)+)")


def test_commands_name_files_and_modules_that_exist() -> None:
    missing = []
    for name, text in _doc_texts():
        code = "\n".join(
            [b.text for b in fenced_blocks(ROOT / name) if b.lang in ("bash", "sh", "")]
            + re.findall(r"`([^`\n]+)`", text)
        )
        paths = [m[1] for m in _REPO_PATH.finditer(code) if code[m.end() : m.end() + 1] != "*"]
        for path in paths + _SCRIPT.findall(code):  # a glob (configs/debug*.toml) is left out
            if not (ROOT / path).exists():
                missing.append(f"{name}: {path}")
        for module in _MODULE.findall(code):
            path = ROOT / Path(*module.split("."))
            if not (path.with_suffix(".py").exists() or (path / "__main__.py").exists()):
                missing.append(f"{name}: python -m {module}")
    assert not missing, f"commands in the docs name what does not exist: {missing}"


_LIGHTHOUSE_COMMAND = re.compile(r"torchft_lighthouse((?: +[^\s`&|;#]+)*)")


def test_lighthouse_commands_use_flags_the_parser_has() -> None:
    from torchtitan_ft.lighthouse.cli import build_parser, build_status_parser

    known = {
        "": {s for a in build_parser()._actions for s in a.option_strings},
        "status": {s for a in build_status_parser()._actions for s in a.option_strings},
    }
    unknown = []
    for name, text in _doc_texts():
        for args in _LIGHTHOUSE_COMMAND.findall(text):
            words = [w.strip("[]") for w in args.split()]
            sub = "status" if words[:1] == ["status"] else ""
            for word in words:
                flag = word.split("=")[0]
                if flag.startswith("--") and flag not in known[sub]:
                    unknown.append(f"{name}: torchft_lighthouse {sub} {flag}")
    assert not unknown, f"lighthouse flags the parser does not have: {unknown}"


MISSPELT_ON_PURPOSE = {"replica_ids"}
"""operations.md's example of the error a misspelt flag gets."""


def test_fault_tolerance_flags_name_config_fields(gen: ModuleType) -> None:
    fields = {f.name for f in gen.config_fields()} | MISSPELT_ON_PURPOSE
    unknown = []
    for name, text in _doc_texts():
        for flag in re.findall(r"--fault_tolerance\.(?:no-)?([a-z_]+)\b(?!-)", text):
            if flag not in fields:
                unknown.append(f"{name}: --fault_tolerance.{flag}")
    assert not unknown, f"flags of no [fault_tolerance] field: {unknown}"
