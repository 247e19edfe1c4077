"""End to end on TorchTitan 0.3.0, the TorchTitan way: ``./run_train.sh --module llama3 --config
llama3_debugmodel`` with ``--fault_tolerance.*`` flags (docs/titan.md's 0.3.0 command; its
env-var form ``MODULE=... CONFIG=...`` is run by test_local_job.py), 2 replica groups of 1 rank
and (``--full``) of 2 FSDP ranks, without any ``parallelism.spmd_backend`` flag (with 2 ranks
the trainer swaps 0.3.0's default for ``partial_dtensor`` on a CPU, one line); replica group 1
is SIGKILLed mid-run, restarts, heals from group 0, and both groups end with bitwise-identical
state, rank by rank (the same run and checks as tests/titan/test_ft_e2e.py on 0.2.2), each
group's TensorBoard scalars and profiler traces in its own ``replica_<id>`` folder."""

from pathlib import Path

import pytest

from tests.titan.test_ft_e2e import (
    E2E_TIMEOUT_S,
    KILL_AT_STEP,
    assert_groups_identical,
    assert_job_loss_logged_per_commit,
    kill_and_restart_group_1,
)

SMALL_CPU = (
    "--training.seq_len=256",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--debug.seed=42",
    "--validator.no-enable",
)
"""debug_ft_cpu.toml's shape on top of the registry's llama3_debugmodel (batch 8 x 2048).
Without its ``metrics.disable_color_printing``: run_train.sh turns TorchTitan's colours off
when its output is not a terminal, as here."""

FT = (
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size=2",
    "--fault_tolerance.hostname=127.0.0.1",
    "--fault_tolerance.process_group_timeout_ms=10000",
    "--fault_tolerance.step_timeout_ms=30000",
    "--fault_tolerance.connect_timeout_ms=10000",
)
"""debug_ft_cpu.toml's ``[fault_tolerance]`` section as flags."""

NO_ACTIVATION_CHECKPOINTING = "activation-checkpoint:none"
"""tyro's subcommand for TorchTitan 0.3.0's ``activation_checkpoint`` (a union of configs)."""

PROFILE_EVERY = 10
OBSERVED = (
    "--metrics.enable_tensorboard",
    "--profiler.enable_profiling",
    f"--profiler.profile_freq={PROFILE_EVERY}",
    "--profiler.profiler_warmup=0",
)
"""TensorBoard, and a profiler trace every :data:`PROFILE_EVERY` iterations of a process."""


@pytest.mark.slow  # the default tier: test_torchx.py (the same checks, restarted by torchrun)
@pytest.mark.multiprocess
@pytest.mark.timeout(E2E_TIMEOUT_S)
@pytest.mark.parametrize("ranks", [1, 2], ids=["1rank", "2ranks"])
def test_killed_replica_group_heals_to_identical_state(tmp_path: Path, ranks: int) -> None:
    job = kill_and_restart_group_1(
        tmp_path,
        ranks,
        *("--module", "llama3", "--config", "llama3_debugmodel"),
        *SMALL_CPU,
        *FT,
        *OBSERVED,
        NO_ACTIVATION_CHECKPOINTING,
        config_env={},  # the config is named by the flags
    )
    job.assert_healed_and_survived()
    assert job.healed_to > KILL_AT_STEP
    assert_groups_identical(tmp_path, ranks)
    # Imported here: collecting this module must work under 0.2.2, where it is skipped.
    from torchtitan_ft.titan.releases.v0_3.parse import SPMD_TYPES_ON_CPU

    swap = SPMD_TYPES_ON_CPU.format(ranks=ranks)  # only where FSDP spans 2+ ranks
    for run in (job.survivor, job.killed, job.restarted):
        assert (swap in run.output) is (ranks > 1), run.output[-4000:]
        assert "\x1b[" not in run.output  # no colour codes: the output is a pipe
    assert_job_loss_logged_per_commit(tmp_path, job)  # reads tb/<time>/replica_<id>
    assert_traces_per_replica({r: tmp_path / f"outputs{r}" for r in (0, 1)}, ranks)


def assert_traces_per_replica(dump_folders: dict[int, Path], ranks: int) -> None:
    """Each replica group's profiler traces (``{replica: its dump folder}``, one folder for
    all where they share it) are in its own ``replica_<id>`` folder, one per rank: the
    survivor and the restarted run train more than :data:`PROFILE_EVERY` iterations each."""
    for replica, dump in dump_folders.items():
        traces = dump / "profiling" / "traces"
        found = {
            p.relative_to(traces).parts[1:] for p in traces.glob(f"iteration_*/replica_{replica}/*")
        }
        assert found == {(f"replica_{replica}", f"rank{r}_trace.json.gz") for r in range(ranks)}
