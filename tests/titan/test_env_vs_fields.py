"""``TORCHFT_*`` variables against ``fault_tolerance`` fields: a variable applies unless the
user set the field (TOML or command line); the Manager's settings resolve both (pure)."""

from __future__ import annotations

import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from torchtitan_ft.checkpoint.http_transport import DEFAULT_STALL_TIMEOUT
from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.settings import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEAL_STALL_TIMEOUT,
    DEFAULT_QUORUM_RETRIES,
    DEFAULT_QUORUM_TIMEOUT,
    DEFAULT_TIMEOUT,
    Source,
    overridden_message,
    resolve_manager_settings,
)
from torchtitan_ft.manager.state_loss import OnStateLoss
from torchtitan_ft.timeouts import BY_KEY, Key
from torchtitan_ft.titan.config import ConfigError, FaultTolerance, parse_job
from torchtitan_ft.titan.config_cli import explicit_fields
from torchtitan_ft.titan.config_schema import ENV_OVERRIDABLE, manager_timeouts
from torchtitan_ft.titan.preflight import check_manager_env

FT_ON = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]


@pytest.mark.parametrize(
    ("toml", "args", "expected"),
    [
        ({}, [], set()),
        ({"fault_tolerance": {"step_timeout_ms": 5}}, [], {"step_timeout_ms"}),
        ({}, ["--fault_tolerance.quorum_timeout_ms", "9"], {"quorum_timeout_ms"}),
        ({}, ["--fault-tolerance.connect-timeout-ms=9"], {"connect_timeout_ms"}),
        ({}, ["--fault_tolerance.no-init-sync"], {"no_init_sync", "init_sync"}),
        ({"training": {"steps": 3}}, ["--training.steps=3", "--job.config_file=x"], set()),
    ],
)
def test_the_fields_the_user_set(toml: dict, args: list[str], expected: set[str]) -> None:
    assert explicit_fields("fault_tolerance", toml, args) == expected


def test_the_parse_records_what_the_user_set(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent("[fault_tolerance]\nquorum_timeout_ms = 90000\n"))
    args = ["--job.config_file", str(path), *FT_ON, "--fault_tolerance.step_timeout_ms=30000"]
    ft = parse_job(args).config.fault_tolerance
    assert {"quorum_timeout_ms", "step_timeout_ms", "enable", "group_size"} <= ft.explicit_fields
    assert "connect_timeout_ms" not in ft.explicit_fields


def test_field_defaults_are_the_managers_defaults() -> None:
    # An unset field leaves the value to the Manager: without a variable it must be the same.
    ft = FaultTolerance()
    assert timedelta(milliseconds=ft.step_timeout_ms) == DEFAULT_TIMEOUT
    assert timedelta(milliseconds=ft.quorum_timeout_ms) == DEFAULT_QUORUM_TIMEOUT
    assert timedelta(milliseconds=ft.connect_timeout_ms) == DEFAULT_CONNECT_TIMEOUT
    assert ft.quorum_retries == DEFAULT_QUORUM_RETRIES
    # ... and the transport's and the timeouts table's.
    stall = timedelta(milliseconds=ft.heal_stall_timeout_ms)
    assert stall == DEFAULT_HEAL_STALL_TIMEOUT == DEFAULT_STALL_TIMEOUT
    assert stall.total_seconds() == BY_KEY[Key.HEAL_STALL].default_s


ENV = {
    "TORCHFT_TIMEOUT_SEC": "30",
    "TORCHFT_QUORUM_TIMEOUT_SEC": "90",
    "TORCHFT_CONNECT_TIMEOUT_SEC": "20",
    "TORCHFT_QUORUM_RETRIES": "3",
    "TORCHFT_LIGHTHOUSE_OUTAGE": "wait",
    "TORCHFT_ON_STATE_LOSS": "from_scratch",
    "TORCHFT_HEAL_INTERFACES": "lo",
    "TORCHFT_HEAL_STALL_TIMEOUT_SEC": "4",
}


def _settings(ft: FaultTolerance, env: dict[str, str]):
    return resolve_manager_settings(env=env, **manager_timeouts(ft))


def test_a_variable_applies_when_the_field_is_not_set() -> None:
    ft = FaultTolerance()
    ft.explicit_fields = frozenset({"enable", "group_size"})
    settings = _settings(ft, ENV)
    assert settings.timeout.value == timedelta(seconds=30)
    assert settings.quorum_timeout.value == timedelta(seconds=90)
    assert settings.connect_timeout.value == timedelta(seconds=20)
    assert settings.quorum_retries.value == 3
    assert settings.lighthouse_outage.value is LighthouseOutage.WAIT
    assert settings.on_state_loss.value is OnStateLoss.FROM_SCRATCH
    assert settings.heal_interfaces.value == ("lo",)
    assert settings.heal_stall_timeout.value == timedelta(seconds=4)
    for name in (
        "timeout",
        "quorum_timeout",
        "connect_timeout",
        "quorum_retries",
        "lighthouse_outage",
        "on_state_loss",
        "heal_interfaces",
        "heal_stall_timeout",
    ):
        assert getattr(settings, name).source is Source.ENV
    assert settings.overridden == ()
    assert overridden_message(settings, ENV) is None
    # no variable: the field's default
    assert _settings(ft, {}).timeout.value == timedelta(milliseconds=ft.step_timeout_ms)


def test_a_field_the_user_set_wins_and_the_manager_says_so() -> None:
    ft = FaultTolerance(step_timeout_ms=45000)
    ft.explicit_fields = frozenset({"step_timeout_ms"})
    settings = _settings(ft, ENV)
    assert (settings.timeout.value, settings.timeout.source) == (
        timedelta(seconds=45),
        Source.ARGUMENT,
    )
    assert settings.quorum_timeout.source is Source.ENV
    assert settings.overridden == ("TORCHFT_TIMEOUT_SEC",)
    assert "TORCHFT_TIMEOUT_SEC" in (overridden_message(settings, ENV) or "")


def test_a_config_built_in_code_counts_every_field_as_set() -> None:
    settings = _settings(FaultTolerance(), ENV)
    assert set(settings.overridden) == set(ENV_OVERRIDABLE.values())


def test_a_variable_that_breaks_the_timeout_order_is_named() -> None:
    config = parse_job(FT_ON).config
    with pytest.raises(ConfigError, match=r"env TORCHFT_TIMEOUT_SEC=5 \(as fault_tolerance"):
        check_manager_env(config, {"TORCHFT_TIMEOUT_SEC": "5"})  # < process_group 10 s
    with pytest.raises(ConfigError, match="env TORCHFT_CONNECT_TIMEOUT_SEC=120"):
        check_manager_env(config, {"TORCHFT_CONNECT_TIMEOUT_SEC": "120"})
    check_manager_env(config, ENV)
    # The field set: the variable loses and cannot break the order.
    explicit = parse_job([*FT_ON, "--fault_tolerance.step_timeout_ms=60000"]).config
    check_manager_env(explicit, {"TORCHFT_TIMEOUT_SEC": "5"})
