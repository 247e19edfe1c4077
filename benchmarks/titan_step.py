"""TorchTitan step times on this CPU: 1 process, native HSDP 2x2 and FT 2x2, per compute dtype;
prints JSON.

Three jobs of the llama3 debugmodel (small shape: batch 2 x seq 256 per rank, gloo on
127.0.0.1, one OpenMP thread per process), run one after the other, ``--rounds`` times in
rotating order so all see the same machine load:

- ``single``: one process (``run_train.sh`` with NGPU=1, ``configs/debug_cpu.toml``);
- ``native``: TorchTitan's own HSDP 2x2 (``run_train.sh`` with NGPU=4,
  ``data_parallel_replicate_degree=2``, ``data_parallel_shard_degree=2``; same config);
- ``ft``: 2 replica groups x 2 FSDP ranks with fault tolerance (two ``run_train.sh`` with NGPU=2,
  ``configs/debug_ft_cpu.toml``: per-step sync, async quorum, Manager + managed all-reduce hook,
  a real lighthouse in this process).

Each ``--dtypes`` value runs all three with ``training.mixed_precision_param`` set to it, e.g.
``--dtypes bfloat16 float32`` measures TorchTitan's default (bf16) against fp32 in one run.
A step's time is TorchTitan's own ``time_metrics/end_to_end(s)`` (read from the TensorBoard
event files, ``log_freq`` 1); for FT the slower of the two groups at that step. The first
``--warmup`` steps are dropped (first quorum, gloo setup, the init_sync heal). The JSON records
the CPU (model, torch capability, bf16 support) and the dtype this machine would choose.

    python -m benchmarks.titan_step [--steps 14] [--warmup 4] [--rounds 1] [--dtypes float32]
        [--releases 0.2.2 0.3.0]

``--releases`` runs the jobs of each TorchTitan release named, side by side in one rotation
(default: the installed one): 0.3.0's with ``.cache/tt030/venv``'s Python and the same TOML
files over the registry's ``llama3_debugmodel`` (``CONFIG_FILE``, which ``run_train.sh`` passes
as ``--job.config_file`` on 0.3.0; the trainer takes ``parallelism.spmd_backend``
``partial_dtensor`` for 2+ ranks on a CPU, where 0.3.0's default stops FSDP). Each row of
``results`` names its release and dtype; ``ratio_0_3_0_over_0_2_2``
divides the FT / native ratios of the two releases.

With ``--link-mbit`` (e.g. ``--link-mbit unlimited,1000,100``) the replicate dimension crosses
a link of that rate instead (needs root, ``ip`` and ``tc``: hosts made of network namespaces,
``torchtitan_ft.testing.netns``; ``tc tbf`` on both hosts' links, as ``benchmarks.wan``):

- ``native``: TorchTitan HSDP 2x2 as one torchrun job of 2 nodes, node 0 (ranks 0, 1) on host
  A and node 1 (ranks 2, 3) on host B; each FSDP pair is on one host, each replicate pair
  crosses the link;
- ``ft``: replica group 0 (2 FSDP ranks) on host A, group 1 on host B, the lighthouse on a
  third host L;
- ``compute``: one group of 2 FSDP ranks alone on host A (no replicate dimension): the step
  without any cross-host traffic, once per round.

Per link the JSON ``links`` has ``link_mbit``, ``measured_mbit`` (TCP from A to B, probed with
``benchmarks._link_probe``), the median ``native_step_s`` / ``ft_step_s`` and their ``ratio``,
``compute_s``, each job's exposed communication (step - compute), and ``ideal_allreduce_s``:
the gradient's bytes (fp32, every parameter: both ranks of a host send their shard over the
same link) x 2(N-1)/N, N = 2 hosts, / the measured rate. ``--dtypes`` is float32 only there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import machine
from torchtitan_ft.testing.netns import INTERFACE, Host, HostNetwork, limit_unavailable_reason
from torchtitan_ft.titan.releases import Release, installed, installed_version
from torchtitan_ft.titan.releases.job import TitanJob, command

ROOT = Path(__file__).resolve().parent.parent
STEP_TAG = "time_metrics/end_to_end(s)"
TARGET = 1.05


RELEASES = ("0.2.2", "0.3.0")
"""TorchTitan releases ``--releases`` may name."""

RELEASE_PYTHONS = {
    "0.2.2": ROOT / ".cache" / "tt022" / "venv" / "bin" / "python",
    "0.3.0": ROOT / ".cache" / "tt030" / "venv" / "bin" / "python",
}
"""Each release's environment (``scripts/install_torchtitan_env.sh <release>``), used for a
release other than this Python's."""


def release_python(release: str | None) -> str:
    """The Python that runs ``release``'s jobs (None: this one's)."""
    if release is None or release == installed_version():
        return sys.executable
    python = RELEASE_PYTHONS[release]
    if not python.exists():
        raise SystemExit(
            f"--releases {release}: no {python} (scripts/install_torchtitan_env.sh {release})"
        )
    return str(python)


def _launch(
    dump: Path,
    ngpu: int,
    steps: int,
    config: str,
    *args: str,
    env: dict,
    host: Host | None = None,
    release: str | None = None,
) -> Any:
    """``run_train.sh`` of ``configs/<config>`` (inside ``host`` when given, else here) with
    ``release``'s Python (None: this one's): the TOML file as ``CONFIG_FILE`` on both releases
    (on 0.3.0 over the registry config its ``[model]`` names)."""
    job = TitanJob(
        dump_folder=dump,
        steps=steps,
        config_file=ROOT / "configs" / config,
        ngpu=ngpu,
        python=release_python(release),
        flags=("--metrics.enable_tensorboard", "--metrics.log_freq=1", *args),
        env={"LOG_RANK": "0", **env},
        prefix=tuple(host.command([])) if host is not None else (),
    )
    named = None if release is None else Release(release)
    return command(job, named).popen(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: Any, timeout: float) -> None:
    output = proc.communicate(timeout=timeout)[0]
    if proc.returncode != 0:
        raise RuntimeError(f"training run failed ({proc.returncode}):\n{output[-3000:]}")


def _step_times(run_dir: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(STEP_TAG)}


def _run_one(
    work: Path, ngpu: int, steps: int, timeout: float, release: str, *args: str
) -> dict[int, float]:
    proc = _launch(work, ngpu, steps, "debug_cpu.toml", *args, env={}, release=release)
    _finish(proc, timeout)
    return _step_times(_tb_dir(work))


def run_single(
    work: Path, steps: int, timeout: float, release: str, *args: str
) -> dict[int, float]:
    """One process (no FSDP, no FT): {step: seconds}."""
    return _run_one(work / "single", 1, steps, timeout, release, *args)


def run_native(
    work: Path, steps: int, timeout: float, release: str, *args: str
) -> dict[int, float]:
    """Native TorchTitan HSDP 2x2: {step: seconds}."""
    hsdp = ("--parallelism.data_parallel_replicate_degree=2",)
    hsdp += ("--parallelism.data_parallel_shard_degree=2",)
    return _run_one(work / "native", 4, steps, timeout, release, *hsdp, *args)


def run_ft(work: Path, steps: int, timeout: float, release: str, *args: str) -> dict[int, float]:
    """2 replica groups x 2 FSDP ranks with FT: {step: seconds of the slower group}."""
    from torchtitan_ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    procs = []
    try:
        for r in range(2):
            procs.append(
                _launch(
                    work / f"ft{r}",
                    2,
                    steps,
                    "debug_ft_cpu.toml",
                    f"--fault_tolerance.replica_id={r}",
                    *args,
                    env={"TORCHFT_LIGHTHOUSE": lighthouse.address()},
                    release=release,
                )
            )
        for proc in procs:
            _finish(proc, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    per_group = [_step_times(_tb_dir(work / f"ft{r}", f"*/replica_{r}")) for r in range(2)]
    return {s: max(g[s] for g in per_group) for s in per_group[0] if all(s in g for g in per_group)}


RDZV_PORT = 29400
LIGHTHOUSE_PORT = 29510


def _tb_dir(dump: Path, pattern: str = "*") -> Path:
    (run_dir,) = [d for d in (dump / "tb").glob(pattern) if d.is_dir()]
    return run_dir


def _finish_all(procs: list[Any], timeout: float) -> None:
    try:
        for proc in procs:
            _finish(proc, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def run_compute_on(net: HostNetwork, work: Path, steps: int, timeout: float) -> dict[int, float]:
    """One group of 2 FSDP ranks alone on host A: the step with no cross-host traffic."""
    dump = work / "compute"
    _finish_all([_launch(dump, 2, steps, "debug_cpu.toml", env={}, host=net["A"])], timeout)
    return _step_times(_tb_dir(dump))


def run_native_across(net: HostNetwork, work: Path, steps: int, timeout: float) -> dict[int, float]:
    """Native HSDP 2x2, one torchrun node per host (A, B): {step: seconds of rank 0}."""
    hsdp = (
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=2",
    )
    rdzv = f"{net['A'].address}:{RDZV_PORT}"
    procs = []
    for name in ("A", "B"):
        host = net[name]
        env = {"NNODES": "2", "RDZV_ENDPOINT": rdzv, "LOCAL_ADDR": host.address}
        env["GLOO_SOCKET_IFNAME"] = INTERFACE  # TorchTitan's own groups span the hosts
        dump = work / f"native_{name}"
        procs.append(_launch(dump, 2, steps, "debug_cpu.toml", *hsdp, env=env, host=host))
    _finish_all(procs, timeout)
    return _step_times(_tb_dir(work / "native_A"))


def run_ft_across(
    net: HostNetwork, lighthouse: str, work: Path, steps: int, timeout: float
) -> dict[int, float]:
    """FT 2 groups x 2 ranks, group 0 on host A, group 1 on host B: {step: slower group}."""
    procs = []
    for r, name in enumerate(("A", "B")):
        host = net[name]
        args = (f"--fault_tolerance.replica_id={r}", f"--fault_tolerance.hostname={host.address}")
        env = {"TORCHFT_LIGHTHOUSE": lighthouse}
        procs.append(
            _launch(work / f"ft{r}", 2, steps, "debug_ft_cpu.toml", *args, env=env, host=host)
        )
    _finish_all(procs, timeout)
    per_group = [_step_times(_tb_dir(work / f"ft{r}", f"*/replica_{r}")) for r in range(2)]
    return {s: max(g[s] for g in per_group) for s in per_group[0] if all(s in g for g in per_group)}


def gradient_bytes() -> int:
    """Bytes of the debug model's gradient in fp32 (every parameter; what crosses the link)."""
    from torchtitan_ft.titan import cpu_compat

    cpu_compat.install()  # before TorchTitan is imported
    from torchtitan.config import ConfigManager

    from torchtitan_ft.titan.replica_axis import meta_model

    config = ConfigManager().parse_args(
        ["--job.config_file", str(ROOT / "configs" / "debug_cpu.toml")]
    )
    return sum(p.numel() for p in meta_model(config).parameters()) * 4


def ideal_allreduce_s(nbytes: int, hosts: int, mbit: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` across ``hosts`` needs on a link of ``mbit``:
    each host sends (and receives) ``nbytes x 2(N-1)/N``."""
    return nbytes * 2 * (hosts - 1) / hosts * 8 / (mbit * 1e6)


def _parse_links(text: str) -> list[float | None]:
    from benchmarks.wan import _parse_link

    return [_parse_link(part) for part in text.split(",")]


def links_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """``--link-mbit``: native HSDP 2x2 and FT 2x2 with the replicate dimension across a link
    of each rate (module docstring); prints and returns the JSON."""
    from benchmarks.wan import probe

    reason = limit_unavailable_reason()
    if reason is not None:
        parser.exit(2, f"{parser.prog}: cannot make hosts here: {reason}\n")
    if args.dtypes != ["float32"]:
        parser.error("--link-mbit measures float32 only; leave --dtypes out")
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    nbytes = gradient_bytes()
    jobs = ("native", "ft")
    steps: dict[tuple[float | None, str], list[float]] = {}
    compute: list[float] = []
    measured: dict[float | None, float] = {}
    work = Path(tempfile.mkdtemp(prefix="titan_link_"))
    try:
        with HostNetwork(["L", "A", "B"]) as net:
            lighthouse = _start_lighthouse(net["L"], work / "lighthouse.log")
            for i in range(args.rounds):
                for host in (net["A"], net["B"]):
                    host.limit(None)
                times = run_compute_on(net, work / f"round{i}", args.steps, args.timeout)
                compute += _after_warmup(times, args.warmup)
                for link in args.link_mbit:
                    for host in (net["A"], net["B"]):
                        host.limit(link)
                    if link not in measured:
                        measured[link] = probe(net["A"], net["B"], link)
                    order = jobs if i % 2 == 0 else jobs[::-1]
                    for job in order:
                        folder = work / f"round{i}" / f"{link or 'unlimited'}" / job
                        if job == "native":
                            times = run_native_across(net, folder, args.steps, args.timeout)
                        else:
                            times = run_ft_across(net, lighthouse, folder, args.steps, args.timeout)
                        steps.setdefault((link, job), []).extend(_after_warmup(times, args.warmup))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    compute_s = _median(compute)
    links = []
    for link in args.link_mbit:
        native, ft = _median(steps[(link, "native")]), _median(steps[(link, "ft")])
        links.append(
            {
                "link_mbit": link,
                "measured_mbit": round(measured[link], 1),
                "native_step_s": native,
                "ft_step_s": ft,
                "ratio": round(ft / native, 4),
                "compute_s": compute_s,
                "native_exposed_comm_s": round(native - compute_s, 4),
                "ft_exposed_comm_s": round(ft - compute_s, 4),
                "ideal_allreduce_s": round(ideal_allreduce_s(nbytes, 2, measured[link]), 4),
                "native_step_all_s": [round(t, 4) for t in steps[(link, "native")]],
                "ft_step_all_s": [round(t, 4) for t in steps[(link, "ft")]],
            }
        )
    command = ["python", "-m", "benchmarks.titan_step"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--rounds", str(args.rounds)]
    command += ["--link-mbit", ",".join(str(link or "unlimited") for link in args.link_mbit)]
    report = {
        "command": " ".join(command),
        "machine": machine(),
        "load_avg_1m_at_start": load_at_start,
        "what": "llama3 debugmodel, batch 2 x seq 256 per rank, gloo, CPU, float32",
        "hosts": "network namespaces on one bridge (torchtitan_ft.testing.netns); tc tbf on "
        "the links of hosts A and B; lighthouse on host L",
        "native": "TorchTitan HSDP 2x2: torchrun, 2 nodes (A, B) x 2 ranks",
        "ft": "2 replica groups x 2 FSDP ranks, group 0 on A, group 1 on B, per-step FT",
        "compute": "1 group of 2 FSDP ranks alone on A (no replicate dimension)",
        "gradient_bytes": nbytes,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "links": links,
        "ft_over_native_target": TARGET,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return report


def _start_lighthouse(host: Host, log: Path) -> str:
    """A lighthouse for 2 groups on ``host`` (stopped with the network); its URL."""
    with log.open("w") as out:
        host.popen(
            [
                *(sys.executable, "-m", "torchtitan_ft.lighthouse.cli"),
                *("--bind", f"{host.address}:{LIGHTHOUSE_PORT}"),
                *("--min_replicas", "2", "--status_bind", "off"),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return f"http://{host.address}:{LIGHTHOUSE_PORT}"


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for descendants so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _after_warmup(times: dict[int, float], warmup: int) -> list[float]:
    return [t for s, t in sorted(times.items()) if s > warmup]


JOBS = {"single": run_single, "native": run_native, "ft": run_ft}


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks.titan_step``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--releases",
        nargs="+",
        choices=RELEASES,
        default=None,
        help="TorchTitan releases to measure side by side, in rotating order (default: the "
        "installed one); 0.3.0 runs with .cache/tt030/venv's Python",
    )
    parser.add_argument(
        "--link-mbit",
        type=_parse_links,
        default=None,
        help="comma-separated link rates in Mbit/s or 'unlimited': put the replicate "
        "dimension across a link of each rate (hosts made of network namespaces; root)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    from torchtitan_ft.titan.compute_dtype import choose_param_dtype, probe_cpu

    parser = _parser()
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be < --steps ({args.steps})")
    if args.link_mbit is not None:
        return links_main(args, parser)

    work = Path(tempfile.mkdtemp(prefix="titan_step_"))
    chosen = args.releases or [installed().value]
    kinds = [(rel, dtype, job) for rel in chosen for dtype in args.dtypes for job in JOBS]
    steps: dict[tuple[str, str, str], list[float]] = {kind: [] for kind in kinds}
    cpu_s: dict[tuple[str, str, str], float] = dict.fromkeys(kinds, 0.0)
    started, load_at_start = time.perf_counter(), os.getloadavg()[0]
    try:
        for i in range(args.rounds):
            order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
            for release, dtype, job in order:
                cpu_before = _cpu_seconds()
                times = JOBS[job](
                    work / f"round{i}" / release / dtype,
                    args.steps,
                    args.timeout,
                    release,
                    f"--training.mixed_precision_param={dtype}",
                )
                cpu_s[(release, dtype, job)] += _cpu_seconds() - cpu_before
                steps[(release, dtype, job)] += _after_warmup(times, args.warmup)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results = []
    for release in chosen:
        for dtype in args.dtypes:
            kind = (release, dtype)
            medians = {job: _median(steps[(*kind, job)]) for job in JOBS}
            results.append(
                {
                    "release": release,
                    "dtype": dtype,
                    **{f"{job}_median_step_s": m for job, m in medians.items()},
                    **{f"{job}_step_s": [round(t, 4) for t in steps[(*kind, job)]] for job in JOBS},
                    # Whole jobs incl. ~8 s of imports/setup per process.
                    **{f"{job}_job_cpu_s": round(cpu_s[(*kind, job)], 1) for job in JOBS},
                    "ratio_ft_over_native": round(medians["ft"] / medians["native"], 4),
                }
            )
    ratios = {}
    for dtype in args.dtypes:
        row = {r["release"]: r["ratio_ft_over_native"] for r in results if r["dtype"] == dtype}
        if set(RELEASES) <= row.keys():
            ratios[dtype] = round(row["0.3.0"] / row["0.2.2"], 3)
    bf16_over_fp32 = {}
    for release in chosen:
        rows = {r["dtype"]: r for r in results if r["release"] == release}
        if {"bfloat16", "float32"} <= rows.keys():
            bf16_over_fp32[release] = {
                job: round(
                    rows["bfloat16"][f"{job}_median_step_s"]
                    / rows["float32"][f"{job}_median_step_s"],
                    2,
                )
                for job in JOBS
            }
    command = ["python", "-m", "benchmarks.titan_step"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--rounds", str(args.rounds), "--dtypes", *args.dtypes, "--releases", *chosen]
    report = {
        "command": " ".join(command),
        "machine": machine(),
        "load_avg_1m_at_start": load_at_start,
        "dtype_chosen_here_when_unset": choose_param_dtype("cpu", probe_cpu(), None).param_dtype,
        "what": "llama3 debugmodel, batch 2 x seq 256 per rank, gloo, CPU",
        "single": "one process, no FSDP (TorchTitan autocast in the dtype)",
        "native": "TorchTitan HSDP dp_replicate=2 x dp_shard=2 (one torchrun job, NGPU=4)",
        "release": "configs/debug_cpu.toml, debug_ft_cpu.toml on both; 0.3.0: over the "
        "registry's llama3_debugmodel, spmd_backend partial_dtensor (the trainer's CPU swap)",
        "ft": "2 replica groups x 2 FSDP ranks, per-step FT (async quorum), real lighthouse",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "results": results,
        "ratio_0_3_0_over_0_2_2": ratios,
        "bfloat16_over_float32": bf16_over_fp32,
        "ft_over_native_target": TARGET,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
