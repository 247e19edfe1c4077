"""The extended ``fault_tolerance`` section: TOML, CLI, precedence, and one clear error."""

import textwrap
from pathlib import Path

import pytest

from torchtitan_ft.titan.config import (
    ConfigError,
    FaultTolerance,
    JobConfig,
    check_timeout_order,
    parse_job_config,
    validate_fault_tolerance,
)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_are_valid_and_ft_off() -> None:
    config = parse_job_config([])
    assert isinstance(config, JobConfig)
    assert isinstance(config.fault_tolerance, FaultTolerance)
    assert config.fault_tolerance.enable is False
    assert config.fault_tolerance.semi_sync_method == "none"


def test_every_field_has_a_docstring() -> None:
    import inspect

    source = inspect.getsource(FaultTolerance)
    for name in FaultTolerance.__dataclass_fields__:
        after = source.split(f"\n    {name}:", 1)[1].split("\n", 2)
        assert after[1].strip().startswith('"""'), f"{name} has no docstring"


def test_toml_sets_fields(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
        [fault_tolerance]
        enable = true
        replica_id = 1
        group_size = 3
        min_replica_size = 2
        quorum_mode = "sync"
        semi_sync_method = "diloco"
        sync_steps = 10
        num_fragments = 2
        fragment_sync_delay = 1
        fragment_update_alpha = 0.5
        outer_lr = 0.5
        world_size_mode = "fixed_with_spares"
        checkpoint_transport = "pg"
        """,
    )
    ft = parse_job_config(["--job.config_file", path]).fault_tolerance
    assert (ft.enable, ft.replica_id, ft.group_size, ft.min_replica_size) == (True, 1, 3, 2)
    assert (ft.semi_sync_method, ft.sync_steps, ft.num_fragments) == ("diloco", 10, 2)
    assert (ft.fragment_sync_delay, ft.fragment_update_alpha, ft.outer_lr) == (1, 0.5, 0.5)
    assert (ft.world_size_mode, ft.checkpoint_transport) == ("fixed_with_spares", "pg")


def test_cli_sets_fields_and_bool_flag_pairs() -> None:
    ft = parse_job_config(
        [
            "--fault_tolerance.enable",
            "--fault_tolerance.replica_id=1",
            "--fault_tolerance.group_size",
            "2",
            "--fault_tolerance.no-init_sync",
            "--fault_tolerance.lighthouse_addr=http://127.0.0.1:29511",
            "--fault_tolerance.max_retries=3",
        ]
    ).fault_tolerance
    assert (ft.enable, ft.replica_id, ft.group_size, ft.init_sync) == (True, 1, 2, False)
    assert (ft.lighthouse_addr, ft.max_retries) == ("http://127.0.0.1:29511", 3)


def test_cli_overrides_toml_overrides_default(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
        [fault_tolerance]
        step_timeout_ms = 30000
        quorum_timeout_ms = 40000
        """,
    )
    ft = parse_job_config(
        ["--job.config_file", path, "--fault_tolerance.quorum_timeout_ms=50000"]
    ).fault_tolerance
    assert ft.quorum_timeout_ms == 50000  # CLI beats TOML
    assert ft.step_timeout_ms == 30000  # TOML beats default
    assert ft.connect_timeout_ms == 60000  # default


def test_unknown_toml_key_is_named_with_a_hint(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[fault_tolerance]\nreplica_ids = 1\n")
    with pytest.raises(ConfigError, match=r"'fault_tolerance.replica_ids'.*replica_id\?"):
        parse_job_config(["--job.config_file", path])


def test_unknown_toml_section_is_named(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[fault_tolerence]\nenable = true\n")
    with pytest.raises(ConfigError, match=r"'fault_tolerence'.*fault_tolerance"):
        parse_job_config(["--job.config_file", path])


def test_unknown_cli_flag_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_job_config(["--fault_tolerance.replica_ids=1"])
    assert exit_info.value.code == 2
    assert "replica_ids" in capsys.readouterr().err.replace("-", "_")


def test_bad_cli_choice_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_job_config(["--fault_tolerance.quorum_mode=sometimes"])
    assert "sometimes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('quorum_mode = "sometimes"', r"fault_tolerance.quorum_mode='sometimes'.*'async', 'sync'"),
        ('group_size = "two"', r"fault_tolerance.group_size='two'.*an integer"),
        ("init_sync = 1", r"fault_tolerance.init_sync=1.*a boolean"),
        ('semi_sync_method = "DiLoCo"', r"semi_sync_method='DiLoCo'.*'diloco'"),
    ],
)
def test_bad_toml_value_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = _toml(tmp_path, f"[fault_tolerance]\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        parse_job_config(["--job.config_file", path])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fault_tolerance.fragment_update_alpha=1.5"], r"fragment_update_alpha=1.5.*\[0, 1\]"),
        (["--fault_tolerance.sync_steps=0"], r"sync_steps=0 must be >= 1"),
        (["--fault_tolerance.max_retries=-1"], r"max_retries=-1"),
        (["--fault_tolerance.enable"], r"group_size must be set"),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.replica_id=2",
            ],
            r"replica_id=2 must be < fault_tolerance.group_size=2",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.min_replica_size=3",
            ],
            r"min_replica_size=3 must be <= fault_tolerance.group_size=2",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.semi_sync_method=local_sgd",
            ],
            r"semi_sync_method='local_sgd' needs fault_tolerance.quorum_mode='sync'",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--parallelism.data_parallel_replicate_degree=2",
            ],
            r"data_parallel_replicate_degree=2 must be 1",
        ),
    ],
)
def test_bad_values_give_one_clear_error(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_job_config(args)


def test_timeout_order_names_the_value_to_raise() -> None:
    ft = FaultTolerance(enable=True, group_size=2, process_group_timeout_ms=90000)
    with pytest.raises(
        ConfigError, match=r"raise fault_tolerance.step_timeout_ms to at least 90000"
    ):
        check_timeout_order(ft)
    ft = FaultTolerance(enable=True, group_size=2, connect_timeout_ms=5000, quorum_timeout_ms=1000)
    with pytest.raises(
        ConfigError, match=r"raise fault_tolerance.quorum_timeout_ms to at least 5000"
    ):
        validate_fault_tolerance(ft)


def test_timeout_order_only_checked_when_enabled() -> None:
    validate_fault_tolerance(FaultTolerance(process_group_timeout_ms=90000))
    with pytest.raises(ConfigError, match="step_timeout_ms"):
        parse_job_config(
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.process_group_timeout_ms=90000",
            ]
        )


def test_entry_point_reports_config_error_before_any_process_group() -> None:
    import torch.distributed as dist

    from torchtitan_ft.train import main

    with pytest.raises(SystemExit, match=r"config error: fault_tolerance\.group_size must be set"):
        main(["--fault_tolerance.enable"])
    assert not dist.is_initialized()
