"""The main job on its embedded default: a local lighthouse and two replica groups training
TorchTitan's llama3 debug model with fault tolerance on CPU (``configs/debug_ft_cpu.toml``).

Each replica group is its own ``run_train.sh`` (torchrun) job. Every log line names its source
once: the trainer's ``[replica=<id> rank=<r> train_step=<n> committed_steps=<m>]`` (the
Manager's ``[<replica id>:<uuid> group_rank=<r> committed_steps=<m>]`` before training starts),
else ``[replica=<id>]`` (torchrun's lines, TorchTitan's start-up) or ``[lighthouse]``. The
lighthouse's status page is on http://127.0.0.1:29511/.

    python scripts/local_job.py [--steps 20] [--ngpu 1] [extra trainer flags...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

from torchtitan_ft.lighthouse import LighthouseClient

ROOT = Path(__file__).resolve().parent.parent
GROUPS = 2


def relay(label: str, proc: subprocess.Popen) -> None:
    """Prints ``proc``'s lines with ``[label]`` in front, unless the trainer's or the Manager's
    prefix (both name the committed steps) already names the source."""
    for line in proc.stdout:
        print(line if "committed_steps=" in line else f"[{label}] {line}", end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    parser.add_argument("--ngpu", type=int, default=1, help="processes per replica group")
    parser.add_argument("--port", type=int, default=29510, help="lighthouse gRPC port")
    args, extra = parser.parse_known_args()

    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "1",
         "--bind", f"127.0.0.1:{args.port}", "--join_timeout_ms", "20000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    threading.Thread(target=relay, args=("lighthouse", lighthouse), daemon=True).start()
    addr = f"http://127.0.0.1:{args.port}"
    groups: list[subprocess.Popen] = []
    try:
        LighthouseClient(addr).heartbeat("local-job-probe", timedelta(seconds=30))
        print(
            f"[run_local] lighthouse at {addr}; status page http://127.0.0.1:{args.port + 1}/",
            flush=True,
        )
        env = {
            **os.environ,
            "NGPU": str(args.ngpu),
            "CONFIG_FILE": str(ROOT / "configs/debug_ft_cpu.toml"),
            "TORCHFT_LIGHTHOUSE": addr,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        for replica in range(GROUPS):
            proc = subprocess.Popen(
                [str(ROOT / "run_train.sh"), f"--fault_tolerance.replica_id={replica}",
                 f"--fault_tolerance.group_size={GROUPS}", f"--training.steps={args.steps}",
                 *extra],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            groups.append(proc)
            label = f"replica={replica}"
            threading.Thread(target=relay, args=(label, proc), daemon=True).start()
        codes = [proc.wait() for proc in groups]
    finally:
        for proc in groups:
            if proc.poll() is None:
                proc.terminate()
        lighthouse.terminate()
        lighthouse.wait(timeout=10)
    if any(codes):
        raise SystemExit(f"replica groups exited with {codes}")
    print(
        f"[run_local] done: {GROUPS} replica groups trained {args.steps} steps with fault tolerance"
    )


if __name__ == "__main__":
    main()
