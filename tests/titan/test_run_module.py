"""What ``run_module`` gives TorchTitan's own FT trainer (``TRAIN_FILE=
torchtitan.experiments.ft.train``): this project's ``[fault_tolerance]`` schema as the custom
config module, and the one line naming the fields the user set that it does not use. Pure
functions, table tests; the end-to-end runs are in test_titan_doc_commands.py."""

from __future__ import annotations

from typing import Any

import pytest

from torchtitan_ft.testing.titan_jobs import ROOT
from torchtitan_ft.titan.run_module import (
    OWN_CONFIG_MODULE,
    PROJECT_TRAINER,
    _titan_ft_fields,
    _toml_of,
    custom_config_args,
    fields_set,
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


def test_every_project_config_parses_for_titans_trainer() -> None:
    """Each config in configs/ is accepted by TorchTitan's parser given the project's schema
    (the issue's crash: ``Invalid field names in ... FaultTolerance``)."""
    from torchtitan.config import ConfigManager

    for path in sorted((ROOT / "configs").glob("*.toml")):
        args = ["--job.config_file", str(path)]
        args += custom_config_args(args, _toml_of(args))
        config = ConfigManager().parse_args(args)
        assert config.fault_tolerance.enable in (True, False), path
