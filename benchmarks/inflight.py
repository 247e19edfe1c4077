"""Survivor stall after a SIGKILL mid-step, with and without ``retry_inflight_allreduce``;
prints JSON.

Two replica groups of one process each (``benchmarks._mlp.ft_setup``: Manager with async
quorum + ``DistributedDataParallel`` + ``OptimizerWrapper`` + SGD, ``ProcessGroupGloo``, an
in-process ``LighthouseServer`` with its defaults, min_replicas=1) train a 2-layer MLP of
``--size-mb`` MB as fast as they can. Once both committed ``--steady`` steps together, the
victim is SIGKILLed at a random moment of a step (uniform over one steady step). **Stall** =
SIGKILL -> the survivor's next committed step. Trials alternate between the two settings
(``off``: the step in flight is discarded; ``on``: the survivor re-runs the step's allreduces
over the new quorum), each with fresh processes, so the two are measured side by side in one
run. Also reported per setting: the survivor's steady step (commit to commit, median of the
last ``--steady - 1`` steps before the kill), the bytes the Manager keeps for the retry, what
copying that many bytes into mapped memory takes in the worker (the per-step cost of keeping
them), and whether the step in flight was retried.

    python -m benchmarks.inflight [--size-mb 200] [--trials 3] [--steady 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from typing import Any

from benchmarks import _mlp, machine
from torchtitan_ft.testing import processes

MODULE = "benchmarks.inflight"
TARGET_STALL_S = 0.5


def worker(replica: int, size_mb: float, lighthouse: str, retry: bool) -> None:
    import torch

    torch.set_num_threads(1)
    model = _mlp.mlp(size_mb)
    # What keeping the inputs costs each step: copying the gradients' bytes into memory that
    # is already mapped (the kept buffers are reused), median of 5.
    src = torch.ones(_mlp.param_bytes(model) // 4)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    copy_s = statistics.median(copies[1:])
    del src, dst
    manager, _pg, ddp, optim = _mlp.ft_setup(
        replica, lighthouse, model, retry_inflight_allreduce=retry
    )
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    dim = _mlp.mlp_dim(size_mb)
    i = 0
    while not stop.is_set():
        t0 = time.time()
        optim.zero_grad()
        x, y = _mlp.batch(dim, replica, i)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        committed = optim.step()
        stats = manager.stats()
        processes.send(
            {
                "t0": t0,
                "t": time.time(),
                "committed": committed,
                "participants": manager.num_participants(),
                "steps_retried": stats.steps_retried,
                "steps_discarded": stats.steps_discarded,
                "kept_bytes": manager._collectives.kept_bytes,
                "param_bytes": _mlp.param_bytes(model),
                "gradient_copy_s": copy_s,
            }
        )
        i += 1
    manager.shutdown(wait=False)


class Proc:
    """A worker process whose JSON lines are read on a thread into a queue."""

    def __init__(self, replica: int, size_mb: float, lighthouse: str, retry: bool) -> None:
        args = ["--worker", "--replica", str(replica), "--size-mb", str(size_mb)]
        args += ["--lighthouse", lighthouse] + (["--retry"] if retry else [])
        self.w = processes.Worker(MODULE, args)
        self.events: list[dict[str, Any]] = []
        self.w.stream()

    def next(self, timeout: float = 300.0) -> dict[str, Any]:
        msg = self.w.next(timeout)
        self.events.append(msg)
        return msg

    def kill(self) -> float:
        t = time.time()
        os.kill(self.w.proc.pid, signal.SIGKILL)
        self.w.proc.wait()
        return t

    def stop(self) -> None:
        if self.w.proc.poll() is None:
            try:
                assert self.w.proc.stdin is not None
                self.w.proc.stdin.write("quit\n")
                self.w.proc.stdin.flush()
                self.w.proc.wait(30)
            except Exception:
                self.w.proc.kill()
                self.w.proc.wait()


def trial(size_mb: float, retry: bool, steady: int, rng: random.Random) -> dict[str, Any]:
    from torchtitan_ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind=f"{_mlp.HOST}:0", min_replicas=1)
    survivor = Proc(0, size_mb, lighthouse.address(), retry)
    victim = Proc(1, size_mb, lighthouse.address(), retry)
    try:
        together = 0
        while together < steady:
            msg = survivor.next()
            together += msg["committed"] and msg["participants"] == 2
        times = [e["t"] for e in survivor.events if e["committed"] and e["participants"] == 2]
        intervals = [b - a for a, b in itertools.pairwise(times[-steady:])]
        steady_s = statistics.median(intervals)
        time.sleep(rng.uniform(0.0, steady_s))
        killed = victim.kill()
        while True:
            after = survivor.next()
            if after["committed"] and after["t"] > killed:
                break
        return {
            "retry_inflight_allreduce": retry,
            "stall_s": round(after["t"] - killed, 3),
            "steady_step_s": round(steady_s, 3),
            "step_in_flight_retried": after["steps_retried"] > 0,
            "steps_discarded": after["steps_discarded"],
            "participants_of_next_commit": after["participants"],
            "kept_bytes": after["kept_bytes"],
            "param_bytes": after["param_bytes"],
            "gradient_copy_s": round(after["gradient_copy_s"], 4),
        }
    finally:
        survivor.stop()
        victim.stop()
        lighthouse.shutdown()


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--retry", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=200.0)
    parser.add_argument("--trials", type=int, default=3, help="per setting")
    parser.add_argument("--steady", type=int, default=8, help="steps together before a kill")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args.replica, args.size_mb, args.lighthouse, args.retry)
        return
    rng = random.Random(args.seed)
    load_at_start = os.getloadavg()[0]
    trials = []
    for i in range(args.trials):
        for retry in (False, True) if i % 2 == 0 else (True, False):
            trials.append(trial(args.size_mb, retry, args.steady, rng))
            print(f"trial {trials[-1]}", file=sys.stderr)
    summary = {}
    for retry in (False, True):
        mine = [t for t in trials if t["retry_inflight_allreduce"] == retry]
        summary["on" if retry else "off"] = {
            "stall_s": _stats([t["stall_s"] for t in mine]),
            "steady_step_s": _stats([t["steady_step_s"] for t in mine]),
            "stall_over_steady_median": round(
                statistics.median(t["stall_s"] / t["steady_step_s"] for t in mine), 2
            ),
            "retried": sum(t["step_in_flight_retried"] for t in mine),
            "kept_bytes": mine[0]["kept_bytes"],
            "gradient_copy_s": _stats([t["gradient_copy_s"] for t in mine]),
        }
    summary["stall_on_over_off"] = round(
        summary["on"]["stall_s"]["median"] / summary["off"]["stall_s"]["median"], 3
    )
    summary["steady_on_over_off"] = round(
        summary["on"]["steady_step_s"]["median"] / summary["off"]["steady_step_s"]["median"], 3
    )
    print(
        json.dumps(
            {
                "command": " ".join(["python -m benchmarks.inflight", *sys.argv[1:]]),
                "machine": machine(),
                "load_avg_1m_at_start": load_at_start,
                "load_avg_1m_at_end": os.getloadavg()[0],
                "setup": _mlp.setup(),
                "size_mb": args.size_mb,
                "target_stall_s": TARGET_STALL_S,
                "summary": summary,
                "trials": trials,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
