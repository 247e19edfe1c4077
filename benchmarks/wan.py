"""What semi-sync buys on a slow link: two replica groups on two hosts, links from unlimited to
10 Mbit/s; wall time per inner step, compute utilisation, bytes on the wire and validation loss
of per-step sync, DiLoCo and Streaming DiLoCo; prints JSON.

    python -m benchmarks.wan [--links unlimited,1000,100,10] [--strategies NAME ...]
                             [--steps 400] [--threads 1] [--timeout-s 120] [--deadline-factor 1]

The hosts are network namespaces of this machine (``torchtitan_ft.testing.netns``; needs root,
``ip`` and ``tc``): the lighthouse (``torchft_lighthouse``) on host L, replica group 0 on host A,
group 1 on host B, each group one process (``benchmarks._semi_sync_worker``, as in
``benchmarks.semi_sync``) with the real ``Manager`` (sync quorum, ``init_sync``, HTTP
checkpoint transport) over gloo, its servers on its host's address. The links of A and B are
limited in both directions with ``tc ... tbf`` (L's link, which carries only quorum and
heartbeat RPCs, is not). This kernel has no ``netem``: there is no added latency, so the
figures show what bandwidth alone costs; a real WAN's round trips add to every sync.

The model is ``benchmarks.semi_sync``'s 612k-parameter causal LM (2.45 MB of fp32 gradients)
on the project's corpus, the same data, seeds and outer optimizer (SGD lr 0.7, momentum 0.5,
Nesterov). It is large enough that per-step sync is link-bound at 100 Mbit/s (2.45 MB at
12.5 MB/s is ~0.2 s against ~0.05 s of compute), and small enough that every strategy runs at
every link within ~30 minutes: the TorchTitan debug model (6.2M parameters, 25 MB of
gradients) would take 20 s a step at 10 Mbit/s.

Per run and per group, the worker times every inner step after the first (the first holds the
first quorum and the ``init_sync`` state transfer: ``first_step_s``) in five phases;
``compute_utilisation`` is (forward + backward + inner optimizer step) / wall time of those
steps, the rest is the strategy's (quorum, allreduce, commit vote, outer step).
``bytes_sent_per_inner_step`` is host A's (group 0's) transmit counter over those steps: every
byte on the wire (Ethernet frames, TCP/IP headers, retransmissions, quorum and heartbeat
RPCs). ``validation_loss`` is the held-out loss of the final model, the mean of the groups.
Before each link's runs the link's TCP throughput A -> B is measured
(``links[].measured_mbit``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import machine
from benchmarks._semi_sync_worker import ReplicaJob, Setup, StrategySpec, TinyLM
from benchmarks.semi_sync import NUM_REPLICAS, batches, token_stream
from torchtitan_ft.semi_sync import OuterOptimizerConfig
from torchtitan_ft.testing.netns import INTERFACE, Host, HostNetwork, limit_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
LINKS = ("unlimited", "1000", "100", "10")
"""Default link rates, Mbit/s each way (``unlimited``: no limit)."""
OUTER = OuterOptimizerConfig(lr=0.7, momentum=0.5, nesterov=True)
"""``benchmarks.semi_sync``'s outer optimizer (its 600-step sweep's pick)."""


OVERLAP_BUCKET_MB = 0.5
"""``per_step_ddp_overlap``'s DDP bucket size: the 2.45 MB of gradients in ~5 buckets, the
first (the output layer's) reduced while the backward runs through the blocks."""


def _diloco(h: int, **kwargs: Any) -> StrategySpec:
    return StrategySpec("diloco", sync_every=h, outer=OUTER, **kwargs)


STRATEGIES = {
    "per_step": StrategySpec("per_step"),
    "per_step_per_gradient": StrategySpec("per_step", bucket_cap_mb=1e-9),
    "per_step_ddp_overlap": StrategySpec("per_step", overlap_bucket_cap_mb=OVERLAP_BUCKET_MB),
    "diloco_h10": _diloco(10),
    "diloco_h50": _diloco(50),
    "diloco_h10_int8": _diloco(10, quantize=True),
    "streaming_h10_f2_tau1": _diloco(10, fragments=2, fragment_sync_delay=1),
    "streaming_h10_f2_tau4": _diloco(10, fragments=2, fragment_sync_delay=4),
    "diloco_h10_overlap": _diloco(10, overlap="delayed"),
    "diloco_h10_overlap_eager": _diloco(10, overlap="eager"),
    "diloco_h20": _diloco(20),
    "diloco_h20_overlap_eager": _diloco(20, overlap="eager"),
    "diloco_h50_overlap": _diloco(50, overlap="delayed"),
    "diloco_h100": _diloco(100),
    "diloco_h100_overlap": _diloco(100, overlap="delayed"),
    "streaming_h10_f2_overlap": _diloco(10, fragments=2, overlap="delayed"),
    "streaming_h10_f2_overlap_eager": _diloco(10, fragments=2, overlap="eager"),
}
"""The runs by name. ``per_step_per_gradient``: per-step sync with one allreduce per gradient
(21 a step), as ``PerStepSync`` did before it bucketed (diagnostic: not in the default
``--strategies``). ``per_step_ddp_overlap``: per-step sync through the DDP wrapper, each
bucket's allreduce started during the backward, the quorum asynchronous (overlapped with the
forward); its ``backward_sync`` phase (launches and the end-of-backward wait) counts as sync,
not compute, and ``overlap_s_per_inner_step`` times its steps (``OVERLAP_SPANS``): from the
backward's start to the first bucket's launch, from there until every bucket is reduced, and
the end-of-backward wait. Streaming DiLoCo: 2 fragments, each synced every 10 steps (one every 5),
its allreduce in flight for tau inner steps (4 is the most a 5-step cycle allows). ``overlap``:
the one-step-delayed outer update (``outer_overlap="delayed"``), each round's allreduce in
flight for the whole next cycle (10 steps for DiLoCo, 5 for each Streaming fragment);
``overlap_eager``: the eager update (``outer_overlap="eager"``), the same in flight.
``diloco_h20`` / ``diloco_h20_overlap_eager``, ``diloco_h50`` / ``diloco_h50_overlap`` and
``diloco_h100`` / ``diloco_h100_overlap``: H = 20, 50 and 100, more compute per round to hide a
round that takes longer than 10 inner steps (the 10 Mbit/s case); not in the default
``--strategies`` (but ``diloco_h50``)."""
DIAGNOSTIC = (
    "per_step_per_gradient",
    "diloco_h20",
    "diloco_h20_overlap_eager",
    "diloco_h50_overlap",
    "diloco_h100",
    "diloco_h100_overlap",
)
OVERLAP_BASES = {
    "diloco_h10_overlap": "diloco_h10",
    "diloco_h10_overlap_eager": "diloco_h10",
    "diloco_h20_overlap_eager": "diloco_h20",
    "diloco_h50_overlap": "diloco_h50",
    "diloco_h100_overlap": "diloco_h100",
    "streaming_h10_f2_overlap": "streaming_h10_f2_tau4",
    "streaming_h10_f2_overlap_eager": "streaming_h10_f2_tau4",
}
"""Each overlapped run and the run without full overlap it is compared with (Streaming: the
largest tau a 5-step cycle allows)."""
LIGHTHOUSE_PORT = 29510
PROBE_PORT = 5201
PROBE_SECONDS = 2.0
"""How long the link probe should send at the link's rate (256 MB when unlimited)."""
_TX_COUNTER = f"/sys/class/net/{INTERFACE}/statistics/tx_bytes"
"""Read inside a host's namespace (``ip netns exec`` mounts its /sys)."""


# ------------------------------------------------------------------ one run


def _deadline_s(spec: StrategySpec, steps: int, link_mbit: float | None, params: int) -> float:
    """A generous bound for one run: start-up, then per step 0.5 s of compute plus three times
    the time its sync takes at the link's rate."""
    sync_bytes = 4 * params / (4 if spec.quantize else 1) / spec.sync_every
    per_step = 0.5 + (3 * sync_bytes * 8 / (link_mbit * 1e6) if link_mbit else 0.0)
    return 180 + steps * per_step


@dataclass(frozen=True)
class Bench:
    """What every run shares."""

    hosts: tuple[Host, ...]
    """The replica groups' hosts, group ``r`` on ``hosts[r]``."""
    lighthouse: str
    setup: Setup
    params: int
    """Model parameters (for the runs' time bounds)."""
    data_path: Path
    threads: int
    timeout_s: float
    deadline_factor: float = 1.0
    """Multiplies each run's time bound (``_deadline_s``), for a loaded machine."""


def run(name: str, link_mbit: float | None, bench: Bench) -> dict[str, Any]:
    """Strategy ``name`` at ``link_mbit``: a replica-group process on each of the hosts."""
    spec = STRATEGIES[name]
    tmp = bench.data_path.parent
    tag = f"{name}_{link_mbit or 'unlimited'}"
    procs, outs, logs = [], [], []
    start = time.perf_counter()
    for r, host in enumerate(bench.hosts):
        job = ReplicaJob(
            replica=r,
            replica_groups=NUM_REPLICAS,
            lighthouse=bench.lighthouse,
            setup=bench.setup,
            strategy=spec,
            data_path=str(bench.data_path),
            out_path=str(tmp / f"{tag}_{r}.json"),
            threads=bench.threads,
            timeout_s=bench.timeout_s,
            host=host.address,
            tx_bytes_path=_TX_COUNTER,
        )
        job_path = tmp / f"{tag}_{r}.pickle"
        job_path.write_bytes(pickle.dumps(job))
        log = tmp / f"{tag}_{r}.log"
        with log.open("w") as out:
            command = [sys.executable, "-m", "benchmarks._semi_sync_worker", str(job_path)]
            procs.append(host.popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        outs.append(Path(job.out_path))
        logs.append(log)
    bound = _deadline_s(spec, bench.setup.steps, link_mbit, bench.params)
    deadline = time.monotonic() + bound * bench.deadline_factor
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    wall = time.perf_counter() - start
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)
        raise RuntimeError(f"{tag}: exit codes {[p.returncode for p in procs]}\n{tails}")
    groups = [json.loads(out.read_text()) for out in outs]
    return _summarize(name, link_mbit, groups, wall)


def _summarize(
    name: str, link_mbit: float | None, groups: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    """The run's figures (see the module doc): means over the groups, bytes of group 0's host."""

    def per_step(group: dict[str, Any], value: float) -> float:
        return value / group["steady_steps"]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    walls = [per_step(g, g["steady_seconds"]) for g in groups]
    phases = {
        phase: mean([per_step(g, g["phase_seconds"][phase]) for g in groups])
        for phase in groups[0]["phase_seconds"]
    }
    compute = [
        per_step(g, g["phase_seconds"]["forward_backward"] + g["phase_seconds"]["optimizer"])
        for g in groups
    ]
    tx = [g["host_tx_bytes"] for g in groups]
    payload = sum(op["payload_bytes"] for op in groups[0]["collectives"].values())
    steps = groups[0]["steady_steps"] + 1
    return {
        "strategy": name,
        "link_mbit": link_mbit,
        "wall_s_per_inner_step": round(mean(walls), 5),
        "compute_utilisation": round(mean([c / w for c, w in zip(compute, walls, strict=True)]), 4),
        "bytes_sent_per_inner_step": round(per_step(groups[0], tx[0][2] - tx[0][1]), 1),
        "validation_loss": mean([g["validation_loss"] for g in groups]),
        "compute_s_per_inner_step": round(mean(compute), 5),
        "sync_s_per_inner_step": round(mean(walls) - mean(compute), 5),
        "backward_s_per_inner_step": round(
            mean([per_step(g, g["backward_seconds"]) for g in groups]), 5
        ),
        "phase_s_per_inner_step": {k: round(v, 5) for k, v in phases.items()},
        **_overlap_summary(groups),
        "bytes_sent_per_inner_step_per_group": [
            round(per_step(g, t[2] - t[1]), 1) for g, t in zip(groups, tx, strict=True)
        ],
        "payload_bytes_per_inner_step": round(payload / steps, 1),
        "first_step_s": [round(g["first_step_seconds"], 3) for g in groups],
        "first_step_bytes_sent": [t[1] - t[0] for t in tx],
        "validation_loss_per_group": [g["validation_loss"] for g in groups],
        "syncs_committed": groups[0]["syncs_committed"],
        "syncs_failed": [g["syncs_failed"] for g in groups],
        "params_sha1": [g["params_sha1"] for g in groups],
        "wall_seconds": round(wall, 1),
    }


def _overlap_summary(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """An overlapped run's step timeline (``_semi_sync_worker.OVERLAP_SPANS``), seconds per
    inner step, mean of the groups; nothing for other runs."""
    if groups[0].get("overlap_seconds") is None:
        return {}
    spans = groups[0]["overlap_seconds"]
    return {
        "overlap_s_per_inner_step": {
            span: round(
                sum(g["overlap_seconds"][span] for g in groups)
                / sum(g["steady_steps"] for g in groups),
                5,
            )
            for span in spans
        }
    }


# ------------------------------------------------------------------ links


def _parse_link(text: str) -> float | None:
    if text == "unlimited":
        return None
    try:
        mbit = float(text)
    except ValueError:
        mbit = 0.0
    if not mbit > 0:
        raise argparse.ArgumentTypeError(
            f"link rate {text!r} is not 'unlimited' or a positive number of Mbit/s"
        )
    return mbit


def probe(sender: Host, receiver: Host, link_mbit: float | None) -> float:
    """The TCP throughput sender -> receiver in Mbit/s, over ~``PROBE_SECONDS``."""
    nbytes = 256 << 20 if link_mbit is None else int(link_mbit * 1e6 / 8 * PROBE_SECONDS)
    command = [sys.executable, "-m", "benchmarks._link_probe"]
    server = receiver.popen(
        [*command, "serve", receiver.address, str(PROBE_PORT)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    sender.run(
        [*command, "send", receiver.address, str(PROBE_PORT), str(nbytes)],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    out, _ = server.communicate(timeout=60)
    measured = json.loads(out)
    return measured["bytes"] * 8 / measured["seconds"] / 1e6


# ------------------------------------------------------------------ main


EXPOSED_SYNC_MARGIN_S = 0.010
"""Issue 22's per-step goals: exposed sync (wall - compute) at most this on an unlimited link,
and at most this over what the link forces (the ideal allreduce's time beyond the backward)."""
UTILISATION_GOAL_UNLIMITED = 0.85


def _per_step_goals(results: list[dict[str, Any]], links: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step rows against issue 22's goals: on an unlimited link utilisation >= 85% and
    exposed sync <= 10 ms; elsewhere exposed sync <= max(0, ideal allreduce - backward) + 10 ms,
    the ideal allreduce being the payload x 2(N-1)/N at the measured link rate."""
    measured = {link["link_mbit"]: link["measured_mbit"] for link in links}
    goals: dict[str, Any] = {}
    for r in results:
        if not r["strategy"].startswith("per_step"):
            continue
        exposed = r["sync_s_per_inner_step"]
        if r["link_mbit"] is None:
            met = (
                r["compute_utilisation"] >= UTILISATION_GOAL_UNLIMITED
                and exposed <= EXPOSED_SYNC_MARGIN_S
            )
            bound = EXPOSED_SYNC_MARGIN_S
        else:
            wire = r["payload_bytes_per_inner_step"] * 2 * (NUM_REPLICAS - 1) / NUM_REPLICAS
            ideal = wire * 8 / (measured[r["link_mbit"]] * 1e6)
            bound = max(0.0, ideal - r["backward_s_per_inner_step"]) + EXPOSED_SYNC_MARGIN_S
            met = exposed <= bound
        goals.setdefault(r["strategy"], {})[str(r["link_mbit"] or "unlimited")] = {
            "exposed_sync_s": exposed,
            "bound_s": round(bound, 5),
            "met": met,
            **({} if r["link_mbit"] is None else {"ideal_allreduce_s": round(ideal, 5)}),
        }
    return goals


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, read off the results (absent when a run they need did not run)."""
    by = {(r["strategy"], r["link_mbit"]): r for r in results}
    goals: dict[str, Any] = {}
    at100 = {s: r for (s, link), r in by.items() if link == 100}
    if at100:
        goals["compute_utilisation_at_100_mbit"] = {
            s: r["compute_utilisation"] for s, r in at100.items()
        }
    models: dict[str, set[str]] = {}
    for (s, _), r in by.items():
        models.setdefault(s, set()).add(r["params_sha1"][0])
    goals["same_final_model_at_every_link"] = {s: len(m) == 1 for s, m in models.items()}
    for (s, link), r in by.items():
        diloco = by.get(("diloco_h10", link))
        if s.startswith("streaming") and diloco and diloco["sync_s_per_inner_step"] > 0:
            hidden = 1 - r["sync_s_per_inner_step"] / diloco["sync_s_per_inner_step"]
            goals.setdefault("streaming_sync_hidden_vs_diloco_h10", {}).setdefault(s, {})[
                str(link or "unlimited")
            ] = round(hidden, 3)
    goals.update(_overlap_goals(by))
    return goals


def _overlap_goals(by: dict[tuple[str, float | None], dict[str, Any]]) -> dict[str, Any]:
    """Each overlapped run's utilisation per link (goal for DiLoCo H=10: >= 0.95 at 100 Mbit/s,
    >= 0.85 at 10 Mbit/s), and its validation loss relative to its base run's
    (``OVERLAP_BASES``; the final model is the same at every link, so any link's will do)."""
    out: dict[str, Any] = {}
    for (s, link), r in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if s not in OVERLAP_BASES:
            continue
        row = out.setdefault(s, {"base": OVERLAP_BASES[s], "compute_utilisation": {}})
        row["compute_utilisation"][str(link or "unlimited")] = r["compute_utilisation"]
        base = by.get((OVERLAP_BASES[s], link))
        if base is not None:
            row["validation_loss_vs_base"] = round(
                r["validation_loss"] / base["validation_loss"] - 1, 5
            )
            row.setdefault("base_compute_utilisation", {})[str(link or "unlimited")] = base[
                "compute_utilisation"
            ]
    return {"overlap": out} if out else {}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--links",
        type=lambda text: [_parse_link(t) for t in text.split(",")],
        default=[_parse_link(t) for t in LINKS],
        help=f"comma-separated link rates in Mbit/s, or unlimited (default {','.join(LINKS)})",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=sorted(STRATEGIES),
        default=[s for s in STRATEGIES if s not in DIAGNOSTIC],
        help="the runs (default: all but per_step_per_gradient and the H = 20 to 100 rows)",
    )
    parser.add_argument(
        "--steps", type=int, default=400, help="inner steps per run (a multiple of every H)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per group")
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="the Managers' collective timeout"
    )
    parser.add_argument(
        "--deadline-factor",
        type=float,
        default=1.0,
        help="multiplies each run's time bound (default 1; more on a loaded machine, where a "
        "step may take ten times its quiet time)",
    )
    return parser


def _data(setup_steps: int, path: Path) -> tuple[Setup, int]:
    """Writes the run's batches and validation set to ``path``; the setup and the model's
    parameter count."""
    from torchtitan_ft.titan.training_data import TRAIN_SEED, VALIDATION_SEED

    stream = token_stream(TRAIN_SEED, 3000)
    val_stream = token_stream(VALIDATION_SEED, 100)
    setup = Setup(vocab=max(int(max(stream.max(), val_stream.max())) + 1, 2000), steps=setup_steps)
    model = TinyLM(setup.vocab, setup.dim, setup.layers, setup.heads, setup.seq_len)
    width = setup.seq_len + 1
    validation = val_stream[: 64 * width].view(64, width)
    torch.save({"train": batches(stream, setup), "validation": validation}, path)
    return setup, sum(p.numel() for p in model.parameters())


def _start_lighthouse(host: Host, log: Path) -> str:
    """``torchft_lighthouse`` on ``host`` (stopped with the network); its URL."""
    with log.open("w") as out:
        host.popen(
            [
                *(sys.executable, "-m", "torchtitan_ft.lighthouse.cli"),
                *("--bind", f"{host.address}:{LIGHTHOUSE_PORT}"),
                *("--min_replicas", str(NUM_REPLICAS), "--status_bind", "off"),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return f"http://{host.address}:{LIGHTHOUSE_PORT}"


def _compare_to_per_step(results: list[dict[str, Any]]) -> None:
    """Adds each run's loss and wall time relative to per-step sync at the same link."""
    base = {r["link_mbit"]: r for r in results if r["strategy"] == "per_step"}
    for r in results:
        if r["link_mbit"] in base:
            ref = base[r["link_mbit"]]
            r["validation_loss_vs_per_step"] = round(
                r["validation_loss"] / ref["validation_loss"] - 1, 5
            )
            r["wall_ratio_to_per_step"] = round(
                r["wall_s_per_inner_step"] / ref["wall_s_per_inner_step"], 4
            )


def main(argv: list[str] | None = None) -> None:
    """Runs every strategy at every link rate and prints one JSON document."""
    parser = _parser()
    args = parser.parse_args(argv)
    horizons = sorted({STRATEGIES[s].sync_every for s in args.strategies})
    if any(args.steps % h for h in horizons) or args.steps < 2:
        parser.error(f"--steps {args.steps} must be >= 2 and a multiple of every H ({horizons})")
    reason = limit_unavailable_reason()
    if reason is not None:
        parser.exit(2, f"{parser.prog}: cannot make hosts here: {reason}\n")

    started = time.time()
    load_before = os.getloadavg()
    links, results = [], []
    with tempfile.TemporaryDirectory(prefix="wan_") as tmp, HostNetwork(["L", "A", "B"]) as net:
        data_path = Path(tmp) / "data.pt"
        setup, params = _data(args.steps, data_path)
        bench = Bench(
            hosts=(net["A"], net["B"]),
            lighthouse=_start_lighthouse(net["L"], Path(tmp) / "lighthouse.log"),
            setup=setup,
            params=params,
            data_path=data_path,
            threads=args.threads,
            timeout_s=args.timeout_s,
            deadline_factor=args.deadline_factor,
        )
        for link in args.links:
            for host in bench.hosts:
                host.limit(link)
            measured = probe(bench.hosts[0], bench.hosts[1], link)
            links.append({"link_mbit": link, "measured_mbit": round(measured, 1)})
            label = f"{link or 'unlimited'} Mbit/s"
            print(f"link {label}: measured {measured:.1f}", file=sys.stderr)
            for name in args.strategies:
                try:
                    result = run(name, link, bench)
                except RuntimeError as e:  # recorded; the other runs still say something
                    results.append({"strategy": name, "link_mbit": link, "error": str(e)})
                    print(f"{name} @ {label} failed: {e}", file=sys.stderr)
                    continue
                results.append(result)
                print(
                    f"{name} @ {label}: {result['wall_s_per_inner_step']:.4f} s/step, utilisation "
                    f"{result['compute_utilisation']:.3f} ({result['wall_seconds']} s)",
                    file=sys.stderr,
                )
    done = [r for r in results if "error" not in r]
    _compare_to_per_step(done)
    print(
        json.dumps(
            {
                "benchmark": "wan",
                "machine": machine(),
                "command": " ".join(["python -m benchmarks.wan", *sys.argv[1:]]).strip(),
                "setup": _describe(setup, params, args, load_before),
                "links": links,
                "results": results,
                "goals": {**_goals(done), "per_step_exposed_sync": _per_step_goals(done, links)},
                "wall_s": round(time.time() - started, 1),
            },
            indent=2,
        )
    )


def _describe(
    setup: Setup, params: int, args: argparse.Namespace, load_before: tuple[float, ...]
) -> dict[str, Any]:
    return {
        "hosts": "network namespaces on one bridge (torchtitan_ft.testing.netns): lighthouse "
        "on L, replica group 0 on A, group 1 on B",
        "links": "tc tbf on A's and B's links, each direction; no added latency (no netem in "
        "this kernel); L unlimited",
        "replica_groups": NUM_REPLICAS,
        "processes": "one per replica group (1 rank), python -m benchmarks._semi_sync_worker "
        "inside its host",
        "manager": "torchtitan_ft.manager.Manager, sync quorum, init_sync, min_replica_size "
        f"{NUM_REPLICAS}, HTTPTransport, collective timeout {args.timeout_s} s",
        "model": f"causal LM dim {setup.dim}, {setup.layers} layers, seq {setup.seq_len}, batch "
        f"{setup.batch}, vocab {setup.vocab}, {params} parameters ({4 * params} bytes fp32)",
        "inner_optimizer": f"AdamW lr {setup.inner_lr}",
        "outer_optimizer": f"SGD lr {OUTER.lr}, momentum {OUTER.momentum}, nesterov "
        f"{OUTER.nesterov}",
        "steps": setup.steps,
        "timed_steps": "steps 2..N; step 1 holds the first quorum and the init_sync transfer "
        "(first_step_s, first_step_bytes_sent)",
        "compute_utilisation": "(forward + backward + inner optimizer step) / wall time, per "
        "group, averaged",
        "bytes_sent_per_inner_step": "host A's eth0 transmit counter over the timed steps / "
        "their number: every byte on the wire, headers and RPCs included",
        "torch_threads_per_process": args.threads,
        "load_average_1_5_15_at_start": [round(x, 2) for x in load_before],
        "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
    }


if __name__ == "__main__":
    main()
