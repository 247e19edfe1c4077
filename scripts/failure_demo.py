"""Failure demo: replica groups train through kills, a hang and a lighthouse restart.

    python scripts/failure_demo.py                 # TorchTitan llama3 debugmodel, CPU, FT
    python scripts/failure_demo.py --model mlp     # the tiny-MLP test harness (fast)
    python scripts/failure_demo.py --groups 2 --faults sigkill --steps 30
                                                   # one kill: the suite's short run

What happens: a lighthouse (``torchft_lighthouse``) and ``--groups`` (3) replica groups start on
127.0.0.1. With ``--model titan`` each group is a torchrun job of ``run_train.sh`` with
``configs/debug_ft_cpu.toml`` and NGPU=1; with ``--model mlp`` each is one process of
``torchtitan_ft.testing.mlp``'s training loop (Manager + DDP + OptimizerWrapper). As the job
progresses a seeded schedule hits it: a replica group is SIGKILLed (the torchrun agent and its
workers, which torchrun starts in their own sessions) and restarted, one group is hung with
SIGSTOP for ``--hang_s`` seconds and then resumed with SIGCONT, the lighthouse is SIGKILLed and
started again on the same port after ``--lighthouse_down_s`` seconds (the groups' quorum
requests wait for it), and another group is killed and restarted. Each failure waits until the
job is whole again (all groups taking part) or ``--recovery_timeout_s`` passes. ``--faults``
picks the faults (default: ``sigkill sigstop lighthouse sigkill``, at 17/33/50/67 % of the
steps: ``schedule``). A progress line is printed every few seconds.

What it observes comes from data, not from log wording: every replica group's Manager writes
its event stream (``torchtitan_ft.events``: commits with their participants, heals with their
bytes and seconds) to ``<out>/events/group<r>_<n>/``; the loss is the MLP harness's per-step
record (``--model mlp``) or TorchTitan's own metrics line (``--model titan``; the loss panel
only).

It exits with status 1, after writing what it saw, when it injected fewer faults than
scheduled (one skipped because the job was nearly done counts too), when a fault was not
followed by a commit, or when a replica-group process it started never committed a step.

At the end it writes to ``--out``:

* ``failure_demo.png``: loss per replica group against step, each group's committed step
  against time (stalls and catch-up are visible), and participants over time, with failure
  (red), lighthouse restart (black) and heal (green) markers;
* ``summary.txt`` (also printed): steps committed, failures survived, stall after each failure,
  heal time (restart to healed) and heal transfer size and time, the lighthouse's downtime and
  the first commit after it came back;
* ``summary.json``: the same verdict as data (``summary_data``): each fault injected, whether
  the job committed after it, the step a killed group's restart healed to, the problems;
* ``faults.json``: the faults injected and the restarts, with times and the job's step;
* the logs: ``lighthouse.log``, one log per replica-group process, and the event streams;
* with ``--page_snapshots``, ``page/<n>_<moment>.html`` (the lighthouse's status page as
  headless Chromium rendered it, or as served when Chromium is missing) and
  ``page/<n>_<moment>.json`` (its ``/status.json`` and ``/events``) after each fault's
  recovery, right before the lighthouse is killed, and at the end; with ``--screenshots`` also
  ``page/<n>_<moment>.png``.

The lighthouse serves its status page on a free port (printed at the start: open it while the
demo runs) and keeps its history and the groups' figures under ``<out>/lighthouse_state``, so
the page still tells the whole story after the lighthouse restart.

Needs matplotlib. Everything is local: no network, 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_ft.events import EventKind, HealOutcome, read_events
from torchtitan_ft.testing.commit_log import commit_log_path, longest_gap, read_commit_log
from torchtitan_ft.testing.faults import FaultKind, fault_victims
from torchtitan_ft.testing.mlp_job import MlpJob
from torchtitan_ft.testing.processes import LighthouseProcess, descendants, free_port
from torchtitan_ft.titan import releases
from torchtitan_ft.titan.releases.job import FtGroup, TitanJob, command

ROOT = Path(__file__).resolve().parents[1]
LIGHTHOUSE_KILL = "lighthouse SIGKILL"
LIGHTHOUSE_RESTART = "lighthouse restart"
FAILURES = ("SIGKILL", "SIGSTOP", LIGHTHOUSE_KILL)
FAULTS = (FaultKind.SIGKILL, FaultKind.SIGSTOP, FaultKind.LIGHTHOUSE)
"""What ``--faults`` may name (``testing.faults.FaultKind``): SIGKILL and restart a group,
SIGSTOP (hang) a group for ``--hang_s``, SIGKILL and restart the lighthouse."""
DEFAULT_FAULTS = [FaultKind.SIGKILL, FaultKind.SIGSTOP, FaultKind.LIGHTHOUSE, FaultKind.SIGKILL]


def schedule(faults: list[FaultKind]) -> list[tuple[FaultKind, float]]:
    """(fault, fraction of ``--steps`` the job reached when it hits): evenly spaced, from
    1/(n+2) to n/(n+2) for n faults (the default four: 17, 33, 50 and 67 %)."""
    return [(fault, (i + 1) / (len(faults) + 2)) for i, fault in enumerate(faults)]


def check_run(scheduled: int, injected: int, unanswered: list[str], silent: list[str]) -> list[str]:
    """Why the run failed (empty: it did not): fewer faults ``injected`` than ``scheduled``,
    faults after which the job never committed (``unanswered``), replica-group processes that
    never committed a step (``silent``)."""
    problems = []
    if injected < scheduled:
        problems.append(f"injected {injected} of the {scheduled} scheduled faults")
    problems += [f"no commit after {fault}" for fault in unanswered]
    problems += [f"{process} never committed a step" for process in silent]
    return problems


# ------------------------------------------------------------------------------ what we observe


@dataclass
class Point:
    """One observation of one replica-group process."""

    time: float
    step: int
    loss: float | None = None
    participants: int | None = None


@dataclass
class Heal:
    time: float
    step: int
    megabytes: float | None = None
    seconds: float | None = None


@dataclass
class Incarnation:
    """One process (or torchrun job) of a replica group."""

    replica: int
    number: int
    started: float
    log: Path
    """Its output (titan) or its per-step records (mlp: the loss on the evaluation batch)."""
    events: Path
    """The folder of its Manager's event stream."""
    losses: list[Point] = field(default_factory=list)
    commits: list[Point] = field(default_factory=list)
    heals: list[Heal] = field(default_factory=list)
    ended: float | None = None
    end_reason: str = ""


@dataclass
class Action:
    """What the demo did to the job: a fault (``FAILURES``), a restart, a SIGCONT."""

    time: float
    kind: str
    replica: int | None
    step: int
    """The job's highest committed step when it happened."""


# ------------------------------------------------------------------------------ replica groups


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.eE+-]+)")
"""TorchTitan's own metrics line (its wording, read for the loss panel only)."""


def read_stream(inc: Incarnation) -> None:
    """Commits (with participants) and applied heals from the incarnation's event stream
    (group rank 0's: every rank of a group commits and heals together)."""
    events = [e for e in read_events(inc.events) if e.group_rank == 0]
    inc.commits = [
        Point(e.time, e.step, participants=e["participants"])
        for e in events
        if e.kind is EventKind.COMMIT
    ]
    # a heal to step 0 is init_sync's start (every group but one takes the first's state)
    inc.heals = [
        Heal(e.time, e.step, e["bytes"] / 1e6, e["seconds"])
        for e in events
        if e.kind is EventKind.HEAL_END and e["outcome"] == HealOutcome.APPLIED and e.step > 0
    ]


def titan_losses(inc: Incarnation) -> list[Point]:
    """TorchTitan's logged loss per step (the last line of a step: a discarded step is logged
    again when it is retried), without the steps whose forward ran on weights the group then
    replaced by healing: a restarted group's steps up to its first heal (its random init) and
    the step after each heal (a heal is applied at the end of that iteration)."""
    if not inc.log.exists():
        return []
    losses: dict[int, float] = {}
    for line in inc.log.read_text(errors="replace").splitlines():
        if m := _LOSS.search(line):
            losses[int(m.group(1))] = float(m.group(2))
    first = inc.heals[0].step if inc.heals and inc.number > 0 else 0
    healing = {h.step + 1 for h in inc.heals}
    return [
        Point(float("nan"), step, loss=loss)
        for step, loss in sorted(losses.items())
        if step > first and step not in healing
    ]


class TitanGroup:
    """One replica group as ``run_train.sh`` (a torchrun job, NGPU=1)."""

    def __init__(self, replica: int, args: argparse.Namespace, lighthouse: str) -> None:
        self.replica = replica
        self.args = args
        self.lighthouse = lighthouse
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnations: list[Incarnation] = []
        self.stopped: list[int] = []

    def start(self) -> None:
        number = len(self.incarnations)
        log = self.args.out / f"group{self.replica}_{number}.log"
        events = events_folder(self.args.out, self.replica, number)
        job = TitanJob(
            dump_folder=self.args.out / f"dump_group{self.replica}_{number}",
            steps=self.args.steps,
            config_file=ROOT / "configs" / "debug_ft_cpu.toml",
            ft=FtGroup(
                replica_id=self.replica,
                group_size=self.args.groups,
                lighthouse=self.lighthouse,
                min_replica_size=self.args.min_replicas,
                # a survivor short of min_replicas waits this long for the restarted group
                quorum_timeout_ms=int(self.args.recovery_timeout_s * 1000),
            ),
            events_dir=events,
            env={"MASTER_ADDR": "127.0.0.1"},
        )
        with open(log, "wb") as f:
            self.proc = command(job).popen(stdout=f, stderr=subprocess.STDOUT)
        self.incarnations.append(Incarnation(self.replica, number, time.time(), log, events))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is None:
            return
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        signal_pids(pids, signal.SIGKILL)
        self.proc.wait(30)
        self._ended("SIGKILL")

    def hang(self) -> None:
        if self.proc is not None:
            self.stopped = descendants(self.proc.pid)  # the workers; the agent keeps watching
            signal_pids(self.stopped, signal.SIGSTOP)

    def resume(self) -> None:
        signal_pids(self.stopped, signal.SIGCONT)
        self.stopped = []

    def _ended(self, reason: str) -> None:
        inc = self.incarnations[-1]
        if inc.ended is None:
            inc.ended, inc.end_reason = time.time(), reason

    def refresh(self) -> None:
        for inc in self.incarnations:
            read_stream(inc)
            inc.losses = titan_losses(inc)
        if self.proc is not None and self.proc.poll() is not None:
            self._ended(f"exit {self.proc.returncode}")


class MlpGroup:
    """One replica group of the demo's MLP job (``testing.mlp_job.MlpJob``: a process of the
    tiny-MLP harness per incarnation, with its commit log and event stream)."""

    def __init__(self, replica: int, job: MlpJob) -> None:
        self.replica = replica
        self.job = job
        self.incarnations: list[Incarnation] = []

    def start(self) -> None:
        self.job.start(self.replica)
        number = self.job.incarnations[self.replica]
        log = commit_log_path(self.job.commit_logs, self.replica, number)
        events = self.job.events_of(self.replica, number)
        self.incarnations.append(Incarnation(self.replica, number, time.time(), log, events))

    def alive(self) -> bool:
        return self.job.alive(self.replica)

    def kill(self) -> None:
        if self.alive():
            self.job.kill(self.replica)
        self._ended("SIGKILL")

    def hang(self) -> None:
        self.job.hang(self.replica)

    def resume(self) -> None:
        self.job.resume(self.replica)

    def _ended(self, reason: str) -> None:
        inc = self.incarnations[-1]
        if inc.ended is None:
            inc.ended, inc.end_reason = time.time(), reason

    def refresh(self) -> None:
        for inc in self.incarnations:
            read_stream(inc)
            records = read_commit_log(inc.log, inc.replica, inc.number)
            # the loss on a fixed evaluation batch: the training batches are random per step
            inc.losses = [Point(r.time, r.step, loss=r.eval_loss) for r in records if r.committed]
        proc = self.job.current.get(self.replica)
        if proc is not None and not proc.is_alive():
            self._ended(f"exit {proc.exitcode}")


def _chromium(chromium: str, out: Path, *args: str) -> str:
    """Headless Chromium's stdout for ``args`` (a profile under ``out``)."""
    return subprocess.run(
        [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={out / 'chromium_profile'}", *args,
        ],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip


def events_folder(out: Path, replica: int, number: int) -> Path:
    """Where incarnation ``number`` of group ``replica`` writes its event stream."""
    return out / "events" / f"group{replica}_{number}"


# ------------------------------------------------------------------------------ the run


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lighthouse_log = open(args.out / "lighthouse.log", "w")  # noqa: SIM115
        self.lighthouse = LighthouseProcess(
            args.min_replicas,
            port=args.port or free_port(),
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            log=self.lighthouse_log,
            status_port=free_port(),
            state_dir=str(args.out / "lighthouse_state"),
        )
        self.snapshots = 0
        self.groups: list[TitanGroup | MlpGroup]
        if args.model == "titan":
            self.groups = [TitanGroup(r, args, self.lighthouse.address) for r in range(args.groups)]
        else:
            job = MlpJob(
                args.out,
                self.lighthouse,
                stop_participants=args.groups,
                min_replica_size=args.min_replicas,
                step_sleep_s=0.05,
                timeout_s=5.0,
                shared_batches=True,
            )
            job.stop_at(args.steps)
            self.groups = [MlpGroup(r, job) for r in range(args.groups)]
        self.actions: list[Action] = []
        self.started = time.time()
        self.last_print = 0.0

    # observations
    def refresh(self) -> None:
        for group in self.groups:
            group.refresh()

    def commits(self) -> list[Point]:
        return sorted(
            (p for g in self.groups for inc in g.incarnations for p in inc.commits),
            key=lambda p: p.time,
        )

    def job_step(self) -> int:
        commits = self.commits()
        return max((p.step for p in commits), default=0)

    def whole(self) -> bool:
        """Every group is up and the latest commit of each took all groups."""
        for group in self.groups:
            if not group.alive():
                return False
            inc = group.incarnations[-1]
            if not inc.commits or inc.commits[-1].participants != self.args.groups:
                return False
        return True

    def holders(self) -> list[int]:
        """Groups up whose current process committed the job's step (or the one before): they
        hold the job's state."""
        step = self.job_step()
        return [
            g.replica
            for g in self.groups
            if g.alive()
            and g.incarnations[-1].commits
            and g.incarnations[-1].commits[-1].step >= step - 1
        ]

    def done(self) -> bool:
        return all(not g.alive() for g in self.groups)

    def show(self, note: str = "") -> None:
        now = time.time()
        if not note and now - self.last_print < self.args.print_every_s:
            return
        self.last_print = now
        parts = []
        for g in self.groups:
            inc = g.incarnations[-1]
            step = inc.commits[-1].step if inc.commits else 0
            n = inc.commits[-1].participants if inc.commits else "-"
            state = "up" if g.alive() else "down"
            parts.append(f"g{g.replica}#{inc.number} {state} step {step:>4} ({n}p)")
        line = f"[{now - self.started:6.1f}s] job step {self.job_step():>4} | " + " | ".join(parts)
        print(line + (f"  <- {note}" if note else ""), flush=True)

    def wait(self, until: Any, timeout_s: float, what: str) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.refresh()
            self.show()
            if until():
                return True
            if self.done():
                return False
            time.sleep(0.5)
        print(f"  ... gave up waiting for {what} after {timeout_s:.0f}s", flush=True)
        return False

    def act(self, kind: str, replica: int | None) -> None:
        self.refresh()
        self.actions.append(Action(time.time(), kind, replica, self.job_step()))
        self.show(f"{kind}" + (f" group {replica}" if replica is not None else ""))

    # the schedule
    def run(self) -> None:
        args = self.args
        rng = random.Random(args.seed)
        self.lighthouse.start()
        for group in self.groups:
            group.start()
        print(
            f"lighthouse {self.lighthouse.address}; {args.groups} replica groups ({args.model}), "
            f"{args.steps} steps; logs in {args.out}\n"
            f"status page: {self.lighthouse.status_address} (open it while the demo runs)",
            flush=True,
        )
        self.wait(self.whole, args.startup_timeout_s, "all groups to train together")
        last_victim: int | None = None
        for kind, fraction in schedule(args.faults):
            target = int(fraction * args.steps)
            reached = self.wait(
                lambda t=target: self.job_step() >= t, args.startup_timeout_s, f"step {target}"
            )
            if not reached:
                break
            if self.job_step() > 0.9 * args.steps:
                print(f"  skipping {kind}: the job is nearly done", flush=True)
                continue
            if kind is FaultKind.LIGHTHOUSE:
                self.snapshot("before_lighthouse")  # the figures a restart must keep
                # Same port: the groups keep retrying the address they were given.
                self.act(LIGHTHOUSE_KILL, None)
                self.lighthouse.kill()
                time.sleep(args.lighthouse_down_s)
                self.lighthouse.start()
                self.act(LIGHTHOUSE_RESTART, None)
                self.wait(
                    self.whole, args.recovery_timeout_s, "recovery from the lighthouse restart"
                )
                self.snapshot("after_lighthouse")
                continue
            wanted = rng.choice([r for r in range(args.groups) if r != last_victim])
            victims = fault_victims(kind, (wanted,), self.holders(), args.groups)
            if victims is None:
                print(f"  skipping {kind}: no other group holds the job's state", flush=True)
                continue
            (victim,) = victims
            last_victim = victim
            group = self.groups[victim]
            if kind is FaultKind.SIGKILL:
                self.act("SIGKILL", victim)
                group.kill()
                time.sleep(args.restart_delay_s)
                group.start()
                self.act("restart", victim)
            else:
                self.act("SIGSTOP", victim)
                group.hang()
                self.wait(lambda: time.time() > self.actions[-1].time + args.hang_s, 1e9, "")
                group.resume()
                self.act("SIGCONT", victim)
            self.wait(self.whole, args.recovery_timeout_s, f"recovery from {kind}")
            self.snapshot(f"after_{kind}")
        if not self.wait(self.done, args.finish_timeout_s, "the groups to finish"):
            for group in self.groups:
                if group.alive():
                    print(f"  stopping group {group.replica}", flush=True)
                    group.kill()
        self.refresh()
        self.snapshot("end")

    def snapshot(self, moment: str) -> None:
        """Saves the status page as a browser renders it, and its JSON (``--page_snapshots``)."""
        if not self.args.page_snapshots:
            return
        url = str(self.lighthouse.status_address)
        folder = self.args.out / "page"
        folder.mkdir(exist_ok=True)
        name = f"{self.snapshots}_{moment}"
        self.snapshots += 1
        data = {
            path: json.loads(urllib.request.urlopen(url + path, timeout=10).read())
            for path in ("status.json", "events")
        }
        (folder / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        chromium = shutil.which("chromium")
        if chromium is None:
            html = urllib.request.urlopen(url + "?range=job", timeout=10).read().decode()
        else:
            html = _chromium(chromium, self.args.out, "--dump-dom", url + "?range=job")
            if self.args.screenshots:
                png = folder / f"{name}.png"
                _chromium(
                    chromium, self.args.out, f"--screenshot={png}", "--window-size=1150,1250",
                    url + "?range=job",
                )  # fmt: skip
        (folder / f"{name}.html").write_text(html)

    def close(self) -> None:
        for group in self.groups:
            if group.alive():
                group.kill()
        self.lighthouse.stop()
        self.lighthouse_log.close()


# ------------------------------------------------------------------------------ report


def summarize(demo: Demo) -> str:
    commits = demo.commits()
    progress: list[tuple[float, int]] = []
    best = -1
    for p in commits:
        if p.step > best:
            best = p.step
            progress.append((p.time, p.step))
    end = max((p.time for p in commits), default=time.time())
    failures = [e for e in demo.actions if e.kind in FAILURES]
    lines = [
        f"model: {demo.args.model}; replica groups: {demo.args.groups}; "
        f"min_replicas: {demo.args.min_replicas}; wall time {end - demo.started:.0f}s",
        f"steps committed: {best} (target {demo.args.steps})",
    ]
    for g in demo.groups:
        for inc in g.incarnations:
            last = inc.commits[-1].step if inc.commits else 0
            ended = f", ended: {inc.end_reason}" if inc.end_reason else ""
            lines.append(
                f"  group {g.replica} process #{inc.number}: {len(inc.commits)} commits, "
                f"last step {last}{ended}"
            )
    survived = 0
    lines.append("failures:")
    for i, e in enumerate(failures):
        following = [f for f in failures[i + 1 :]]
        until = following[0].time if following else end
        after = [t for t, s in progress if t > e.time]
        ok = bool(after)
        survived += ok
        stall = longest_gap(progress, e.time, until) if ok else float("nan")
        who = e.kind if e.replica is None else f"{e.kind} group {e.replica}"
        lines.append(
            f"  {who} at step {e.step} "
            f"(t={e.time - demo.started:.1f}s): job stalled {stall:.2f}s at most, "
            f"{'kept committing' if ok else 'NO COMMIT AFTERWARDS'}"
        )
        if e.kind == LIGHTHOUSE_KILL:
            back = next(
                (x for x in demo.actions if x.kind == LIGHTHOUSE_RESTART and x.time > e.time), None
            )
            if back is not None:
                first = next((p for p in commits if p.time > back.time), None)
                after = f"{first.time - back.time:.1f}s later" if first else "NONE"
                lines.append(
                    f"    lighthouse down {back.time - e.time:.1f}s (same port); first commit "
                    f"after it came back: {after}"
                )
        if e.kind == "SIGKILL":
            group = demo.groups[e.replica]
            inc = next((x for x in group.incarnations if x.started >= e.time), None)
            if inc is None:
                continue
            if inc.heals:
                h = inc.heals[0]
                transfer = (
                    f"; transfer {_size(h.megabytes)}" if h.megabytes is not None else ""
                ) + (f" in {h.seconds:.3f}s" if h.seconds is not None else "")
                lines.append(
                    f"    restarted group {e.replica}: healed to step {h.step} "
                    f"{h.time - inc.started:.1f}s after its restart{transfer}"
                )
            else:
                lines.append(f"    restarted group {e.replica}: NO HEAL SEEN in its event stream")
        if e.kind == "SIGSTOP":
            group = demo.groups[e.replica]
            inc = next(x for x in reversed(group.incarnations) if x.started <= e.time)
            heals = [h for h in inc.heals if h.time > e.time]
            if heals:
                h = heals[0]
                lines.append(
                    f"    hung group {e.replica}: healed to step {h.step} "
                    f"{h.time - e.time:.1f}s after the hang began"
                )
    lines.insert(2, f"failures survived: {survived} of {len(failures)}")
    return "\n".join(lines)


def problems(demo: Demo) -> list[str]:
    """``check_run`` of what the demo did and saw."""
    commits = demo.commits()
    failures = [e for e in demo.actions if e.kind in FAILURES]
    return check_run(
        scheduled=len(demo.args.faults),
        injected=len(failures),
        unanswered=[
            e.kind if e.replica is None else f"{e.kind} group {e.replica}"
            for e in failures
            if not any(p.time > e.time for p in commits)
        ],
        silent=[
            f"group {g.replica} process #{inc.number}"
            for g in demo.groups
            for inc in g.incarnations
            if not inc.commits
        ],
    )


def summary_data(demo: Demo) -> dict[str, Any]:
    """What ``summary.json`` holds: the run's setting, the faults scheduled and, per fault
    injected, whether the job committed after it (``survived``) and, for a group SIGKILLed,
    the step its restarted process healed to (None: no heal seen); ``problems`` as the exit
    status judges them (empty: exit 0)."""
    commits = demo.commits()
    faults = []
    for e in (e for e in demo.actions if e.kind in FAILURES):
        fault = {
            "kind": e.kind,
            "replica": e.replica,
            "step": e.step,
            "time_s": round(e.time - demo.started, 3),
            "survived": any(p.time > e.time for p in commits),
        }
        if e.kind == "SIGKILL":
            later = [x for x in demo.groups[e.replica].incarnations if x.started >= e.time]
            heals = later[0].heals if later else []
            fault["healed_to_step"] = heals[0].step if heals else None
        faults.append(fault)
    return {
        "model": demo.args.model,
        "torchtitan": releases.installed_version() if demo.args.model == "titan" else None,
        "groups": demo.args.groups,
        "steps": demo.args.steps,
        "steps_committed": max((p.step for p in commits), default=0),
        "faults_scheduled": list(demo.args.faults),
        "faults": faults,
        "problems": problems(demo),
    }


def _size(megabytes: float) -> str:
    return f"{megabytes:.1f} MB" if megabytes >= 1 else f"{megabytes * 1e3:.1f} kB"


def _loss_at(inc: Incarnation, step: int) -> float:
    return next((p.loss for p in inc.losses if p.step > step + 1), float("nan"))


def plot(demo: Demo, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = demo.started
    colors = ["tab:blue", "tab:orange", "tab:purple"]
    fig, (ax_loss, ax_step, ax_part) = plt.subplots(
        3, 1, figsize=(11, 10), gridspec_kw={"height_ratios": [3, 2, 1.3]}
    )
    for g in demo.groups:
        for inc in g.incarnations:
            label = f"group {g.replica}" + (f" (restart {inc.number})" if inc.number else "")
            style = "-" if inc.number == 0 else "--"
            if inc.losses:
                ax_loss.plot(
                    *_gapped(inc.losses, lambda p: p.step, lambda p: p.loss),
                    style,
                    color=colors[g.replica],
                    label=label,
                    lw=1.2,
                    alpha=0.85,
                )
            if inc.commits:
                ax_step.plot(
                    *_gapped(inc.commits, lambda p: p.time - t0, lambda p: p.step),
                    style,
                    color=colors[g.replica],
                    label=label,
                    lw=1.5,
                )
            for h in inc.heals:
                for ax, x in ((ax_step, h.time - t0), (ax_part, h.time - t0)):
                    ax.axvline(x, color="tab:green", ls=":", lw=1.2)
                ax_step.plot([h.time - t0], [h.step], "o", color="tab:green", ms=7, zorder=5)
                ax_loss.plot([h.step], [_loss_at(inc, h.step)], "o", color="tab:green", ms=6)
    commits = demo.commits()
    ax_part.step(
        [p.time - t0 for p in commits], [p.participants for p in commits], where="post", lw=1.5
    )
    markers = {
        "SIGKILL": "tab:red",
        "SIGSTOP": "darkred",
        "SIGCONT": "gray",
        "restart": "gray",
        LIGHTHOUSE_KILL: "black",
        LIGHTHOUSE_RESTART: "black",
    }
    for e in demo.actions:
        color = markers.get(e.kind, "gray")
        ls = "-" if e.kind in FAILURES else "--"
        for ax in (ax_step, ax_part):
            ax.axvline(e.time - t0, color=color, ls=ls, lw=1.2)
        if e.kind in FAILURES:
            ax_loss.axvline(e.step, color=color, ls=ls, lw=1.2)
            ax_step.annotate(
                "lighthouse" if e.replica is None else f"{e.kind} g{e.replica}",
                (e.time - t0, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                color=color,
                fontsize=8,
            )
    from matplotlib.lines import Line2D

    legend_extra = [
        Line2D([], [], color="tab:red", lw=1.2, label="SIGKILL"),
        Line2D([], [], color="darkred", lw=1.2, label="SIGSTOP (hang)"),
        Line2D([], [], color="gray", ls="--", lw=1.2, label="restart / SIGCONT"),
        Line2D([], [], color="black", lw=1.2, label="lighthouse SIGKILL (- -: back)"),
        Line2D([], [], color="tab:green", ls=":", marker="o", lw=1.2, label="healed"),
    ]
    ylabel = "training loss" if demo.args.model == "titan" else "loss on a fixed eval batch"
    ax_loss.set(xlabel="step", ylabel=ylabel, title=_title(demo))
    ax_loss.legend(
        fontsize=8,
        ncol=2,
        loc="upper right",
        title=(
            "each group's loss on its own data slice"
            if demo.args.model == "titan"
            else "curves coincide: the groups hold the same weights"
        ),
        title_fontsize=8,
    )
    ax_step.set(xlabel="time since start (s)", ylabel="committed step")
    ax_step.legend(handles=legend_extra, fontsize=8, loc="lower right")
    groups = demo.args.groups
    ax_part.set(xlabel="time since start (s)", ylabel="participants", ylim=(0, groups + 0.5))
    ax_part.set_yticks(range(groups + 1))
    xmax = max((p.time - t0 for p in commits), default=1.0)
    for ax in (ax_step, ax_part):
        ax.set_xlim(0, xmax * 1.02)
    for ax in (ax_loss, ax_step, ax_part):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gapped(points: list[Point], x: Any, y: Any) -> tuple[list[float], list[float]]:
    """x and y values, with a break (NaN) where the process skipped steps (it healed)."""
    xs: list[float] = []
    ys: list[float] = []
    for i, p in enumerate(points):
        if i and p.step > points[i - 1].step + 1:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(x(p))
        ys.append(y(p))
    return xs, ys


def _title(demo: Demo) -> str:
    model = "llama3 debugmodel (TorchTitan, CPU)" if demo.args.model == "titan" else "tiny MLP"
    kills = sum(1 for e in demo.actions if e.kind == "SIGKILL")
    hangs = sum(1 for e in demo.actions if e.kind == "SIGSTOP")
    lighthouse = sum(1 for e in demo.actions if e.kind == LIGHTHOUSE_KILL)
    return (
        f"{demo.args.groups} replica groups of {model}: {kills} SIGKILL + restart, "
        f"{hangs} SIGSTOP hang, {lighthouse} lighthouse restart"
    )


# ------------------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="failure_demo.py",
        description=(
            "Start a lighthouse and 3 fault-tolerant replica groups, SIGKILL/restart and "
            "SIGSTOP them and restart the lighthouse on a schedule, then plot and summarize "
            "what happened."
        ),
    )
    p.add_argument(
        "--model",
        choices=["titan", "mlp"],
        default="titan",
        help="titan: TorchTitan llama3 debugmodel via run_train.sh (configs/debug_ft_cpu.toml); "
        "mlp: the tiny-MLP harness of torchtitan_ft/testing/mlp.py (fast). Default: %(default)s",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (default: titan 120, mlp 400)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: outputs/failure_demo_<model>)",
    )
    p.add_argument(
        "--groups", type=int, default=3, help="replica groups, 2 or more (default: %(default)s)"
    )
    p.add_argument(
        "--faults",
        nargs="+",
        type=FaultKind,
        choices=FAULTS,
        default=DEFAULT_FAULTS,
        help="the faults, in order, evenly spaced over the steps (default: "
        + " ".join(DEFAULT_FAULTS)
        + ")",
    )
    p.add_argument("--seed", type=int, default=0, help="schedule seed (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="lighthouse port (default: a free one)")
    p.add_argument("--min_replicas", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--hang_s", type=float, default=None, help="SIGSTOP duration, s")
    p.add_argument(
        "--heartbeat_timeout_ms",
        type=int,
        default=1000,
        help="lighthouse heartbeat timeout: evicts the hung group (default: %(default)s)",
    )
    p.add_argument("--join_timeout_ms", type=int, default=2000, help="(default: %(default)s)")
    p.add_argument("--restart_delay_s", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument(
        "--lighthouse_down_s",
        type=float,
        default=2.0,
        help="how long the lighthouse stays down before it is started again (default: %(default)s)",
    )
    p.add_argument(
        "--recovery_timeout_s",
        type=float,
        default=None,
        help="how long to wait for all groups to train together again before the next "
        "failure; titan: also the groups' quorum timeout (default: titan 180, mlp 30)",
    )
    p.add_argument("--startup_timeout_s", type=float, default=None)
    p.add_argument("--finish_timeout_s", type=float, default=None)
    p.add_argument("--print_every_s", type=float, default=3.0)
    p.add_argument(
        "--page_snapshots",
        action="store_true",
        help="save the lighthouse's status page (as Chromium renders it) and its JSON after "
        "each fault's recovery and at the end, under <out>/page/",
    )
    p.add_argument(
        "--screenshots", action="store_true", help="with --page_snapshots: PNGs of the page too"
    )
    args = p.parse_args(argv)
    if args.groups < 2:
        p.error(f"--groups must be 2 or more (a fault needs a survivor), got {args.groups}")
    if args.min_replicas > args.groups:
        p.error(f"--min_replicas ({args.min_replicas}) is more than --groups ({args.groups})")
    titan = args.model == "titan"
    defaults = {
        "steps": 120 if titan else 400,
        "hang_s": 15.0 if titan else 7.0,
        "recovery_timeout_s": 180.0 if titan else 30.0,
        "startup_timeout_s": 240.0 if titan else 60.0,
        "finish_timeout_s": 300.0 if titan else 60.0,
        "out": ROOT / "outputs" / f"failure_demo_{args.model}",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in [*args.out.glob("*.log"), *args.out.glob("*.jsonl"), *args.out.glob("*.pt")]:
        old.unlink()
    for folder in ("events", "commit_logs", "lighthouse_state", "page"):
        shutil.rmtree(args.out / folder, ignore_errors=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    demo = Demo(args)
    try:
        demo.run()
    except KeyboardInterrupt:
        print("interrupted; writing what was seen so far", flush=True)
    finally:
        demo.close()
    demo.refresh()
    summary = summarize(demo)
    (args.out / "summary.txt").write_text(summary + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary_data(demo), indent=1) + "\n")
    (args.out / "faults.json").write_text(
        json.dumps([e.__dict__ for e in demo.actions], indent=1) + "\n"
    )
    png = args.out / "failure_demo.png"
    plot(demo, png)
    print("\n" + summary)
    print(f"\nwrote {png} and {args.out / 'summary.txt'}")
    failed = problems(demo)
    for problem in failed:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
