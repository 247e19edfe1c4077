"""The extended ``fault_tolerance`` section: TOML, CLI, precedence, and one clear error."""

import json
import re
import textwrap
from pathlib import Path

import pytest

from torchtitan_ft.semi_sync.config import QuorumMode, SyncMethod
from torchtitan_ft.titan.config import (
    ConfigError,
    FaultTolerance,
    JobConfig,
    check_heal_interfaces,
    check_lighthouse_addr,
    check_local_address,
    check_local_paths,
    check_process_group_kind,
    check_profiler_schedule,
    check_timeout_order,
    parse_job,
    parse_job_config,
    quorum_mode,
    sync_method,
    trainer_job_config,
    validate_fault_tolerance,
)

ROOT = Path(__file__).resolve().parents[2]


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_are_valid_and_ft_off() -> None:
    config = parse_job_config([])
    assert isinstance(config, JobConfig)
    assert isinstance(config.fault_tolerance, FaultTolerance)
    assert config.fault_tolerance.enable is False
    assert config.fault_tolerance.semi_sync_method is None  # TorchTitan's "no method"
    assert config.fault_tolerance.quorum_mode is None
    assert quorum_mode(config.fault_tolerance) is QuorumMode.ASYNC


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--fault_tolerance.quorum_mode=bogus"],
            "--fault_tolerance.quorum_mode='bogus' is invalid: "
            "expected one of 'async', 'sync' or None",
        ),
        (
            ["--fault_tolerance.group_size", "abc"],
            "--fault_tolerance.group_size='abc' is invalid: expected an integer",
        ),
        (
            ["--fault_tolerance.max_retries=x"],
            "--fault_tolerance.max_retries='x' is invalid: expected an integer or None",
        ),
        (
            ["--fault_tolerance.group_size"],
            "--fault_tolerance.group_size needs a value: expected an integer",
        ),
        (
            ["--fault_tolerance.enable=true"],
            "--fault_tolerance.enable is a flag and takes no value: write "
            "--fault_tolerance.enable or --fault_tolerance.no-enable",
        ),
        (
            ["--fault_tolerance.replica_ids=1"],
            "unknown flag --fault_tolerance.replica_ids; "
            "did you mean --fault_tolerance.replica_id?",
        ),
        (
            ["--fault-tolerence.enable"],
            "unknown flag --fault-tolerence.enable; did you mean --fault_tolerance.enable?",
        ),
        (["--training.steps=ten"], "--training.steps='ten' is invalid: expected an integer"),
        (["--optimizer.lr=fast"], "--optimizer.lr='fast' is invalid: expected a number"),
        (
            ["--compile.components", "model", "loss"],
            "unexpected argument 'loss' after --compile.components model: options are "
            "--section.field=value, and a list is one comma-separated value",
        ),
        (["steps=3"], "unexpected argument 'steps=3': options are --section.field=value"),
    ],
)
def test_bad_cli_flag_is_one_config_error(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_job_config(args)
    assert str(error.value).startswith(message), str(error.value)


def test_cli_error_only_tyro_finds_is_still_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistake the check before tyro lets through: tyro's own box, squeezed into one line."""
    from torchtitan_ft.titan import config_cli

    monkeypatch.setattr(config_cli, "check_cli_args", lambda args, classes: None)
    with pytest.raises(ConfigError) as error:
        parse_job_config(["--fault_tolerance.group_size", "abc"])
    message = str(error.value)
    assert message.startswith("invalid command line: "), message
    assert "--fault-tolerance.group-size" in message and "'abc'" in message, message
    assert "\n" not in message and "helptext" not in message, message
    assert capsys.readouterr().err == ""  # tyro's box was not printed


def test_good_cli_spellings_parse() -> None:
    config = parse_job_config(
        [
            "--fault-tolerance.group-size=3",
            "--fault_tolerance.no-init_sync",
            "--fault_tolerance.no_outer_nesterov",
            "--fault_tolerance.max_retries=None",
            "--fault_tolerance.replica_id",
            "1",
            "--optimizer.lr=1e-3",
            "--debug.seed",
            "-1",
            "--job.print_config",
            "--parallelism.fsdp_reshard_after_forward=never",
            "--compile.components",
            "model,loss",
            "--parallelism.data_parallel_shard_degree",
            "-1",
        ]
    )
    ft = config.fault_tolerance
    assert (ft.group_size, ft.init_sync, ft.outer_nesterov) == (3, False, False)
    assert (ft.max_retries, ft.replica_id) == (None, 1)
    assert (config.optimizer.lr, config.debug.seed) == (1e-3, -1)
    assert config.parallelism.fsdp_reshard_after_forward == "never"
    assert config.compile.components == ["model", "loss"]
    assert config.parallelism.data_parallel_shard_degree == -1


def test_flags_of_a_custom_config_module_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TorchTitan merges ``--job.custom_config_module``'s JobConfig into the parser: its flags
    are known, and a bad value of any flag is still one line."""
    (tmp_path / "my_custom_config.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass, field

            @dataclass
            class Custom:
                flag: int = 0

            @dataclass
            class FaultTolerance:
                extra: str = ""

            @dataclass
            class JobConfig:
                custom: Custom = field(default_factory=Custom)
                fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = ["--job.custom_config_module=my_custom_config"]
    config = parse_job_config([*module, "--custom.flag=1", "--fault_tolerance.extra=x"])
    assert (config.custom.flag, config.fault_tolerance.extra) == (1, "x")
    with pytest.raises(ConfigError, match=r"--custom.flag='x' is invalid: expected an integer"):
        parse_job_config([*module, "--custom.flag=x"])


@pytest.mark.parametrize(
    "entry",
    [
        "torchtitan_ft.titan.train",
        # The default tier runs the old name in test_user_errors.py's
        # test_trainer_outside_torchrun_is_one_line.
        pytest.param("torchtitan_ft.train", marks=pytest.mark.slow),
    ],
)
def test_bad_cli_value_exits_with_one_line(entry: str) -> None:
    """Through the entry point (and its old name), in a subprocess: nothing but the one line,
    exit status 2."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", entry, "--fault_tolerance.quorum_mode=bogus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "torchtitan_ft: config error: --fault_tolerance.quorum_mode='bogus' is invalid: "
        "expected one of 'async', 'sync' or None\n"
    )


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=rf"--job.config_file '{missing}' does not exist: pass"):
        parse_job_config(["--job.config_file", missing])
    with pytest.raises(
        ConfigError,
        match=r"--job.config_file 'nope.toml' \(from the working directory .*\) does not exist",
    ):
        parse_job_config(["--job.config_file=nope.toml"])
    with pytest.raises(ConfigError, match=r"--job.config_file '.*' cannot be read: Is a directory"):
        parse_job_config([f"--job.config_file={tmp_path}"])


def test_last_config_file_wins(tmp_path: Path) -> None:
    """run_train.sh passes CONFIG_FILE first; a user's own --job.config_file comes later."""
    first = _toml(tmp_path, "[training]\nsteps = 3\n")
    second = tmp_path / "second.toml"
    second.write_text("[training]\nsteps = 7\n")
    for args in (
        ["--job.config_file", first, "--job.config_file", str(second)],
        [f"--job.config_file={first}", f"--job.config-file={second}"],
    ):
        config = parse_job_config(args)
        assert (config.training.steps, config.job.config_file) == (7, str(second))
    assert (
        parse_job_config(["--job.config_file", str(second), "--training.steps=9"]).training.steps
        == 9
    )


def test_malformed_config_file_names_line_and_column(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[training]\nsteps = 10\n[fault_tolerance\nenable = true\n")
    with pytest.raises(ConfigError) as error:
        parse_job_config(["--job.config_file", path])
    message = str(error.value)
    assert message.startswith(f"--job.config_file {path!r} is not valid TOML: ")
    assert "(at line 3, column 17)" in message, message


def test_non_utf8_config_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[job]\ndescription = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_job_config(["--job.config_file", str(path)])


def test_bad_value_in_any_toml_section_is_named(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[training]\nsteps = "ten"\n')
    with pytest.raises(
        ConfigError, match=r"job.toml: training.steps='ten' is invalid: expected an integer"
    ):
        parse_job_config(["--job.config_file", path])
    path = _toml(tmp_path, "training = 3\n")
    with pytest.raises(ConfigError, match=r"training must be a table \(\[training\]\)"):
        parse_job_config(["--job.config_file", path])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('quorum_mode = "sometimes"', r"fault_tolerance.quorum_mode='sometimes'.*'async', 'sync'"),
        ('group_size = "two"', r"fault_tolerance.group_size='two'.*an integer"),
        ("init_sync = 1", r"fault_tolerance.init_sync=1.*a boolean"),
        ('semi_sync_method = "DiLoCoo"', r"semi_sync_method='DiLoCoo'.*'diloco'.*any case"),
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
        (["--fault_tolerance.outer_lr=inf"], r"outer_lr=inf must be a finite number > 0"),
        (["--fault_tolerance.outer_lr=nan"], r"outer_lr=nan must be a finite number > 0"),
        (
            ["--fault_tolerance.step_timeout_ms=100000000000000000"],
            r"step_timeout_ms=100000000000000000 must be > 0 and <= 604800000 \(7 days\)",
        ),
        (["--fault_tolerance.connect_timeout_ms=0"], r"connect_timeout_ms=0 must be > 0"),
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
                "--fault_tolerance.quorum_mode=async",
            ],
            r"semi_sync_method='local_sgd' needs a synchronous quorum.*got 'async'",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--parallelism.data_parallel_replicate_degree=2",
            ],
            r"data_parallel_replicate_degree=2 must be 1",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=2",
                "--fault_tolerance.retry_inflight_allreduce",
            ],
            r"retry_inflight_allreduce=true is not supported with TorchTitan: .*FSDP",
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


def test_entry_point_reports_config_error_before_any_process_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    with pytest.raises(SystemExit) as stop:
        main(["--fault_tolerance.enable"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(
        "torchtitan_ft: config error: fault_tolerance.group_size must be set"
    )
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("ft", "env", "message"),
    [
        (
            FaultTolerance(enable=True, group_size=1, lighthouse_addr="localhost:29510"),
            {},
            r"fault_tolerance.lighthouse_addr='localhost:29510' is not a lighthouse URL: "
            r"expected http://host:port",
        ),
        (
            FaultTolerance(enable=True, group_size=1, lighthouse_addr="http://host"),
            {},
            "lighthouse_addr='http://host' is not a lighthouse URL",
        ),
        (
            FaultTolerance(enable=True, group_size=1),
            {"TORCHFT_LIGHTHOUSE": "lighthouse:29510"},
            r"env TORCHFT_LIGHTHOUSE \(as fault_tolerance.lighthouse_addr is empty\)="
            r"'lighthouse:29510' is not a lighthouse URL",
        ),
    ],
)
def test_malformed_lighthouse_url_is_named(ft, env, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_lighthouse_addr(ft, env)


@pytest.mark.parametrize(
    ("fields", "native", "message"),
    [
        ({}, False, None),  # "rebuilt", the default, on any torch
        (
            {"process_group_kind": "native", "process_group_store": "h:1"},
            False,
            r"process_group_kind='native' needs torch>=2.14 \(enable_reconfigure\); torch "
            r"2.13.0 is installed: use 'rebuilt'",
        ),
        (
            {"process_group_kind": "native", "process_group": "nccl", "process_group_store": "h:1"},
            True,
            r"process_group='nccl': set it to 'gloo'",
        ),
        ({"process_group_kind": "native"}, True, r"process_group_store='' must be the host:port"),
        (
            {"process_group_kind": "native", "process_group_store": "h"},
            True,
            r"process_group_store='h' must be the host:port",
        ),
        ({"process_group_kind": "native", "process_group_store": "h:29600"}, True, None),
    ],
)
def test_native_process_group_kind_needs_torch_gloo_and_a_store(
    fields: dict, native: bool, message: str | None
) -> None:
    ft = FaultTolerance(enable=True, group_size=1, **fields)
    if message is None:
        check_process_group_kind(ft, native, "2.13.0")
    else:
        with pytest.raises(ConfigError, match=message):
            check_process_group_kind(ft, native, "2.13.0")


def test_good_lighthouse_urls_pass() -> None:
    ft = FaultTolerance(enable=True, group_size=1, lighthouse_addr="http://10.0.0.5:29510")
    check_lighthouse_addr(ft, {"TORCHFT_LIGHTHOUSE": "garbage"})  # the explicit value wins
    check_lighthouse_addr(FaultTolerance(enable=True, group_size=1), {})  # default URL


def test_malformed_lighthouse_url_stops_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="is not a lighthouse URL"):
        parse_job_config(
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size=1",
                "--fault_tolerance.lighthouse_addr=127.0.0.1:29510",
            ]
        )


def test_tokenizer_directory_is_checked_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = parse_job_config(["--job.config_file", str(ROOT / "configs" / "debug_ft_cpu.toml")])
    monkeypatch.chdir(ROOT)
    check_local_paths(config)  # the shipped configs work from the repository root
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        check_local_paths(config)
    message = str(error.value)
    assert message.startswith(
        f"model.hf_assets_path='./torchtitan_ft/assets/tokenizer' (from the working directory "
        f"{tmp_path}) is not a directory: put the model's tokenizer (tokenizer.json) there"
    ), message
    (tmp_path / "empty").mkdir()
    config.model.hf_assets_path = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"holds no tokenizer\.json / vocab\.json / vocab\.txt"):
        check_local_paths(config)
    config.model.hf_assets_path = str(ROOT / "torchtitan_ft" / "assets" / "tokenizer")
    check_local_paths(config)  # an absolute path works from anywhere


def test_unknown_model_is_named() -> None:
    config = parse_job_config(["--model.name=llama9"])
    with pytest.raises(
        ConfigError, match=r"model.name='llama9' is not a registered model.*'llama3'"
    ):
        check_local_paths(config)


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("debug*.toml")))
def test_shipped_debug_configs_find_their_tokenizer(
    config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # where run_train.sh is started from
    check_local_paths(parse_job_config(["--job.config_file", str(ROOT / "configs" / config)]))


def test_missing_tokenizer_stops_the_entry_point_before_any_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    with pytest.raises(SystemExit) as stop:
        main([f"--model.hf_assets_path={tmp_path / 'missing'}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert re.match(r"torchtitan_ft: config error: model.hf_assets_path=.* is not a directory", err)
    assert not dist.is_initialized()


def _entry_point_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """What the entry point prints to stderr when ``args`` stop it with exit status 2, before
    any process group exists."""
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert not dist.is_initialized()
    return capsys.readouterr().err


def test_a_profiler_cycle_shorter_than_warmup_and_active_stops_the_entry_point(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TorchTitan asserts ``profile_freq >= warmup + active`` only when it builds the profiler,
    after the process groups exist; the entry point says it first, in one line."""
    profiling = ["--profiling.enable_profiling", "--profiling.profile_freq=2"]
    warmup = ["--profiling.profiler_warmup=3", "--profiling.profiler_active=1"]
    assert _entry_point_error(capsys, [*profiling, *warmup]) == (
        "torchtitan_ft: config error: profiling.profile_freq=2 is shorter than "
        "profiling.profiler_warmup + profiling.profiler_active = 3 + 1: expected profile_freq "
        ">= 4 (each cycle of profile_freq steps waits, warms up, then traces), or fewer warm-up "
        "steps, e.g. --profiling.profiler_warmup=1\n"
    )
    for flags in ([*profiling, "--profiling.profiler_warmup=1"], ["--profiling.profile_freq=1"]):
        check_profiler_schedule(parse_job_config(flags).profiling, "profiling")  # fits, or off


def test_hostname_of_another_machine_stops_the_entry_point_with_the_address_to_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size=1"]
    lighthouse = "--fault_tolerance.lighthouse_addr=http://127.0.0.1:29510"
    hostname = "--fault_tolerance.hostname=192.0.2.77"  # TEST-NET-1
    assert _entry_point_error(capsys, [*ft, lighthouse, hostname]) == (
        "torchtitan_ft: config error: fault_tolerance.hostname='192.0.2.77' resolves to "
        "192.0.2.77, which is not an address of this host; the other replica groups dial it "
        "and this group's servers listen on it: set it to an address of this host (e.g. "
        "127.0.0.1, this host's address towards the lighthouse at http://127.0.0.1:29510)\n"
    )
    for hostname in ("127.0.0.1", ""):  # unset: this machine's name, an address of it
        check_local_address(parse_job_config([*ft, f"--fault_tolerance.hostname={hostname}"]))
    check_local_address(parse_job_config(["--fault_tolerance.hostname=192.0.2.77"]))  # FT off


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--fault_tolerance.heal_interfaces=lo,ib7"], {}),
        ([], {"TORCHFT_HEAL_INTERFACES": "ib7"}),
    ],
)
def test_a_pinned_heal_interface_that_does_not_exist_stops_at_start_in_one_line(
    flags: list[str], env: dict[str, str]
) -> None:
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size=1"]
    config = parse_job_config([*ft, "--fault_tolerance.hostname=127.0.0.1", *flags])
    with pytest.raises(ConfigError) as error:
        check_heal_interfaces(config.fault_tolerance, env)
    message = str(error.value)
    assert message.startswith("heal interface 'ib7' does not exist on this host (its interfaces: ")
    assert "lo" in message and "\n" not in message
    # the field wins over the variable; existing interfaces pass
    fine = parse_job_config([*ft, "--fault_tolerance.heal_interfaces=lo"])
    check_heal_interfaces(fine.fault_tolerance, {"TORCHFT_HEAL_INTERFACES": "ib7"})
    with pytest.raises(ConfigError, match="TORCHFT_HEAL_INTERFACES must name network"):
        check_heal_interfaces(
            parse_job_config(ft).fault_tolerance, {"TORCHFT_HEAL_INTERFACES": "a b"}
        )


# --- TorchTitan's FT doc: semi-sync spelling, fragments, global batch ------------------------

FT_ON = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]


@pytest.mark.parametrize(
    ("given", "method"),
    [("diloco", "diloco"), ("DiLoCo", "diloco"), ("LOCAL_SGD", "local_sgd"), ("None", None)],
)
def test_semi_sync_method_is_case_insensitive_and_implies_a_sync_quorum(
    given: str, method: str | None
) -> None:
    ft = parse_job_config([*FT_ON, f"--fault_tolerance.semi_sync_method={given}"]).fault_tolerance
    assert ft.semi_sync_method == (None if given == "None" else given)  # as the user wrote it
    assert sync_method(ft) is (SyncMethod(method) if method else SyncMethod.PER_STEP)
    assert quorum_mode(ft) is (QuorumMode.ASYNC if method is None else QuorumMode.SYNC)


def test_semi_sync_alone_logs_that_it_implies_a_sync_quorum(caplog) -> None:
    import logging

    config = parse_job_config([*FT_ON, "--fault_tolerance.semi_sync_method=DiLoCo"])
    with caplog.at_level(logging.INFO):
        trainer = trainer_job_config(config, explicit_param_dtype=False, world_size=1)
    assert (
        "FT: derived fault_tolerance.quorum_mode='sync' from fault_tolerance.semi_sync_method="
        "'DiLoCo': semi_sync_method='diloco' implies a synchronous quorum" in caplog.text
    )
    assert config.fault_tolerance.quorum_mode is None  # the user's field is not rewritten
    assert trainer.fault_tolerance.quorum_mode == "sync"


def test_none_in_toml_means_per_step(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[fault_tolerance]\nsemi_sync_method = "none"\n')
    ft = parse_job_config(["--job.config_file", path]).fault_tolerance
    assert sync_method(ft) is SyncMethod.PER_STEP


FRAGMENTS = [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4"]]
LAST = ["layers.5", "norm", "output"]


@pytest.mark.parametrize(
    "value", ["tok_embeddings,layers.0,layers.1,layers.2;layers.3,layers.4;layers.5,norm,output"]
)
def test_fragments_from_the_command_line(value: str) -> None:
    args = [*FT_ON, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=6"]
    for form in (
        [f"--fault_tolerance.module_fqns_per_model_fragment={value}"],
        ["--fault_tolerance.module_fqns_per_model_fragment", json.dumps([*FRAGMENTS, LAST])],
    ):
        ft = parse_job_config([*args, *form]).fault_tolerance
        assert ft.module_fqns_per_model_fragment == [*FRAGMENTS, LAST]
        from torchtitan_ft.titan.config import sync_config

        config = sync_config(ft)
        assert (config.num_fragments, config.fragment_fqns) == (3, [*FRAGMENTS, LAST])


def test_fragments_from_toml_are_checked_against_the_model(tmp_path: Path) -> None:
    from torchtitan_ft.titan.config import check_model_fragments

    body = (
        '[model]\nname = "llama3"\nflavor = "debugmodel"\nhf_assets_path = "x"\n'
        '[fault_tolerance]\nenable = true\ngroup_size = 2\nsemi_sync_method = "diloco"\n'
        "sync_steps = 4\nmodule_fqns_per_model_fragment = "
    )
    good = _toml(tmp_path, body + json.dumps([FRAGMENTS[0], [*FRAGMENTS[1], *LAST]]) + "\n")
    check_model_fragments(parse_job_config(["--job.config_file", good]))
    unknown = _toml(tmp_path, body + json.dumps([["tok_embedding"], ["layers", "norm"]]) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"'tok_embedding'.*top-level modules are "
        r"tok_embeddings, layers, norm, output",
    ):
        check_model_fragments(parse_job_config(["--job.config_file", unknown]))
    gap = _toml(tmp_path, body + json.dumps([FRAGMENTS[0], LAST]) + "\n")
    with pytest.raises(ConfigError, match=r"parameters in no fragment: \['layers.3"):
        check_model_fragments(parse_job_config(["--job.config_file", gap]))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([["a"], []], "non-empty lists of module names"),
        ("a,b", r"expected a list of \(a list of \(a string\)\)"),
    ],
)
def test_bad_fragment_lists_are_named(tmp_path: Path, value, message: str) -> None:
    path = _toml(
        tmp_path, f"[fault_tolerance]\nmodule_fqns_per_model_fragment = {json.dumps(value)}\n"
    )
    with pytest.raises(ConfigError, match=message):
        parse_job_config(["--job.config_file", path])


def test_fragment_count_must_agree_with_num_fragments() -> None:
    with pytest.raises(ConfigError, match=r"defines 2 fragments but .*num_fragments=3"):
        parse_job_config(
            [
                "--fault_tolerance.num_fragments=3",
                "--fault_tolerance.module_fqns_per_model_fragment=a;b",
            ]
        )


def test_global_batch_covers_all_replica_groups(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import logging

    args = [*FT_ON, "--training.local_batch_size=2", "--training.global_batch_size=16"]
    job = parse_job(args)
    with caplog.at_level(logging.INFO):
        trainer = trainer_job_config(job.config, explicit_param_dtype=False, world_size=2)
    assert job.config.training.global_batch_size == 16  # the user's field is not rewritten
    assert trainer.training.global_batch_size == 8  # per group: 2 accumulation steps x 2 x 2
    assert (
        "FT: derived training.global_batch_size=8 from fault_tolerance.group_size=2: "
        "training.global_batch_size=16 covers 2 replica groups: 8 per group = 2 gradient"
    ) in caplog.text
    assert caplog.text.count("FT: derived") == 1
    # FT off: TorchTitan's meaning (the job's own data-parallel ranks) is unchanged.
    off = parse_job_config(["--training.local_batch_size=2", "--training.global_batch_size=16"])
    trainer = trainer_job_config(off, explicit_param_dtype=False, world_size=2)
    assert trainer.training.global_batch_size == 16


@pytest.mark.parametrize(
    ("total", "message"),
    [
        (15, r"global_batch_size=15 covers all 2 replica groups.*multiple"),
        (12, r"6 per replica group .*multiple of training.local_batch_size=2 x 2"),
    ],
)
def test_global_batch_that_does_not_split_is_an_error(total: int, message: str) -> None:
    args = [*FT_ON, "--training.local_batch_size=2", f"--training.global_batch_size={total}"]
    config = parse_job_config(args)
    with pytest.raises(ConfigError, match=message):
        trainer_job_config(config, explicit_param_dtype=False, world_size=2)


@pytest.mark.parametrize(
    ("text", "annotation", "fits"),
    [
        ("3", int, True),
        ("-1", int, True),
        ("3.5", int, False),
        ("1e-3", float, True),
        ("None", int | None, True),
        ("x", int | None, False),
        ("sync", FaultTolerance.__annotations__["quorum_mode"], True),
        ("bogus", FaultTolerance.__annotations__["quorum_mode"], False),
        ("a,b", list[str], True),
        ("a;b", list[list[str]], None),  # a type the check does not know: left to tyro
        ("{}", dict[str, int] | None, None),
    ],
)
def test_command_line_text_is_checked_against_the_field_type(
    text: str, annotation: object, fits: bool | None
) -> None:
    from torchtitan_ft.titan.config_cli import text_fits

    assert text_fits(text, annotation) is fits


def test_the_check_before_tyro_stops_at_help_and_at_types_it_does_not_know() -> None:
    from torchtitan_ft.titan.config_cli import check_cli_args

    check_cli_args(["--help", "--no.such=flag"], [JobConfig])
    check_cli_args(["--fault_tolerance.module_fqns_per_model_fragment", "a;b", "x"], [JobConfig])
    check_cli_args(["--no.such=flag"], [])  # a custom config module that does not import
    with pytest.raises(ConfigError, match=r"unknown flag --no\.such"):
        check_cli_args(["--training.steps=3", "--no.such=flag"], [JobConfig])


def test_the_titan_side_validates_the_sync_config_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parse checks the strategy's settings (before any process group); the replica axis
    builds its own SyncConfig, which checks itself once, when built, and nothing checks it again
    (the strategy's builder included): four checks on this path before."""
    from types import SimpleNamespace

    from torchtitan_ft.semi_sync.config import SyncConfig
    from torchtitan_ft.titan import semi_sync_axis

    calls = []
    validate = SyncConfig.validate
    monkeypatch.setattr(SyncConfig, "validate", lambda self: calls.append(self) or validate(self))
    config = parse_job_config([*FT_ON, "--fault_tolerance.semi_sync_method=diloco"])
    assert len(calls) == 1
    monkeypatch.setattr(
        semi_sync_axis, "build_manager_runtime", lambda _: SimpleNamespace(manager=None)
    )
    axis = semi_sync_axis.build_semi_sync_axis(config)
    assert axis.config.method is SyncMethod.DILOCO
    assert len(calls) == 2 and calls[1] is axis.config


def test_outer_overlap_maps_to_the_sync_config_and_is_checked_with_the_schedule() -> None:
    from torchtitan_ft.semi_sync import OuterOverlap
    from torchtitan_ft.titan.config import sync_config

    args = [*FT_ON, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=4"]
    ft = parse_job_config(args).fault_tolerance
    assert sync_config(ft).outer_overlap is OuterOverlap.NONE
    ft = parse_job_config([*args, "--fault_tolerance.outer_overlap=delayed"]).fault_tolerance
    assert sync_config(ft).outer_overlap is OuterOverlap.DELAYED
    with pytest.raises(ConfigError, match="fragment_sync_delay must be 0 with it, got 1"):
        parse_job_config(
            [
                *args,
                "--fault_tolerance.outer_overlap=delayed",
                "--fault_tolerance.num_fragments=2",
                "--fault_tolerance.fragment_sync_delay=1",
            ]
        )
    ft = parse_job_config([*args, "--fault_tolerance.outer_overlap=eager"]).fault_tolerance
    assert sync_config(ft).outer_overlap is OuterOverlap.EAGER
    with pytest.raises(ConfigError, match="outer_overlap"):
        parse_job_config([*args, "--fault_tolerance.outer_overlap=lazy"])
