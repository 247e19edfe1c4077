"""FT reproduces native HSDP on TorchTitan 0.3.0 (tests/titan/test_train_run.py has the 0.2.2
version, 2 groups x 2 ranks): 2 replica groups x 1 rank with fault tolerance against native
HSDP over 2 ranks (replicate 2, shard 1), both from configs/debug_cpu.toml's shape over the
registry config. Native HSDP takes ``parallelism.spmd_backend`` ``partial_dtensor`` by itself
(0.3.0's default ``spmd_types`` stops in FSDP's init over 2 ranks on this torch: "all
parameters must be DTensors on the full SPMD mesh"), which shards over the (replicate, shard)
mesh as 0.2.2 did."""

from pathlib import Path

import pytest

from tests.titan030._groups import ft_groups, toml
from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_dump import dump_path
from torchtitan_ft.testing.titan_jobs import (
    TrainRun,
    assert_identical,
    finish_all,
    lighthouse,
    step_metrics,
)

STEPS = 3


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_ft_replica_groups_reproduce_native_hsdp(tmp_path: Path) -> None:
    """Each FT group trains one of native HSDP's two data-parallel slices (local batch 2 each),
    no failures: every step, each group's grad norm is native HSDP's, and the job loss each
    group logs (the sum of the groups' mean losses, as TorchTitan's FT trainer logs it) is
    twice native HSDP's mean; the groups end with bitwise-identical models.

    ``init_sync`` is off: both groups initialise from the same seed, and with an async quorum a
    group healing at step 0 would sit out that step's gradient average."""
    native = TrainRun(
        "native HSDP",
        STEPS,
        tmp_path / "native",
        *toml("debug_cpu.toml"),
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=1",
        ngpu=2,
    )
    (native_output,) = finish_all([native])
    native_metrics = step_metrics(native_output)
    assert sorted(native_metrics) == list(range(1, STEPS + 1)), native_output[-4000:]
    assert native_metrics[STEPS][0] < native_metrics[1][0]  # the loss went down

    with lighthouse(min_replicas=2) as address:
        runs = ft_groups(
            [tmp_path / "outputs0", tmp_path / "outputs1"],
            address,
            STEPS,
            *toml("debug_ft_cpu.toml"),
            "--fault_tolerance.no-init_sync",
            TRAIN_FILE="torchtitan_ft.testing.titan_dump",
            FT_E2E_OUT=str(tmp_path),
        )
        outputs = finish_all(runs)
    for run in runs:
        assert len(run.events(EventKind.COMMIT)) >= STEPS
    per_group = [step_metrics(o) for o in outputs]
    for step in range(1, STEPS + 1):
        loss, grad_norm = native_metrics[step]
        assert per_group[0][step][1] == per_group[1][step][1] == grad_norm, step
        job_loss = per_group[0][step][0]
        assert per_group[1][step][0] == job_loss
        assert job_loss / 2 == pytest.approx(loss, abs=1.5e-5)  # logs round to 5 decimals
    import torch

    states = [torch.load(dump_path(tmp_path, r, 0), weights_only=False) for r in range(2)]
    assert_identical(states[0]["healed"]["model"], states[1]["healed"]["model"], "model")
