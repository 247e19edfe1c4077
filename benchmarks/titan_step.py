"""TorchTitan step times on this CPU: 1 process, native HSDP 2x2 and FT 2x2, per compute dtype;
prints JSON.

Three jobs of the llama3 debugmodel (small shape: batch 2 x seq 256 per rank, gloo on
127.0.0.1, one OpenMP thread per process), run one after the other, ``--rounds`` times in
rotating order so all see the same machine load:

- ``single``: one process (``run_train.sh`` with NGPU=1, ``configs/debug_cpu.toml``);
- ``native``: TorchTitan's own HSDP 2x2 (``run_train.sh`` with NGPU=4,
  ``data_parallel_replicate_degree=2``, ``data_parallel_shard_degree=2``; same config);
- ``ft``: 2 replica groups x 2 FSDP ranks with fault tolerance (two ``run_train.sh`` with NGPU=2,
  ``configs/debug_ft_cpu.toml``: per-step sync, async quorum, Manager + managed all-reduce hook,
  a real lighthouse in this process).

Each ``--dtypes`` value runs all three with ``training.mixed_precision_param`` set to it, e.g.
``--dtypes bfloat16 float32`` measures TorchTitan's default (bf16) against fp32 in one run.
A step's time is TorchTitan's own ``time_metrics/end_to_end(s)`` (read from the TensorBoard
event files, ``log_freq`` 1); for FT the slower of the two groups at that step. The first
``--warmup`` steps are dropped (first quorum, gloo setup, the init_sync heal). The JSON records
the CPU (model, torch capability, bf16 support) and the dtype this machine would choose.

    python -m benchmarks.titan_step [--steps 14] [--warmup 4] [--rounds 1] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import machine

ROOT = Path(__file__).resolve().parent.parent
STEP_TAG = "time_metrics/end_to_end(s)"
TARGET = 1.05


def _launch(dump: Path, ngpu: int, steps: int, config: str, *args: str, env: dict) -> Any:
    full_env = {
        **os.environ,
        "NGPU": str(ngpu),
        "LOG_RANK": "0",
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "CONFIG_FILE": str(ROOT / "configs" / config),
        **env,
    }
    command = [
        str(ROOT / "run_train.sh"),
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(dump),
        "--metrics.enable_tensorboard",
        "--metrics.log_freq=1",
        *args,
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: Any, timeout: float) -> None:
    output = proc.communicate(timeout=timeout)[0]
    if proc.returncode != 0:
        raise RuntimeError(f"training run failed ({proc.returncode}):\n{output[-3000:]}")


def _step_times(run_dir: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(STEP_TAG)}


def _run_one(work: Path, ngpu: int, steps: int, timeout: float, *args: str) -> dict[int, float]:
    proc = _launch(work, ngpu, steps, "debug_cpu.toml", *args, env={})
    _finish(proc, timeout)
    (run_dir,) = [d for d in (work / "tb").glob("*") if d.is_dir()]
    return _step_times(run_dir)


def run_single(work: Path, steps: int, timeout: float, *args: str) -> dict[int, float]:
    """One process (no FSDP, no FT): {step: seconds}."""
    return _run_one(work / "single", 1, steps, timeout, *args)


def run_native(work: Path, steps: int, timeout: float, *args: str) -> dict[int, float]:
    """Native TorchTitan HSDP 2x2: {step: seconds}."""
    hsdp = ("--parallelism.data_parallel_replicate_degree=2",)
    hsdp += ("--parallelism.data_parallel_shard_degree=2",)
    return _run_one(work / "native", 4, steps, timeout, *hsdp, *args)


def run_ft(work: Path, steps: int, timeout: float, *args: str) -> dict[int, float]:
    """2 replica groups x 2 FSDP ranks with FT: {step: seconds of the slower group}."""
    from torchtitan_ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    procs = []
    try:
        for r in range(2):
            procs.append(
                _launch(
                    work / f"ft{r}",
                    2,
                    steps,
                    "debug_ft_cpu.toml",
                    f"--fault_tolerance.replica_id={r}",
                    *args,
                    env={"TORCHFT_LIGHTHOUSE": lighthouse.address()},
                )
            )
        for proc in procs:
            _finish(proc, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    per_group = []
    for r in range(2):
        (run_dir,) = (work / f"ft{r}" / "tb").glob(f"*/replica_{r}")
        per_group.append(_step_times(run_dir))
    return {s: max(g[s] for g in per_group) for s in per_group[0] if all(s in g for g in per_group)}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for descendants so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _after_warmup(times: dict[int, float], warmup: int) -> list[float]:
    return [t for s, t in sorted(times.items()) if s > warmup]


JOBS = {"single": run_single, "native": run_native, "ft": run_ft}


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main(argv: list[str] | None = None) -> dict:
    from torchtitan_ft.titan.compute_dtype import choose_param_dtype, probe_cpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be < --steps ({args.steps})")

    work = Path(tempfile.mkdtemp(prefix="titan_step_"))
    kinds = [(dtype, job) for dtype in args.dtypes for job in JOBS]
    steps: dict[tuple[str, str], list[float]] = {kind: [] for kind in kinds}
    cpu_s: dict[tuple[str, str], float] = dict.fromkeys(kinds, 0.0)
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    try:
        for i in range(args.rounds):
            order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
            for dtype, job in order:
                cpu_before = _cpu_seconds()
                times = JOBS[job](
                    work / f"round{i}" / dtype,
                    args.steps,
                    args.timeout,
                    f"--training.mixed_precision_param={dtype}",
                )
                cpu_s[(dtype, job)] += _cpu_seconds() - cpu_before
                steps[(dtype, job)] += _after_warmup(times, args.warmup)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results = {}
    for dtype in args.dtypes:
        medians = {job: _median(steps[(dtype, job)]) for job in JOBS}
        results[dtype] = {
            **{f"{job}_median_step_s": m for job, m in medians.items()},
            **{f"{job}_step_s": [round(t, 4) for t in steps[(dtype, job)]] for job in JOBS},
            # Whole jobs incl. ~8 s of imports/setup per process.
            **{f"{job}_job_cpu_s": round(cpu_s[(dtype, job)], 1) for job in JOBS},
            "ratio_ft_over_native": round(medians["ft"] / medians["native"], 4),
        }
    if "bfloat16" in results and "float32" in results:
        results["bfloat16_over_float32"] = {
            job: round(
                results["bfloat16"][f"{job}_median_step_s"]
                / results["float32"][f"{job}_median_step_s"],
                2,
            )
            for job in JOBS
        }
    command = ["python", "-m", "benchmarks.titan_step"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--rounds", str(args.rounds), "--dtypes", *args.dtypes]
    report = {
        "command": " ".join(command),
        "machine": machine(),
        "load_avg_1m_at_start": load_at_start,
        "dtype_chosen_here_when_unset": choose_param_dtype("cpu", probe_cpu(), None).param_dtype,
        "what": "llama3 debugmodel, batch 2 x seq 256 per rank, gloo, CPU",
        "single": "one process, no FSDP (TorchTitan autocast in the dtype)",
        "native": "TorchTitan HSDP dp_replicate=2 x dp_shard=2 (one torchrun job, NGPU=4)",
        "ft": "2 replica groups x 2 FSDP ranks, per-step FT (async quorum), real lighthouse",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "results": results,
        "ft_over_native_target": TARGET,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
