"""Semi-sync on TorchTitan 0.3.0 (the semi-sync axis is the release-neutral one of 0.2.2;
tests/titan/test_semi_sync_run.py checks its numerics): Streaming DiLoCo with 2 fragments from
flags over the registry config; LocalSGD, and a DiLoCo group killed and healed, from the
repository's TOML files over it."""

from pathlib import Path

import pytest

from tests.titan.test_ft_e2e import E2E_TIMEOUT_S, kill_and_restart_group_1
from tests.titan.test_ft_e2e import STEPS as STEPS_E2E
from tests.titan030._groups import ft_groups, toml
from tests.titan030.test_ft_e2e import FT, NO_ACTIVATION_CHECKPOINTING, SMALL_CPU
from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_dump import dump_path
from torchtitan_ft.testing.titan_jobs import (
    TrainRun,
    assert_identical,
    finish_all,
    lighthouse,
    step_metrics,
)

STEPS = 6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_streaming_diloco_trains_and_commits_in_both_groups(tmp_path: Path) -> None:
    with lighthouse(min_replicas=2) as address:
        runs = [
            TrainRun(
                f"replica group {r}",
                STEPS,
                tmp_path / f"outputs{r}",
                *SMALL_CPU,
                *FT,
                f"--fault_tolerance.replica_id={r}",
                "--fault_tolerance.semi_sync_method=diloco",
                "--fault_tolerance.sync_steps=2",
                "--fault_tolerance.num_fragments=2",
                NO_ACTIVATION_CHECKPOINTING,
                env={
                    "MODULE": "llama3",
                    "CONFIG": "llama3_debugmodel",
                    "TORCHFT_LIGHTHOUSE": address,
                },
            )
            for r in range(2)
        ]
        finish_all(runs)
    for run in runs:
        assert run.step_lines()[-1][0] == STEPS
        commits = run.events(EventKind.COMMIT)
        assert commits, f"{run.name} committed no sync"
        # Every commit is a fragment sync both groups took part in.
        assert [e["participants"] for e in commits] == [2] * len(commits)
        assert not run.events(EventKind.DISCARD)


# --- LocalSGD and DiLoCo from the repository's TOML files ----------------------------------------


def _states(out: Path) -> list[dict]:
    import torch

    return [torch.load(dump_path(out, r, 0), weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_local_sgd_run_trains_and_ends_identical(tmp_path: Path) -> None:
    """configs/debug_ft_localsgd_cpu.toml (LocalSGD, sync_steps 3), 6 steps, as on 0.2.2
    (tests/titan/test_semi_sync_run.py): the groups train apart (no per-step gradient
    all-reduce), quorums at the start and at the 2 syncs, identical models at the end."""
    steps = 6
    with lighthouse(min_replicas=2) as address:
        runs = ft_groups(
            [tmp_path / "outputs0", tmp_path / "outputs1"],
            address,
            steps,
            *toml("debug_ft_localsgd_cpu.toml"),
            TRAIN_FILE="torchtitan_ft.testing.titan_dump",
            FT_E2E_OUT=str(tmp_path),
        )
        outputs = finish_all(runs)
    for run, output in zip(runs, outputs, strict=True):
        assert "cross-replica gradient all-reduce hooked" not in output
        metrics = step_metrics(output)
        assert sorted(metrics) == list(range(1, steps + 1)), output[-4000:]
        assert metrics[steps][0] < metrics[1][0] - 0.5, metrics
        assert len(run.events(EventKind.COMMIT)) == 1 + steps // 3, output[-4000:]
    assert step_metrics(outputs[0])[1][1] != step_metrics(outputs[1])[1][1]  # apart
    states = _states(tmp_path)
    assert_identical(states[0]["healed"]["model"], states[1]["healed"]["model"], "model")
    assert_identical(states[0]["strategy"], states[1]["strategy"], "strategy")


DILOCO = (
    "--fault_tolerance.num_fragments=1",
    "--fault_tolerance.fragment_sync_delay=0",
    "--fault_tolerance.sync_steps=3",
)
"""tests/titan/test_ft_e2e.py's DiLoCo kill-and-heal settings over debug_ft_diloco_cpu.toml."""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_killed_diloco_group_heals_to_the_global_model(tmp_path: Path) -> None:
    """configs/debug_ft_diloco_cpu.toml with one fragment, sync every 3 steps: group 1 is
    SIGKILLed and restarted, heals at a sync point from group 0 (global parameters and
    outer-optimizer state), and after the last sync both hold the same model and strategy
    state (the same checks as tests/titan/test_ft_e2e.py on 0.2.2, without its step-time
    comparison)."""
    job = kill_and_restart_group_1(
        tmp_path, 1, *toml("debug_ft_diloco_cpu.toml"), *DILOCO, config_env={}
    )
    job.assert_healed_and_survived()
    assert job.healed_to > 0
    states = _states(tmp_path)
    for state in states:
        assert state["healed"]["train_state"]["step"] == STEPS_E2E
    assert_identical(states[0]["healed"]["model"], states[1]["healed"]["model"], "model")
    assert_identical(states[0]["strategy"], states[1]["strategy"], "strategy")
    assert states[0]["manager"] == states[1]["manager"]
