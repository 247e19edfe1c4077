"""The main job on its embedded default: a local lighthouse and two replica groups training
TorchTitan's llama3 debug model with fault tolerance on CPU, on the TorchTitan release this
Python has (``torchtitan_ft.titan.releases``; ``./run_local.sh`` installs 0.3.0 unless
``TORCHTITAN_VERSION=0.2.2``): on 0.3.0 the registry's ``llama3_debugmodel`` in the shape of
0.2.2's ``configs/debug_ft_cpu.toml``, on 0.2.2 that file (one ``TitanJob`` of
``torchtitan_ft.titan.releases.job``, spelled for the release).

Each replica group is its own ``run_train.sh`` (torchrun) job. Every line starts with one prefix
naming its source: a trainer's log lines with the trainer's ``[replica=<id> rank=<r>
train_step=<n> committed_steps=<m>]`` (moved to the front, in place of torchrun's ``[rank<r>]:``),
a trainer's other lines (TorchTitan's start-up, warnings) with ``[replica=<id> rank=<r>]``, its
torchrun agent's with ``[replica=<id>]``; else ``[lighthouse]`` or ``[run_local]``. Warnings
known to be harmless on CPU are quieted in the trainers (``torchtitan_ft.titan.known_warnings``).
The lighthouse's status page is on http://127.0.0.1:29511/.

    python scripts/local_job.py [--steps 20] [--ngpu 1] [extra trainer flags...]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from torchtitan_ft.lighthouse import LighthouseClient
from torchtitan_ft.titan import releases
from torchtitan_ft.titan.releases.job import FtGroup, TitanJob, command

ROOT = Path(__file__).resolve().parent.parent
GROUPS = 2


_TORCHRUN_PREFIX = re.compile(r"\[rank(\d+)\]:")
"""What torchrun (``--tee``) puts in front of each line of a worker."""
_TRAINER_PREFIX = re.compile(r"\[replica=\d+ rank=\d+ train_step=\d+ committed_steps=\d+\] ")
"""What the trainer puts in front of each log message (``titan.metrics.ReplicaLogPrefix``)."""


def one_prefix(replica: int, line: str) -> str:
    """``line`` of replica group ``replica``'s ``run_train.sh`` with one prefix, in front (see
    the module docstring)."""
    worker = _TORCHRUN_PREFIX.match(line)
    rest = line[worker.end() :] if worker else line
    trainer = _TRAINER_PREFIX.search(rest)
    if trainer:
        return f"{trainer.group()}{rest[: trainer.start()]}{rest[trainer.end() :]}"
    source = f"replica={replica} rank={worker.group(1)}" if worker else f"replica={replica}"
    return f"[{source}] {rest}"


def relay(proc: subprocess.Popen, prefixed: Callable[[str], str]) -> None:
    """Prints ``proc``'s lines, each as ``prefixed`` gives it."""
    for line in proc.stdout:
        print(prefixed(line), end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    parser.add_argument("--ngpu", type=int, default=1, help="processes per replica group")
    parser.add_argument("--port", type=int, default=29510, help="lighthouse gRPC port")
    args, extra = parser.parse_known_args()
    release = releases.installed()
    print(f"[run_local] training with TorchTitan {release.value}", flush=True)

    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "1",
         "--bind", f"127.0.0.1:{args.port}", "--join_timeout_ms", "20000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    threading.Thread(
        target=relay, args=(lighthouse, lambda line: f"[lighthouse] {line}"), daemon=True
    ).start()
    addr = f"http://127.0.0.1:{args.port}"
    groups: list[subprocess.Popen] = []
    try:
        LighthouseClient(addr).heartbeat("local-job-probe", timedelta(seconds=30))
        print(
            f"[run_local] lighthouse at {addr}; status page http://127.0.0.1:{args.port + 1}/",
            flush=True,
        )
        for replica in range(GROUPS):
            job = TitanJob(
                steps=args.steps,
                config_file=ROOT / "configs" / "debug_ft_cpu.toml",
                module="llama3",
                config="llama3_debugmodel",
                ngpu=args.ngpu,
                ft=FtGroup(replica_id=replica, group_size=GROUPS, lighthouse=addr),
                flags=tuple(extra),
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            )
            proc = command(job, release).popen(
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            groups.append(proc)
            prefixed = functools.partial(one_prefix, replica)
            threading.Thread(target=relay, args=(proc, prefixed), daemon=True).start()
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
