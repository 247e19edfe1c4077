"""What ``run_module`` gives TorchTitan's own FT trainer (``TRAIN_FILE=
torchtitan.experiments.ft.train``): this project's ``[fault_tolerance]`` schema as the custom
config module, the one line naming the fields the user set that it does not use, and the one
saying it trains one DiLoCo fragment where the config asks for more. Pure
functions, table tests; the end-to-end runs are in test_titan_doc_commands.py."""

from __future__ import annotations

from typing import Any

import pytest

from torchtitan_ft.testing.titan_jobs import ROOT
from torchtitan_ft.titan.run_module import (
    OWN_CONFIG_MODULE,
    PROJECT_TRAINER,
    _has_fragment_fn,
    _titan_ft_fields,
    _toml_of,
    custom_config_args,
    fields_set,
    one_fragment_line,
    setting,
    unused_fields_line,
)

TRAINER = "torchtitan.experiments.ft.train"
OWN = [f"--job.custom_config_module={OWN_CONFIG_MODULE}"]


@pytest.mark.parametrize(
    ("args", "toml", "expected"),
    [
        ([], {}, OWN),
        ([], {"job": {"custom_config_module": "torchtitan.components.ft.config"}}, OWN),
        ([], {"job": {"custom_config_module": "my.config"}}, []),
        (["--job.custom_config_module=my.config"], {}, []),
        (["--job.custom-config-module", "my.config"], {}, []),
    ],
)
def test_the_project_schema_is_given_unless_the_user_names_a_module(
    args: list[str], toml: dict[str, Any], expected: list[str]
) -> None:
    assert custom_config_args(args, toml) == expected


@pytest.mark.parametrize(
    ("args", "toml", "expected"),
    [
        ([], {}, set()),
        ([], {"fault_tolerance": {"hostname": "h", "enable": True}}, {"hostname", "enable"}),
        (["--fault_tolerance.step_timeout_ms=5", "--training.steps", "2"], {}, {"step_timeout_ms"}),
        (["--fault-tolerance.quorum-timeout-ms", "5"], {}, {"quorum_timeout_ms"}),
        (["--fault_tolerance.no-init-sync"], {}, {"init_sync"}),
    ],
)
def test_fields_set_reads_the_toml_and_the_command_line(
    args: list[str], toml: dict[str, Any], expected: set[str]
) -> None:
    assert fields_set(args, toml) == expected


def test_the_line_names_only_the_fields_titan_does_not_use() -> None:
    titan = _titan_ft_fields()
    assert {"min_replica_size", "sync_steps", "num_fragments", "process_group"} <= titan
    assert unused_fields_line(TRAINER, {"enable", "sync_steps"}, titan) is None
    line = unused_fields_line(TRAINER, {"enable", "step_timeout_ms", "hostname"}, titan)
    assert line is not None and "\n" not in line
    assert "fault_tolerance.{hostname, step_timeout_ms}" in line and PROJECT_TRAINER in line


@pytest.mark.parametrize(
    ("args", "toml", "expected"),
    [
        ([], {}, None),
        ([], {"fault_tolerance": {"num_fragments": 2}}, 2),
        (["--fault_tolerance.num_fragments=3"], {"fault_tolerance": {"num_fragments": 2}}, "3"),
        (["--fault-tolerance.num-fragments", "4"], {}, "4"),
    ],
)
def test_setting_is_the_last_flag_else_the_toml(
    args: list[str], toml: dict[str, Any], expected: object
) -> None:
    assert setting(args, toml, "fault_tolerance", "num_fragments") == expected


@pytest.mark.parametrize(
    ("module", "method", "fragments", "split", "says"),
    [
        (TRAINER, "diloco", 2, False, True),  # Example 2's config: model llama3
        (TRAINER, "DiLoCo", "2", False, True),
        (TRAINER, "diloco", 2, True, False),  # llama3_ft: its fragment_fn splits it
        (TRAINER, "diloco", 1, False, False),
        (TRAINER, "diloco", None, False, False),
        (TRAINER, "local_sgd", 2, False, False),
        ("torchtitan.train", "diloco", 2, False, False),
    ],
)
def test_one_fragment_is_said_where_the_train_spec_cannot_split(
    module: str, method: str, fragments: object, split: bool, says: bool
) -> None:
    line = one_fragment_line(module, "llama3", method, fragments, split)
    assert (line is not None) is says
    if line is not None:
        assert "\n" not in line and "num_fragments=2" in line and PROJECT_TRAINER in line


def test_llama3_has_no_fragment_fn_and_llama3_ft_has_one() -> None:
    """TorchTitan 0.2.2's train specs, which the line above depends on."""
    assert not _has_fragment_fn("llama3")
    assert _has_fragment_fn("llama3_ft")


def test_every_project_config_parses_for_titans_trainer() -> None:
    """Each config in configs/ is accepted by TorchTitan's parser given the project's schema
    (the issue's crash: ``Invalid field names in ... FaultTolerance``)."""
    from torchtitan.config import ConfigManager

    for path in sorted((ROOT / "configs").glob("*.toml")):
        args = ["--job.config_file", str(path)]
        args += custom_config_args(args, _toml_of(args))
        config = ConfigManager().parse_args(args)
        assert config.fault_tolerance.enable in (True, False), path
