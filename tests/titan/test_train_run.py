"""End-to-end CPU training through run_train.sh (torchrun, gloo, 127.0.0.1), small shape.

Each run is the llama3 debugmodel at batch 2 x seq 256 for a few steps; most of the time is
imports and setup (about 10 s per run on 2 cores).
"""

import re
from pathlib import Path

import pytest

from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_jobs import (
    CONFIGS,
    TrainRun,
    group_events,
    run_ft_groups,
    run_train,
    step_metrics,
)

pytestmark = pytest.mark.multiprocess


def _assert_trained(result: TrainRun, steps: int) -> dict:
    assert result.returncode == 0
    metrics = step_metrics(result.output)
    assert sorted(metrics) == list(range(1, steps + 1))
    losses = [metrics[s][0] for s in sorted(metrics)]
    assert losses[-1] < losses[0] - 0.5, losses
    return metrics


@pytest.mark.light
@pytest.mark.slow  # default tier: the native HSDP run below (docs/development.md)
def test_one_process_debugmodel_trains(tmp_path: Path) -> None:
    _assert_trained(run_train(tmp_path, 1, 5), 5)


@pytest.mark.slow  # the native HSDP 2x2 run of test_ft_replica_groups_reproduce_native_hsdp
def test_two_process_fsdp_debugmodel_trains(tmp_path: Path) -> None:
    result = run_train(tmp_path, 2, 5)
    assert "FSDP modules reduce with SUM" in result.output
    _assert_trained(result, 5)


GLOBAL_BATCH = "--training.global_batch_size=16"
"""All 4 data-parallel ranks' batch (local batch 2): 2 gradient accumulation steps."""
BATCH_LINE = re.compile(r"global batch size (\d+), gradient accumulation steps (\d+)")


def test_ft_replica_groups_reproduce_native_hsdp(tmp_path: Path) -> None:
    """2 replica groups x 2 FSDP ranks with fault tolerance (lighthouse, Manager, managed
    all-reduce hook, commit-gated optimizer), no failures, against native HSDP 2x2 with the
    same ``training.global_batch_size``, which with FT covers all replica groups (TorchTitan's
    FT doc): each group takes half, so both jobs train on 16 samples a step in 2 gradient
    accumulation steps. Native HSDP 2x2's grad norm at every step, and its loss as the mean of
    the two groups' losses: each group logs the job's loss as TorchTitan's FT trainer does, the
    sum of the groups' mean losses (docs/titan.md, "What a replica group logs"). The native run
    also stands for FSDP training on CPU (gloo's SUM reduction, a falling loss) in the default
    tier.

    ``init_sync`` is off: both groups initialise from the same seed, and with an async quorum a
    group healing at step 0 would sit out that step's gradient average."""
    steps = 3
    native = run_train(
        tmp_path / "native",
        4,
        steps,
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=2",
        GLOBAL_BATCH,
    )
    native_metrics = _assert_trained_quietly(native, steps)
    assert BATCH_LINE.search(native.output).groups() == ("16", "2")
    assert "FSDP modules reduce with SUM" in native.output
    assert native_metrics[steps][0] < native_metrics[1][0]  # the loss went down

    outputs = run_ft_groups(
        tmp_path,
        2,
        steps,
        CONFIGS / "debug_ft_cpu.toml",
        "--fault_tolerance.no-init_sync",
        GLOBAL_BATCH,
    )
    for replica, output in enumerate(outputs):
        assert len(group_events(tmp_path, replica, EventKind.COMMIT)) >= steps
        assert "global_batch_size=16 covers 2 replica groups: 8 per group" in output
        assert BATCH_LINE.search(output).groups() == ("8", "2")  # 2 x 8 = native's 16
    per_group = [step_metrics(o) for o in outputs]
    for step in range(1, steps + 1):
        loss, grad_norm = native_metrics[step]
        assert per_group[0][step][1] == per_group[1][step][1] == grad_norm
        job_loss = per_group[0][step][0]
        assert per_group[1][step][0] == job_loss  # both log the job's sum over 2 groups
        assert job_loss / 2 == pytest.approx(loss, abs=1.5e-5)  # logs round to 5 decimals


def _assert_trained_quietly(result: TrainRun, steps: int) -> dict:
    assert result.returncode == 0
    metrics = step_metrics(result.output)
    assert sorted(metrics) == list(range(1, steps + 1))
    return metrics
