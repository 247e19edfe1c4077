"""Goodput under routine failures: the same TorchTitan job under the same seeded fault schedule,
once per recovery method, one after the other; prints JSON and draws a PNG.

    python -m benchmarks.goodput [--duration 600] [--mean-interval 30] [--seed 27]
    python -m benchmarks.goodput --quick          # CI: short, 1 rank per group

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

Faults (``testing.faults.fault_schedule``: seeded, exponential intervals of mean
``--mean-interval``, kinds in shuffled rounds): SIGKILL of one rank; SIGSTOP of one rank for
``--hang-s`` (longer than the process-group timeout), then SIGCONT; a group's link down for
``--link-down-s``; the lighthouse SIGKILLed and restarted after ``--lighthouse-down-s``; a group
killed and then its donor killed as soon as it starts healing; two groups killed together. A
victim that is not running when its fault is due is replaced by the next running group.

Per method (JSON ``methods.<name>``): ``time_to_target_s``, ``goodput`` (ideal's time / this),
``faults_injected``, ``faults_survived`` (the job committed again and the victim group took
part again), ``job_restarts``, ``group_restarts`` (torchrun's), ``samples_lost`` /
``samples_duplicated`` (ledger check for FT, checkpoint lineage for checkpoint-restart),
``groups_identical`` (every group's rank k holds the same model and optimizer bytes),
for torchft also ``samples_lost_by`` (what the records show of each lost batch: read while its
group healed, read in a step that did not commit, or read by no record) and ``divergence``
(the first committed step after which its groups' weights differ, each group's learning rate
in it and whether it healed in it; null when they never part),
``second_lines`` (processes that committed below the job's step instead of healing: the job's
state was lost; empty when it never was),
``final_loss`` (and ``ideal_loss``), ``faults`` (per fault: ``stall_s`` until the job's
committed samples pass those at the fault, ``rejoin_s`` until the victim takes part again,
``samples_rolled_back``), ``usage`` (RSS and descriptors of each long-lived rank at its first
and last record). Top level: ``replacement_s`` (median ``rejoin_s`` of torchtitan_ft's SIGKILLs
of a ``./run_train.sh`` rank), ``timeouts``, ``cpu_quota``, ``machine``. Everything is read
from the workers' records and the Managers' event streams, never from log wording.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from benchmarks import machine
from benchmarks._reference import REFERENCE_DIR, RUNTIME_DEPS_DIR
from torchtitan_ft.events import EVENTS_DIR_ENV, EventKind, read_events
from torchtitan_ft.testing import netns
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.faults import DEFAULT_KINDS, Fault, FaultKind, fault_schedule
from torchtitan_ft.testing.goodput_accounting import ledger_check, time_to_samples
from torchtitan_ft.testing.processes import descendants, free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "debug_ft_cpu.toml"
LOCAL_BATCH = 2
"""``training.local_batch_size`` of ``CONFIG``: samples per rank per step."""
LIGHTHOUSE_PORT = 29510
TORCHFT_NO_LINK = (
    "not injected: torchft's Manager advertises socket.gethostname() and TorchTitan's FTManager "
    "gives it no host name, so torchft's groups cannot live in network-namespace hosts (the name "
    "resolves to a loopback address there); they run on this machine's loopback, where no "
    "group's link can be pulled"
)
"""Why a ``link_down`` fault does not apply to the ``torchft`` method."""
TORCHFT_TIMEOUTS = {"TORCHFT_QUORUM_TIMEOUT_SEC": "300", "TORCHFT_QUORUM_RETRIES": "10"}
"""torchft's own settings for the torchft method (environment variables: TorchTitan's FTManager
passes only the process-group timeout): the quorum timeout of the torchtitan_ft groups, and
retries so that a quorum call that meets a restarting lighthouse does not end the group. Its
collective and commit timeout (``TORCHFT_TIMEOUT_SEC``) is set to the process-group timeout."""
STOP_MARGIN_STEPS = 2
"""After the target: every group trains this many more steps together, then stops and dumps."""


class Method(StrEnum):
    IDEAL = "ideal"
    CHECKPOINT_RESTART = "checkpoint_restart"
    TORCHFT = "torchft"
    TORCHTITAN_FT = "torchtitan_ft"


@dataclass
class Options:
    groups: int
    ranks: int
    duration_s: float
    mean_interval_s: float
    seed: int
    cpus_per_group: float
    cpus_lighthouse: float
    replacement: str
    heartbeat_timeout_ms: int
    process_group_timeout_ms: int
    hang_s: float
    link_down_s: float
    lighthouse_down_s: float
    checkpoint_every: int
    cap_factor: float
    startup_limit_s: float
    kinds: list[FaultKind]
    out: Path

    @property
    def samples_per_step(self) -> int:
        return self.groups * self.ranks * LOCAL_BATCH


# ------------------------------------------------------------------------------ processes


def worker_pids(agent: int, folder: Path) -> dict[int, int]:
    """Local rank -> pid of the trainer processes under torchrun agent ``agent``: those of its
    descendants that announced themselves in ``folder`` (``worker_<tag>_l<RANK>_p<PID>``; a
    worker forked by the zygote has the zygote's command line and environment in /proc)."""
    announced = {}
    for path in folder.glob("worker_*_l*_p*"):
        rank, pid = path.name.rsplit("_l", 1)[1].split("_p")
        announced[int(pid)] = int(rank)
    return {announced[pid]: pid for pid in descendants(agent) if pid in announced}


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Launch:
    """One ``run_train.sh`` (a torchrun job): a replica group, or the whole native job."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        limits: list[CpuLimit],
        ranks: int,
        host: netns.Host | None,
    ) -> None:
        self.name, self.argv, self.env, self.log, self.host = name, argv, env, log, host
        self.folder = log.parent
        """Where its workers announce themselves (the method's folder)."""
        self.limits = limits
        """One per replica group in this launch: its ranks' CPU quota."""
        self.ranks = ranks
        self.placed: set[int] = set()
        self.proc: subprocess.Popen[bytes] | None = None
        self.launches = 0

    def start(self) -> None:
        self.launches += 1
        with open(self.log, "ab") as f:
            command = self.host.command(self.argv) if self.host else self.argv
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT
            )
        self.limits[0].add(self.proc.pid)  # torchrun and its workers until placed

    def place_workers(self) -> None:
        """Moves each new worker into its group's cgroup (local rank // ranks per group): a
        cgroup weighs as much as one process against the machine's others, so the native job's
        ranks share out as the FT groups' do."""
        if len(self.limits) == 1:
            return
        for local_rank, pid in self.workers().items():
            if pid not in self.placed:
                self.limits[local_rank // self.ranks].add(pid)
                self.placed.add(pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tree(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)] if self.proc else []

    def kill(self) -> None:
        if self.proc is None:
            return
        pids = self.tree()
        signal_pids(pids, signal.SIGCONT)
        signal_pids(pids, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def workers(self) -> dict[int, int]:
        return worker_pids(self.proc.pid, self.folder) if self.alive() else {}


class Lighthouse:
    """``torchft_lighthouse`` in host ``host`` (or on 127.0.0.1), restartable on its port: this
    project's, with ``--state_dir`` (what its state guard needs across a restart), or torchft
    0.2.0's with ``reference``."""

    def __init__(
        self, opts: Options, host: netns.Host | None, log: Path, *, reference: bool = False
    ) -> None:
        self.limit = CpuLimit("goodput_lighthouse", [], cpus=opts.cpus_lighthouse)
        self.addr = host.address if host else "127.0.0.1"
        self.port = LIGHTHOUSE_PORT if host else free_port()
        self.host = host
        self.log = log
        self.argv = [
            sys.executable,
            "-m",
            "torchtitan_ft.lighthouse.cli",
            f"--bind={self.addr}:{self.port}",
            "--min_replicas=1",
            "--join_timeout_ms=2000",
            f"--heartbeat_timeout_ms={opts.heartbeat_timeout_ms}",
            "--quorum_tick_ms=50",
            "--status_bind=off",
            f"--state_dir={log.parent / 'lighthouse_state'}",
        ]
        if reference:
            self.argv = [
                sys.executable,
                *("-m", "benchmarks._goodput_torchft_worker", "lighthouse"),
                *(f"{self.addr}:{self.port}", "1", "2000", "50", str(opts.heartbeat_timeout_ms)),
            ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"http://{self.addr}:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as f:
            argv = self.host.command(self.argv) if self.host else self.argv
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        self.limit.add(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self.limit.close()


# ------------------------------------------------------------------------------ records


@dataclass
class Record:
    """One line of a worker's ``steps_*.jsonl`` (see ``torchtitan_ft.testing.goodput_worker``)."""

    group: int | None
    """The replica group (None: the native job)."""
    pid: int
    time: float
    step: int
    committed: bool
    consumed: list[int] | None
    participants: list[int] | None
    loss: float | None
    rss_mb: float
    fds: int
    batches_committed: int | None = None
    """torchft's count of committed batches (the torchft method; else None)."""
    participating: bool | None = None
    """This group's batch was in the step (the torchft method; else None)."""
    drawn: int | None = None
    """Batches the group's loader has given out, over its processes: TorchTitan's FT data loader
    checkpoint carries the count across a restart (the torchft method; else None)."""
    lr: float | None = None
    """The learning rate the optimizer stepped with (the torchft method; else None)."""
    param_sum: float | None = None
    """Sum of rank 0's model shards after the step (the torchft method; else None)."""
    healed: bool = False
    """This group healed in the step (this project's worker)."""
    logged_loss: float | None = None
    """The loss as TorchTitan's FT trainer logs it (the torchft method; ``loss`` is this over
    the participants)."""


class RecordReader:
    """The workers' records under ``folder``, read on from where the last call stopped (the
    benchmark polls them every 50 ms for the whole run, on the little CPU the groups' budgets
    leave it): only whole lines are taken, so a line being written is read next time, and the
    torn last line of a killed writer never."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}
        self._records: list[Record] = []

    def read(self) -> list[Record]:
        new = []
        for path in self.folder.glob("steps_*.jsonl"):
            tag, pid = path.stem.removeprefix("steps_").rsplit("_p", 1)
            group = None if tag == "job" else int(tag[1:])
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    new.append(Record(group, int(pid), **json.loads(line)))
        if new:
            self._records = sorted([*self._records, *new], key=lambda r: r.time)
        return list(self._records)


def record_samples(r: Record, opts: Options) -> int:
    """Samples in the model as this record saw it: the ledger (FT), torchft's committed batches,
    or steps x world batch."""
    if r.batches_committed is not None:
        return r.batches_committed * opts.ranks * LOCAL_BATCH
    if r.consumed is not None:
        return sum(r.consumed) * opts.ranks * LOCAL_BATCH
    return r.step * opts.samples_per_step


def fill_participants(records: list[Record]) -> None:
    """The torchft method's participants of each committed step: the groups whose record of
    that step says they took part (a group knows only how many did)."""
    by_step: dict[int, set[int]] = {}
    for r in records:
        if r.committed and r.participating and r.group is not None:
            by_step.setdefault(r.step, set()).add(r.group)
    for r in records:
        if r.participating is not None:
            r.participants = sorted(by_step.get(r.step, ())) if r.committed else []


def drawn_batches_check(records: list[Record]) -> dict[str, Any]:
    """Exactly once for the torchft method, per group's slice of the data: the batch a record
    trained (or lost) is ``drawn - 1`` of the group's loader, whose position TorchTitan's FT
    data loader checkpoint carries across a restart (a new process resumes where the latest
    such checkpoint left it, not where the killed one stopped). Lost: batches of the slice below
    the last one trained that no committed step of the group took part with (read and
    discarded, or skipped by a resume ahead); duplicated: batches trained more than once (a
    resume behind). ``lost_by``: each lost batch by what its records show, ``healing`` (its
    step committed while the group healed: torchft zeroes a healing group's gradient),
    ``discarded`` (its step did not commit) or ``not_read`` (no record read it)."""
    lost = duplicated = 0
    lost_by = {"healing": 0, "discarded": 0, "not_read": 0}
    for g in sorted({r.group for r in records if r.group is not None}):
        mine = [r for r in records if r.group == g and r.drawn is not None]
        trained: dict[int, int] = {}
        for r in mine:
            if r.committed and r.participating:
                trained[r.drawn - 1] = trained.get(r.drawn - 1, 0) + 1
        if not trained:
            continue
        missing = set(range(max(trained) + 1)) - set(trained)
        lost += len(missing)
        duplicated += sum(n - 1 for n in trained.values())
        for batch in missing:
            steps = [r for r in mine if r.drawn - 1 == batch]
            if any(r.committed for r in steps):
                lost_by["healing"] += 1
            elif steps:
                lost_by["discarded"] += 1
            else:
                lost_by["not_read"] += 1
    return {
        "exactly_once": lost == duplicated == 0,
        "lost": lost,
        "duplicated": duplicated,
        "lost_by": lost_by,
    }


def first_divergence(records: list[Record]) -> dict[str, Any] | None:
    """The torchft method's first committed step after which the groups' rank 0 hold different
    model bytes (their ``param_sum`` differs), with each group's learning rate in that step and
    whether it healed in it; None when they never part. Groups that part stay apart: every
    later step applies the same averaged gradient to different weights. Only the job's first
    line of steps is read: after the job lost its state (:func:`second_lines`), the steps are
    numbered again from its first commit on."""
    again = {line["pid"] for line in second_lines(records)}
    end = min((r.time for r in records if r.pid in again and r.committed), default=float("inf"))
    by_step: dict[int, dict[int, Record]] = {}
    for r in records:
        if r.committed and r.param_sum is not None and r.group is not None and r.time < end:
            by_step.setdefault(r.step, {})[r.group] = r
    for step in sorted(by_step):
        groups = by_step[step]
        if len({r.param_sum for r in groups.values()}) > 1:
            return {
                "step": step,
                "groups": {
                    g: {"lr": r.lr, "healed": not r.participating}
                    for g, r in sorted(groups.items())
                },
            }
    return None


def second_lines(records: list[Record]) -> list[dict[str, int]]:
    """Processes whose first commit is at a step below the job's highest committed step at
    that time: they trained from their own state instead of healing, a second line of steps
    (per-step FT lost the job's state: every group holding it was down together). A process
    that heals commits at the job's step."""
    out = []
    best = -1
    seen: set[int] = set()
    for r in sorted(records, key=lambda r: r.time):
        if not r.committed:
            continue
        if r.pid not in seen:
            seen.add(r.pid)
            if r.step < best:
                out.append({"group": r.group, "pid": r.pid, "step": r.step, "job_step": best})
        best = max(best, r.step)
    return out


# ------------------------------------------------------------------------------ one method


@dataclass
class Injected:
    fault: Fault
    time: float
    """Seconds after launch."""
    groups: list[int]
    effect: str = ""
    deferred_s: float = 0.0
    """How long it waited past its time for a group holding the state to survive it."""
    donor: int | None = None
    stall_s: float | None = None
    rejoin_s: float | None = None
    samples_rolled_back: int = 0


@dataclass
class MethodRun:
    method: Method
    opts: Options
    schedule: list[Fault]
    target: int | None = None
    """Samples to reach (None: the ideal run, which sets it)."""
    folder: Path = field(init=False)
    started: float = 0.0
    injected: list[Injected] = field(default_factory=list)
    job_restarts: int = 0
    pending: list[tuple[float, Callable[[], None]]] = field(default_factory=list)
    t0: float | None = None
    """Seconds after launch at which the job trained (every group took part in a commit)."""
    load_at_start: float | None = None
    watch: Callable[[], bool] | None = None
    struck: dict[int, float] = field(default_factory=dict)
    """Group -> when a fault last hit it (Unix time)."""

    def __post_init__(self) -> None:
        self.folder = self.opts.out / self.method.value
        shutil.rmtree(self.folder, ignore_errors=True)
        (self.folder / "events").mkdir(parents=True)
        self.stop_file = self.folder / "stop"
        self.reader = RecordReader(self.folder)

    @property
    def ft(self) -> bool:
        return self.method is not Method.CHECKPOINT_RESTART

    def now(self) -> float:
        return time.time() - self.started

    # launch ------------------------------------------------------------------------------

    def _env(self, ngpu: int, lighthouse: str, events: Path) -> dict[str, str]:
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        extra: dict[str, str] = {}
        if self.method is Method.TORCHFT:  # the reference after this environment's packages
            paths += [str(REFERENCE_DIR), str(RUNTIME_DEPS_DIR)]
            extra = {
                **TORCHFT_TIMEOUTS,
                "TORCHFT_TIMEOUT_SEC": str(self.opts.process_group_timeout_ms // 1000),
                "TRAIN_FILE": "benchmarks._goodput_torchft_worker",
            }
        return {
            **os.environ,
            "NGPU": str(ngpu),
            "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            "CONFIG_FILE": str(CONFIG),
            "TRAIN_FILE": "torchtitan_ft.testing.goodput_worker",
            "TORCHFT_LIGHTHOUSE": lighthouse,
            "MASTER_ADDR": "127.0.0.1",
            "MAX_RESTARTS": "1000" if self.ft else "0",
            "GOODPUT_OUT": str(self.folder),
            "GOODPUT_STOP_FILE": str(self.stop_file),
            EVENTS_DIR_ENV: str(events),
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            **extra,
        }

    def _common_args(self) -> list[str]:
        return [
            str(ROOT / "run_train.sh"),
            "--training.steps=1000000",
            f"--job.dump_folder={self.folder / 'dump'}",
            f"--comm.train_timeout_seconds={self.opts.process_group_timeout_ms // 1000}",
        ]

    def _group_launch(self, g: int, lighthouse: Lighthouse, host: netns.Host | None) -> Launch:
        opts = self.opts
        hostname = host.address if host else "127.0.0.1"
        if self.method is Method.TORCHFT:  # TorchTitan's own fault_tolerance fields only
            own = ["--job.custom_config_module=torchtitan_ft.titan.config_schema"]
        else:
            own = [
                f"--fault_tolerance.hostname={hostname}",
                "--fault_tolerance.quorum_timeout_ms=300000",
                f"--fault_tolerance.replacement={opts.replacement}",
            ]
        argv = [
            *self._common_args(),
            *own,
            f"--fault_tolerance.replica_id={g}",
            f"--fault_tolerance.group_size={opts.groups}",
            "--fault_tolerance.min_replica_size=1",
            f"--fault_tolerance.process_group_timeout_ms={opts.process_group_timeout_ms}",
        ]
        limit = CpuLimit(f"goodput_g{g}", [], cpus=opts.cpus_per_group)
        env = self._env(opts.ranks, lighthouse.address, self.folder / "events" / f"g{g}")
        log = self.folder / f"group{g}.log"
        return Launch(f"group {g}", argv, env, log, [limit], opts.ranks, host)

    def _native_launch(self) -> Launch:
        opts = self.opts
        argv = [
            *self._common_args(),
            "--fault_tolerance.no-enable",
            f"--parallelism.data_parallel_replicate_degree={opts.groups}",
            f"--parallelism.data_parallel_shard_degree={opts.ranks}",
            "--checkpoint.enable",
            f"--checkpoint.interval={opts.checkpoint_every}",
            f"--checkpoint.folder={self.folder / 'checkpoint'}",
            "--checkpoint.keep_latest_k=2",
        ]
        limits = [
            CpuLimit(f"goodput_native{g}", [], cpus=opts.cpus_per_group) for g in range(opts.groups)
        ]
        env = self._env(opts.groups * opts.ranks, "http://127.0.0.1:1", self.folder / "events")
        return Launch("native job", argv, env, self.folder / "job.log", limits, opts.ranks, None)

    # the run -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        net = None
        if self.method is Method.TORCHTITAN_FT and netns.unavailable_reason() is None:
            net = netns.HostNetwork(["L", *(f"G{g}" for g in range(self.opts.groups))])
            net.start()
        try:
            return self._run(net)
        finally:
            if net is not None:
                net.close()

    def _run(self, net: netns.HostNetwork | None) -> dict[str, Any]:
        opts = self.opts
        self.net = net
        self.lighthouse = Lighthouse(
            opts,
            net["L"] if net else None,
            self.folder / "lh.log",
            reference=self.method is Method.TORCHFT,
        )
        if self.ft:
            self.launches = [
                self._group_launch(g, self.lighthouse, net[f"G{g}"] if net else None)
                for g in range(opts.groups)
            ]
        else:
            self.launches = [self._native_launch()]
        self.started = time.time()
        try:
            if self.ft:
                self.lighthouse.start()
            for launch in self.launches:
                launch.start()
            reached = self._drive()
            finals = self._stop()
        finally:
            for launch in self.launches:
                launch.kill()
                for limit in launch.limits:
                    limit.close()
            self.lighthouse.close()
        return self._summary(reached, finals)

    def records(self) -> list[Record]:
        records = self.reader.read()
        if self.method is Method.TORCHFT:
            fill_participants(records)
        return records

    def samples_now(self, records: list[Record]) -> int:
        if not records:
            return 0
        if self.ft:
            return max(record_samples(r, self.opts) for r in records)
        return record_samples(records[-1], self.opts)

    def _training_started(self, records: list[Record]) -> bool:
        """Every group took part in a commit (the native job: it committed)."""
        for r in records:
            if r.committed and (r.participants is None or len(r.participants) == self.opts.groups):
                return True
        return False

    def _drive(self) -> float:
        """Runs the schedule until the target (or ``--duration`` for ideal); returns the time.
        The schedule's clock starts once the job trains (:attr:`t0`): start-up, which takes
        minutes on a loaded machine, is neither measured nor hit."""
        opts = self.opts
        length = opts.duration_s if self.target is None else opts.duration_s * opts.cap_factor
        faults = list(self.schedule) if self.method is not Method.IDEAL else []
        last_print = 0.0
        while True:
            now = self.now()
            records = self.records()
            samples = self.samples_now(records)
            if self.t0 is None:
                if self._training_started(records):
                    self.t0 = now
                    self.load_at_start = os.getloadavg()[0]
                elif now > opts.startup_limit_s:
                    raise RuntimeError(
                        f"{self.method}: the job did not train within {opts.startup_limit_s} s "
                        f"of its launch; logs in {self.folder}"
                    )
            else:
                if self.target is not None and samples >= self.target:
                    return now
                if now >= self.t0 + length:
                    return now
                while faults and self.t0 + faults[0].at_s <= now:
                    victims = self._victims(faults[0], records)
                    if victims is None:
                        break  # deferred: no group holding the state would survive it
                    fault = faults.pop(0)
                    self._inject(fault, victims, self.t0 + fault.at_s)
            for due, action in list(self.pending):
                if due <= now:
                    self.pending.remove((due, action))
                    action()
            if self.watch is not None and self.watch():
                self.watch = None
            if not self.ft:
                self.launches[0].place_workers()
                if not self.launches[0].alive():
                    self._restart_job("exited")
            if now - last_print > 15:
                last_print = now
                print(
                    f"[{self.method}] {now:6.0f}s samples {samples} faults {len(self.injected)}",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05)

    def _restart_job(self, why: str) -> None:
        self.job_restarts += 1
        launch = self.launches[0]
        launch.kill()
        launch.start()

    # faults ------------------------------------------------------------------------------

    def _running_groups(self) -> list[int]:
        return [
            g for g, launch in enumerate(self.launches) if len(launch.workers()) == self.opts.ranks
        ]

    def _holders(self, records: list[Record]) -> list[int]:
        """Running groups that took part in the job's latest commit and have not been struck
        since without taking part again: they hold its state. (A group one of whose ranks was
        just killed still has all its workers until torchrun notices.)"""
        latest = next((r for r in reversed(records) if r.committed and r.participants), None)
        if latest is None:
            return []
        running = self._running_groups()
        return [
            g
            for g in latest.participants
            if g in running
            and not (
                g in self.struck
                and not any(
                    r.time > self.struck[g] and r.participants and g in r.participants
                    for r in records
                )
            )
        ]

    def _victims(self, fault: Fault, records: list[Record]) -> list[int] | None:
        """The fault's victim groups, or None while it must wait (per-step FT keeps the job's
        state only in live groups: a fault fires once a group holding the state survives it,
        else it would end the job, not test its recovery). A scheduled victim that does not
        hold the state is replaced by the next group that does."""
        needed = {FaultKind.LIGHTHOUSE: 0, FaultKind.TWO_GROUPS: 2, FaultKind.DONOR_KILL: 2}.get(
            fault.kind, 1
        )
        if not self.ft:
            return list(fault.groups)
        holders = self._holders(records)
        if len(holders) < needed + 1:
            return None
        out: list[int] = []
        for g in fault.groups:
            order = [(g + i) % self.opts.groups for i in range(self.opts.groups)]
            out.append(next(v for v in order if v in holders and v not in out))
        return out

    def _inject(self, fault: Fault, victims: list[int], due: float) -> None:
        inj = Injected(fault, self.now(), victims, deferred_s=round(self.now() - due, 2))
        self.injected.append(inj)
        if not self.ft:
            if fault.kind is FaultKind.LIGHTHOUSE:
                inj.effect = "none: no lighthouse"
                return
            inj.effect = "job restarted from the last checkpoint"
            self._restart_job(fault.kind.value)
            return
        kind = fault.kind
        if kind in (FaultKind.SIGKILL, FaultKind.TWO_GROUPS, FaultKind.DONOR_KILL):
            for g in victims:
                self._kill_rank(g, fault.rank)
            inj.effect = f"SIGKILL rank {fault.rank} of group(s) {victims}"
            if kind is FaultKind.DONOR_KILL:
                self.watch = self._donor_watch(inj)
        elif kind is FaultKind.SIGSTOP:
            pid = self.launches[victims[0]].workers().get(fault.rank)
            if pid is None:
                inj.effect = "not injected: rank gone"
                return
            os.kill(pid, signal.SIGSTOP)
            self.struck[victims[0]] = time.time()
            inj.effect = f"SIGSTOP rank {fault.rank} of group {victims[0]} for {self.opts.hang_s}s"
            self.pending.append(
                (self.now() + self.opts.hang_s, lambda: signal_pids([pid], signal.SIGCONT))
            )
        elif kind is FaultKind.LINK_DOWN:
            if self.method is Method.TORCHFT:
                inj.effect = TORCHFT_NO_LINK
                return
            if self.net is None:
                inj.effect = "not injected: no network namespaces here"
                return
            host = self.net[f"G{victims[0]}"]
            host.disconnect()
            self.struck[victims[0]] = time.time()
            inj.effect = f"link of group {victims[0]} down for {self.opts.link_down_s}s"
            self.pending.append((self.now() + self.opts.link_down_s, host.reconnect))
        elif kind is FaultKind.LIGHTHOUSE:
            self.lighthouse.kill()
            inj.groups = []
            inj.effect = f"lighthouse SIGKILLed, back after {self.opts.lighthouse_down_s}s"
            self.pending.append((self.now() + self.opts.lighthouse_down_s, self.lighthouse.start))

    def _kill_rank(self, g: int, rank: int) -> None:
        self.struck[g] = time.time()
        pid = self.launches[g].workers().get(rank)
        if pid is not None:
            signal_pids([pid], signal.SIGCONT)
            signal_pids([pid], signal.SIGKILL)

    def _donor_watch(self, inj: Injected) -> Callable[[], bool]:
        """Kills the donor of the victim's first heal after the kill (or gives up after 300 s)."""
        victim = inj.groups[0]
        folder = self.folder / "events" / f"g{victim}"
        since = self.started + inj.time

        def check() -> bool:
            if self.now() - inj.time > 300:
                inj.effect += "; no heal seen within 300 s, donor not killed"
                return True
            if self.method is Method.TORCHFT:
                return self._torchft_donor(inj, victim, since)
            events = [e for e in read_events(folder) if e.time > since and e.group_rank == 0]
            heals = [e for e in events if e.kind is EventKind.HEAL_START]
            if not heals:
                return False
            quorums = [e for e in events if e.kind is EventKind.QUORUM and e.time <= heals[0].time]
            donor_id = quorums[-1]["replica_ids"][heals[0]["source_replica_rank"]]
            donor = int(donor_id.removeprefix("torchtitan_ft_").split(":")[0])
            self._kill_rank(donor, inj.fault.rank)
            done = [e for e in events if e.kind is EventKind.HEAL_END]
            inj.donor = donor
            inj.effect += f"; donor group {donor} SIGKILLed " + (
                "after the heal had ended" if done else "while the victim healed"
            )
            return True

        return check

    def _torchft_donor(self, inj: Injected, victim: int, since: float) -> bool:
        """The torchft method's donor kill: the source of the victim's first heal after the
        kill, as its quorum named it (``heals_*.jsonl`` of the torchft worker)."""
        heals = []
        for path in self.folder.glob(f"heals_r{victim}_p*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    heals.append(json.loads(line))
        heals = sorted((h for h in heals if h["time"] > since), key=lambda h: h["time"])
        if not heals:
            return False
        inj.donor = heals[0]["source"]
        self._kill_rank(inj.donor, inj.fault.rank)
        inj.effect += f"; donor group {inj.donor} SIGKILLed when the victim's quorum said heal"
        return True

    # the end -----------------------------------------------------------------------------

    def _stop(self) -> dict[str, dict]:
        """Every group back (at most 300 s), a few steps together, then stop and collect."""
        for _, action in self.pending:
            action()
        self.pending = []
        deadline = time.time() + 300
        if self.ft:
            while time.time() < deadline:
                records = self.records()
                last = [r for r in records if r.committed and r.participants]
                if last and len(last[-1].participants) == self.opts.groups:
                    break
                time.sleep(0.2)
        records = self.records()
        step = max((r.step for r in records), default=0) + STOP_MARGIN_STEPS
        self.stop_file.write_text(str(step))
        for launch in self.launches:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launch.proc.wait(max(deadline + 60 - time.time(), 1))
        finals = {}
        for path in self.folder.glob("final_*.json"):
            finals[path.stem.removeprefix("final_")] = json.loads(path.read_text())
        return finals

    def _summary(self, reached: float, finals: dict[str, dict]) -> dict[str, Any]:
        opts = self.opts
        records = self.records()
        t0 = self.started + (self.t0 or 0.0)
        points = [(r.time - t0, record_samples(r, opts)) for r in records if r.committed]
        target = self.target if self.target is not None else self.samples_now(records)
        at = time_to_samples(points, target, rollback=not self.ft)
        # a healing step logs the loss of the model it replaced: not the job's
        lineage = [r for r in records if r.committed and r.loss is not None and not r.healed]
        final_loss = next(
            (r.loss for r in lineage if record_samples(r, opts) >= target),
            lineage[-1].loss if lineage else None,
        )
        for inj in self.injected:
            self._fault_figures(inj, records)
        by_rank: dict[int, set[str]] = {}
        for tag, final in finals.items():
            by_rank.setdefault(int(tag.rsplit("rank", 1)[1]), set()).add(final["hash"])
        group_finals = {
            int(tag[1:].split("_")[0]): f
            for tag, f in finals.items()
            if tag.startswith("r") and tag.endswith("_rank0")
        }
        if self.method is Method.TORCHFT:
            ledger = drawn_batches_check(records)
            identical = len(finals) == opts.groups * opts.ranks and all(
                len(h) == 1 for h in by_rank.values()
            )
        elif self.ft:
            ledger = ledger_check(group_finals, opts.groups)
            identical = (
                len(group_finals) == opts.groups
                and len(finals) == opts.groups * opts.ranks
                and all(len(h) == 1 for h in by_rank.values())
            )
        else:
            ledger = self._checkpoint_lineage(records)
            identical = True  # one job: HSDP replicas are kept equal by its all-reduce
        per_batch = opts.ranks * LOCAL_BATCH
        survived = [
            i
            for i in self.injected
            if i.stall_s is not None and (i.rejoin_s is not None or not i.groups)
        ]
        injected = [i for i in self.injected if not i.effect.startswith("not injected")]
        return {
            "target_samples": target,
            "time_to_target_s": round(at, 2) if at is not None else None,
            "startup_s": round(self.t0, 1) if self.t0 is not None else None,
            "load_avg_1m": [self.load_at_start, os.getloadavg()[0]],
            "reached_target": at is not None,
            "faults_injected": len(injected),
            "faults_survived": len([i for i in survived if i in injected]),
            "job_restarts": self.job_restarts,
            "group_restarts": len({(r.group, r.pid) for r in records})
            - len({r.group for r in records}),
            "samples_lost": ledger["lost"] * per_batch,
            **(
                {"samples_lost_by": {k: n * per_batch for k, n in ledger["lost_by"].items()}}
                if "lost_by" in ledger
                else {}
            ),
            "samples_duplicated": ledger["duplicated"] * per_batch,
            "exactly_once": ledger["exactly_once"],
            "groups_identical": identical,
            **({"divergence": first_divergence(records)} if self.method is Method.TORCHFT else {}),
            "second_lines": second_lines(records) if self.ft else [],
            "final_loss": final_loss,
            "faults": [
                {
                    **asdict(i.fault),
                    "time_s": round(i.time - (self.t0 or 0.0), 2),
                    **{k: v for k, v in asdict(i).items() if k not in ("fault", "time")},
                }
                for i in self.injected
            ],
            "usage": usage(records, self.started),
            "curve": [
                [
                    round(r.time - t0, 2),
                    r.loss,
                    len(r.participants) if r.participants is not None else opts.groups,
                ]
                for r in lineage
            ],
        }

    def _fault_figures(self, inj: Injected, records: list[Record]) -> None:
        """Stall (until the job's samples pass those at the fault), rejoin (until each victim
        group takes part again: a new process after a kill, any commit after the hang or the
        link outage ended), samples rolled back (checkpoint-restart)."""
        t = self.started + inj.time
        at_fault = self.samples_now([r for r in records if r.time <= t and r.committed])
        after = [r for r in records if r.time > t and r.committed]
        passed = next((r for r in after if record_samples(r, self.opts) > at_fault), None)
        if passed is not None:
            inj.stall_s = round(passed.time - t, 2)
        if not self.ft:
            if after:
                low = min(record_samples(r, self.opts) for r in after)
                inj.samples_rolled_back = max(0, at_fault - low + self.opts.samples_per_step)
                inj.rejoin_s = round(after[0].time - t, 2)
            return
        if not inj.groups:
            return
        kind = inj.fault.kind
        resume = t + {
            FaultKind.SIGSTOP: self.opts.hang_s,
            FaultKind.LINK_DOWN: self.opts.link_down_s,
        }.get(kind, 0.0)
        times = []
        for g in [*inj.groups, *([inj.donor] if inj.donor is not None else [])]:
            old = {r.pid for r in records if r.group == g and r.time <= t}
            back = next(
                (
                    r
                    for r in after
                    if r.group == g
                    and r.participants
                    and g in r.participants
                    and r.time > resume
                    and (kind in (FaultKind.SIGSTOP, FaultKind.LINK_DOWN) or r.pid not in old)
                ),
                None,
            )
            if back is None:
                return
            times.append(back.time - t)
        inj.rejoin_s = round(max(times), 2)

    def _checkpoint_lineage(self, records: list[Record]) -> dict[str, Any]:
        """After each restart the job must resume at its last checkpoint (step multiple of
        ``--checkpoint-every``), with the data loader saved with it: then no sample is
        skipped or trained twice in the final model."""
        k = self.opts.checkpoint_every
        lost = duplicated = 0
        by_pid: dict[int, list[Record]] = {}
        for r in records:
            by_pid.setdefault(r.pid, []).append(r)
        runs = sorted(by_pid.values(), key=lambda rs: rs[0].time)
        for prev, nxt in itertools.pairwise(runs):
            expected = (max(r.step for r in prev) // k) * k
            resumed = nxt[0].step - 1
            lost += max(0, resumed - expected) * self.opts.groups
            duplicated += max(0, expected - resumed) * self.opts.groups
        return {"exactly_once": lost == duplicated == 0, "lost": lost, "duplicated": duplicated}


def usage(records: list[Record], started: float) -> dict[str, Any]:
    """Resident memory and descriptors of each trainer process that wrote records for at
    least half the run: at its first record past its third and at its last; the largest
    growth of each."""
    end = max((r.time for r in records), default=started)
    by_pid: dict[int, list[Record]] = {}
    for r in records:
        by_pid.setdefault(r.pid, []).append(r)
    rows = []
    for pid, rs in by_pid.items():
        if len(rs) < 5 or rs[-1].time - rs[0].time < (end - started) / 2:
            continue
        first, last = rs[3], rs[-1]
        rows.append(
            {
                "pid": pid,
                "group": first.group,
                "seconds": round(last.time - first.time, 1),
                "rss_mb": [first.rss_mb, last.rss_mb],
                "fds": [first.fds, last.fds],
            }
        )
    return {
        "processes": rows,
        "max_rss_growth_mb": max((r["rss_mb"][1] - r["rss_mb"][0] for r in rows), default=None),
        "max_fd_growth": max((r["fds"][1] - r["fds"][0] for r in rows), default=None),
    }


# ------------------------------------------------------------------------------ torchft


def torchft_problem() -> str | None:
    """Why TorchTitan's own FT trainer on the torchft 0.2.0 reference cannot run here, or None."""
    if not sorted(REFERENCE_DIR.glob("torchft/_torchft*.so")):
        return f"the torchft 0.2.0 reference is not installed under {REFERENCE_DIR}"
    if not RUNTIME_DEPS_DIR.is_dir():
        return f"torchft's dependencies are not installed under {RUNTIME_DEPS_DIR}"
    if importlib.util.find_spec("torchtitan.experiments.ft.train") is None:
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
        help="checkpoint-restart: steps between DCP checkpoints",
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
        default=[k.value for k in DEFAULT_KINDS if k is not FaultKind.LIGHTHOUSE_GROUP_AWAY],
    )
    p.add_argument(
        "--methods", nargs="+", choices=[m.value for m in Method], default=[m.value for m in Method]
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    opts = Options(
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
    budget = args.groups * args.cpus_per_group + args.cpus_lighthouse
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
    for name in (Method.TORCHTITAN_FT, Method.TORCHFT, Method.CHECKPOINT_RESTART):
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
        entry["ideal_loss"] = ideal["final_loss"]
        result["methods"][name.value] = entry
        # after each method: a run cut short keeps the methods it finished
        (args.out / "goodput.json").write_text(json.dumps(result, indent=1, default=str))
    ideal["goodput"] = 1.0
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
