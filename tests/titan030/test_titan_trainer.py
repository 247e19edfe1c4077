"""TorchTitan 0.3.0's own trainers on this machine (torchtitan_ft/titan/releases/v0_3/
titan_trainer.py), without processes: which registry configs go to TorchTitan's trainer, and
what is changed for a CPU (the runs: test_torchtitan_ft_trainer.py)."""

import pytest

from torchtitan_ft.titan import releases

if releases.installed_version() != releases.Release.V0_3.value:
    pytest.skip("TorchTitan 0.3.0 only (see conftest.py)", allow_module_level=True)

from torchtitan_ft.titan.releases.v0_3.parse import (
    SPMD_TYPES_CHOSEN,
    SPMD_TYPES_ON_CPU,
    parse,
    runnable_here,
)
from torchtitan_ft.titan.releases.v0_3.titan_trainer import (
    NCCL_ON_CPU,
    gloo_for_nccl,
    mccl_problem,
    trainer_line,
    wants_titan_trainer,
)

TITAN_FT = ["--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel"]


@pytest.mark.parametrize(
    ("args", "titans"),
    [
        (TITAN_FT, True),
        (["--module", "llama3", "--config", "llama3_debugmodel"], False),
        ([], False),  # the default registry config
    ],
)
def test_a_config_of_another_trainer_goes_to_that_trainer(args: list[str], titans: bool) -> None:
    assert wants_titan_trainer(args) is titans


@pytest.mark.parametrize(
    ("flags", "cuda", "process_group", "lines"),
    [
        ([], False, "gloo", [NCCL_ON_CPU]),
        (["--fault_tolerance.process_group=nccl"], False, "nccl", []),  # the user chose
        ([], True, "nccl", []),
    ],
)
def test_nccl_becomes_gloo_on_a_cpu_where_the_user_did_not_choose(
    flags: list[str], cuda: bool, process_group: str, lines: list[str]
) -> None:
    parsed = parse([*TITAN_FT, *flags], None)
    logged: list[str] = []
    gloo_for_nccl(parsed, cuda, logged.append)
    assert parsed.config.fault_tolerance.process_group == process_group
    assert logged == lines


@pytest.mark.parametrize(
    ("process_group", "torchcomms", "torchft_torchcomms", "stops"),
    [
        ("mccl", False, False, True),
        ("mccl", True, False, True),
        ("mccl", False, True, True),
        ("mccl", True, True, False),  # where both install, TorchTitan's trainer builds it
        ("gloo", False, False, False),
    ],
)
def test_mccl_stops_with_one_line_naming_what_is_missing_and_what_works(
    process_group: str, torchcomms: bool, torchft_torchcomms: bool, stops: bool
) -> None:
    parsed = parse([*TITAN_FT, f"--fault_tolerance.process_group={process_group}"], None)
    problem = mccl_problem(parsed, torchcomms, torchft_torchcomms)
    assert (problem is not None) is stops
    if problem is None:
        return
    assert "\n" not in problem
    assert "process_group='mccl'" in problem and "'gloo'" in problem and "'nccl'" in problem
    assert ("the torchcomms package" in problem) is not torchcomms
    assert ("torchft.torchcomms (the torchft compatibility" in problem) is not torchft_torchcomms


def test_the_line_names_the_trainer() -> None:
    line = trainer_line(parse(TITAN_FT, None).config)
    assert "FaultTolerantTrainer (torchtitan.experiments.torchft.trainer)" in line


@pytest.mark.parametrize(
    ("flags", "cuda", "ranks", "backend", "lines"),
    [
        ([], False, 2, "partial_dtensor", [SPMD_TYPES_ON_CPU.format(ranks=2)]),
        ([], False, 1, "spmd_types", []),  # one rank: no FSDP sharding to stop
        ([], True, 4, "spmd_types", []),
        # chosen: kept, with one line saying what to expect
        (
            ["--parallelism.spmd_backend=spmd_types"],
            False,
            2,
            "spmd_types",
            [SPMD_TYPES_CHOSEN.format(ranks=2)],
        ),
        (["--parallelism.spmd_backend=partial_dtensor"], False, 2, "partial_dtensor", []),
    ],
)
@pytest.mark.parametrize("trainer", ["TorchTitan's", "torchtitan_ft's"])
def test_spmd_types_becomes_partial_dtensor_on_a_cpu_with_several_ranks(
    flags: list[str], cuda: bool, ranks: int, backend: str, lines: list[str], trainer: str
) -> None:
    """The same swap, by ``runnable_here``, for a config of TorchTitan's FT trainer and of this
    project's trainer (the registry's llama3_debugmodel in its ``Config``, which has the
    ``fault_tolerance`` section): both mains call it."""
    if trainer == "TorchTitan's":
        parsed = parse([*TITAN_FT, *flags], None)
    else:
        from torchtitan_ft.titan.releases.v0_3.trainer import FaultTolerantTrainer

        parsed = parse(flags, FaultTolerantTrainer.Config)
    logged: list[str] = []
    runnable_here(parsed, cuda, ranks, logged.append)
    assert parsed.config.parallelism.spmd_backend == backend
    assert [line for line in logged if "spmd_backend" in line] == lines
