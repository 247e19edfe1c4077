"""Where the Manager's settings come from (``torchtitan_ft.manager.settings``): arguments, env
vars and defaults, with a mapping for the env (pure)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.settings import (
    DEFAULT_LIGHTHOUSE_ADDR,
    Resolved,
    Source,
    overridden_message,
    port_in_use_message,
    resolve_manager_settings,
    store_key_prefix,
)
from torchtitan_ft.manager.state_loss import OnStateLoss

_ENV = {
    "TORCHFT_LIGHTHOUSE": "http://env-lh:1",
    "TORCHFT_MANAGER_PORT": "1234",
    "REPLICA_GROUP_ID": "env_group",
    "MASTER_ADDR": "env-host",
    "MASTER_PORT": "2345",
    "RANK": "1",
    "WORLD_SIZE": "2",
}


@pytest.mark.parametrize(
    ("name", "arg_name", "arg", "env_value", "default"),
    [
        ("lighthouse_addr", "lighthouse_addr", "http://arg:9", "http://env-lh:1", None),
        ("manager_port", "port", 7, 1234, 0),
        ("replica_id", "replica_id", "arg_group", "env_group", ""),
        ("store_addr", "store_addr", "arg-host", "env-host", "127.0.0.1"),
        ("store_port", "store_port", 3456, 2345, 0),
        ("group_rank", "rank", 0, 1, 0),
        ("group_world_size", "world_size", 3, 2, 1),
    ],
)
def test_config_precedence(
    name: str, arg_name: str, arg: Any, env_value: Any, default: Any
) -> None:
    # argument beats env
    got = getattr(resolve_manager_settings(env=_ENV, **{arg_name: arg}), name)
    assert (got.value, got.source) == (arg, Source.ARGUMENT)
    # env fills what is not given
    got = getattr(resolve_manager_settings(env=_ENV), name)
    assert (got.value, got.source, got.env_var is not None) == (env_value, Source.ENV, True)
    # default when neither
    got = getattr(resolve_manager_settings(env={}), name)
    expected_default = DEFAULT_LIGHTHOUSE_ADDR if default is None else default
    assert (got.value, got.source) == (expected_default, Source.DEFAULT)


def test_config_empty_env_counts_as_unset_and_describe_names_sources() -> None:
    settings = resolve_manager_settings(env={"MASTER_PORT": "", "RANK": ""}, port=5)
    assert settings.store_port.source is Source.DEFAULT
    line = settings.describe()
    assert "manager_port=5 (argument)" in line
    assert "group_rank=0 (default)" in line
    assert "env MASTER_PORT" in resolve_manager_settings(env=_ENV).describe()


def test_store_key_prefix_follows_torchrun_restarts() -> None:
    assert store_key_prefix({}) == "torchft/0/"
    assert store_key_prefix({"TORCHELASTIC_RESTART_COUNT": "3"}) == "torchft/3/"
    # A new store per incarnation: the nodes' differing restart counts must not matter.
    per_round = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert store_key_prefix({**per_round, "TORCHELASTIC_RESTART_COUNT": "1"}) == "torchft/"


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        ({}, {"MASTER_PORT": "abc"}, "MASTER_PORT must be an integer"),
        ({"rank": 2, "world_size": 2}, {}, r"rank must be in \[0, 2\)"),
        ({"world_size": 2}, {}, "needs a shared TCPStore"),
        ({"world_size": 0}, {}, "world_size must be >= 1"),
        ({"port": 70000}, {}, "port must be in"),
        ({"lighthouse_addr": "htp://x:1"}, {}, r"'htp://x:1' \(argument\) is not http://host:port"),
        ({}, {"TORCHFT_LIGHTHOUSE": "127.0.0.1:29510"}, r"\(env TORCHFT_LIGHTHOUSE\) is not"),
        ({"lighthouse_addr": "http://127.0.0.1"}, {}, "is not http://host:port"),
        ({"samples_per_batch": 0}, {}, "samples_per_batch must be a positive number"),
        ({}, {"TORCHFT_SAMPLES_PER_BATCH": "-8"}, "TORCHFT_SAMPLES_PER_BATCH must be a positive"),
        ({}, {"TORCHFT_SAMPLES_PER_BATCH": "8.5"}, "TORCHFT_SAMPLES_PER_BATCH must be an integer"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_manager_settings(env=env, **kwargs)


def test_port_in_use_message() -> None:
    env = port_in_use_message(Resolved(29512, Source.ENV, "TORCHFT_MANAGER_PORT"), "[::]:29512")
    assert env == (
        "manager server port 29512 (from TORCHFT_MANAGER_PORT=29512) is already in use "
        "([::]:29512); stop the process listening there or choose a free port (leave "
        "TORCHFT_MANAGER_PORT unset and port=None to pick one automatically)"
    )
    arg = port_in_use_message(Resolved(7, Source.ARGUMENT), "127.0.0.1:7")
    assert "(from the Manager's port=7 argument)" in arg


@pytest.mark.parametrize(
    ("arg_name", "env_var", "default"),
    [
        ("timeout", "TORCHFT_TIMEOUT_SEC", timedelta(seconds=60)),
        ("quorum_timeout", "TORCHFT_QUORUM_TIMEOUT_SEC", timedelta(seconds=60)),
        ("connect_timeout", "TORCHFT_CONNECT_TIMEOUT_SEC", timedelta(seconds=60)),
        ("heal_stall_timeout", "TORCHFT_HEAL_STALL_TIMEOUT_SEC", timedelta(seconds=10)),
    ],
)
def test_torchft_timeout_env_vars(arg_name: str, env_var: str, default: timedelta) -> None:
    env = {env_var: "7"}
    # argument beats env (torchft lets the env win; we do not)
    got = getattr(resolve_manager_settings(env=env, **{arg_name: timedelta(seconds=3)}), arg_name)
    assert (got.value, got.source) == (timedelta(seconds=3), Source.ARGUMENT)
    # env (whole or fractional seconds) fills what is not given
    got = getattr(resolve_manager_settings(env=env), arg_name)
    assert (got.value, got.source, got.env_var) == (timedelta(seconds=7), Source.ENV, env_var)
    half = getattr(resolve_manager_settings(env={env_var: "0.5"}), arg_name)
    assert half.value == timedelta(milliseconds=500)
    got = getattr(resolve_manager_settings(env={}), arg_name)
    assert (got.value, got.source) == (default, Source.DEFAULT)
    # the start-up line names the variable
    assert f"{arg_name}=7 s (env {env_var})" in (resolve_manager_settings(env=env).describe())


@pytest.mark.parametrize("bad", ["sixty", "-1", "0", "nan s"])
def test_bad_timeout_env_var_names_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"env var TORCHFT_QUORUM_TIMEOUT_SEC .*{bad!r}"):
        resolve_manager_settings(env={"TORCHFT_QUORUM_TIMEOUT_SEC": bad})


def test_bad_timeout_argument_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="timeout must be positive"):
        resolve_manager_settings(env={}, timeout=timedelta(0))
    with pytest.raises(TypeError, match=r"connect_timeout must be a datetime\.timedelta"):
        resolve_manager_settings(env={}, connect_timeout=5)  # type: ignore[arg-type]


def test_torchft_quorum_retries_env_var() -> None:
    env = {"TORCHFT_QUORUM_RETRIES": "3"}
    assert resolve_manager_settings(env=env, quorum_retries=1).quorum_retries.value == 1
    got = resolve_manager_settings(env=env).quorum_retries
    assert (got.value, got.source, got.env_var) == (3, Source.ENV, "TORCHFT_QUORUM_RETRIES")
    assert resolve_manager_settings(env={}).quorum_retries == Resolved(0, Source.DEFAULT)
    with pytest.raises(ValueError, match="env var TORCHFT_QUORUM_RETRIES must be an integer"):
        resolve_manager_settings(env={"TORCHFT_QUORUM_RETRIES": "many"})
    with pytest.raises(ValueError, match=r"TORCHFT_QUORUM_RETRIES must be >= 0, got '-2'"):
        resolve_manager_settings(env={"TORCHFT_QUORUM_RETRIES": "-2"})


@pytest.mark.parametrize(
    ("arg", "env", "value", "shown"),
    [
        ("arg-s3cret", {"TORCHFT_AUTH_TOKEN": "env-s3cret"}, "arg-s3cret", "set (argument)"),
        (None, {"TORCHFT_AUTH_TOKEN": "env-s3cret"}, "env-s3cret", "set (env TORCHFT_AUTH_TOKEN)"),
        (None, {"TORCHFT_AUTH_TOKEN": ""}, None, "none (default)"),
        (None, {}, None, "none (default)"),
    ],
)
def test_auth_token_argument_then_env_and_never_shown(arg, env, value, shown) -> None:
    settings = resolve_manager_settings(env=env, auth_token=arg)
    assert settings.auth_token.value == value
    line = settings.describe()
    assert f"auth_token={shown}" in line
    assert "s3cret" not in line


def test_auth_token_env_no_client_can_present_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"^\$TORCHFT_AUTH_TOKEN may hold only visible ASCII"):
        resolve_manager_settings(env={"TORCHFT_AUTH_TOKEN": "s3cret\n"})


@pytest.mark.parametrize(
    ("var", "bad", "match"),
    [
        ("TORCHFT_MANAGER_PORT", "abc", "TORCHFT_MANAGER_PORT must be an integer"),
        ("TORCHFT_MANAGER_PORT", "70000", r"TORCHFT_MANAGER_PORT must be a port in \[0, 65536\)"),
        ("TORCHFT_TIMEOUT_SEC", "abc", "TORCHFT_TIMEOUT_SEC must be a number of seconds"),
        ("TORCHFT_TIMEOUT_SEC", "-5", "TORCHFT_TIMEOUT_SEC must be positive"),
        ("TORCHFT_QUORUM_TIMEOUT_SEC", "nan", "TORCHFT_QUORUM_TIMEOUT_SEC must be a number"),
        ("TORCHFT_CONNECT_TIMEOUT_SEC", "1e400", "TORCHFT_CONNECT_TIMEOUT_SEC must be a number"),
        ("TORCHFT_QUORUM_RETRIES", "-1", "TORCHFT_QUORUM_RETRIES must be >= 0"),
        ("TORCHFT_QUORUM_RETRIES", "two", "TORCHFT_QUORUM_RETRIES must be an integer"),
        ("TORCHFT_LIGHTHOUSE", "lighthouse:29510", "is not http://host:port"),
        ("TORCHFT_SAMPLES_PER_BATCH", "0", "TORCHFT_SAMPLES_PER_BATCH must be a positive"),
        ("TORCHFT_LIGHTHOUSE_OUTAGE", "stall", "TORCHFT_LIGHTHOUSE_OUTAGE must be one of 'wait'"),
        ("TORCHFT_HEAL_INTERFACES", "ib0,,eth1", "TORCHFT_HEAL_INTERFACES must name network"),
        ("TORCHFT_HEAL_STALL_TIMEOUT_SEC", "x", "TORCHFT_HEAL_STALL_TIMEOUT_SEC must be a number"),
        ("TORCHFT_HEAL_STALL_TIMEOUT_SEC", "0", "TORCHFT_HEAL_STALL_TIMEOUT_SEC must be positive"),
    ],
)
def test_bad_env_var_is_an_error_even_when_an_argument_overrides_it(var, bad, match) -> None:
    """They were silently ignored whenever an argument was given (issue 20, N9)."""
    arguments = {
        "port": 0,
        "timeout": timedelta(seconds=5),
        "quorum_timeout": timedelta(seconds=5),
        "connect_timeout": timedelta(seconds=5),
        "quorum_retries": 0,
        "lighthouse_addr": "http://127.0.0.1:1",
        "samples_per_batch": 8,
        "lighthouse_outage": "wait",
        "on_state_loss": "stop",
        "heal_interfaces": "lo",
        "heal_stall_timeout": timedelta(seconds=2),
    }
    with pytest.raises(ValueError, match=match):
        resolve_manager_settings(env={var: bad}, **arguments)


def test_overridden_env_vars_are_named_with_the_winning_argument() -> None:
    env = {
        "TORCHFT_TIMEOUT_SEC": "5",
        "TORCHFT_AUTH_TOKEN": "env-s3cret",
        "TORCHFT_QUORUM_RETRIES": "2",
    }
    settings = resolve_manager_settings(
        env=env, timeout=timedelta(seconds=60), auth_token="arg-s3cret"
    )
    assert settings.overridden == ("TORCHFT_TIMEOUT_SEC", "TORCHFT_AUTH_TOKEN")
    message = overridden_message(settings, env)
    assert message is not None
    assert "TORCHFT_TIMEOUT_SEC='5' loses to timeout=60 s (argument)" in message
    assert "TORCHFT_AUTH_TOKEN=(set) loses to auth_token=set (argument)" in message
    assert "s3cret" not in message and "QUORUM_RETRIES" not in message
    assert overridden_message(resolve_manager_settings(env=env), env) is None


def test_the_record_names_every_value_and_source_and_hides_the_token() -> None:
    env = {"TORCHFT_TIMEOUT_SEC": "7", "TORCHFT_AUTH_TOKEN": "s3cret"}
    record = resolve_manager_settings(env=env, quorum_timeout=timedelta(seconds=3)).record()
    assert record["timeout"] == {"value": 7.0, "source": "env", "env_var": "TORCHFT_TIMEOUT_SEC"}
    assert record["quorum_timeout"] == {"value": 3.0, "source": "argument"}
    assert record["quorum_retries"] == {"value": 0, "source": "default"}
    assert record["auth_token"]["value"] is True and "s3cret" not in str(record)
    assert record["events_dir"] == {"value": None, "source": "default"}


@pytest.mark.parametrize(
    ("arg", "env", "expected"),
    [
        (32, {"TORCHFT_SAMPLES_PER_BATCH": "16"}, Resolved(32, Source.ARGUMENT)),
        (
            None,
            {"TORCHFT_SAMPLES_PER_BATCH": "16"},
            Resolved(16, Source.ENV, "TORCHFT_SAMPLES_PER_BATCH"),
        ),
        (None, {"TORCHFT_SAMPLES_PER_BATCH": ""}, Resolved(None, Source.DEFAULT)),
        (None, {}, Resolved(None, Source.DEFAULT)),
    ],
)
def test_samples_per_batch_argument_then_env_then_none(arg, env, expected) -> None:
    settings = resolve_manager_settings(env=env, samples_per_batch=arg)
    assert settings.samples_per_batch == expected
    assert f"samples_per_batch={expected.describe()}" in settings.describe()


@pytest.mark.parametrize(
    ("arg", "env", "expected"),
    [
        ("wait", {"TORCHFT_LIGHTHOUSE_OUTAGE": "previous_quorum"}, LighthouseOutage.WAIT),
        (LighthouseOutage.WAIT, {}, LighthouseOutage.WAIT),
        (None, {"TORCHFT_LIGHTHOUSE_OUTAGE": "wait"}, LighthouseOutage.WAIT),
        (None, {"TORCHFT_LIGHTHOUSE_OUTAGE": ""}, LighthouseOutage.PREVIOUS_QUORUM),
        (None, {}, LighthouseOutage.PREVIOUS_QUORUM),
    ],
)
def test_lighthouse_outage_argument_then_env_then_previous_quorum(arg, env, expected) -> None:
    settings = resolve_manager_settings(env=env, lighthouse_outage=arg)
    assert settings.lighthouse_outage.value is expected
    assert f"lighthouse_outage={settings.lighthouse_outage.describe()}" in settings.describe()
    assert settings.record()["lighthouse_outage"]["value"] == expected.value


def test_a_bad_lighthouse_outage_argument_names_the_choices() -> None:
    with pytest.raises(ValueError, match="lighthouse_outage must be one of 'wait', 'previous_q"):
        resolve_manager_settings(env={}, lighthouse_outage="stall")


@pytest.mark.parametrize(
    ("arg", "env", "expected"),
    [
        ("stop", {"TORCHFT_ON_STATE_LOSS": "from_scratch"}, OnStateLoss.STOP),
        (OnStateLoss.FROM_SCRATCH, {}, OnStateLoss.FROM_SCRATCH),
        (None, {"TORCHFT_ON_STATE_LOSS": "from_scratch"}, OnStateLoss.FROM_SCRATCH),
        (None, {"TORCHFT_ON_STATE_LOSS": ""}, OnStateLoss.CHECKPOINT),
        (None, {}, OnStateLoss.CHECKPOINT),
    ],
)
def test_on_state_loss_argument_then_env_then_checkpoint(arg, env, expected) -> None:
    settings = resolve_manager_settings(env=env, on_state_loss=arg)
    assert settings.on_state_loss.value is expected
    assert f"on_state_loss={settings.on_state_loss.describe()}" in settings.describe()
    assert settings.record()["on_state_loss"]["value"] == expected.value


@pytest.mark.parametrize(
    ("arg", "env", "origin"),
    [("restart", {}, "on_state_loss"), (None, {"TORCHFT_ON_STATE_LOSS": "go"}, "env var")],
)
def test_a_bad_on_state_loss_names_the_choices(arg, env, origin) -> None:
    with pytest.raises(ValueError, match=f"{origin}.* must be one of 'stop', 'from_scratch'"):
        resolve_manager_settings(env=env, on_state_loss=arg)


@pytest.mark.parametrize(
    ("arg", "env", "expected", "source"),
    [
        (None, {}, (), "default"),
        (None, {"TORCHFT_HEAL_INTERFACES": ""}, (), "default"),
        (None, {"TORCHFT_HEAL_INTERFACES": "ib0"}, ("ib0",), "env"),
        (None, {"TORCHFT_HEAL_INTERFACES": " ib0, ib1 "}, ("ib0", "ib1"), "env"),
        ("eth1", {"TORCHFT_HEAL_INTERFACES": "ib0"}, ("eth1",), "argument"),
        (["ib0", "eth1"], {}, ("ib0", "eth1"), "argument"),
        # the field set to "" (every interface) wins over the variable
        ("", {"TORCHFT_HEAL_INTERFACES": "ib0"}, (), "argument"),
    ],
)
def test_heal_interfaces_argument_then_env_then_every_interface(arg, env, expected, source) -> None:
    settings = resolve_manager_settings(env=env, heal_interfaces=arg)
    assert settings.heal_interfaces.value == expected
    assert settings.heal_interfaces.source.value == source
    assert settings.record()["heal_interfaces"]["value"] == list(expected)
    assert "heal_interfaces=" in settings.describe()


@pytest.mark.parametrize(
    ("arg", "env", "match"),
    [
        ("ib0,", {}, r"heal_interfaces must name network interfaces .*'' is not"),
        (["ib0", "a b"], {}, r"heal_interfaces .*'a b' is not an interface name"),
        (None, {"TORCHFT_HEAL_INTERFACES": "eth0/1"}, r"env var TORCHFT_HEAL_INTERFACES .*eth0/1"),
        ("averyveryverylongname", {}, r"'averyveryverylongname' is not an interface name"),
    ],
)
def test_a_malformed_heal_interface_is_named(arg, env, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_manager_settings(env=env, heal_interfaces=arg)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"TORCHFT_LAUNCHER_JOB": "pod:ft-groups-1", "SLURM_JOB_ID": "17"},
            Resolved("pod:ft-groups-1", Source.ENV, "TORCHFT_LAUNCHER_JOB"),
        ),
        ({"SLURM_JOB_ID": "17"}, Resolved("slurm:17", Source.ENV, "SLURM_JOB_ID")),
        (
            {"TORCHFT_LAUNCHER_JOB": "", "SLURM_JOB_ID": "17"},
            Resolved("slurm:17", Source.ENV, "SLURM_JOB_ID"),
        ),
        ({}, Resolved(None, Source.DEFAULT)),
    ],
)
def test_launcher_job_env_then_slurm_job_id_then_none(env, expected) -> None:
    settings = resolve_manager_settings(env=env)
    assert settings.launcher_job == expected
    assert f"launcher_job={expected.describe()}" in settings.describe()
    assert settings.record()["launcher_job"]["value"] == expected.value


@pytest.mark.parametrize(
    ("env", "var"),
    [
        ({"TORCHFT_LAUNCHER_JOB": "two words"}, "TORCHFT_LAUNCHER_JOB"),
        ({"TORCHFT_LAUNCHER_JOB": "x" * 129}, "TORCHFT_LAUNCHER_JOB"),
        ({"TORCHFT_LAUNCHER_JOB": "pod:\u00e9"}, "TORCHFT_LAUNCHER_JOB"),
        ({"SLURM_JOB_ID": "1\n2"}, "SLURM_JOB_ID"),
    ],
)
def test_a_bad_launcher_job_names_the_variable_and_the_value(env, var) -> None:
    with pytest.raises(ValueError, match=f"env var {var} must give a job name") as e:
        resolve_manager_settings(env=env)
    assert repr(env[var]) in str(e.value)
