"""How long a replica group whose every rank process restarts at once takes to be back in a
quorum at its ManagerServer (the rebinding rule of ``manager/rounds.py``); prints JSON.

A real ``LighthouseServer`` and a 2-rank ``ManagerServer`` run in this process; each group rank
is a worker process (``python -m benchmarks.group_restart --worker``) with its own
``ManagerClient``. Each trial SIGKILLs both ranks (their connections close, as a crashed
process's do), starts two new ones, waits until both are ready to call, then tells both to call
``Quorum`` at once. ``back_s`` is from that moment to the later of the two answers (the ranks
report when they got theirs on the machine's monotonic clock, which all processes share).
Process start-up is not counted: it is the same whatever the rule. ``steady_quorum_s_median``
is the same measure for the ranks before each kill, for comparison.

    python -m benchmarks.group_restart [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from datetime import timedelta

from benchmarks import machine
from torchtitan_ft.testing import processes

MODULE = "benchmarks.group_restart"
WORLD_SIZE = 2
TIMEOUT = timedelta(seconds=30)


def _worker(addr: str, rank: int) -> None:
    from torchtitan_ft.manager import ManagerClient

    client = ManagerClient(addr, connect_timeout=TIMEOUT)
    processes.send({"ready": rank})
    while (msg := processes.recv()) is not None and msg.get("cmd") == "quorum":
        step = msg["step"]
        client._quorum(
            group_rank=rank,
            step=step,
            checkpoint_metadata=f"rank-{rank}-step-{step}",
            shrink_only=False,
            timeout=TIMEOUT,
        )
        processes.send({"answered": time.monotonic()})
    client.close()


def _start_group(addr: str) -> list[processes.Worker]:
    ranks = [
        processes.Worker(MODULE, ["--worker", "--addr", addr, "--rank", str(r)])
        for r in range(WORLD_SIZE)
    ]
    for worker in ranks:
        worker.recv()  # ready: imported and connected
    return ranks


def _quorum(ranks: list[processes.Worker], step: int) -> float:
    """All ranks call Quorum at once; seconds until the last answer."""
    go = time.monotonic()
    for worker in ranks:
        worker.send({"cmd": "quorum", "step": step})
    return max(worker.recv()["answered"] for worker in ranks) - go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.addr, args.rank)
        return

    from torchtitan_ft.lighthouse import LighthouseServer
    from torchtitan_ft.testing.servers import loopback_manager_server

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    server = loopback_manager_server(
        lighthouse.address(), world_size=WORLD_SIZE, connect_timeout=TIMEOUT
    )
    back: list[float] = []
    steady: list[float] = []
    try:
        ranks = _start_group(server.address())
        _quorum(ranks, step=1)
        for trial in range(args.trials):
            steady.append(_quorum(ranks, step=2 * trial + 2))
            for worker in ranks:
                worker.proc.send_signal(signal.SIGKILL)
                worker.proc.wait()
            ranks = _start_group(server.address())
            back.append(_quorum(ranks, step=2 * trial + 3))
        for worker in ranks:
            worker.close()
    finally:
        server.shutdown()
        lighthouse.shutdown()
    print(
        json.dumps(
            {
                "machine": machine(),
                "world_size": WORLD_SIZE,
                "trials": args.trials,
                "back_s": back,
                "back_s_median": statistics.median(back),
                "back_s_max": max(back),
                "steady_quorum_s_median": statistics.median(steady),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
