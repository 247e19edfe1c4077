"""A slow replica group: what it costs the healthy groups, and how soon it is reported; prints
JSON.

``--groups`` MLP replica groups (``torchtitan_ft.testing.mlp``, ``--work`` matrix products of
fixed CPU work per step) train per-step FT against a real lighthouse, each process under a CPU
limit of its own (``testing.cpulimit``: a cgroup CFS quota where the machine allows one, else
a SIGSTOP/SIGCONT duty cycle; the JSON's ``cpu_limit`` says which), so that the groups do not
take each other's CPU. Runs, in one invocation:

* a clean run (every group at ``--cpus``) under the straggler policy (``--straggler_policy
  exclude``, ``min_replicas`` one less than the groups): the healthy throughput baseline, and
  the straggler reports and exclusions it made (both should be zero);
* for each ``--slowdowns`` factor, two runs with one group at ``--cpus / factor`` from its
  warm-up on: the policy off (``min_replicas`` = the groups: every step waits for it), and on.

Throughput is the healthy groups' (all but the last, in every run) committed samples per
second over ``--steps`` steps (from their event streams): with the policy off from the limits
on, with it on from the slowed group's exclusion on (the steps before it, while it is being
detected, run at the policy-off speed: ``detection_steps`` of them). ``detection_steps``: the
slowed group's steps from its limit to the lighthouse's report reaching it (its ``straggler``
event); ``false_reports``: healthy groups reported in that run.

    python -m benchmarks.stragglers [--slowdowns 2,4] [--steps 40] [--clean-steps 40]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import machine
from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.lighthouse.exclusion import ExclusionOptions, StragglerPolicy
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.mlp import BATCH_SIZE, WorkerConfig, spawn_rank

WARMUP_STEPS = StragglerOptions().window + 3
"""Steps before the limits: the lighthouse holds a full window of every group's steady-state
compute times (the first steps are slow for all)."""


def _commits(events: list[Event], replica: int) -> list[Event]:
    name = f"replica_{replica}"
    return [e for e in events if e.kind is EventKind.COMMIT and e.replica_name == name]


def _step(folder: Path, replica: int) -> int:
    return max((e.step for e in _commits(read_events(folder), replica)), default=0)


def _wait_step(folder: Path, replica: int, step: int, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _step(folder, replica) < step:
        for i, proc in enumerate(procs):
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"replica_{i} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica_{replica} did not reach step {step} in {timeout} s")
        time.sleep(0.1)


def _wait_excluded(folder: Path, replica: int, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    name = f"replica_{replica}"
    while not any(
        e.kind is EventKind.EXCLUDED and e.replica_name == name for e in read_events(folder)
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not left out in {timeout} s")
        time.sleep(0.1)


def run(
    args: argparse.Namespace, slowdown: float | None, steps: int, folder: Path, policy: bool
) -> dict:
    """One job; ``slowdown`` None: the clean run; ``policy``: the straggler policy on.
    Returns its measurements."""
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=args.groups - 1 if policy else args.groups,
        exclusion=ExclusionOptions(StragglerPolicy.EXCLUDE) if policy else None,
    )
    events, stop_file = folder / "events", folder / "stop_step"
    procs = [
        spawn_rank(
            WorkerConfig(
                lighthouse_addr=lighthouse.address(),
                replica=i,
                out_path=str(folder / f"out_{i}.pt"),
                stop_participants=args.groups,
                stop_step_file=str(stop_file),
                max_iterations=100_000,
                events_dir=str(events),
                work=args.work,
                shared_batches=True,
            )
        )
        for i in range(args.groups)
    ]
    slow = args.groups - 1 if slowdown is not None else None
    limits: list[CpuLimit] = []
    try:
        _wait_step(events, 0, WARMUP_STEPS, procs, timeout=120)
        for i, proc in enumerate(procs):
            cpus = args.cpus / slowdown if i == slow else args.cpus
            limits.append(CpuLimit(f"bench_{i}", [proc.pid], cpus))
        limited_at = _step(events, slow if slow is not None else 0)
        if policy and slow is not None:
            _wait_excluded(events, slow, procs, timeout=args.timeout)
        start_step = _step(events, 0) + 1  # the first step that runs wholly under the limits
        _wait_step(events, 0, start_step + steps, procs, timeout=args.timeout)
        reports = lighthouse.run_in_loop(lambda: lighthouse.state.speeds.reports_started)
        exclusions = lighthouse.run_in_loop(lambda: lighthouse.state.metrics.exclusions)
        if not policy:
            stop_file.write_text(str(max(_step(events, i) for i in range(args.groups)) + 2))
            for i, proc in enumerate(procs):
                proc.join(60)
                if proc.exitcode != 0:
                    raise RuntimeError(f"replica_{i} exit code {proc.exitcode}")
        # Under the policy a left-out group never reaches a stop step with every group in the
        # quorum: the processes are killed below, once measured.
    finally:
        for limit in limits:
            limit.close()
        for proc in procs:  # all at once: none waits on a peer killed before it
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        lighthouse.shutdown()
    all_events = read_events(events)
    # The same groups in every run, the clean one too: all but the last, the one slowed.
    healthy = list(range(args.groups - 1))
    samples, seconds = 0, []
    for i in healthy:
        window = [e for e in _commits(all_events, i) if start_step < e.step <= start_step + steps]
        first = next(e for e in _commits(all_events, i) if e.step == start_step)
        samples += len(window) * BATCH_SIZE
        seconds.append(window[-1].time - first.time)
    started = [e for e in all_events if e.kind is EventKind.STRAGGLER and e["straggler"] is True]
    detection = None
    if slow is not None:
        mine = [e for e in started if e.replica_name == f"replica_{slow}"]
        detection = mine[0].step - limited_at if mine else None
    return {
        "seconds": max(seconds),
        "healthy_samples_per_s": samples / max(seconds),
        "detection_steps": detection,
        "reported_groups": sorted({e.replica_name for e in started}),
        "lighthouse_reports": reports,
        "exclusions": exclusions,
        "cpu_limit": limits[0].mechanism if limits else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4, help="replica groups (default 4)")
    parser.add_argument(
        "--slowdowns", default="2,4", help="comma-separated slowdown factors (default 2,4)"
    )
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run (default 40)")
    parser.add_argument(
        "--clean-steps", type=int, default=None, help="steps of the clean run (default --steps)"
    )
    parser.add_argument(
        "--cpus", type=float, default=0.4, help="CPU limit of each healthy group (default 0.4)"
    )
    parser.add_argument(
        "--work", type=int, default=400, help="matrix products per step (default 400)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds a run may take (default 900)"
    )
    args = parser.parse_args()
    slowdowns = [float(s) for s in args.slowdowns.split(",") if s]
    folder = Path(tempfile.mkdtemp(prefix="bench_stragglers_"))
    try:
        clean = run(args, None, args.clean_steps or args.steps, folder / "clean", policy=True)
        print(json.dumps({"clean": clean}), file=sys.stderr)
        results = []
        for slowdown in slowdowns:
            measured = run(args, slowdown, args.steps, folder / f"slow_{slowdown:g}", False)
            print(json.dumps({f"slowdown_{slowdown:g}": measured}), file=sys.stderr)
            on = run(args, slowdown, args.steps, folder / f"slow_{slowdown:g}_on", True)
            print(json.dumps({f"slowdown_{slowdown:g}_policy_on": on}), file=sys.stderr)
            results.append(
                {
                    "model": "mlp",
                    "slowdown": slowdown,
                    "healthy_throughput_ratio_policy_on": round(
                        on["healthy_samples_per_s"] / clean["healthy_samples_per_s"], 3
                    ),
                    "healthy_throughput_ratio_policy_off": round(
                        measured["healthy_samples_per_s"] / clean["healthy_samples_per_s"], 3
                    ),
                    "detection_steps": measured["detection_steps"],
                    "detection_steps_policy_on": on["detection_steps"],
                    "exclusions_policy_on": on["exclusions"],
                    "reported_groups": measured["reported_groups"],
                    "false_reports": sum(
                        g != f"replica_{args.groups - 1}" for g in measured["reported_groups"]
                    ),
                }
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        json.dumps(
            {
                "benchmark": "stragglers",
                "machine": machine(),
                "command": " ".join(["python -m benchmarks.stragglers", *sys.argv[1:]]),
                "setup": (
                    f"{args.groups} MLP replica groups, {args.work} matrix products per step, "
                    f"each under a CPU limit of {args.cpus} CPUs ({clean['cpu_limit']}); the "
                    f"last group slowed by limiting it to {args.cpus}/slowdown; lighthouse "
                    "straggler report at its defaults; policy off: min_replicas = the groups; "
                    "policy on (and the clean run): --straggler_policy exclude, min_replicas "
                    "one less, throughput measured from the exclusion on"
                ),
                "targets": {
                    "healthy_throughput_ratio_policy_on": ">= 0.9 at slowdown 4",
                    "detection_steps": "<= 10",
                    "clean_run": "0 false reports, 0 exclusions",
                },
                "results": results,
                "clean_run": {
                    "steps": args.clean_steps or args.steps,
                    "seconds": round(clean["seconds"], 1),
                    "healthy_samples_per_s": round(clean["healthy_samples_per_s"], 1),
                    "false_reports": clean["lighthouse_reports"],
                    "exclusions": clean["exclusions"],
                },
                "not_done": "TorchTitan row",
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
