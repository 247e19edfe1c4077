"""Bytes across replica groups and final loss of the sync strategies; prints JSON.

Two replica groups train the same small causal language model on the project's own corpus
(``torchtitan_ft.titan.training_data.generate_corpus``, tokenized with the shipped BPE) for the same
number of inner steps and tokens, with:

- ``per_step``: FT-HSDP, gradients averaged every step (``PerStepSync``);
- ``diloco_h10`` / ``diloco_h50``: DiLoCo with H = 10 / 50 (``DiLoCo``);
- ``diloco_h10_int8``: DiLoCo H = 10 with int8 pseudo-gradients (``should_quantize``);
- ``diloco_h10_paper_outer``: DiLoCo H = 10 with the DiLoCo paper's outer optimizer (SGD lr
  0.7, momentum 0.9, Nesterov; torchft's hard-coded choice), for comparison;
- optionally ``streaming_h10_f2_tau1``: Streaming DiLoCo, 2 fragments, tau = 1, alpha = 0;
- optionally (``--overlap``) the one-step-delayed outer update (``outer_overlap="delayed"``)
  and the eager one (``"eager"``) beside the same strategy without overlap:
  ``diloco_h10_overlap`` and ``diloco_h10_overlap_eager`` (base ``diloco_h10``),
  ``streaming_h10_f2_overlap`` and ``streaming_h10_f2_overlap_eager`` (base
  ``streaming_h10_f2``, tau = 0); each overlapped row gets ``validation_loss_vs_base`` (its
  loss / the base's - 1, at equal inner steps and tokens).

The outer optimizer of the other DiLoCo runs is SGD lr 0.7, momentum 0.5, Nesterov (change it
with ``--outer-lr/--outer-momentum/--no-nesterov``): at H = 10 over a few hundred steps the
paper's momentum 0.9 (tuned for H = 500) overshoots; a 600-step sweep on this setup gave
+3.3% (m 0.9), +0.4% (m 0.5), +0.1% (lr 1.0, no momentum) validation loss vs per-step.

The parts are the real ones: each replica group is its own process
(``benchmarks._semi_sync_worker``, started from a forkserver that preloaded torch) with a
``torchtitan_ft.manager.Manager`` (sync quorum, ``init_sync``, HTTP checkpoint transport) over
a gloo ``ProcessGroupGloo``, and each run has its own ``LighthouseServer`` in this process; all
on 127.0.0.1. Both groups seed the model alike, as before.

Bytes are measured: the process group handed to the Manager counts the bytes of the tensors
passed to each collective (``payload``: the Manager's ``allreduce``, or for int8 the quantized
allreduce's ``alltoall_base`` + ``allgather``). ``sent_..._estimate`` applies each
collective's algorithm to those counts (ring allreduce ``2 (N-1)/N`` of the payload, alltoall
``(N-1)/N``, allgather ``N-1`` times): the bytes one group sends to the other. Both per inner
step, with their ratio to per-step. The loss is the held-out loss of each group's final model
(the global model: ``--steps`` must be a multiple of every H).

    python -m benchmarks.semi_sync [--steps 600] [--streaming] [--overlap] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import machine
from benchmarks._semi_sync_worker import HOST, ReplicaJob, Setup, StrategySpec, replica_group
from torchtitan_ft.semi_sync import OuterOptimizerConfig

NUM_REPLICAS = 2
QUICK_STEPS = 100
PAPER_OUTER = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.optim",
    "torchtitan_ft.manager",
    "benchmarks._semi_sync_worker",
]
"""Imported once by the forkserver (~3 s a process otherwise)."""


# ------------------------------------------------------------------ data


def token_stream(seed: int, documents: int) -> torch.Tensor:
    """The project's corpus (train or validation grammar seed), tokenized, one long stream."""
    from tokenizers import Tokenizer

    from torchtitan_ft.titan.training_data import TOKENIZER_DIR, generate_corpus

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids: list[int] = []
    for text in generate_corpus(seed, documents):
        ids.extend(tok.encode(text).ids)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, setup: Setup) -> torch.Tensor:
    """[steps, replicas, batch, seq_len + 1]: disjoint windows, replica r gets its own shard."""
    n = setup.steps * NUM_REPLICAS * setup.batch
    width = setup.seq_len + 1
    if n * width > stream.numel():
        # Several epochs over the corpus: windows start at shifted offsets each epoch.
        reps = math.ceil(n * width / stream.numel()) + 1
        stream = torch.cat([stream[(i * 7) % width :] for i in range(reps)])
    return stream[: n * width].view(setup.steps, NUM_REPLICAS, setup.batch, width)


# ------------------------------------------------------------------ one run


def run(
    name: str,
    strategy: StrategySpec,
    setup: Setup,
    data_path: Path,
    threads: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Trains NUM_REPLICAS replica-group processes against a fresh lighthouse."""
    from torchtitan_ft.lighthouse import LighthouseServer

    ctx = mp.get_context("forkserver")
    out = [data_path.parent / f"{name}_{r}.json" for r in range(NUM_REPLICAS)]
    start = time.perf_counter()
    lighthouse = LighthouseServer(bind=f"{HOST}:0", min_replicas=NUM_REPLICAS)
    try:
        procs = []
        for r in range(NUM_REPLICAS):
            job = ReplicaJob(
                replica=r,
                replica_groups=NUM_REPLICAS,
                lighthouse=lighthouse.address(),
                setup=setup,
                strategy=strategy,
                data_path=str(data_path),
                out_path=str(out[r]),
                threads=threads,
                timeout_s=timeout_s,
            )
            procs.append(ctx.Process(target=replica_group, args=(job,), daemon=True))
            procs[-1].start()
        # ~1 s a step: several times a per-step step on a loaded 2-core machine (~0.12 s).
        _join(procs, deadline=time.monotonic() + 60 + setup.steps)
    finally:
        lighthouse.shutdown()
    wall = time.perf_counter() - start
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{name}: replica exit codes {[p.exitcode for p in procs]}")
    groups = [json.loads(path.read_text()) for path in out]
    return _summarize(name, setup, groups, wall)


def _join(procs: list[Any], deadline: float) -> None:
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join()
    if stuck:
        raise TimeoutError(f"replica processes {[p.pid for p in stuck]} did not finish in time")


def _summarize(
    name: str, setup: Setup, groups: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    """One run's figures: group 0's bytes (each group's totals are listed too), mean losses."""

    def total(group: dict[str, Any], field: str) -> int:
        return sum(op[field] for op in group["collectives"].values())

    first = groups[0]
    val = [g["validation_loss"] for g in groups]
    return {
        "name": name,
        "parameters": first["parameters"],
        "payload_bytes_per_inner_step": total(first, "payload_bytes") / setup.steps,
        "sent_bytes_per_inner_step_estimate": total(first, "sent_bytes_estimate") / setup.steps,
        "payload_bytes_total_per_group": [total(g, "payload_bytes") for g in groups],
        "collectives": first["collectives"],
        "syncs_committed": first["syncs_committed"],
        "syncs_failed": [g["syncs_failed"] for g in groups],
        "manager_step": [g["manager_step"] for g in groups],
        "validation_loss": sum(val) / len(val),
        "validation_loss_per_replica": val,
        "train_loss_last_10pct": sum(g["train_loss_last_10pct"] for g in groups) / len(groups),
        "replicas_identical": len({g["params_sha1"] for g in groups}) == 1,
        "train_seconds": round(max(g["train_seconds"] for g in groups), 2),
        "wall_seconds": round(wall, 2),
    }


# ------------------------------------------------------------------ main


def _runs(args: argparse.Namespace, outer: OuterOptimizerConfig) -> list[tuple[str, StrategySpec]]:
    def diloco(h: int, **kwargs: Any) -> StrategySpec:
        kwargs.setdefault("outer", outer)
        return StrategySpec("diloco", sync_every=h, **kwargs)

    runs = [
        ("per_step", StrategySpec("per_step")),
        ("diloco_h10", diloco(10)),
        ("diloco_h50", diloco(50)),
        ("diloco_h10_int8", diloco(10, quantize=True)),
        ("diloco_h10_paper_outer", diloco(10, outer=PAPER_OUTER)),
    ]
    if args.streaming:
        runs.append(("streaming_h10_f2_tau1", diloco(10, fragments=2, fragment_sync_delay=1)))
    if args.overlap:
        runs += [
            ("diloco_h10_overlap", diloco(10, overlap="delayed")),
            ("diloco_h10_overlap_eager", diloco(10, overlap="eager")),
            ("streaming_h10_f2", diloco(10, fragments=2)),
            ("streaming_h10_f2_overlap", diloco(10, fragments=2, overlap="delayed")),
            ("streaming_h10_f2_overlap_eager", diloco(10, fragments=2, overlap="eager")),
        ]
    if args.only is not None:
        runs = [r for r in runs if r[0] == "per_step" or r[0] in args.only]
    return runs


def _parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks.semi_sync``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=Setup.steps, help="inner steps per run")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_STEPS} steps (a smoke run, ~1-2 min)"
    )
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.5)
    parser.add_argument("--no-nesterov", action="store_true")
    parser.add_argument("--streaming", action="store_true", help="also run Streaming DiLoCo")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also run the delayed outer update beside the same strategy without it",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="the Managers' collective timeout"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these (per_step always runs)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Runs every strategy and prints one JSON document."""
    parser = _parser()
    args = parser.parse_args(argv)
    steps = QUICK_STEPS if args.quick else args.steps
    outer = OuterOptimizerConfig(
        lr=args.outer_lr, momentum=args.outer_momentum, nesterov=not args.no_nesterov
    )
    runs = _runs(args, outer)
    horizons = {spec.sync_every for _, spec in runs}
    if any(steps % h for h in horizons):
        parser.error(f"--steps {steps} must be a multiple of every H ({sorted(horizons)})")
    started = time.time()
    load_before = os.getloadavg()
    from torchtitan_ft.titan.training_data import TRAIN_SEED, VALIDATION_SEED

    stream = token_stream(TRAIN_SEED, 3000)
    val_stream = token_stream(VALIDATION_SEED, 100)
    setup = Setup(
        vocab=max(int(max(stream.max(), val_stream.max())) + 1, 2000),
        steps=steps,
    )
    width = setup.seq_len + 1
    validation = val_stream[: 64 * width].view(64, width)
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="semi_sync_") as tmp:
        data_path = Path(tmp) / "data.pt"
        torch.save({"train": batches(stream, setup), "validation": validation}, data_path)
        results = []
        for name, spec in runs:
            results.append(run(name, spec, setup, data_path, args.threads, args.timeout_s))
            print(f"{name} done: {results[-1]['wall_seconds']} s", file=sys.stderr)
    base = results[0]
    for r in results:
        r["payload_ratio_to_per_step"] = (
            r["payload_bytes_per_inner_step"] / base["payload_bytes_per_inner_step"]
        )
        r["sent_ratio_to_per_step_estimate"] = (
            r["sent_bytes_per_inner_step_estimate"] / base["sent_bytes_per_inner_step_estimate"]
        )
        r["validation_loss_vs_per_step"] = r["validation_loss"] / base["validation_loss"] - 1
    by_name = {r["name"]: r for r in results}
    for r in results:
        base_name, overlapped, _ = r["name"].partition("_overlap")
        if overlapped and base_name in by_name:
            r["validation_loss_vs_base"] = (
                r["validation_loss"] / by_name[base_name]["validation_loss"] - 1
            )
    print(
        json.dumps(
            {
                "benchmark": "semi_sync",
                "machine": machine(),
                "command": " ".join(["python -m benchmarks.semi_sync", *sys.argv[1:]]).strip(),
                "setup": {
                    "replica_groups": NUM_REPLICAS,
                    "simulated": False,
                    "processes": f"{NUM_REPLICAS} processes per run, one per replica group "
                    "(1 rank each), started from a forkserver that preloaded torch",
                    "manager": "torchtitan_ft.manager.Manager, sync quorum, init_sync, "
                    f"min_replica_size {NUM_REPLICAS}, HTTPTransport",
                    "lighthouse": "torchtitan_ft.lighthouse.LighthouseServer in the benchmark "
                    f"process, {HOST}, min_replicas {NUM_REPLICAS}, a fresh one per run",
                    "process_group": f"torchtitan_ft.process_group.ProcessGroupGloo on {HOST}, "
                    "subclassed to count the bytes of the tensors handed to allreduce, "
                    "alltoall_base and allgather",
                    "bytes": "payload: measured (tensor bytes handed to the cross-group "
                    "process group, group 0); sent_..._estimate: payload x the collective's "
                    "bytes per rank (ring allreduce 2(N-1)/N, alltoall (N-1)/N, "
                    "allgather N-1); framing not counted",
                    "model": f"causal LM dim {setup.dim}, {setup.layers} layers, "
                    f"seq {setup.seq_len}, vocab {setup.vocab}, {base['parameters']} parameters",
                    "tokens_per_run": setup.steps * NUM_REPLICAS * setup.batch * setup.seq_len,
                    "inner_optimizer": f"AdamW lr {setup.inner_lr}",
                    "outer_optimizer": {
                        "type": "sgd",
                        "lr": outer.lr,
                        "momentum": outer.momentum,
                        "nesterov": outer.nesterov,
                        "diloco_h10_paper_outer": "sgd lr 0.7 momentum 0.9 nesterov",
                    },
                    "steps": setup.steps,
                    "corpus": "torchtitan_ft.titan.training_data.generate_corpus (train seed), "
                    "validation: 64 sequences of the validation seed",
                    "torch_threads_per_process": args.threads,
                    "load_average_1_5_15_at_start": [round(x, 2) for x in load_before],
                    "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
                },
                "results": results,
                "wall_s": round(time.time() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
