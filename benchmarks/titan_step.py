"""TorchTitan step time with FT ÷ native TorchTitan HSDP, same shape, same run; prints JSON.

Two jobs of the llama3 debugmodel (small shape: batch 2 x seq 256 per rank, 4 ranks in all,
gloo on 127.0.0.1, one OpenMP thread per process), run one after the other, ``--rounds`` times
in alternating order so both see the same machine load:

- ``native``: TorchTitan's own HSDP 2x2 (``run_train.sh`` with NGPU=4,
  ``data_parallel_replicate_degree=2``, ``data_parallel_shard_degree=2``; config
  ``configs/debug_cpu.toml``);
- ``ft``: 2 replica groups x 2 FSDP ranks with fault tolerance (two ``run_train.sh`` with NGPU=2,
  ``configs/debug_ft_cpu.toml``: per-step sync, async quorum, Manager + managed all-reduce hook,
  a real lighthouse in this process).

A step's time is TorchTitan's own ``time_metrics/end_to_end(s)`` (read from the TensorBoard
event files, ``log_freq`` 1); for FT the slower of the two groups at that step. The first
``--warmup`` steps are dropped (first quorum, gloo setup, the init_sync heal); the headline is
the median FT step over the median native step, pooled over rounds (target <= 1.05).

    python -m benchmarks.titan_step [--steps 14] [--warmup 4] [--rounds 1]
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


def run_native(work: Path, steps: int, timeout: float) -> dict[int, float]:
    """Native TorchTitan HSDP 2x2: {step: seconds}."""
    dump = work / "native"
    proc = _launch(
        dump,
        4,
        steps,
        "debug_cpu.toml",
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=2",
        env={},
    )
    _finish(proc, timeout)
    (run_dir,) = [d for d in (dump / "tb").glob("*") if d.is_dir()]
    return _step_times(run_dir)


def run_ft(work: Path, steps: int, timeout: float) -> dict[int, float]:
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be < --steps ({args.steps})")

    work = Path(tempfile.mkdtemp(prefix="titan_step_"))
    native: list[float] = []
    ft: list[float] = []
    rounds = []
    started = time.perf_counter()
    try:
        for i in range(args.rounds):
            order = ["native", "ft"] if i % 2 == 0 else ["ft", "native"]
            result: dict[str, list[float]] = {}
            cpu: dict[str, float] = {}
            for kind in order:
                run = run_native if kind == "native" else run_ft
                cpu_before = _cpu_seconds()
                times = run(work / f"round{i}", args.steps, args.timeout)
                cpu[kind] = _cpu_seconds() - cpu_before
                result[kind] = _after_warmup(times, args.warmup)
            native += result["native"]
            ft += result["ft"]
            rounds.append(
                {
                    "order": order,
                    "native_step_s": [round(t, 4) for t in result["native"]],
                    "ft_step_s": [round(t, 4) for t in result["ft"]],
                    # Whole job incl. ~8 s of imports/setup per process: a load-independent
                    # view of what FT costs in CPU (lighthouse, manager servers, quorum threads).
                    "native_job_cpu_s": round(cpu["native"], 1),
                    "ft_job_cpu_s": round(cpu["ft"], 1),
                    "ratio": round(
                        statistics.median(result["ft"]) / statistics.median(result["native"]), 4
                    ),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ratio = statistics.median(ft) / statistics.median(native)
    command = ["python", "-m", "benchmarks.titan_step"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--rounds", str(args.rounds)]
    report = {
        "command": " ".join(command),
        "what": "llama3 debugmodel, batch 2 x seq 256 per rank, 4 ranks, gloo, CPU",
        "native": "TorchTitan HSDP dp_replicate=2 x dp_shard=2 (one torchrun job, NGPU=4)",
        "ft": "2 replica groups x 2 FSDP ranks, per-step FT (async quorum), real lighthouse",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": rounds,
        "native_median_step_s": round(statistics.median(native), 4),
        "ft_median_step_s": round(statistics.median(ft), 4),
        "ratio_ft_over_native": round(ratio, 4),
        "target": TARGET,
        "met": ratio <= TARGET,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
