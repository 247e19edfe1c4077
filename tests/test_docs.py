"""The docs stay true to the code: the generated configuration reference is current, every
config field and lighthouse flag is documented, links resolve, and the configuration
mistakes a user can make stop the job with one line naming the key."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import textwrap
from pathlib import Path
from types import ModuleType

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


def test_timeouts_md_tables_are_current(gen: ModuleType) -> None:
    committed = (DOCS / "timeouts.md").read_text()
    assert committed == gen.render_timeouts_md(committed), (
        "docs/timeouts.md's tables are stale (torchtitan_ft/timeouts.py changed); regenerate "
        "them with: python scripts/gen_config_docs.py"
    )


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
