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

``--models mlp,titan`` adds the TorchTitan row: the same runs with every group a
``run_train.sh`` job of the llama3 debug model (``configs/debug_ft_cpu.toml``, one process per
group, batch 2 x 256 tokens, ``--group_size`` = the groups), its Manager's events through
``TORCHFT_EVENTS_DIR``, each job's processes under the CPU limit. Its steps take seconds at
``--cpus``, so the row is reduced to ``--titan-slowdowns`` (default 4) and ``--titan-steps``
(default 10) measured steps, and its policy-on run waits at most ``--titan-detect-steps``
(default 30) steps for the exclusion (then it is measured without one: ``exclusions_policy_on``
0); the JSON's ``titan_reduced`` says so.

``--link-mbit`` adds the link row (``"slowed_by": "link"``; the CPU rows say
``"cpu_quota"`` or ``"duty_cycle"``): the MLP groups on test hosts (``testing.netns``, the
lighthouse on a host of its own, a hidden layer of ``LINK_HIDDEN``: 344 kB of gradients a step,
each group under the same CPU limit), the last group's link held to ``--link-mbit`` each way
(``tc tbf``) after the warm-up. Its ``slowdown`` is what the link did to the job: the clean
run's healthy throughput over the policy-off run's. The groups' link probes are sent every
``--link-probe-interval-ms`` (``LINK_PROBE_BYTES`` each way). The row's clean run is run twice,
with the probes and without (``--straggler_link_probe_bytes 0``): ``probe_cost`` is the
healthy throughput ratio of the two, the probes' cost to a healthy job. Needs root (network
namespaces); elsewhere the JSON's ``link_skipped`` says why.

    python -m benchmarks.stragglers [--slowdowns 2,4] [--steps 40] [--clean-steps 40]
                                    [--models mlp,titan] [--link-mbit 5]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import machine
from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.lighthouse.exclusion import ExclusionOptions, StragglerPolicy
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.testing import netns
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.mlp import BATCH_SIZE, WorkerConfig, spawn_rank, write_stop_step
from torchtitan_ft.testing.processes import descendants
from torchtitan_ft.titan.releases.job import FtGroup, TitanJob, command

WARMUP_STEPS = StragglerOptions().window + 3
"""Steps before the limits: the lighthouse holds a full window of every group's steady-state
compute times (the first steps are slow for all)."""
ROOT = Path(__file__).resolve().parent.parent
TITAN_BATCH = 2
"""Samples in a TorchTitan group's step (``configs/debug_ft_cpu.toml``'s local batch size)."""
NAMES = {"mlp": "replica_{}", "titan": "torchtitan_ft_{}"}
"""Each model's replica group names (``Event.replica_name``) by group number."""
LINK_HIDDEN = 4096
"""The link row's MLP hidden layer (``WorkerConfig.hidden``): 86k parameters, 344 kB of
gradients a step, so that the all-reduce waits on a limited link."""
LINK_PROBE_BYTES = 128 * 1024
"""The link row's probe payload, each way (``--straggler_link_probe_bytes``)."""
LINK_PORT = 29510


def _commits(events: list[Event], name: str) -> list[Event]:
    return [e for e in events if e.kind is EventKind.COMMIT and e.replica_name == name]


def _step(folder: Path, name: str) -> int:
    return max((e.step for e in _commits(read_events(folder), name)), default=0)


class _Job:
    """A TorchTitan replica group's ``run_train.sh``, with the interface of a
    ``multiprocessing.Process`` that this benchmark uses."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self.pid = proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        for pid in reversed(_tree(self.pid)):  # the trainers first, then their launchers
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc), parents before children."""
    return [pid, *descendants(pid)]


def _spawn_titan(
    args: argparse.Namespace, i: int, lighthouse: str, folder: Path, events: Path
) -> _Job:
    job = TitanJob(
        dump_folder=folder / f"titan_{i}",
        steps=100000,
        config_file=ROOT / "configs" / "debug_ft_cpu.toml",
        ft=FtGroup(replica_id=i, group_size=args.groups, lighthouse=lighthouse),
        events_dir=events,
        env={"LOG_RANK": "0"},
    )
    with (folder / f"titan_{i}.log").open("wb") as log:
        proc = command(job).popen(stdout=log, stderr=subprocess.STDOUT)
    return _Job(proc)


def _wait_step(folder: Path, name: str, step: int, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _step(folder, name) < step:
        for i, proc in enumerate(procs):
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"group {i} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not reach step {step} in {timeout} s")
        time.sleep(0.1)


def _wait_excluded(
    folder: Path, name: str, timeout: float, healthy: str, until_step: int | None
) -> None:
    """Waits until group ``name`` is left out, or (``until_step`` set) the ``healthy`` group
    reached that step: then the run is measured without an exclusion (its ``exclusions``
    say 0)."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(folder)
        if any(e.kind is EventKind.EXCLUDED and e.replica_name == name for e in events):
            return
        if until_step is not None and _step(folder, healthy) >= until_step:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not left out in {timeout} s")
        time.sleep(0.1)


def run(
    args: argparse.Namespace,
    slowdown: float | None,
    steps: int,
    folder: Path,
    policy: bool,
    model: str = "mlp",
) -> dict:
    """One job of ``model``'s groups; ``slowdown`` None: the clean run; ``policy``: the
    straggler policy on. Returns its measurements."""
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=args.groups - 1 if policy else args.groups,
        exclusion=ExclusionOptions(StragglerPolicy.EXCLUDE) if policy else None,
    )
    events, stop_file = folder / "events", folder / "stop_step"
    folder.mkdir(parents=True, exist_ok=True)
    names = [NAMES[model].format(i) for i in range(args.groups)]
    spawn: Callable[[int], Any]
    if model == "titan":
        spawn = lambda i: _spawn_titan(args, i, lighthouse.address(), folder, events)  # noqa: E731
    else:
        spawn = lambda i: spawn_rank(  # noqa: E731
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
    procs = [spawn(i) for i in range(args.groups)]
    slow = args.groups - 1 if slowdown is not None else None
    limits: list[CpuLimit] = []
    try:
        _wait_step(events, names[0], WARMUP_STEPS, procs, timeout=args.timeout)
        for i, proc in enumerate(procs):
            pids = _tree(proc.pid)
            if i == slow and args.slow_by == "duty-cycle":
                limits.append(CpuLimit(f"bench_{i}", pids, args.cpus))
                limits.append(CpuLimit(f"duty_{i}", pids, 1 / slowdown, duty_cycle=True))
            else:
                cpus = args.cpus / slowdown if i == slow else args.cpus
                limits.append(CpuLimit(f"bench_{i}", pids, cpus))
        limited_at = _step(events, names[slow] if slow is not None else names[0])
        if policy and slow is not None:
            until = limited_at + args.titan_detect_steps if model == "titan" else None
            _wait_excluded(events, names[slow], args.timeout, names[0], until)
        start_step = _step(events, names[0]) + 1  # the first step wholly under the limits
        _wait_step(events, names[0], start_step + steps, procs, timeout=args.timeout)
        reports = lighthouse.run_in_loop(lambda: lighthouse.state.speeds.reports_started)
        exclusions = lighthouse.run_in_loop(lambda: lighthouse.state.metrics.exclusions)
        if not policy and model == "mlp":
            write_stop_step(stop_file, max(_step(events, n) for n in names) + 2)
            for i, proc in enumerate(procs):
                proc.join(60)
                if proc.exitcode != 0:
                    raise RuntimeError(f"replica_{i} exit code {proc.exitcode}")
        # Under the policy a left-out group never reaches a stop step with every group in the
        # quorum, and the TorchTitan jobs have no stop step: the processes are killed below,
        # once measured.
    finally:
        for limit in limits:
            limit.close()
        for proc in procs:  # all at once: none waits on a peer killed before it
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        lighthouse.shutdown()
    batch = TITAN_BATCH if model == "titan" else BATCH_SIZE
    slow_name = names[slow] if slow is not None else None
    return {
        **_measure(read_events(events), names, start_step, steps, batch, slow_name, limited_at),
        "lighthouse_reports": reports,
        "exclusions": exclusions,
        "cpu_limit": limits[0].mechanism if limits else None,
    }


def _measure(
    all_events: list[Event],
    names: list[str],
    start_step: int,
    steps: int,
    batch: int,
    slow: str | None,
    limited_at: int,
) -> dict:
    """A run's healthy throughput over ``steps`` steps from ``start_step``, and its reports."""
    # The same groups in every run, the clean one too: all but the last, the one slowed.
    healthy = names[:-1]
    samples, seconds = 0, []
    for name in healthy:
        commits = _commits(all_events, name)
        window = [e for e in commits if start_step < e.step <= start_step + steps]
        first = next(e for e in commits if e.step == start_step)
        samples += len(window) * batch
        seconds.append(window[-1].time - first.time)
    started = [e for e in all_events if e.kind is EventKind.STRAGGLER and e["straggler"] is True]
    detection, cause = None, None
    if slow is not None:
        mine = [e for e in started if e.replica_name == slow]
        if mine:
            detection, cause = mine[0].step - limited_at, mine[0].get("cause")
    return {
        "seconds": max(seconds),
        "healthy_samples_per_s": samples / max(seconds),
        "detection_steps": detection,
        "detected_cause": cause,
        "reported_groups": sorted({e.replica_name for e in started}),
    }


def run_link(
    args: argparse.Namespace,
    link_mbit: float | None,
    steps: int,
    folder: Path,
    policy: bool,
    probes: bool = True,
) -> dict:
    """One MLP job on test hosts; ``link_mbit``: the last group's link limit after the
    warm-up (None: the clean run); ``probes``: the groups probe their links."""
    events, stop_file = folder / "events", folder / "stop_step"
    folder.mkdir(parents=True, exist_ok=True)
    names = [NAMES["mlp"].format(i) for i in range(args.groups)]
    hosts = ["L", *(f"G{i}" for i in range(args.groups))]
    slow = args.groups - 1 if link_mbit is not None else None
    limits: list[CpuLimit] = []
    with netns.HostNetwork(hosts) as net:
        lighthouse = net["L"]
        with (folder / "lighthouse.log").open("w") as log:
            lighthouse.popen(
                [
                    *(sys.executable, "-m", "torchtitan_ft.lighthouse.cli"),
                    *("--bind", f"{lighthouse.address}:{LINK_PORT}"),
                    *("--status_bind", f"{lighthouse.address}:{LINK_PORT + 1}"),
                    "--min_replicas",
                    str(args.groups - 1 if policy else args.groups),
                    *("--straggler_policy", "exclude" if policy else "off"),
                    "--straggler_link_probe_bytes",
                    str(LINK_PROBE_BYTES if probes else 0),
                    *("--straggler_link_probe_interval_ms", str(args.link_probe_interval_ms)),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs = []
        for i in range(args.groups):
            host = net[f"G{i}"]
            cfg = WorkerConfig(
                lighthouse_addr=f"http://{lighthouse.address}:{LINK_PORT}",
                replica=i,
                out_path=str(folder / f"out_{i}.pt"),
                stop_participants=args.groups,
                stop_step_file=str(stop_file),
                max_iterations=100_000,
                events_dir=str(events),
                work=args.work,
                shared_batches=True,
                timeout_s=60.0,
                host=host.address,
                hidden=LINK_HIDDEN,
            )
            with (folder / f"{i}.log").open("w") as log:
                command = [sys.executable, "-m", "torchtitan_ft.testing.mlp_rank"]
                procs.append(
                    _Job(
                        host.popen(
                            [*command, json.dumps(dataclasses.asdict(cfg))],
                            cwd=ROOT,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
                )
        try:
            for name in names:  # every group in (one that started late heals past steps)
                _wait_step(events, name, WARMUP_STEPS, procs, timeout=args.timeout)
            # and a full window of every group's link probes
            time.sleep(StragglerOptions().link_window * args.link_probe_interval_ms / 1000)
            limits = [CpuLimit(f"bench_{i}", [p.pid], args.cpus) for i, p in enumerate(procs)]
            limited_at = 0
            if slow is not None:
                limited_at = _step(events, names[slow])
                net[f"G{slow}"].limit(link_mbit)
                if policy:
                    _wait_excluded(events, names[slow], args.timeout, names[0], None)
            start_step = _step(events, names[0]) + 1
            _wait_step(events, names[0], start_step + steps, procs, timeout=args.timeout)
            metrics = _metrics(lighthouse, f"http://{lighthouse.address}:{LINK_PORT + 1}")
        finally:
            for limit in limits:
                limit.close()
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.join(5)
    slow_name = names[slow] if slow is not None else None
    return {
        **_measure(
            read_events(events), names, start_step, steps, BATCH_SIZE, slow_name, limited_at
        ),
        "lighthouse_reports": int(metrics["torchft_lighthouse_straggler_reports_total"]),
        "exclusions": int(metrics["torchft_lighthouse_straggler_exclusions_total"]),
        "cpu_limit": limits[0].mechanism if limits else None,
    }


def _metrics(host: netns.Host, base: str) -> dict[str, str]:
    """The lighthouse's /metrics, read from inside its host: series -> value."""
    url = base + "/metrics"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    out = host.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"the lighthouse's /metrics did not answer: {out.stderr[-500:]}")
    return dict(
        re.split(r" (?=\S+$)", line) for line in out.stdout.splitlines() if line and line[0] != "#"
    )


def _link_rows(
    args: argparse.Namespace, folder: Path, results: list[dict], cleans: dict
) -> dict[str, Any]:
    """The link rows (appended to ``results``, their clean run to ``cleans``); returns what
    the JSON says of them: the probes' cost, or why they were skipped."""
    rates = [float(x) for x in args.link_mbit.split(",") if x]
    if not rates:
        return {"skipped": "not asked (--link-mbit '')"}
    if (reason := netns.limit_unavailable_reason()) is not None:
        return {"skipped": f"no test hosts here: {reason}"}
    clean = run_link(args, None, args.steps, folder / "clean", policy=True)
    print(json.dumps({"link_clean": clean}), file=sys.stderr)
    bare = run_link(args, None, args.steps, folder / "clean_no_probes", policy=True, probes=False)
    print(json.dumps({"link_clean_no_probes": bare}), file=sys.stderr)
    cleans["mlp_link"] = (clean, args.steps)
    for mbit in rates:
        off = run_link(args, mbit, args.steps, folder / f"link_{mbit:g}", policy=False)
        print(json.dumps({f"link_{mbit:g}": off}), file=sys.stderr)
        on = run_link(args, mbit, args.steps, folder / f"link_{mbit:g}_on", policy=True)
        print(json.dumps({f"link_{mbit:g}_on": on}), file=sys.stderr)
        slowdown = round(clean["healthy_samples_per_s"] / off["healthy_samples_per_s"], 2)
        row = _row("mlp", slowdown, off, on, clean, args.groups, "link")
        results.append({**row, "link_mbit": mbit})
    return {
        "probe_bytes_each_way": LINK_PROBE_BYTES,
        "probe_interval_ms": args.link_probe_interval_ms,
        "healthy_throughput_ratio_probes_on_over_off": round(
            clean["healthy_samples_per_s"] / bare["healthy_samples_per_s"], 3
        ),
    }


def _row(
    model: str, slowdown: float, off: dict, on: dict, clean: dict, groups: int, slowed_by: str
) -> dict:
    slow_name = NAMES[model].format(groups - 1)
    return {
        "model": model,
        "slowed_by": slowed_by,
        "slowdown": slowdown,
        "healthy_throughput_ratio_policy_on": round(
            on["healthy_samples_per_s"] / clean["healthy_samples_per_s"], 3
        ),
        "healthy_throughput_ratio_policy_off": round(
            off["healthy_samples_per_s"] / clean["healthy_samples_per_s"], 3
        ),
        "detection_steps": off["detection_steps"],
        "detection_steps_policy_on": on["detection_steps"],
        "exclusions_policy_on": on["exclusions"],
        "detected_cause": on["detected_cause"],  # the policy-on run waits for the report
        "reported_groups": off["reported_groups"],
        "false_reports": sum(g != slow_name for g in off["reported_groups"]),
    }


def _clean_summary(clean: dict, steps: int) -> dict:
    return {
        "steps": steps,
        "seconds": round(clean["seconds"], 1),
        "healthy_samples_per_s": round(clean["healthy_samples_per_s"], 1),
        "false_reports": clean["lighthouse_reports"],
        "exclusions": clean["exclusions"],
    }


def _parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks.stragglers``."""
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
        "--work", type=int, default=400, help="MLP: matrix products per step (default 400)"
    )
    parser.add_argument(
        "--models",
        default="mlp",
        help="comma-separated models: mlp, titan (the llama3 debug model; default mlp)",
    )
    parser.add_argument(
        "--titan-slowdowns", default="4", help="TorchTitan: slowdown factors (default 4)"
    )
    parser.add_argument(
        "--titan-steps",
        type=int,
        default=10,
        help="TorchTitan: measured steps per run, the clean one too (default 10)",
    )
    parser.add_argument(
        "--slow-by",
        choices=("quota", "duty-cycle"),
        default="quota",
        help="how the slowed group is slowed: quota (default): its CPU quota is --cpus / "
        "slowdown; duty-cycle: the others' quota, and stopped 1 - 1/slowdown of the time "
        "(SIGSTOP/SIGCONT), which slows it against its peers however loaded the machine is "
        "(a quota does not where every process already gets less)",
    )
    parser.add_argument(
        "--titan-detect-steps",
        type=int,
        default=30,
        help="TorchTitan, policy on: steps to wait for the exclusion before measuring without "
        "one (default 30)",
    )
    parser.add_argument(
        "--link-mbit",
        default="5",
        help="comma-separated link limits (Mbit/s) of the slowed group for the link rows, on "
        "test hosts (needs root); '' skips them (default 5)",
    )
    parser.add_argument(
        "--link-probe-interval-ms",
        type=int,
        default=1000,
        help="link rows: the lighthouse's --straggler_link_probe_interval_ms (default 1000)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds a run may take (default 900)"
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    for model in models:
        if model not in NAMES:
            parser.error(f"--models: {model!r} is not one of {sorted(NAMES)}")
    folder = Path(tempfile.mkdtemp(prefix="bench_stragglers_"))
    results: list[dict] = []
    cleans: dict[str, tuple[dict, int]] = {}
    try:
        for model in models:
            titan = model == "titan"
            slowdowns = [
                float(x)
                for x in (args.titan_slowdowns if titan else args.slowdowns).split(",")
                if x
            ]
            steps = args.titan_steps if titan else args.steps
            clean_steps = args.titan_steps if titan else args.clean_steps or args.steps
            work = folder / model
            clean = run(args, None, clean_steps, work / "clean", True, model)
            print(json.dumps({f"{model}_clean": clean}), file=sys.stderr)
            cleans[model] = (clean, clean_steps)
            for slowdown in slowdowns:
                off = run(args, slowdown, steps, work / f"slow_{slowdown:g}", False, model)
                print(json.dumps({f"{model}_slowdown_{slowdown:g}": off}), file=sys.stderr)
                on = run(args, slowdown, steps, work / f"slow_{slowdown:g}_on", True, model)
                print(json.dumps({f"{model}_slowdown_{slowdown:g}_on": on}), file=sys.stderr)
                slowed_by = "cpu_quota" if args.slow_by == "quota" else "duty_cycle"
                results.append(_row(model, slowdown, off, on, clean, args.groups, slowed_by))
        link_info = (
            _link_rows(args, folder / "link", results, cleans)
            if "mlp" in models
            else {"skipped": "the link rows run with --models mlp"}
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    first, first_steps = cleans[models[0]]
    out = {
        "benchmark": "stragglers",
        "machine": machine(),
        "command": shlex.join(["python", "-m", "benchmarks.stragglers", *sys.argv[1:]]),
        "setup": (
            f"{args.groups} replica groups, each under a CPU limit of {args.cpus} CPUs "
            f"({first['cpu_limit']}); MLP: {args.work} matrix products per step; TorchTitan: "
            "the llama3 debug model, configs/debug_ft_cpu.toml, one process per group; the "
            + (
                "last group slowed by limiting it to --cpus/slowdown"
                if args.slow_by == "quota"
                else "last group slowed by a SIGSTOP/SIGCONT duty cycle of 1/slowdown on top"
            )
            + "; link rows: the groups on test hosts, the last one's link held to --link-mbit"
            + "; lighthouse straggler "
            "report at its defaults; policy off: min_replicas = the groups; policy on (and the "
            "clean run): --straggler_policy exclude, min_replicas one less, throughput "
            "measured from the exclusion on"
        ),
        "targets": {
            "healthy_throughput_ratio_policy_on": ">= 0.9 at slowdown 4",
            "detection_steps": "<= 10",
            "clean_run": "0 false reports, 0 exclusions",
        },
        "results": results,
        "clean_run": _clean_summary(first, first_steps),
        "clean_runs": {m: _clean_summary(c, n) for m, (c, n) in cleans.items()},
        "link": link_info,
    }
    if "titan" in models:
        out["titan_reduced"] = (
            f"TorchTitan: slowdowns {args.titan_slowdowns} and {args.titan_steps} measured "
            "steps per run (the MLP's: --slowdowns, --steps): a debug-model step takes seconds "
            f"at {args.cpus} CPUs, so the full row does not fit this 2-core machine in minutes"
        )
    else:
        out["not_done"] = "TorchTitan row: run with --models mlp,titan"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
