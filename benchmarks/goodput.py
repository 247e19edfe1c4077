"""Goodput under routine failures: the same TorchTitan job under the same seeded fault schedule,
once per recovery method, one after the other; prints JSON and draws a PNG.

    python -m benchmarks.goodput [--duration 600] [--mean-interval 30] [--seed 27]
    python -m benchmarks.goodput --quick          # CI: short, 1 rank per group
    python -m benchmarks.goodput --methods ideal torchtitan_ft torchtitan_ft_spare \
        --cpus-per-group 0.35                     # with the hot spare's row (2 cores)

The job: the llama3 debugmodel (``configs/debug_ft_cpu.toml``: batch 2 x seq 256 per rank,
fp32), ``--groups`` (3) replica groups of ``--ranks`` (2) FSDP ranks, each group one
``./run_train.sh`` (torchrun) with its own CPU budget (``testing.cpulimit``: a cgroup CFS quota of
``--cpus-per-group`` CPUs, on this machine cgroup v1 ``cpu.cfs_quota_us``, with the top CPU weight
so that the quota is also what the group gets beside the machine's other processes, made under
the benchmark's own cgroup), so a dead group's CPU does not speed up the survivors and a busy
machine does not slow them down. The lighthouse has a budget of its own
(``--cpus-lighthouse``). Keep the budgets' sum below the CPU the benchmark's cgroup has (the
benchmark itself needs a little): it says so in one line when they take 90 % or more of the
machine. The trainer is ``torchtitan_ft.testing.goodput_worker`` (this project's, plus one JSON
line per step: committed, data ledger, participants, loss, RSS, descriptors). A killed rank's
group is restarted by torchrun (``MAX_RESTARTS``) warm, from a pre-imported zygote
(``fault_tolerance.replacement = "zygote"``, docs/titan.md), or cold with ``--replacement cold``.

Methods, in this order, under the same schedule (times after launch):

* ``ideal``: per-step FT, no faults, for ``--duration`` seconds. Its committed samples at the
  end are the target S of the others, its time to them the baseline.
* ``torchtitan_ft``: per-step FT; each group in a network namespace host of its own
  (``testing.netns``), the lighthouse in another; torchrun restarts a group's workers after a
  rank dies (``MAX_RESTARTS``), nothing is restarted by hand.
* ``torchtitan_ft_spare`` (only when ``--methods`` names it): torchtitan_ft with a hot spare
  (docs/titan.md, "A hot spare group"): ``--groups`` + 1 groups, each with
  ``fault_tolerance.world_size_mode = "fixed_with_spares"``, ``group_size = --groups + 1`` and
  ``min_replica_size = --groups`` (as ``benchmarks.recovery --titan spare``), so that exactly
  ``--groups`` groups average each step (the lowest replica ids in step) and the spare, which
  takes every update without a slot and stays identical, takes a lost group's slot at the next
  quorum. Each group has the same quota as torchtitan_ft's, so the spare costs one group's CPU
  more: with the default ``--cpus-per-group`` that is more than 2 cores leave (lower it, for
  every method of the run). Its faults are the schedule's times, kinds and ranks with the
  victims drawn again over the ``--groups`` + 1 groups (``_goodput_inject.spare_schedule``):
  the schedule's victims are replica ids below ``--groups``, the spare's job's slot holders
  while all is well, so as drawn they would never hit the spare, whose hardware fails as often
  as any group's (its death costs the step in flight, as a participant's does). Two groups
  lost together leave fewer than ``min_replica_size``: no step commits until one is back.
  Here a group is back (``rejoin_s``) and holds the state once it commits a step it did not
  heal in, in a slot or as the spare. Its samples are the data ledger's, as torchtitan_ft's:
  a step adds the batches of the groups that held a slot in it, so the spare's steps without
  one add none (its slice is read only while it holds a slot); the ledger check and
  ``groups_identical`` cover every launched group, the spare included.
* ``torchft``: TorchTitan 0.2.2's own FT trainer (``torchtitan.experiments.ft.train``) on the
  torchft 0.2.0 reference under ``.cache``, with torchft's lighthouse, through a recording
  subclass (``benchmarks._goodput_torchft_worker``; nothing of either is changed): the same
  groups, quotas, timeouts (torchft's through its ``TORCHFT_*`` variables) and schedule;
  torchrun restarts a group cold, as TorchTitan launches it. Its groups run on loopback
  (torchft's Manager advertises the host name), so ``link_down`` faults are recorded as not
  injected, with the reason. Its samples are torchft's committed batches; exactly once is
  checked per group from the batches its loader gave out (TorchTitan's loader reads on whether
  the step commits or not, and a new process resumes from TorchTitan's FT data loader
  checkpoint, saved after every step). ``skipped`` with the
  reason when it cannot run here (no reference, or TorchTitan 0.3.0). With one rank per group
  (``--quick``) TorchTitan applies no FSDP, so its cross-group all-reduce hook is never set and
  its groups train apart: compare it with 2 or more ranks.
* ``checkpoint_restart``: TorchTitan's own HSDP over the same ranks (one torchrun job, replicate
  ``--groups`` x shard ``--ranks``, no FT), DCP checkpoints every ``--checkpoint-every`` steps;
  every fault restarts the whole job from the last checkpoint (as a supervisor would; a
  lighthouse fault does not concern it). Its quota: the ranks of each group's share (local
  ranks ``g * ranks`` on) in a cgroup of the per-group quota, as the FT groups: a cgroup weighs
  as one process against the machine's other processes, so the split matters under load.

Every method but ideal writes TorchTitan checkpoints every ``--checkpoint-every`` steps, as users
run them (the FT methods too: a restarted group loads the newest at start, and a job that lost
its state resumes from it), so the time spent writing them is part of its figure; ideal writes
none.

Faults (``testing.faults.fault_schedule``: seeded, exponential intervals of mean
``--mean-interval``, kinds in shuffled rounds): SIGKILL of one rank; SIGSTOP of one rank for
``--hang-s`` (longer than the process-group timeout), then SIGCONT; a group's link down for
``--link-down-s``; the lighthouse SIGKILLed and restarted after ``--lighthouse-down-s`` (with
``lighthouse_group_away``, a rank of one group killed with it); a group killed and then its donor
killed as soon as it starts healing (the donor only while another group holds the state); two
groups killed together; with ``--kinds ... correlated`` (not by default), a rank of every group
killed at once about once in 50 faults, which loses the job's state on purpose. A fault fires
once a group holding the job's state survives it (``testing.faults.fault_victims``; it waits
until then), and a victim that does not hold the state is replaced by the next group that does.
The benchmark's parts: ``_goodput_launch`` (the processes), ``_goodput_inject`` (the faults),
``_goodput_accounts`` (the figures).

Per method (JSON ``methods.<name>``): ``time_to_target_s``, ``goodput`` (ideal's time / this),
``launched_groups``, ``cpus_quota`` (the launched groups' CPU quotas added up: a hot spare's
counts, the lighthouse's does not, as checkpoint-restart runs none), ``cpu_s_to_target``
(``cpus_quota`` x ``time_to_target_s``), ``samples_per_cpu_s`` (the target samples per such
CPU-second), ``goodput_per_cpu`` (this method's ``samples_per_cpu_s`` / ideal's: its goodput
with the CPU it was given paid for; the same as ``goodput`` for a method with ``--groups``
groups, ``--groups`` / (``--groups`` + 1) of it for the spare's),
``checkpoint_every_steps`` (null for ideal), ``faults_injected``, ``faults_survived`` (the job
committed again, the victim group took part again, and the job did not lose its state after
it), ``job_restarts`` (the native job's restarts,
plus each loss of the per-step job's state: ``state_losses``, each with its time, the job step it
fell back from, the step it started over at, the groups and ``samples_rolled_back``; after a
loss the job's samples count again from the state it went on from, so ``time_to_target_s``
waits for the undone steps), ``samples_rolled_back`` (samples that a restart or a state loss
undid and the job trained again: counted here, not as trained twice), ``group_restarts``
(torchrun's), ``samples_lost`` /
``samples_duplicated`` (ledger check for FT, checkpoint lineage for checkpoint-restart),
``groups_identical`` (every group's rank k holds the same model and optimizer bytes),
for torchft also ``samples_lost_by`` (what the records show of each lost batch: read while its
group healed, read in a step that did not commit, or read by no record) and ``divergence``
(the first committed step after which its groups' weights differ, each group's learning rate
in it and whether it healed in it; null when they never part),
``second_lines`` (processes that committed below the job's step instead of healing: the job's
state was lost; empty when it never was),
``final_loss`` (and ``ideal_loss``), for this project's methods ``recoveries`` (each
recovery of the event stream, ``torchtitan_ft.recoveries``: group, kind, how it was noticed,
phases, ``phases_sum_s``, ``measured_s`` from the workers' records, and ``within``: the phases
add up to it within 5 %; ``_goodput_accounts.recovery_checks`` says what is measured) and
``recoveries_within_5pct`` (every complete one is; null when there is none), ``faults`` (per
fault: ``stall_s`` until the job's committed samples pass those at the fault, ``rejoin_s``
until the victim takes part again, ``samples_rolled_back``, ``state_lost`` when the job lost
its state after it), ``usage`` (RSS and descriptors of each long-lived rank at its first and
last record). Top level:
``replacement_s`` (median ``rejoin_s`` of torchtitan_ft's SIGKILLs of a ``./run_train.sh``
rank), ``timeouts``, ``cpu_quota``, ``machine``. Everything is read from the workers' records
and the Managers' event streams, never from log wording.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import machine
from benchmarks._goodput_accounts import Accounts, Record, RecordReader, fill_participants
from benchmarks._goodput_inject import Injector
from benchmarks._goodput_job import CONFIG, DEFAULT_METHODS, ROOT, Method, Options, launched_groups
from benchmarks._goodput_launch import Launcher
from benchmarks._reference import REFERENCE_DIR, RUNTIME_DEPS_DIR
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.faults import DEFAULT_KINDS, Fault, FaultKind, fault_schedule
from torchtitan_ft.testing.goodput_accounting import samples_per_cpu_s
from torchtitan_ft.testing.mlp import write_stop_step

STOP_MARGIN_STEPS = 2
"""After the target: every group trains this many more steps together, then stops and dumps."""


class MethodRun:
    """One method's run: its processes (:class:`Launcher`), the schedule's faults
    (:class:`Injector`) and its figures (:class:`Accounts`), tied together by :meth:`run`."""

    def __init__(
        self, method: Method, opts: Options, schedule: list[Fault], target: int | None = None
    ) -> None:
        self.method, self.opts, self.schedule = method, opts, schedule
        self.target = target
        """Samples to reach (None: the ideal run, which sets it)."""
        self.folder = opts.out / method.value
        shutil.rmtree(self.folder, ignore_errors=True)
        (self.folder / "events").mkdir(parents=True)
        self.reader = RecordReader(self.folder)
        self.launcher = Launcher(method, opts, self.folder)

    def run(self) -> dict[str, Any]:
        try:
            self.launcher.prepare()
            started = time.time()
            self.accounts = Accounts(self.method, self.opts, started)
            self.injector = Injector(self.launcher, self.opts, self.schedule, started)
            self.launcher.start()
            self._drive()
            finals = self._stop()
        finally:
            self.launcher.close()
        return self.accounts.summary(
            self.records(),
            finals,
            self.injector.injected,
            self.launcher.job_restarts,
            self.target,
            events_dir=(
                self.folder / "events"
                if self.method in (Method.IDEAL, Method.TORCHTITAN_FT, Method.TORCHTITAN_FT_SPARE)
                else None
            ),
        )

    def records(self) -> list[Record]:
        records = self.reader.read()
        if self.method is Method.TORCHFT:
            fill_participants(records)
        return records

    def _drive(self) -> None:
        """Runs the schedule until the target (or ``--duration`` for ideal). The schedule's
        clock starts once the job trains (``Accounts.t0``): start-up, which takes minutes on a
        loaded machine, is neither measured nor hit."""
        opts, accounts, injector = self.opts, self.accounts, self.injector
        length = opts.duration_s if self.target is None else opts.duration_s * opts.cap_factor
        last_print = 0.0
        while True:
            now = injector.now()
            records = self.records()
            samples = accounts.samples_now(records)
            if accounts.t0 is None:
                if accounts.training_started(records):
                    accounts.t0 = now
                    accounts.load_at_start = os.getloadavg()[0]
                elif now > opts.startup_limit_s:
                    raise RuntimeError(
                        f"{self.method}: the job did not train within {opts.startup_limit_s} s "
                        f"of its launch; logs in {self.folder}"
                    )
            else:
                if self.target is not None and samples >= self.target:
                    return
                if now >= accounts.t0 + length:
                    return
                injector.tick(accounts.t0, records)
            injector.end_due(now)
            self.launcher.tend()
            if now - last_print > 15:
                last_print = now
                print(
                    f"[{self.method}] {now:6.0f}s samples {samples} "
                    f"faults {len(injector.injected)}",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05)

    def _stop(self) -> dict[str, dict]:
        """Every group back (at most 300 s), a few steps together, then stop and collect."""
        self.injector.end_all()
        since = time.time()
        deadline = since + 300
        if self.launcher.ft:
            while time.time() < deadline:
                if self.accounts.trained_together_since(self.records(), since):
                    break
                time.sleep(0.2)
        step = max((r.step for r in self.records()), default=0) + STOP_MARGIN_STEPS
        write_stop_step(self.launcher.stop_file, step)
        self.launcher.wait_exit(deadline + 60)
        finals = {}
        for path in self.folder.glob("final_*.json"):
            finals[path.stem.removeprefix("final_")] = json.loads(path.read_text())
        return finals


def per_cpu_goodput(entry: dict[str, Any], ideal: dict[str, Any]) -> float | None:
    """``goodput_per_cpu``: a method's samples per CPU-second of its groups' quota to the
    target (``samples_per_cpu_s``), over ideal's; None when it did not reach the target."""
    rate, base = (
        samples_per_cpu_s(e["target_samples"], e["time_to_target_s"], e["cpus_quota"])
        for e in (entry, ideal)
    )
    return round(rate / base, 3) if rate and base else None


# ------------------------------------------------------------------------------ torchft


def torchft_problem() -> str | None:
    """Why TorchTitan's own FT trainer on the torchft 0.2.0 reference cannot run here, or None."""
    if not sorted(REFERENCE_DIR.glob("torchft/_torchft*.so")):
        return f"the torchft 0.2.0 reference is not installed under {REFERENCE_DIR}"
    if not RUNTIME_DEPS_DIR.is_dir():
        return f"torchft's dependencies are not installed under {RUNTIME_DEPS_DIR}"
    try:  # a missing parent package raises instead of answering None
        trainer = importlib.util.find_spec("torchtitan.experiments.ft.train")
    except ModuleNotFoundError:
        trainer = None
    if trainer is None:
        return (
            "this TorchTitan has no torchtitan.experiments.ft.train (0.3.0 names its FT trainer "
            "by a registry config, which the recording trainer does not wrap): run the "
            "benchmark with TorchTitan 0.2.2"
        )
    return None


# ------------------------------------------------------------------------------ figure


def plot(result: dict[str, Any], path: Path) -> str | None:
    """Loss and participating groups against wall time per method, a mark per fault; the
    reason when no figure was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'torchtitan_ft[demo]')"
    fig, (ax_loss, ax_groups) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for name, entry in result["methods"].items():
        if "skipped" in entry or not entry.get("curve"):
            continue
        times = [c[0] for c in entry["curve"]]
        (line,) = ax_loss.plot(times, [c[1] for c in entry["curve"]], label=name, lw=1)
        ax_groups.step(
            times, [c[2] for c in entry["curve"]], where="post", color=line.get_color(), lw=1
        )
        if name != Method.IDEAL:
            for fault in entry["faults"]:
                ax_groups.axvline(fault["time_s"], color=line.get_color(), ls=":", lw=0.6)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_groups.set_ylabel("participating groups")
    ax_groups.set_xlabel("wall time since the job trained (s); dotted: a fault")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------ main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--duration",
        type=float,
        default=660.0,
        help="seconds the ideal run trains (default 660: about 20 faults at one per 30 s)",
    )
    p.add_argument("--mean-interval", type=float, default=30.0, help="mean seconds between faults")
    p.add_argument(
        "--min-interval", type=float, default=5.0, help="shortest seconds between faults"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="seconds after the job trains (all groups took part in a commit) to the first fault",
    )
    p.add_argument(
        "--startup-limit",
        type=float,
        default=900.0,
        help="give up when a job has not trained this many seconds after its launch",
    )
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="FSDP ranks per group")
    p.add_argument(
        "--cpus-per-group",
        type=float,
        default=0.5,
        help="CPU budget of each group (a quota with the top weight; default 0.5: 3 groups and "
        "the lighthouse take 1.7 of 2 cores)",
    )
    p.add_argument(
        "--cpus-lighthouse",
        type=float,
        default=0.2,
        help="CPU budget of the lighthouse (the top weight keeps the groups from starving it)",
    )
    p.add_argument(
        "--replacement",
        choices=["zygote", "cold"],
        default="zygote",
        help="fault_tolerance.replacement of the FT groups: how torchrun's restart of a group "
        "starts its workers (zygote: forked from a pre-imported process; cold: fresh "
        "interpreters)",
    )
    p.add_argument("--heartbeat-timeout-ms", type=int, default=3000)
    p.add_argument("--process-group-timeout-ms", type=int, default=10000)
    p.add_argument("--hang-s", type=float, default=15.0, help="SIGSTOP length (> the PG timeout)")
    p.add_argument("--link-down-s", type=float, default=15.0)
    p.add_argument("--lighthouse-down-s", type=float, default=5.0)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="steps between the TorchTitan checkpoints of every method but ideal",
    )
    p.add_argument(
        "--cap-factor",
        type=float,
        default=3.0,
        help="a faulted run stops at this x --duration even short of the target",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=[k.value for k in FaultKind],
        default=[k.value for k in DEFAULT_KINDS],
        help="the fault kinds drawn (default: every kind but correlated, which loses the job's "
        "state on purpose: name it to have it about once in 50 faults)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=[m.value for m in Method],
        default=[m.value for m in DEFAULT_METHODS],
        help="the methods run (default: every one but torchtitan_ft_spare, whose hot spare is "
        "one group more: name it, with a --cpus-per-group that leaves room for it)",
    )
    p.add_argument(
        "--quick", action="store_true", help="CI: 3 groups of 1 rank, 60 s, a fault every 12 s"
    )
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "goodput")
    if p.parse_args(argv).quick:  # its settings are defaults: flags given beside it win
        p.set_defaults(ranks=1, duration=60.0, mean_interval=12.0, warmup=5.0)
    args = p.parse_args(argv)
    if Method.IDEAL.value not in args.methods:
        p.error("--methods must include ideal (it sets the target and the baseline)")
    return args


def options(args: argparse.Namespace) -> Options:
    return Options(
        groups=args.groups,
        ranks=args.ranks,
        duration_s=args.duration,
        mean_interval_s=args.mean_interval,
        seed=args.seed,
        cpus_per_group=args.cpus_per_group,
        cpus_lighthouse=args.cpus_lighthouse,
        replacement=args.replacement,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        process_group_timeout_ms=args.process_group_timeout_ms,
        hang_s=args.hang_s,
        link_down_s=args.link_down_s,
        lighthouse_down_s=args.lighthouse_down_s,
        checkpoint_every=args.checkpoint_every,
        cap_factor=args.cap_factor,
        startup_limit_s=args.startup_limit,
        kinds=[FaultKind(k) for k in args.kinds],
        out=args.out,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    opts = options(args)
    schedule = fault_schedule(
        args.seed,
        start_s=args.warmup,
        end_s=args.duration * args.cap_factor,
        mean_interval_s=args.mean_interval,
        min_interval_s=args.min_interval,
        groups=args.groups,
        ranks=args.ranks,
        kinds=opts.kinds,
    )
    result: dict[str, Any] = {
        "benchmark": "goodput",
        "command": " ".join(
            ["python -m benchmarks.goodput", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine(),
        "job": {
            "groups": args.groups,
            "ranks_per_group": args.ranks,
            "samples_per_step": opts.samples_per_step,
            "config": CONFIG.name,
            "replacement": args.replacement,
        },
        "cpu_quota": {
            "cpus_per_group": args.cpus_per_group,
            "cpus_lighthouse": args.cpus_lighthouse,
        },
        "timeouts": {
            "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
            "process_group_timeout_ms": args.process_group_timeout_ms,
            "hang_s": args.hang_s,
            "link_down_s": args.link_down_s,
            "lighthouse_down_s": args.lighthouse_down_s,
            "checkpoint_every_steps": args.checkpoint_every,
        },
        "schedule": [asdict(f) for f in schedule],
        "methods": {},
    }
    probe = CpuLimit("goodput_probe", [], cpus=1.0)
    result["cpu_quota"].update(mechanism=probe.mechanism, parent=probe.parent, weight=probe.weight)
    probe.close()
    groups = max(launched_groups(Method(m), opts) for m in args.methods)
    budget = groups * args.cpus_per_group + args.cpus_lighthouse
    if budget >= 0.9 * (os.cpu_count() or 1):
        print(
            f"goodput: the groups' and the lighthouse's budgets add up to {budget:g} CPUs of "
            f"{os.cpu_count()}: with their top weight they leave this process and the rest of "
            "the machine little; lower --cpus-per-group",
            file=sys.stderr,
        )
    ideal = MethodRun(Method.IDEAL, opts, schedule).run()
    result["methods"][Method.IDEAL.value] = ideal
    baseline = ideal["time_to_target_s"]
    order = (
        Method.TORCHTITAN_FT,
        Method.TORCHTITAN_FT_SPARE,
        Method.TORCHFT,
        Method.CHECKPOINT_RESTART,
    )
    for name in order:
        if name.value not in args.methods:
            continue
        if name is Method.TORCHFT and (problem := torchft_problem()):
            result["methods"][name.value] = {"skipped": problem}
            continue
        try:
            entry = MethodRun(name, opts, schedule, target=ideal["target_samples"]).run()
        except Exception as e:  # recorded: the other methods still run
            result["methods"][name.value] = {"failed": f"{type(e).__name__}: {e}"}
            continue
        at = entry["time_to_target_s"]
        entry["goodput"] = round(baseline / at, 3) if at and baseline else None
        entry["goodput_per_cpu"] = per_cpu_goodput(entry, ideal)
        entry["ideal_loss"] = ideal["final_loss"]
        result["methods"][name.value] = entry
        # after each method: a run cut short keeps the methods it finished
        (args.out / "goodput.json").write_text(json.dumps(result, indent=1, default=str))
    ideal["goodput"] = 1.0
    ideal["goodput_per_cpu"] = 1.0
    kills = [
        f["rejoin_s"]
        for f in result["methods"].get(Method.TORCHTITAN_FT.value, {}).get("faults", [])
        if f["kind"] == FaultKind.SIGKILL and f["rejoin_s"] is not None
    ]
    result["replacement_s"] = statistics.median(kills) if kills else None
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    (args.out / "goodput.json").write_text(json.dumps(result, indent=1, default=str))
    result["figure"] = plot(result, args.out / "goodput.png") or str(args.out / "goodput.png")
    brief = {
        **result,
        "methods": {
            k: {kk: vv for kk, vv in v.items() if kk not in ("curve", "faults")}
            for k, v in result["methods"].items()
        },
    }
    print(json.dumps(brief, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
