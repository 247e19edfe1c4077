"""FT step time ÷ plain torch DDP step time, same model, batch and optimizer, one run; prints JSON.

For each size (a 2-layer MLP of ~10 MB and ~200 MB of fp32 parameters) fresh worker processes
(``python -m benchmarks.manager_step --worker ...``, one torch thread each, all on 127.0.0.1)
run in pairs:

- baselines: two processes with ``torch.nn.parallel.DistributedDataParallel`` over a gloo
  process group, with torch's defaults (``torch_ddp``) and with
  ``gradient_as_bucket_view=True`` (``torch_ddp_bucket_view``: no gradient copies);
- ``ft``: two replica groups of one process each: ``Manager`` (async quorum, a real
  ``LighthouseServer`` running in this process, ``ProcessGroupGloo``, ``HTTPTransport``) +
  ``torchtitan_ft.ddp.DistributedDataParallel`` + ``OptimizerWrapper``, all with defaults;
- optionally (``--ft-bucket-caps-mb``, diagnostic) more FT pairs with another
  ``bucket_cap_mb``, each with its own lighthouse.

All use SGD and the same batch per step. The pairs take turns (one pair runs at a time; the
order rotates every round), so they see the same machine load. A step is ``zero_grad``,
forward, backward, ``step``; its time is the slower of the pair's two processes for that
step. The first ``--warmup`` steps of each pair are dropped (the FT pair's first step includes
the first quorum, building the gloo group and the init_sync heal of replica 1).

The headline ``ratio_ft_over_faster_baseline`` is the FT median step over the median step of
the faster baseline in this run; every baseline's ratio and the per-round ratios are there
too. For attribution, the JSON has per-phase medians for every pair (time in ``zero_grad``,
forward, backward -- which includes waiting for the allreduces -- and ``step``), CPU time per
step of the whole process and of the training thread, and for FT: time blocked waiting for
the async quorum, in the ShouldCommit RPC, in the quorum RPC (on the quorum thread), in DDP's
bucket launch (``Manager.allreduce`` of the bucket's flat buffer, which the gradients are views
into), in ``Manager.allreduce`` alone and in DDP's end-of-backward callback (the wait).

    python -m benchmarks.manager_step [--sizes-mb 10 200] [--rounds 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from benchmarks import _mlp, machine
from torchtitan_ft.testing import processes

MODULE = "benchmarks.manager_step"
PHASES = ("zero_grad", "forward", "backward", "step")


# ------------------------------------------------------------------ workers


def _loop(
    ddp: Any, optim: Any, dim: int, replica: int, start: int, steps: int, probes: dict[str, float]
) -> dict[str, Any]:
    import torch

    step_s: list[float] = []
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    probe_s: dict[str, list[float]] = {name: [] for name in probes}
    probe_s["cpu_process"] = []  # CPU time of the whole process (all threads) in the step
    probe_s["cpu_main_thread"] = []
    not_committed = 0
    for i in range(start, start + steps):
        x, y = _mlp.batch(dim, replica, i)
        for name in probes:
            probes[name] = 0.0
        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        optim.zero_grad()
        t1 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        committed = optim.step()
        t4 = time.perf_counter()
        probe_s["cpu_process"].append(time.process_time() - c0)
        probe_s["cpu_main_thread"].append(time.thread_time() - m0)
        if committed is False:
            not_committed += 1
        step_s.append(t4 - t0)
        for name, value in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name].append(value)
        for name, value in probes.items():
            probe_s[name].append(value)
    return {"step_s": step_s, "phases": phases, "probes": probe_s, "not_committed": not_committed}


def _timed(fn: Any, probes: dict[str, float], name: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            probes[name] += time.perf_counter() - t

    return wrapper


def worker_ddp(rank: int, size_mb: float, port: int, bucket_view: bool) -> None:
    import os
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if rank == 0:  # host the store on loopback only (TCPStore alone listens on every interface)
        sock = socket.socket()
        sock.bind((_mlp.HOST, 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        processes.send({"port": port})
        store = dist.TCPStore(
            _mlp.HOST,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
            timeout=timedelta(seconds=60),
        )
    else:
        store = dist.TCPStore(_mlp.HOST, port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = _mlp.mlp(size_mb)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    optim = _mlp.optimizer(ddp.parameters())
    _serve(ddp, optim, _mlp.mlp_dim(size_mb), rank, {})
    dist.destroy_process_group()


def worker_ft(replica: int, size_mb: float, lighthouse: str, bucket_cap_mb: float) -> None:
    import torch

    torch.set_num_threads(1)
    model = _mlp.mlp(size_mb)
    manager, _pg, ddp, optim = _mlp.ft_setup(
        replica, lighthouse, model, bucket_cap_mb=bucket_cap_mb
    )
    probes = {
        "wait_quorum": 0.0,
        "should_commit_rpc": 0.0,
        "quorum_rpc_on_worker": 0.0,
        "ddp_launch": 0.0,
        "manager_allreduce_call": 0.0,
        "ddp_finish_backward": 0.0,
    }
    manager.wait_quorum = _timed(manager.wait_quorum, probes, "wait_quorum")
    # DDP internals looked up on the instance at call time (not the grad hooks themselves):
    # launching a bucket (Manager.allreduce of its flat buffer), Manager.allreduce alone, and
    # the end-of-backward callback (wait for the allreduces).
    ddp._launch = _timed(ddp._launch, probes, "ddp_launch")
    manager.allreduce = _timed(manager.allreduce, probes, "manager_allreduce_call")
    ddp._finish_backward = _timed(ddp._finish_backward, probes, "ddp_finish_backward")
    manager._client.should_commit = _timed(
        manager._client.should_commit, probes, "should_commit_rpc"
    )
    manager._client._quorum = _timed(manager._client._quorum, probes, "quorum_rpc_on_worker")
    _serve(ddp, optim, _mlp.mlp_dim(size_mb), replica, probes)
    manager.shutdown(wait=False)


def _serve(ddp: Any, optim: Any, dim: int, replica: int, probes: dict[str, float]) -> None:
    processes.send({"ready": True})
    done = 0
    while (msg := processes.recv()) is not None and msg["cmd"] == "run":
        result = _loop(ddp, optim, dim, replica, done, msg["steps"], probes)
        done += msg["steps"]
        processes.send(result)


def worker_quorum(impl: str, replica: int, lighthouse: str) -> None:
    """One replica group of one rank with ``impl``'s ManagerServer and ManagerClient; asks for
    a quorum at the wall-clock time each ``ask`` message names and sends how long it took."""
    from datetime import timedelta

    if impl == "torchft":
        from benchmarks._reference import load_reference

        ft = load_reference()
        server_cls, client_cls = ft.ManagerServer, ft.ManagerClient
    else:
        from functools import partial

        from torchtitan_ft.manager.client import LocalManagerClient
        from torchtitan_ft.manager.outage import LighthouseOutage
        from torchtitan_ft.manager.server import ManagerServer

        outage = LighthouseOutage.WAIT if impl == "ours_wait" else LighthouseOutage.PREVIOUS_QUORUM
        server_cls = partial(ManagerServer, lighthouse_outage=outage)

        def client_cls(addr: str, _timeout: timedelta) -> Any:
            return LocalManagerClient(server, addr)  # as the Manager's group rank 0 asks

    server = server_cls(
        replica_id=f"{impl}_{replica}",
        lighthouse_addr=lighthouse,
        hostname=_mlp.HOST,
        bind=f"{_mlp.HOST}:0",
        store_addr=f"{_mlp.HOST}:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=10),
        quorum_retries=0,
    )
    client = client_cls(server.address(), timedelta(seconds=10))
    processes.send({"ready": True})
    while (msg := processes.recv()) is not None and msg["cmd"] == "ask":
        time.sleep(max(0.0, msg["at"] - time.time()))
        t = time.perf_counter()
        client._quorum(
            group_rank=0,
            step=msg["step"],
            checkpoint_metadata="",
            shrink_only=False,
            timeout=timedelta(seconds=10),
            commit_failures=0,
            init_sync=True,
        )
        processes.send({"s": time.perf_counter() - t})
    server.shutdown()


# ------------------------------------------------------------------ parent


QUORUM_IMPLS = ("ours", "torchft")
QUORUM_LEAD_S = 0.05
"""How far ahead of now each quorum round's agreed start time is set."""
QUORUM_MIXED = {
    "ours_groups_torchft_lighthouse": ("ours", "torchft"),
    "torchft_groups_our_lighthouse": ("torchft", "ours"),
}
"""Diagnostic pairs (``--quorum-mixed``): one implementation's groups with the other's
lighthouse (ours falls back to unary calls there), to tell which half a difference is in."""
QUORUM_OUTAGE_WAIT = {"ours_outage_wait": ("ours_wait", "ours")}
"""Diagnostic pair (``--quorum-outage-wait``): our groups with ``lighthouse_outage='wait'``,
which asks the lighthouse without racing it against an outage (what the default
``previous_quorum`` costs a round while the lighthouse is up)."""


def bench_quorum(rounds: int, mixed: bool = False, outage_wait: bool = False) -> dict[str, Any]:
    """The synchronous quorum round trip of ``torchtitan_ft`` and torchft 0.2.0 side by side:
    per implementation a lighthouse (``min_replicas`` 2, in this process) and two replica
    groups of one rank (a ManagerServer and its client each, in a process of their own: ours
    is the in-process client a Manager's group rank 0 uses, torchft's its gRPC one); each
    round both groups ask at the same wall-clock moment, and the time from asking to holding
    the quorum is the slower group's (it waited for nothing but the round trip, as both asked
    at once). The implementations take turns round by round; ``mixed`` adds the
    ``QUORUM_MIXED`` pairs to the turns."""
    from benchmarks._reference import load_reference
    from torchtitan_ft.lighthouse import LighthouseServer

    ft = load_reference()
    pairs = {impl: (impl, impl) for impl in QUORUM_IMPLS}
    if mixed:
        pairs.update(QUORUM_MIXED)
    if outage_wait:
        pairs.update(QUORUM_OUTAGE_WAIT)
    if ft is None:
        pairs = {name: pair for name, pair in pairs.items() if "torchft" not in pair}
    impls = list(pairs)
    lighthouses: list[Any] = []
    workers: dict[str, list[processes.Worker]] = {}
    try:
        for name, (group_impl, lighthouse_impl) in pairs.items():
            if lighthouse_impl == "torchft":
                lighthouse = ft.LighthouseServer(bind=f"{_mlp.HOST}:0", min_replicas=2)
            else:
                lighthouse = LighthouseServer(bind=f"{_mlp.HOST}:0", min_replicas=2)
            lighthouses.append(lighthouse)
            args = ["--worker", "quorum", "--impl", group_impl]
            args += ["--lighthouse", lighthouse.address()]
            workers[name] = [processes.Worker(MODULE, [*args, "--rank", str(r)]) for r in range(2)]
        for pair in workers.values():
            for w in pair:
                w.recv()  # ready
        slower: dict[str, list[float]] = {impl: [] for impl in impls}
        faster: dict[str, list[float]] = {impl: [] for impl in impls}
        for r in range(rounds + 1):  # round 0 forms the first quorum: not timed
            for impl in impls[r % len(impls) :] + impls[: r % len(impls)]:
                at = time.time() + QUORUM_LEAD_S
                for w in workers[impl]:
                    w.send({"cmd": "ask", "at": at, "step": r})
                took = sorted(w.recv()["s"] for w in workers[impl])
                if r > 0:
                    faster[impl].append(took[0])
                    slower[impl].append(took[-1])
    finally:
        for pair in workers.values():
            for w in pair:
                w.close()
        for lighthouse in lighthouses:
            lighthouse.shutdown()
    out: dict[str, Any] = {"rounds": rounds, "implementations": impls}
    for impl in impls:
        out[impl] = {
            "round_trip_ms": _mlp.summary(slower[impl]),
            "faster_group_ms": _mlp.summary(faster[impl]),
        }
    if "torchft" in impls:
        ours = statistics.median(slower["ours"])
        theirs = statistics.median(slower["torchft"])
        out["ratio_ours_over_torchft"] = round(ours / theirs, 3)
    else:
        out["torchft"] = "not installed (scripts/install_reference.sh): not measured"
    if outage_wait:
        wait = statistics.median(slower["ours_outage_wait"])
        out["ratio_ours_over_ours_outage_wait"] = round(statistics.median(slower["ours"]) / wait, 3)
    return out


def _run_pair(pair: list[processes.Worker], steps: int) -> list[dict[str, Any]]:
    for w in pair:
        w.send({"cmd": "run", "steps": steps})
    return [w.recv() for w in pair]


def _merge(results: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per step, the slower process's step time; phases and probes of that process."""
    step_s: list[float] = []
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    probes: dict[str, list[float]] = {}
    not_committed = 0
    for pair in results:
        not_committed += max(r["not_committed"] for r in pair)
        for i in range(len(pair[0]["step_s"])):
            slow = max(pair, key=lambda r: r["step_s"][i])
            step_s.append(slow["step_s"][i])
            for name in PHASES:
                phases[name].append(slow["phases"][name][i])
            for name, values in slow["probes"].items():
                probes.setdefault(name, []).append(values[i])
    return {
        "step": _mlp.summary(step_s),
        "phase_median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in phases.items()},
        "probe_median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in probes.items()},
        "probe_mean_ms": {k: round(statistics.mean(v) * 1e3, 2) for k, v in probes.items()},
        "not_committed": not_committed,
        "_median_s": statistics.median(step_s),
        "_round_medians_s": [statistics.median(r[0]["step_s"]) for r in results],
    }


BASELINES = {"torch_ddp": False, "torch_ddp_bucket_view": True}
"""Baseline pairs: torch DDP with its defaults, and with ``gradient_as_bucket_view=True``
(gradients are views into the allreduce buckets: no copy in or out)."""


def _start_ddp_pair(size: str, bucket_view: bool) -> list[processes.Worker]:
    extra = ["--bucket-view"] if bucket_view else []
    rank0 = processes.Worker(MODULE, ["--worker", "ddp", "--rank", "0", "--size-mb", size, *extra])
    try:
        port = rank0.recv()["port"]
        args = ["--worker", "ddp", "--rank", "1", "--size-mb", size, "--port", str(port)]
        return [rank0, processes.Worker(MODULE, args + extra)]
    except BaseException:
        rank0.close()
        raise


def bench_size(
    size_mb: float,
    rounds: int,
    steps: int,
    warmup: int,
    baselines: list[str],
    ft_caps: list[float],
) -> dict[str, Any]:
    from torchtitan_ft.lighthouse import LighthouseServer

    lighthouses: list[LighthouseServer] = []
    workers: list[processes.Worker] = []
    pairs: dict[str, list[processes.Worker]] = {}
    try:
        size = str(size_mb)
        for name in baselines:
            pairs[name] = _start_ddp_pair(size, BASELINES[name])
            workers.extend(pairs[name])
        for cap in [None, *ft_caps]:  # one lighthouse per FT pair (a job each)
            name = "ft" if cap is None else f"ft_bucket_cap_{cap:g}mb"
            lighthouses.append(LighthouseServer(bind=f"{_mlp.HOST}:0", min_replicas=2))
            args = ["--size-mb", size, "--lighthouse", lighthouses[-1].address()]
            args += [] if cap is None else ["--bucket-cap-mb", str(cap)]
            pairs[name] = [
                processes.Worker(MODULE, ["--worker", "ft", "--rank", str(r), *args])
                for r in range(2)
            ]
            workers.extend(pairs[name])
        for w in workers:
            w.recv()  # ready
        for pair in pairs.values():
            _run_pair(pair, warmup)
        modes = list(pairs)
        results: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in modes}
        for r in range(rounds):
            # rotate the order every round, so no pair always runs first or last
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                results[mode].append(_run_pair(pairs[mode], steps))
    finally:
        for w in workers:
            w.close()
        for lighthouse in lighthouses:
            lighthouse.shutdown()
    merged = {mode: _merge(results[mode]) for mode in modes}
    ft = merged["ft"]
    out: dict[str, Any] = {"size_mb": size_mb, "param_mb": round(_param_mb(size_mb), 2)}
    for name in baselines:
        base = merged[name]
        out[f"ratio_ft_over_{name}"] = round(ft["_median_s"] / base["_median_s"], 3)
        out[f"ratio_per_round_{name}"] = [
            round(f / d, 3)
            for f, d in zip(ft["_round_medians_s"], base["_round_medians_s"], strict=True)
        ]
    best = min(baselines, key=lambda name: merged[name]["_median_s"])
    out["faster_baseline"] = best
    out["ratio_ft_over_faster_baseline"] = out[f"ratio_ft_over_{best}"]
    out["ft_overhead_ms_vs_faster_baseline"] = round(
        ft["step"]["median_ms"] - merged[best]["step"]["median_ms"], 2
    )
    for mode in modes:
        if mode.startswith("ft_bucket_cap_"):
            base = merged[best]["_median_s"]
            out[f"ratio_{mode}_over_faster_baseline"] = round(merged[mode]["_median_s"] / base, 3)
    for mode in modes:
        merged[mode].pop("_median_s")
        merged[mode].pop("_round_medians_s")
        out[mode] = merged[mode]
    return out


def _param_mb(size_mb: float) -> float:
    d = _mlp.mlp_dim(size_mb)
    return 2 * (d * d + d) * 4 / 1e6


TARGETS = {10.0: 1.10, 200.0: 1.03}
REFERENCE = {10.0: 1.43, 200.0: 1.15}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-mb", type=float, nargs="*", default=[10.0, 200.0], help="MLP sizes (none: skip)"
    )
    parser.add_argument("--rounds", type=int, default=6, help="turns per pair (alternating)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per turn")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per pair")
    parser.add_argument("--baselines", nargs="+", choices=list(BASELINES), default=list(BASELINES))
    parser.add_argument(
        "--ft-bucket-caps-mb",
        type=float,
        nargs="*",
        default=[],
        help="extra FT pairs (diagnostic) with DistributedDataParallel(bucket_cap_mb=...)",
    )
    parser.add_argument(
        "--quorum-outage-wait",
        action="store_true",
        help="diagnostic: also time our groups with lighthouse_outage='wait' (what racing the "
        "lighthouse against an outage costs a round)",
    )
    parser.add_argument("--bucket-view", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--quorum-rounds",
        type=int,
        default=30,
        help="synchronous quorum round trips per implementation, ours and torchft 0.2.0 side "
        "by side (0: not measured)",
    )
    parser.add_argument(
        "--quorum-mixed",
        action="store_true",
        help="diagnostic: also time our groups with torchft's lighthouse and torchft's groups "
        "with ours (which half of the round trip a difference is in)",
    )
    parser.add_argument("--worker", choices=["ddp", "ft", "quorum"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--impl", choices=[*QUORUM_IMPLS, "ours_wait"], default="ours", help=argparse.SUPPRESS
    )
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ddp":
        worker_ddp(args.rank, args.size_mb, args.port, args.bucket_view)
        return
    if args.worker == "ft":
        worker_ft(args.rank, args.size_mb, args.lighthouse, args.bucket_cap_mb)
        return
    if args.worker == "quorum":
        worker_quorum(args.impl, args.rank, args.lighthouse)
        return

    started = time.time()
    sizes = []
    for size_mb in args.sizes_mb:
        result = bench_size(
            size_mb, args.rounds, args.steps, args.warmup, args.baselines, args.ft_bucket_caps_mb
        )
        ratio = result["ratio_ft_over_faster_baseline"]
        target = TARGETS.get(size_mb)
        result["target"] = target
        result["target_met"] = None if target is None else ratio <= target
        result["reference_torchft_0_2_0"] = REFERENCE.get(size_mb)
        sizes.append(result)
        print(f"size {size_mb} MB done: {ratio}", file=sys.stderr)
    quorum = (
        bench_quorum(args.quorum_rounds, args.quorum_mixed, args.quorum_outage_wait)
        if args.quorum_rounds > 0
        else None
    )
    command = "python -m " + MODULE + " " + " ".join(sys.argv[1:])
    print(
        json.dumps(
            {
                "command": command.strip(),
                "machine": machine(),
                "setup": {
                    **_mlp.setup(),
                    "torch_threads_per_process": 1,
                    "backend": "gloo, 127.0.0.1",
                    "bucket_cap_mb": 25,
                    "rounds": args.rounds,
                    "steps_per_round": args.steps,
                    "warmup": args.warmup,
                },
                "sizes": sizes,
                "quorum_round_trip": quorum,
                "wall_s": round(time.time() - started, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
