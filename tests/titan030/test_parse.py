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
    runnable_here(parsed, cuda=False, ranks=1, log=lines.append)
    config = parsed.config
    assert config.dataloader.dataset == "ft_corpus"
    assert config.validator.dataloader.dataset == "ft_corpus_validation"
    assert config.hf_assets_path.endswith("torchtitan_ft/assets/tokenizer")
    assert len(lines) == 4  # tokenizer, two corpora, attention: one line each


def test_what_the_user_set_is_not_changed() -> None:
    parsed = parse([*REGISTRY, "--dataloader.dataset=c4_test"], Config)
    lines: list[str] = []
    runnable_here(parsed, cuda=True, ranks=1, log=lines.append)
    assert parsed.config.dataloader.dataset == "c4_test"
    assert not any("dataloader.dataset=" in line and "validator" not in line for line in lines)


# --- a TOML file over the registry config (releases/v0_3/toml_config.py) -----------------------

import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

from torchtitan_ft.titan.config_cli import check_toml_values  # noqa: E402
from torchtitan_ft.titan.preflight import validate_job_config  # noqa: E402
from torchtitan_ft.titan.releases.v0_3.toml_config import translate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _toml(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def parse_and_check(args: list[str]) -> object:
    """What the 0.3.0 entry point does before the trainer: parse, then the 0.2.2 checks."""
    config = parse(args, Config).config
    validate_job_config(config)
    return config


@pytest.mark.parametrize(
    ("toml", "values", "moved"),
    [
        ({"job": {"dump_folder": "o"}}, {"dump_folder": "o"}, [("job.dump_folder", "dump_folder")]),
        (
            {"training": {"dataset": "d", "steps": 3}},
            {"dataloader": {"dataset": "d"}, "training": {"steps": 3}},
            [("training.dataset", "dataloader.dataset")],
        ),
        (
            {"profiling": {"profile_freq": 5}},
            {"profiler": {"profile_freq": 5}},
            [("profiling.profile_freq", "profiler.profile_freq")],
        ),
        (
            {"validation": {"enable": True, "dataset": "v"}},
            {"validator": {"enable": True, "dataloader": {"dataset": "v"}}},
            [
                ("validation.enable", "validator.enable"),
                ("validation.dataset", "validator.dataloader.dataset"),
            ],
        ),
        ({"dataloader": {"dataset": "d"}}, {"dataloader": {"dataset": "d"}}, []),  # 0.3.0's own
        ({"fault_tolerance": {"group_size": 2}}, {"fault_tolerance": {"group_size": 2}}, []),
        ({"job": {"description": "x"}}, {}, []),
    ],
)
def test_toml_keys_are_read_at_their_0_3_0_place(toml: dict, values: dict, moved: list) -> None:
    translated = translate(toml)
    assert translated.values == values
    assert list(translated.moved) == moved


def test_toml_model_names_the_registry_config() -> None:
    assert translate({"model": {"name": "llama3", "flavor": "8B"}}).registry == (
        "llama3",
        "llama3_8b",
    )
    with pytest.raises(ConfigError, match=r"name and flavor go together"):
        translate({"model": {"name": "llama3"}})


@pytest.mark.parametrize(
    ("toml", "key", "instead"),
    [
        ({"model": {"converters": ["float8"]}}, "model.converters", "llama3_debugmodel_float8"),
        ({"float8": {"recipe_name": "x"}}, "float8.recipe_name", "float8 converters"),
        ({"job": {"custom_config_module": "m"}}, "job.custom_config_module", "--module"),
        ({"job": {"print_args": True}}, "job.print_args", "debug.print_config"),
        ({"experimental": {"custom_import": "m"}}, "experimental.custom_import", "override"),
        ({"model": {"tokenizer_path": "t"}}, "model.tokenizer_path", "hf_assets_path"),
        (
            {"activation_checkpoint": {"selective_ac_option": "2"}},
            "activation_checkpoint.selective_ac_option",
            "per-op only",
        ),
    ],
)
def test_0_2_2_keys_without_a_0_3_0_place_are_one_line(toml: dict, key: str, instead: str) -> None:
    with pytest.raises(ConfigError) as e:
        translate(toml)
    message = str(e.value)
    assert "\n" not in message and repr(key) in message and instead in message, message


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.toml")))
def test_every_repository_config_parses_on_0_3_0(name: str) -> None:
    # llama3_ft_debug_cpu.toml leaves group_size to the command line (its header says so)
    toml = str(ROOT / "configs" / name)
    parsed = parse(["--job.config_file", toml, "--fault_tolerance.group_size=2"], Config)
    config = parsed.config
    validate_job_config(config)
    assert config.dataloader.dataset in ("ft_corpus", "c4")
    assert config.fault_tolerance.enable is name.startswith(("debug_ft", "llama3"))
    assert parsed.notes[0].startswith("torchtitan_ft: config: registry config llama3/")


def test_toml_over_registry_and_flags_over_toml(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        """
        dump_folder = "out"
        [training]
        steps = 7
        seq_len = 128
        [optimizer]
        lr = 1e-3
        beta2 = 0.99
        [activation_checkpoint]
        mode = "full"
        [fault_tolerance]
        enable = true
        group_size = 3
        """,
    )
    parsed = parse(
        [
            *REGISTRY,
            "--job.config_file",
            path,
            "--training.steps=3",
            "--fault_tolerance.group_size=2",
        ],
        Config,
    )
    config = parsed.config
    assert (config.training.steps, config.training.seq_len) == (3, 128)  # flag, TOML
    assert config.training.local_batch_size == 8  # the registry's
    assert config.dump_folder == "out"
    group = config.optimizer.param_groups[0]
    assert group.optimizer_kwargs["lr"] == 1e-3 and group.optimizer_kwargs["betas"] == (0.9, 0.99)
    assert type(config.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert (config.fault_tolerance.enable, config.fault_tolerance.group_size) == (True, 2)
    assert config.fault_tolerance.explicit_fields == {"enable", "group_size"}
    assert {"training.seq_len", "training.steps", "dump_folder"} <= parsed.explicit


def test_last_config_file_wins_and_none_mode_turns_checkpointing_off(tmp_path: Path) -> None:
    first = _toml(tmp_path, "[training]\nsteps = 5\n", "a.toml")
    second = _toml(tmp_path, '[training]\nsteps = 6\n[activation_checkpoint]\nmode = "none"\n')
    config = parse(["--job.config_file", first, "--job.config_file", second], Config).config
    assert config.training.steps == 6 and config.activation_checkpoint is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # the fault_tolerance section: 0.2.2's readers and checks (tests/titan/test_config.py)
        (
            "[fault_tolerance]\ngrup_size = 2",
            r"unknown config key 'fault_tolerance.grup_size'; "
            r"did you mean fault_tolerance.group_size\?",
        ),
        (
            '[fault_tolerance]\nquorum_mode = "sometimes"',
            r"fault_tolerance.quorum_mode='sometimes'.*'async', 'sync'",
        ),
        ('[fault_tolerance]\ngroup_size = "two"', r"fault_tolerance.group_size='two'.*an integer"),
        ("[fault_tolerance]\ninit_sync = 1", r"fault_tolerance.init_sync=1.*a boolean"),
        (
            '[fault_tolerance]\nsemi_sync_method = "DiLoCoo"',
            r"semi_sync_method='DiLoCoo'.*'diloco'.*any case",
        ),
        ("[fault_tolerance]\nsync_steps = 0", r"sync_steps=0 must be >= 1"),
        ("fault_tolerance = 3", r"fault_tolerance must be a table \(\[fault_tolerance\]\)"),
        # the 0.3.0 sections, in the same words
        ('[training]\nsteps = "ten"', r"training.steps='ten' is invalid: expected an integer"),
        (
            "[training]\nseq_lenn = 5",
            r"unknown config key 'training.seq_lenn'; did you mean "
            r"training.seq_len\?",
        ),
        ("training = 3", r"training must be a table \(\[training\]\)"),
        ("[dataloader]\ndataset = 3", r"dataloader.dataset=3 is invalid: expected a string"),
        ('[activation_checkpoint]\nmode = "some"', r"activation_checkpoint.mode='some'.*'none'"),
        ('[optimizer]\nlr = "x"', r"optimizer.lr='x' is invalid: expected a number"),
        ("[optimizer]\nbeta3 = 1", r"unknown config key 'optimizer.beta3'"),
        ('[model]\nname = "llama3"\nflavor = "nope"', r"llama3_nope"),
        ('[model]\nname = "llama3"\nflavor = 8', r"model.flavor=8 is invalid: expected a string"),
        (
            '[activation_checkpoint]\nmode = "none"\ndebug = true',
            r"\[activation_checkpoint\] sets fields of what the config leaves unset",
        ),
        ("[training.steps]\nx = 1", r"training.steps is a value, not a table"),
    ],
)
def test_bad_toml_is_one_line_naming_file_key_and_expected(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _toml(tmp_path, text + "\n")
    with pytest.raises(ConfigError, match=message) as e:
        parse_and_check(["--job.config_file", path])
    assert "\n" not in str(e.value)


def test_fault_tolerance_errors_are_0_2_2_readers_word_for_word(tmp_path: Path) -> None:
    section = {"group_size": "two"}
    with pytest.raises(ConfigError) as ours:
        parse(
            ["--job.config_file", _toml(tmp_path, '[fault_tolerance]\ngroup_size = "two"\n')],
            Config,
        )
    with pytest.raises(ConfigError) as reader:
        check_toml_values(section, FaultTolerance, "fault_tolerance.")
    assert str(ours.value).endswith(f": {reader.value}")


def test_missing_toml_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--job.config_file 'nope.toml'.*does not exist"):
        parse(["--job.config_file", "nope.toml"], Config)


def test_a_profiler_cycle_shorter_than_warmup_and_active_stops_the_entry_point(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """0.3.0 keeps the profiler's fields in ``profiler`` and asserts the same relation as
    0.2.2 when it builds the profiler; the entry point says it first, in one line."""
    import torch.distributed as dist

    from torchtitan_ft.titan.releases.v0_3.trainer import main

    with pytest.raises(SystemExit) as stop:
        main([*REGISTRY, "--profiler.enable_profiling", "--profiler.profile_freq=3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "torchtitan_ft: config error: profiler.profile_freq=3 is shorter than "
        "profiler.profiler_warmup + profiler.profiler_active = 3 + 1: expected profile_freq >= 4"
    ), err
    assert err.count("\n") == 1
    assert not dist.is_initialized()
