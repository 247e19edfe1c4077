"""The command line on TorchTitan 0.3.0 (torchtitan_ft/titan/releases/v0_3/parse.py), without
processes: a registry config with the ``fault_tolerance`` section, overridden by flags."""

import contextlib
import io

import pytest

from torchtitan_ft.titan import releases

if releases.installed_version() != releases.Release.V0_3.value:
    pytest.skip("TorchTitan 0.3.0 only (see conftest.py)", allow_module_level=True)

from torchtitan_ft.titan.config_schema import ConfigError, FaultTolerance
from torchtitan_ft.titan.releases.v0_3.parse import (
    as_config_of,
    explicit_flags,
    parse,
    runnable_here,
    with_default_config,
)
from torchtitan_ft.titan.releases.v0_3.trainer import FaultTolerantTrainer

Config = FaultTolerantTrainer.Config
REGISTRY = ("--module", "llama3", "--config", "llama3_debugmodel")


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--fault_tolerance.enable"], {"fault_tolerance.enable"}),
        (["--fault_tolerance.replica_id=1"], {"fault_tolerance.replica_id"}),
        (["--fault-tolerance.group-size", "2"], {"fault_tolerance.group_size"}),
        (["--validator.no-enable"], {"validator.enable"}),
        (["--hf_assets_path", "x", "activation-checkpoint:none"], set()),
    ],
)
def test_explicit_flags(args: list[str], names: set[str]) -> None:
    assert explicit_flags(args) == names


def test_default_registry_config_fills_only_what_is_missing() -> None:
    assert with_default_config([]) == [*REGISTRY]
    assert with_default_config(["--config=x"]) == ["--module", "llama3", "--config=x"]
    assert with_default_config([*REGISTRY]) == [*REGISTRY]


def test_fault_tolerance_flags_land_in_the_section_with_0_2_2_meanings() -> None:
    parsed = parse(
        [
            *REGISTRY,
            "--fault_tolerance.enable",
            "--fault_tolerance.replica_id=1",
            "--fault_tolerance.group_size=2",
            "--fault_tolerance.step_timeout_ms=30000",
            "--training.steps=3",
        ],
        Config,
    )
    ft = parsed.config.fault_tolerance
    assert isinstance(parsed.config, Config) and isinstance(ft, FaultTolerance)
    assert (ft.enable, ft.replica_id, ft.group_size, ft.step_timeout_ms) == (True, 1, 2, 30000)
    assert ft.explicit_fields == {"enable", "replica_id", "group_size", "step_timeout_ms"}
    assert parsed.config.training.steps == 3
    assert parsed.config.model_spec.name == "llama3"  # the registry's, kept


def test_help_shows_the_fault_tolerance_section() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        parse([*REGISTRY, "--help"], Config)
    assert done.value.code == 0
    text = out.getvalue()
    for name in ("enable", "replica-id", "group-size", "semi-sync-method", "lighthouse-addr"):
        assert f"--fault-tolerance.{name}" in text or f"--fault_tolerance.{name}" in text, name


def test_bad_registry_names_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match="no_such_config"):
        parse(["--module", "llama3", "--config", "no_such_config"], Config)
    with pytest.raises(ConfigError, match="another trainer's config"):
        as_config_of(Config, object())


def test_a_registry_config_is_made_runnable_on_a_cpu_and_says_so() -> None:
    parsed = parse([*REGISTRY], Config)
    lines: list[str] = []
    runnable_here(parsed, cuda=False, log=lines.append)
    config = parsed.config
    assert config.dataloader.dataset == "ft_corpus"
    assert config.validator.dataloader.dataset == "ft_corpus_validation"
    assert config.hf_assets_path.endswith("torchtitan_ft/assets/tokenizer")
    assert len(lines) == 4  # tokenizer, two corpora, attention: one line each


def test_what_the_user_set_is_not_changed() -> None:
    parsed = parse([*REGISTRY, "--dataloader.dataset=c4_test"], Config)
    lines: list[str] = []
    runnable_here(parsed, cuda=True, log=lines.append)
    assert parsed.config.dataloader.dataset == "c4_test"
    assert not any("dataloader.dataset=" in line and "validator" not in line for line in lines)
