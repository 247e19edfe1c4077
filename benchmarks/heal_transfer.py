"""Live-healing transfer benchmark: prints JSON.

For each state size (a 2-layer MLP's parameters, default 10 MB and 200 MB) it measures, side by
side in one run, between a donor process and this (receiver) process on loopback:

- raw loopback TCP: the donor ``sendall``s the same parameter bytes, the receiver
  ``recv_into``s a preallocated buffer (the baseline), and into a fresh buffer (for context);
- page faults only: allocating and faulting in fresh memory of that size, no network (every
  receiver that returns new tensors pays this; it bounds the transports below);
- ``HTTPTransport``: ``recv_checkpoint`` of the donor's offered snapshot (new tensors), and its
  ratio to raw TCP;
- ``HTTPTransport`` borrowed: ``recv_checkpoint_borrowed`` into the transport's reused receive
  buffer (what the Manager's heals use), and "into place": that plus copying the state into the
  receiver's existing tensors (``healing.land_in_place``, what the Manager applies); the first
  receive into a new buffer is reported apart (it pays the page faults);
- ``PGTransport``: send/recv over a 2-process gloo group;
- donor stall: the donor trains (sweeps reading the live parameters, then an in-place update
  of them; one torch thread, no per-step allocation, steady step ~``--step-s``) and serves two
  heals while the receiver pulls each; reported as its slowest step while serving / its
  median steady step, with the training thread's own CPU time for context.
  As in the Manager, ``send_checkpoint`` runs on a quorum thread overlapped with the forward
  pass, and the update waits for it. The first heal snapshots into a new staging buffer
  (cold), the second reuses it (warm); both are reported.

Transfer figures are medians over ``--reps`` interleaved repetitions after one warm-up each.

    python benchmarks/heal_transfer.py [--sizes-mb 10 200] [--reps 5] [--num-chunks 0]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import machine
from torchtitan_ft.checkpoint import HTTPTransport, PGTransport
from torchtitan_ft.checkpoint._staging import Prefaulter, writable_view
from torchtitan_ft.manager.healing import land_in_place

TIMEOUT = timedelta(seconds=120)


def mlp(size_mb: float) -> torch.nn.Sequential:
    """Two square linear layers holding about ``size_mb`` MB of float32 parameters."""
    d = int(math.sqrt(size_mb * 1e6 / 4 / 2))
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d))


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def pg_group(rank: int, store_path: str) -> dist.ProcessGroup:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    return dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2, TIMEOUT)


# Donor process.


def donor_main(conn: Connection, store_path: str, num_chunks: int) -> None:
    torch.set_num_threads(1)
    http = HTTPTransport(TIMEOUT, num_chunks, hostname="127.0.0.1")
    pg = PGTransport(pg_group(0, store_path), TIMEOUT, torch.device("cpu"))
    raw_server = socket.create_server(("127.0.0.1", 0))
    conn.send(("hello", http.metadata(), raw_server.getsockname()[1]))
    raw, _ = raw_server.accept()
    model: torch.nn.Sequential | None = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "setup":
            model = mlp(args[0])
            state = model.state_dict()
            http.send_checkpoint([1], 1, state, TIMEOUT)
            conn.send(("ready", state_bytes(state)))
        elif cmd == "raw":
            for t in model.state_dict().values():
                raw.sendall(writable_view(t))
        elif cmd == "pg":
            pg.send_checkpoint([1], args[0], model.state_dict(), TIMEOUT)
        elif cmd == "train":
            conn.send(("trained", train(conn, http, model, *args)))
        elif cmd == "quit":
            break
    http.shutdown(wait=False)
    raw.close()


def train(
    conn: Connection,
    http: HTTPTransport,
    model: torch.nn.Sequential,
    step_s: float,
    steady_steps: int,
    heal_gap: int,
) -> dict[str, Any]:
    """Trains, serving a heal at two steps; returns step times and the serving windows.

    A step is a "forward/backward" phase that reads the live parameters (``passes`` sweeps
    writing a preallocated scratch tensor), then, after the quorum thread finished, an
    "optimizer" phase that updates the live parameters in place. Nothing is allocated per
    step, as on an accelerator with a caching allocator.
    """
    with torch.no_grad():
        params = list(model.parameters())
        scratch = [torch.zeros_like(p) for p in params]

    def step(passes: int, quorum: threading.Thread | None) -> None:
        with torch.no_grad():
            for _ in range(passes):
                for p, s in zip(params, scratch, strict=True):
                    torch.mul(p, 1.0001, out=s)
            if quorum is not None:
                quorum.join()  # like wait_quorum before the allreduce
            for p, s in zip(params, scratch, strict=True):
                p.add_(s, alpha=-1e-6)  # in place: the live tensors the donor offered

    # Calibrate the number of sweeps so one step takes about step_s.
    passes = 1
    for _ in range(6):
        took = []
        for _ in range(2):
            started = time.perf_counter()
            step(passes, None)
            took.append(time.perf_counter() - started)
        new = max(1, round(passes * step_s / min(took)))
        converged = abs(new - passes) <= max(1, passes // 10)
        passes = new
        if converged:
            break

    heal_steps = [steady_steps, steady_steps + heal_gap]
    times: list[float] = []
    thread_cpu: list[float] = []  # CPU time of the training thread itself, per step
    other_cpu: list[float] = []  # CPU time of the donor's other threads (quorum, server)
    snapshot_s: dict[int, float] = {}
    windows: dict[int, list[int]] = {}
    serving: int | None = None
    for i in range(steady_steps + 2 * heal_gap):
        quorum = None
        started = time.perf_counter()
        cpu0, proc0 = time.thread_time(), time.process_time()
        if i in heal_steps:

            def send(i: int = i) -> None:
                t0 = time.perf_counter()
                http.send_checkpoint([1], 100 + i, model.state_dict(), TIMEOUT)
                snapshot_s[i] = time.perf_counter() - t0
                conn.send(("offered", 100 + i))

            quorum = threading.Thread(target=send)
            quorum.start()
            serving = i
            windows[i] = []
        step(passes, quorum)
        times.append(time.perf_counter() - started)
        thread_cpu.append(time.thread_time() - cpu0)
        other_cpu.append(time.process_time() - proc0 - thread_cpu[-1])
        if serving is not None:
            windows[serving].append(i)
            if conn.poll():
                conn.recv()  # "pulled": the receiver has everything
                windows[serving].append(i + 1)  # the tail of the transfer may spill over
                http.disallow_checkpoint()
                serving = None
    return {
        "passes": passes,
        "times": times,
        "thread_cpu": thread_cpu,
        "other_cpu": other_cpu,
        "steady": times[1:steady_steps],
        "windows": windows,
        "snapshot_s": snapshot_s,
    }


# Receiver (this process).


def recv_raw(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("raw sender closed")
        got += n


def mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e6, 1)


def _donor_stall(
    conn: Connection, http_rx: HTTPTransport, metadata: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The donor's training while the receiver pulls checkpoints from it (``--heal-gap`` steps
    apart): its steady step, and each heal's slowest step over it."""
    conn.send(("train", args.step_s, args.steady_steps, args.heal_gap))
    pulls = []
    while True:
        msg = conn.recv()
        if msg[0] == "trained":
            trained = msg[1]
            break
        started = time.perf_counter()
        http_rx.recv_checkpoint(0, metadata, msg[1], TIMEOUT)
        pulls.append(time.perf_counter() - started)
        conn.send(("pulled",))

    steady = statistics.median(trained["steady"])
    steady_cpu = statistics.median(trained["thread_cpu"][1 : args.steady_steps])
    heals = []
    for (start, window), pull in zip(trained["windows"].items(), pulls, strict=True):
        window = [i for i in window if i < len(trained["times"])]
        worst = max(window, key=lambda i: trained["times"][i])
        slowest = trained["times"][worst]
        heals.append(
            {
                "staging": "cold (new buffer)" if not heals else "warm (reused buffer)",
                "send_checkpoint_s": round(trained["snapshot_s"][start], 4),
                "receiver_pull_s": round(pull, 4),
                "steps_while_serving": len(window),
                "slowest_step_s": round(slowest, 4),
                "slowest_step_training_thread_cpu_s": round(trained["thread_cpu"][worst], 4),
                "donor_other_threads_cpu_s_in_window": round(
                    sum(trained["other_cpu"][i] for i in window), 4
                ),
                "slowest_over_steady": round(slowest / steady, 3),
            }
        )
    return {
        "steady_step_s": round(steady, 4),
        "steady_step_training_thread_cpu_s": round(steady_cpu, 4),
        "read_sweeps_per_step": trained["passes"],
        "slowest_over_steady": max(h["slowest_over_steady"] for h in heals),
        "heals": heals,
    }


def measure_size(
    conn: Connection,
    raw: socket.socket,
    http_rx: HTTPTransport,
    pg_rx: PGTransport,
    metadata: str,
    size_mb: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    conn.send(("setup", size_mb))
    _, nbytes = conn.recv()
    warm = memoryview(bytearray(nbytes))

    def raw_warm() -> None:
        conn.send(("raw",))
        recv_raw(raw, warm)

    def raw_fresh() -> None:
        conn.send(("raw",))
        buf = torch.empty(nbytes, dtype=torch.uint8)  # writable_view does not keep it alive
        recv_raw(raw, writable_view(buf))

    def fault_only() -> None:
        # No network: the cost of faulting in fresh receive memory (what a receiver must do).
        buf = torch.empty(nbytes, dtype=torch.uint8)
        Prefaulter.submit([buf]).wait()

    def http() -> None:
        http_rx.recv_checkpoint(0, metadata, 1, TIMEOUT)

    live = {k: v.clone() for k, v in mlp(size_mb).state_dict().items()}  # the receiver's own

    def http_borrowed() -> None:
        http_rx.recv_checkpoint_borrowed(0, metadata, 1, TIMEOUT)

    def http_into_place() -> None:
        land_in_place(http_rx.recv_checkpoint_borrowed(0, metadata, 1, TIMEOUT), live)

    def pg() -> None:
        conn.send(("pg", 2))
        pg_rx.recv_checkpoint(0, "<n/a>", 2, TIMEOUT)

    kinds = {
        "raw_tcp": raw_warm,
        "raw_tcp_fresh_buffer": raw_fresh,
        "page_faults_only": fault_only,
        "http": http,
        "http_borrowed": http_borrowed,
        "http_into_place": http_into_place,
        "pg": pg,
    }
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    first_borrowed = 0.0
    for rep in range(args.reps + 1):
        for name, fn in kinds.items():
            started = time.perf_counter()
            fn()
            if rep:  # rep 0 warms up sockets, allocator and page tables
                samples[name].append(time.perf_counter() - started)
            elif name == "http_borrowed":  # into a new receive buffer
                first_borrowed = time.perf_counter() - started

    donor_stall = _donor_stall(conn, http_rx, metadata, args)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "state_bytes": nbytes,
        "raw_tcp_MBps": mbps(nbytes, med["raw_tcp"]),
        "raw_tcp_fresh_buffer_MBps": mbps(nbytes, med["raw_tcp_fresh_buffer"]),
        "http_MBps": mbps(nbytes, med["http"]),
        "http_over_raw_tcp": round(med["raw_tcp"] / med["http"], 3),
        "http_over_raw_tcp_fresh_buffer": round(med["raw_tcp_fresh_buffer"] / med["http"], 3),
        "http_borrowed_MBps": mbps(nbytes, med["http_borrowed"]),
        "http_borrowed_over_raw_tcp": round(med["raw_tcp"] / med["http_borrowed"], 3),
        "http_borrowed_first_receive_new_buffer_MBps": mbps(nbytes, first_borrowed),
        "http_into_place_MBps": mbps(nbytes, med["http_into_place"]),
        "http_into_place_over_raw_tcp": round(med["raw_tcp"] / med["http_into_place"], 3),
        "receive_buffer_bytes_held": http_rx._receive_buffer.nbytes,
        "pg_gloo_MBps": mbps(nbytes, med["pg"]),
        "page_faults_only_MBps": mbps(nbytes, med["page_faults_only"]),
        "samples_MBps": {k: [mbps(nbytes, s) for s in v] for k, v in samples.items()},
        "donor_stall": donor_stall,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 200])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per transfer")
    parser.add_argument(
        "--num-chunks", type=int, default=0, help="HTTPTransport num_chunks (0: one stream)"
    )
    parser.add_argument("--step-s", type=float, default=0.35, help="donor's target step time")
    parser.add_argument("--steady-steps", type=int, default=8)
    parser.add_argument("--heal-gap", type=int, default=6, help="steps between the two heals")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_at_start = os.getloadavg()[0]

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        donor = ctx.Process(target=donor_main, args=(child_conn, store, args.num_chunks))
        donor.start()
        try:
            pg_rx = PGTransport(pg_group(1, store), TIMEOUT, torch.device("cpu"))
            _, metadata, raw_port = conn.recv()
            raw = socket.create_connection(("127.0.0.1", raw_port))
            http_rx = HTTPTransport(TIMEOUT, args.num_chunks, hostname="127.0.0.1")
            results = {
                f"{size:g}MB": measure_size(conn, raw, http_rx, pg_rx, metadata, size, args)
                for size in args.sizes_mb
            }
            conn.send(("quit",))
            donor.join(timeout=30)
            http_rx.shutdown(wait=False)
        finally:
            if donor.is_alive():
                donor.kill()
    print(
        json.dumps(
            {
                "command": " ".join(["python -m benchmarks.heal_transfer", *sys.argv[1:]]),
                "machine": machine(),
                "cpus": os.cpu_count(),
                "load_avg_1m_at_start": load_at_start,
                "load_avg_1m_at_end": os.getloadavg()[0],
                "num_chunks": args.num_chunks,
                "reps": args.reps,
                "torch_threads_per_process": 1,
                "targets": {
                    "http_borrowed_over_raw_tcp": ">= 0.6",
                    "donor slowest_over_steady": "<= 1.3",
                },
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
