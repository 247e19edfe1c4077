"""TorchTitan's own fault-tolerance trainer, ``TRAIN_FILE=torchtitan.experiments.ft.train``
(docs/titan.md, "TorchTitan's FT doc, command by command"): with the opt-in torchft
compatibility package (``compat/`` on PYTHONPATH, as installing it would do) it trains on
torchtitan_ft, CPU fixes applied; without it, ``run_train.sh`` stops with one line.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from torchtitan_ft.events import EventKind, HealOutcome
from torchtitan_ft.testing.titan_jobs import (
    CONFIGS,
    ROOT,
    STEP_LINE,
    TrainRun,
    finish_all,
    ft_env,
    group_events,
    lighthouse,
    logged_scalars,
    remaining,
    run_ft_groups,
)

COMPAT = ROOT / "compat"
TRAINER = "torchtitan.experiments.ft.train"


def _pythonpath_without_compat() -> str:
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != COMPAT.resolve()
    ]
    return os.pathsep.join([str(ROOT), *kept])


def test_without_the_compat_package_it_stops_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.enable", f"--job.dump_folder={tmp_path}"],
        env={**os.environ, "TRAIN_FILE": TRAINER, "PYTHONPATH": _pythonpath_without_compat()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"torchtitan_ft: TRAIN_FILE={TRAINER} is TorchTitan's own")
    assert "torchtitan_ft.titan.train" in lines[0]
    assert "scripts/install_torchft_compat.sh" in lines[0]


def test_beside_a_real_torchft_it_stops_with_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "torchft"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise AssertionError('the fake torchft was imported')\n")
    path = os.pathsep.join([str(COMPAT), _pythonpath_without_compat(), str(tmp_path / "site")])
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.enable", f"--job.dump_folder={tmp_path}"],
        env={**os.environ, "TRAIN_FILE": TRAINER, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "another torchft is also visible" in lines[0] and str(fake) in lines[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_with_the_compat_package_two_groups_train_on_torchtitan_ft(tmp_path: Path) -> None:
    steps = 2
    path = os.pathsep.join([str(COMPAT), _pythonpath_without_compat()])
    outputs = run_ft_groups(
        tmp_path,
        1,
        steps,
        CONFIGS / "debug_cpu.toml",
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size=2",
        "--fault_tolerance.process_group=gloo",
        "--training.mixed_precision_param=float32",
        env={"TRAIN_FILE": TRAINER, "PYTHONPATH": path},
    )
    assert remaining() > 0
    for replica, output in enumerate(outputs):
        # TorchTitan's FTManager named the replica; torchtitan_ft's Manager and ManagerServer ran.
        assert f"torchtitan_ft_{replica}" in output
        assert "torchtitan_ft.manager.server" in output
        commits = group_events(tmp_path, replica, EventKind.COMMIT)
        assert any(e["participants"] == 2 for e in commits), commits
        trained = sorted({int(m.group(2)) for m in STEP_LINE.finditer(output)})
        assert trained and trained[-1] == steps, output[-3000:]


TWO_RANKS = (
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size=2",
    "--fault_tolerance.process_group=gloo",
    "--training.mixed_precision_param=float32",
    "--parallelism.data_parallel_shard_degree=2",
    "--metrics.enable_tensorboard",
)
"""2 replica groups of 2 FSDP ranks (TorchTitan reduces the loss across groups only then)."""


def _two_rank_group(tmp_path: Path, replica: int, steps: int, lighthouse: str) -> TrainRun:
    path = os.pathsep.join([str(COMPAT), _pythonpath_without_compat()])
    env = ft_env(
        CONFIGS / "debug_cpu.toml",
        lighthouse,
        TRAIN_FILE=TRAINER,
        PYTHONPATH=path,
        TORCHFT_QUORUM_TIMEOUT_SEC="180",  # the survivor waits for the restart (min 2 groups)
    )
    return TrainRun(
        f"replica group {replica}",
        steps,
        tmp_path / f"replica{replica}" / "outputs",
        f"--fault_tolerance.replica_id={replica}",
        *TWO_RANKS,
        ngpu=2,
        env=env,
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_two_rank_group_heals_with_torchtitans_trainer(tmp_path: Path) -> None:
    """The DTensor heal between 2-rank groups whose worlds TorchTitan's trainer names by their
    global ranks (torchtitan_ft/checkpoint/_dtensor.py): at start-up and after a SIGKILL. The
    lighthouse wants both groups, so the survivor waits for the restarted group (which takes
    longer to start than the survivor takes to finish alone) and the restart must heal."""
    steps = 10
    tag = "loss_metrics/global_avg_loss"
    with lighthouse(min_replicas=2, heartbeat_timeout_ms=2000) as address:
        survivor, victim = (_two_rank_group(tmp_path, r, steps, address) for r in range(2))
        deadline = time.monotonic() + remaining(240)
        while not any(e.data["participants"] == 2 for e in victim.events(EventKind.COMMIT)):
            assert time.monotonic() < deadline, "the 2 groups never committed a step together"
            assert victim.returncode is None and survivor.returncode is None
            time.sleep(0.2)
        victim.sigkill()
        restarted = _two_rank_group(tmp_path, 1, steps, address)
        finish_all([survivor, restarted])
    for rank in range(2):
        # At step 0 one of the groups loads the other's state (init_sync); the restarted one
        # heals to the survivor's step.
        at_start = [
            e
            for run in (victim, survivor)
            for e in run.events(EventKind.HEAL_END, rank)
            if e.step == 0
        ]
        for heals in (at_start, restarted.events(EventKind.HEAL_END, rank)):
            assert heals and all(e.data["outcome"] == HealOutcome.APPLIED for e in heals), heals
    # The restarted group trained beside the survivor to the last step. (TorchTitan's trainer
    # counts its own steps: a discarded step is counted and logged too, so its step and the
    # Manager's committed count part after the kill.)
    assert any(e.data["participants"] == 2 for e in restarted.events(EventKind.COMMIT))
    assert restarted.step_lines()[-1][0] == steps
    logged = [step for step, _ in logged_scalars(tmp_path / "replica0" / "outputs", 0, tag)]
    assert logged == list(range(1, steps + 1))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_job_level_values_match_torchtitans_trainer_under_its_numerics(tmp_path: Path) -> None:
    """2 groups of 2 ranks, the same config and seed, through each trainer; TensorBoard read
    back. With ``fault_tolerance.numerics = "torchtitan_ft_trainer"`` (Adam's zero-lr first
    step; group 1 skips the batch of the step it heals in) this project logs the job-level
    loss and max loss (the sum of the groups' losses, a healing group adding nothing) of
    TorchTitan's FT trainer to 4 decimals at every step, and the same tokens. Under the default
    numerics the losses part from step 2 (docs/titan.md, "What a replica group logs")."""
    steps = 4
    path = os.pathsep.join([str(COMPAT), _pythonpath_without_compat()])
    losses = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss")
    runs = {
        "titan": ({"TRAIN_FILE": TRAINER, "PYTHONPATH": path}, ()),
        "ours": ({}, ("--fault_tolerance.numerics=torchtitan_ft_trainer",)),
    }
    logged: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for name, (env, extra) in runs.items():
        run_ft_groups(
            tmp_path / name, 2, steps, CONFIGS / "debug_cpu.toml", *TWO_RANKS, *extra, env=env
        )
        for tag in (*losses, "n_tokens_seen"):
            values = [
                logged_scalars(tmp_path / name / f"replica{r}" / "outputs", r, tag)
                for r in range(2)
            ]
            assert values[0] == values[1], (name, tag)  # every group logs the job's values
            assert [step for step, _ in values[0]] == list(range(1, steps + 1)), (name, tag)
            logged[name, tag] = values[0]
    for tag in losses:  # to 4 decimals: within half a unit of the 4th
        ours, titan = ([v for _, v in logged[name, tag]] for name in ("ours", "titan"))
        assert ours == pytest.approx(titan, abs=5e-5), (tag, ours, titan)
    assert logged["ours", "n_tokens_seen"] == logged["titan", "n_tokens_seen"]
