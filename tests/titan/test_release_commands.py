"""run_train.sh's choice of trainer module on TorchTitan 0.3.0 (torchtitan_ft/titan/releases/
commands.py), as tables: pure, so they run beside either release (the commands themselves run
on 0.3.0 in tests/titan030/test_doc_commands.py)."""

import re
import shlex

import pytest

from torchtitan_ft.titan.releases.commands import (
    TITAN_TRAINER_0_3,
    config_module,
    form_on_0_3,
    needs_torchft,
    old_name_problem,
    torchft_problem,
    train_file_problem,
    trainer_module,
)

FT_TRAIN = "torchtitan.experiments.ft.train"
DOC_ARGS = ["--fault_tolerance.enable", "--fault_tolerance.replica_id=0"]
PER_STEP = ["--fault_tolerance.semi_sync_method", "None"]


@pytest.mark.parametrize(
    ("module", "needs"),
    [
        ("torchft.llama3", True),
        ("torchtitan.experiments.torchft.llama3", True),
        ("llama3", False),
        ("torchtitan.models.llama3", False),
        (None, False),
    ],
)
def test_which_registry_modules_need_torchft(module: str | None, needs: bool) -> None:
    assert needs_torchft(module) is needs


@pytest.mark.parametrize(
    ("args", "env", "module"),
    [
        (["--module", "a", "--module=b"], {}, "b"),
        ([], {"MODULE": "m", "MODEL": "x"}, "m"),
        ([], {"MODEL": "x"}, "x"),
        (["--module", "a"], {"MODULE": "m"}, "a"),  # after run_train.sh's, so it wins
        ([], {}, None),
    ],
)
def test_config_module(args: list[str], env: dict[str, str], module: str | None) -> None:
    assert config_module(args, env) == module


@pytest.mark.parametrize(
    ("env", "extra"),
    [
        ({"MODEL": "llama3_ft", "CONFIG": "llama3_ft_debugmodel"}, []),  # DiLoCo in both
        ({"MODULE": "torchft.llama3"}, []),
        ({"MODEL": "llama3", "CONFIG": "llama3_8B"}, PER_STEP),
        ({}, PER_STEP),  # 0.2.x's default config: per-step
    ],
)
def test_the_0_3_0_form_is_titans_ft_config_with_the_same_arguments(
    env: dict[str, str], extra: list[str]
) -> None:
    words = shlex.split(form_on_0_3({**env, "NGPU": "4", "OTHER": "x"}, DOC_ARGS))
    assert words == [
        "MODULE=torchft.llama3",
        "CONFIG=llama3_torchft_debugmodel",
        "NGPU=4",
        "./run_train.sh",
        *DOC_ARGS,
        *extra,
    ]


@pytest.mark.parametrize(
    ("train_file", "env", "expected"),
    [
        (FT_TRAIN, {"CONFIG": "llama3_ft_debugmodel"}, "the 0.3.0 form of this command is `"),
        (FT_TRAIN, {"CONFIG": "llama3_8B"}, "has the debug model, not llama3_8B"),
        ("torchtitan.experiments.forge.train", {}, "not a TorchTitan 0.3.0 entry point"),
        ("torchtitan.train", {}, None),
        ("torchtitan_ft.titan.train", {}, None),
        ("my_trainer", {}, None),
    ],
)
def test_train_file_problems(train_file: str, env: dict[str, str], expected: str | None) -> None:
    problem = train_file_problem(train_file, env, DOC_ARGS)
    if expected is None:
        assert problem is None
    else:
        assert problem and expected in problem and "\n" not in problem


def test_without_a_torchft_a_titan_ft_config_says_how_to_run() -> None:
    line = torchft_problem("torchft.llama3", "no torchft package is installed")
    assert line and "scripts/install_torchft_compat.sh" in line and "--module llama3" in line
    assert torchft_problem("torchft.llama3", None) is None
    assert torchft_problem("llama3", "no torchft package is installed") is None


def test_torchtitan_train_runs_through_the_titan_trainer_wrapper() -> None:
    assert trainer_module("torchtitan.train") == TITAN_TRAINER_0_3
    assert trainer_module("torchtitan_ft.titan.train") == "torchtitan_ft.titan.train"


HEADER_ARGS = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]


@pytest.mark.parametrize("module", ["llama3_ft", "ft.llama3", "LLAMA3_FT"])
def test_a_0_2_name_of_the_ft_debug_model_gives_its_0_3_0_commands(module: str) -> None:
    """configs/llama3_ft_debug_cpu.toml's start command (MODEL=llama3_ft ...) stopped each
    worker with TorchTitan 0.3.0's "Cannot import module 'llama3_ft'"."""
    line = old_name_problem(module, {}, [*HEADER_ARGS, "--module", module, "--config=x"])
    assert line and "\n" not in line and repr(module) in line
    ours, titans = re.findall(r"`([^`]*)`", line)
    assert shlex.split(ours) == [
        "CONFIG_FILE=configs/llama3_ft_debug_cpu.toml", "./run_train.sh",
        "--module", "llama3", "--config", "llama3_debugmodel", *HEADER_ARGS,
    ]  # fmt: skip
    assert shlex.split(titans) == [
        "MODULE=torchft.llama3", "CONFIG=llama3_torchft_debugmodel", "./run_train.sh",
        *HEADER_ARGS,
    ]  # fmt: skip


def test_a_config_file_given_stays_in_the_0_3_0_command() -> None:
    line = old_name_problem("llama3_ft", {"CONFIG_FILE": "mine.toml"}, HEADER_ARGS)
    assert line and "`CONFIG_FILE=mine.toml ./run_train.sh --module llama3" in line


@pytest.mark.parametrize("module", [None, "llama3", "torchft.llama3", "my.models"])
def test_other_config_modules_run(module: str | None) -> None:
    assert old_name_problem(module, {}, HEADER_ARGS) is None
