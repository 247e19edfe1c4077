"""End-to-end CPU training through run_train.sh (torchrun, gloo, 127.0.0.1), small shape.

Each run is the llama3 debugmodel at batch 2 x seq 256 for a few steps; most of the time is
imports and setup (about 10 s per run on 2 cores).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ft.lighthouse import LighthouseServer

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"\[rank(\d+)\]:.*step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+)")

pytestmark = pytest.mark.multiprocess


def run_train(
    tmp_path: Path,
    ngpu: int,
    steps: int,
    *args: str,
    env: dict[str, str] | None = None,
    log_rank: str = "0",
    timeout: float = 150,
    wait: bool = True,
) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run ``run_train.sh`` with NGPU=ngpu; returns the completed process (or the Popen)."""
    # One OpenMP thread per process (torchrun does this itself for NGPU > 1): on 2 shared
    # cores a 2-thread process spin-waits behind other jobs (8 s/step instead of 0.8 s).
    full_env = {
        **os.environ,
        "NGPU": str(ngpu),
        "LOG_RANK": log_rank,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    full_env.update(env or {})
    command = [
        str(ROOT / "run_train.sh"),
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(tmp_path / "outputs"),
        *args,
    ]
    kwargs = dict(
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if not wait:
        return subprocess.Popen(command, **kwargs)
    return subprocess.run(command, timeout=timeout, check=False, **kwargs)


def run_ft_groups(
    tmp_path: Path,
    ngpu: int,
    steps: int,
    config: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 240,
) -> list[str]:
    """Runs 2 replica groups of ``run_train.sh`` with FT against a fresh lighthouse
    (min_replicas 2); asserts each exited 0 and returns their outputs (group ``r`` runs in
    ``tmp_path / f"replica{r}"`` with ``--fault_tolerance.replica_id=r``)."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    group_env = {"CONFIG_FILE": str(config), "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    procs: list[subprocess.Popen] = []
    try:
        for r in range(2):
            procs.append(
                run_train(
                    tmp_path / f"replica{r}",
                    ngpu,
                    steps,
                    f"--fault_tolerance.replica_id={r}",
                    *args,
                    env={**group_env, **(env or {})},
                    wait=False,
                )
            )
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-4000:]
    return outputs


def step_metrics(output: str, rank: int = 0) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} logged by ``rank``."""
    return {
        int(m.group(2)): (float(m.group(3)), float(m.group(4)))
        for m in STEP_LINE.finditer(output)
        if int(m.group(1)) == rank
    }


def _assert_trained(result: subprocess.CompletedProcess, steps: int) -> dict:
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = step_metrics(result.stdout)
    assert sorted(metrics) == list(range(1, steps + 1)), result.stdout[-4000:]
    losses = [metrics[s][0] for s in sorted(metrics)]
    assert losses[-1] < losses[0] - 0.5, losses
    return metrics


def test_one_process_debugmodel_trains(tmp_path: Path) -> None:
    _assert_trained(run_train(tmp_path, 1, 5), 5)


def test_two_process_fsdp_debugmodel_trains(tmp_path: Path) -> None:
    result = run_train(tmp_path, 2, 5)
    assert "FSDP modules reduce with SUM" in result.stdout
    _assert_trained(result, 5)


def test_ft_replica_groups_reproduce_native_hsdp(tmp_path: Path) -> None:
    """2 replica groups x 2 FSDP ranks with fault tolerance (lighthouse, Manager, managed
    all-reduce hook, commit-gated optimizer), no failures: native HSDP 2x2's grad norm at every
    step, and its loss as the mean of the two groups' losses (each group logs its own).

    ``init_sync`` is off: both groups initialise from the same seed, and with an async quorum a
    group healing at step 0 would sit out that step's gradient average."""
    steps = 3
    native = run_train(
        tmp_path / "native",
        4,
        steps,
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=2",
    )
    native_metrics = _assert_trained_quietly(native, steps)

    outputs = run_ft_groups(
        tmp_path, 2, steps, ROOT / "configs" / "debug_ft_cpu.toml", "--fault_tolerance.no-init_sync"
    )
    for output in outputs:
        assert output.count("should_commit=True") >= steps, output[-4000:]
    per_group = [step_metrics(o) for o in outputs]
    for step in range(1, steps + 1):
        loss, grad_norm = native_metrics[step]
        assert per_group[0][step][1] == per_group[1][step][1] == grad_norm
        mean_loss = (per_group[0][step][0] + per_group[1][step][0]) / 2
        assert mean_loss == pytest.approx(loss, abs=2e-5)


def _assert_trained_quietly(result: subprocess.CompletedProcess, steps: int) -> dict:
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = step_metrics(result.stdout)
    assert sorted(metrics) == list(range(1, steps + 1)), result.stdout[-4000:]
    return metrics
