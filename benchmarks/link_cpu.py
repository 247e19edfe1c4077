"""What a transfer over a shaped test link costs this machine's CPUs, with the tbf bucket of
64 KiB used before issue 22 part 3 and with ``torchtitan_ft.testing.netns``'s default, side by
side in one run; prints JSON.

    python -m benchmarks.link_cpu [--link-mbit 100] [--mb 2.45] [--ops 10] [--work 10]

Two hosts (network namespaces), one process each, a gloo process group between them; the link
limited to ``--link-mbit`` each way (``Host.limit``). Per bucket setting, each process runs
``--ops`` rounds of: a ``--mb`` MB allreduce started, a fixed compute loop (``--work``
256x256 matrix products, one torch thread) repeated until it is done, then the same number of
loops with nothing on the wire. Reported per setting: the median loop time alone and with the
transfer beside it (``compute_inflation``: their ratio - 1), the allreduce's wall time, and the
machine's kernel CPU (softirq and system time from ``/proc/stat``, all processes) per
allreduce. The default
setting is ``semi_sync``'s overlapped round of ``benchmarks.wan`` at 100 Mbit/s: 2.45 MB (the
612k-parameter LM's pseudo-gradients) in flight beside the inner steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from benchmarks import machine
from torchtitan_ft.testing import netns

OLD_BURST_BYTES = 64 * 1024
"""The tbf bucket floor before issue 22 part 3 (every full TCP segment batch was split)."""
PORT = 29557


def _worker(rank: int, store_host: str, own_host: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(store_host, PORT, 2, rank == 0, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=own_host)]
    pg = dist.ProcessGroupGloo(store, rank, 2, options)
    payload = torch.zeros(int(args.mb * 1e6 / 4))
    a = torch.randn(256, 256)

    def compute() -> float:
        start = time.perf_counter()
        for _ in range(args.work):
            (a @ a).sum()
        return time.perf_counter() - start

    pg.allreduce([payload]).wait()  # connections made, buffers allocated
    compute()
    alone: list[float] = []
    beside: list[float] = []
    transfers = []
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(args.ops):
        start = time.perf_counter()
        work = pg.allreduce([payload])
        loops = 0
        while not work.is_completed():
            beside.append(compute())
            loops += 1
        work.wait()
        transfers.append(time.perf_counter() - start)
        alone.extend(compute() for _ in range(loops))
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "compute_alone_s": statistics.median(alone),
                "compute_beside_transfer_s": statistics.median(beside),
                "allreduce_s": statistics.median(transfers),
                "process_system_s_per_op": (after.ru_stime - usage.ru_stime) / args.ops,
            }
        )
    )


def _kernel_jiffies() -> tuple[int, int]:
    """The machine's (softirq, system) CPU time so far, in clock ticks."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[7]), int(fields[3])


def _run(net: netns.HostNetwork, burst: int, args: argparse.Namespace) -> dict[str, Any]:
    hosts = [net["A"], net["B"]]
    for host in hosts:
        host.limit(args.link_mbit, min_burst_bytes=burst)
    before = _kernel_jiffies()
    procs = [
        host.popen(
            [
                sys.executable,
                "-m",
                "benchmarks.link_cpu",
                "--worker",
                str(rank),
                hosts[0].address,
                host.address,
                *_forwarded(args),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank, host in enumerate(hosts)
    ]
    outs = [p.communicate(timeout=args.timeout_s)[0] for p in procs]
    after = _kernel_jiffies()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(
            f"a worker failed at bucket {burst}: exit codes {[p.returncode for p in procs]}"
        )
    ranks = [json.loads(out) for out in outs]
    tick = os.sysconf("SC_CLK_TCK")
    ops = args.ops + 1  # the warm-up allreduce also crossed the link

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in ranks)

    return {
        "min_burst_bytes": burst,
        "compute_alone_s": round(mean("compute_alone_s"), 5),
        "compute_beside_transfer_s": round(mean("compute_beside_transfer_s"), 5),
        "compute_inflation": round(
            mean("compute_beside_transfer_s") / mean("compute_alone_s") - 1, 4
        ),
        "allreduce_s": round(mean("allreduce_s"), 4),
        "machine_softirq_s_per_op": round((after[0] - before[0]) / tick / ops, 4),
        "machine_system_s_per_op": round((after[1] - before[1]) / tick / ops, 4),
        "process_system_s_per_op": [round(r["process_system_s_per_op"], 4) for r in ranks],
    }


def _forwarded(args: argparse.Namespace) -> list[str]:
    return ["--mb", str(args.mb), "--ops", str(args.ops), "--work", str(args.work)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--link-mbit", type=float, default=100.0, help="link rate, Mbit/s each way")
    parser.add_argument("--mb", type=float, default=2.45, help="allreduce payload, MB")
    parser.add_argument("--ops", type=int, default=10, help="allreduces per setting")
    parser.add_argument("--work", type=int, default=10, help="matrix products per compute loop")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound per setting")
    parser.add_argument(
        "--worker", nargs=3, metavar=("RANK", "STORE_HOST", "OWN_HOST"), help=argparse.SUPPRESS
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        rank, store_host, own_host = args.worker
        _worker(int(rank), store_host, own_host, args)
        return
    if not args.link_mbit > 0 or args.ops < 1 or args.work < 1 or not args.mb > 0:
        parser.error("--link-mbit and --mb must be > 0, --ops and --work >= 1")
    reason = netns.limit_unavailable_reason()
    if reason is not None:
        parser.exit(2, f"{parser.prog}: cannot make hosts here: {reason}\n")
    load_before = os.getloadavg()
    with netns.HostNetwork(["A", "B"]) as net:
        settings = [_run(net, burst, args) for burst in (OLD_BURST_BYTES, netns.MIN_BURST_BYTES)]
    print(
        json.dumps(
            {
                "benchmark": "link_cpu",
                "machine": machine(),
                "command": " ".join(["python -m benchmarks.link_cpu", *sys.argv[1:]]).strip(),
                "link_mbit": args.link_mbit,
                "payload_mb": args.mb,
                "settings": settings,
                "load_average_1_5_15_at_start": [round(x, 2) for x in load_before],
                "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
