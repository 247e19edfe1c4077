"""Slurm: the lighthouse as a Slurm job of its own and each replica group as a job of its own,
a runner that watches them and resubmits a dead one alone, and a punisher that cancels groups.

    python -m torchtitan_ft.slurm run --name ft --replicas 2 -- --training.steps 100
    python -m torchtitan_ft.slurm punisher --name ft kill_loop --mtbf_secs 60 --seed 1

The runner submits with ``sbatch --wrap``, reads the jobs' states with ``squeue --json`` and
cancels with ``scancel``: TorchX's Slurm scheduler (torchx 0.7) submits every role of an
application as one heterogeneous job, so one group cannot be resubmitted alone, and it reads job
states only through ``sacct``, which needs Slurm's accounting storage (``slurmdbd`` and a
database) that a plain ``slurmctld`` has not (docs/launchers.md, "Slurm").

What restarts what: a dead rank inside a group is restarted by the group's torchrun
(``MAX_RESTARTS``); a group job that ends in any state but ``COMPLETED`` (cancelled, failed, its
node lost, ...) is resubmitted with the same replica id, at most ``max_resubmits`` times per
group, and the other groups keep training; the lighthouse job likewise. The runner ends when
every group job has completed (it then cancels the lighthouse), when a job has used up its
resubmits (one line on stderr, every job cancelled, exit status 1), or on SIGTERM/SIGINT (every
job cancelled). Its record (``--events``) has one JSON object a line, :class:`RunnerEvent`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TextIO
from urllib.parse import urlparse

from torchtitan_ft.titan.releases.job import FtGroup, TitanJob, command

LIGHTHOUSE_PORT = 29510
"""The lighthouse job's default port (torchft's)."""
COMMAND_TIMEOUT_S = 30.0
"""How long one ``sbatch``/``squeue``/``scancel`` may take before the runner gives up on it."""

CANCEL_WAIT_S = 120.0
"""How long the runner waits at its end for the jobs it cancelled to have ended."""

ALIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    }
)
"""``squeue``'s job states of a job that has not ended (its ``job_state``)."""


class SlurmError(RuntimeError):
    """A Slurm command failed or Slurm lacks what the runner needs; the message is one line."""


class Liveness(Enum):
    ALIVE = "alive"
    """Pending or running."""
    COMPLETED = "completed"
    """Ended with exit status 0 (a group that finished its training)."""
    DEAD = "dead"
    """Ended otherwise (cancelled, failed, timed out, its node lost), or no longer listed."""


def liveness(state: str | None) -> Liveness:
    """What a job's ``squeue`` state (None: the job is not listed) says of it."""
    if state is None:
        return Liveness.DEAD
    if state in ALIVE_STATES:
        return Liveness.ALIVE
    return Liveness.COMPLETED if state == "COMPLETED" else Liveness.DEAD


class Action(Enum):
    KEEP = "keep"
    """Alive: nothing to do."""
    FINISHED = "finished"
    """A completed group: not resubmitted."""
    RESUBMIT = "resubmit"
    """Dead with resubmits left: submit it again, with the same replica id."""
    GIVE_UP = "give_up"
    """Dead with no resubmit left: the runner stops the whole job."""


def decide(state: Liveness, resubmits: int, max_resubmits: int, *, lighthouse: bool) -> Action:
    """What the runner does with a job in ``state`` that has been resubmitted ``resubmits``
    times. A lighthouse that completed is resubmitted too: the groups still need it."""
    if state is Liveness.ALIVE:
        return Action.KEEP
    if state is Liveness.COMPLETED and not lighthouse:
        return Action.FINISHED
    return Action.RESUBMIT if resubmits < max_resubmits else Action.GIVE_UP


def kill_intervals(seed: int, mtbf_s: float) -> Iterable[float]:
    """The punisher's waits between kills: exponential draws of mean ``mtbf_s`` seconds (a
    Poisson process of failures), the same sequence for the same ``seed``."""
    if mtbf_s <= 0:
        raise ValueError(f"mtbf_secs must be > 0, got {mtbf_s}")
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(1.0 / mtbf_s)


@dataclass(frozen=True)
class SlurmJob:
    """One job as ``squeue --json`` lists it."""

    job_id: int
    name: str
    state: str
    node: str
    """The node its batch script runs on (``batch_host``; empty while pending)."""


@dataclass
class Slurm:
    """Slurm's client commands, run with ``env`` (e.g. ``SLURM_CONF``) over this process's
    environment."""

    env: Mapping[str, str] = field(default_factory=dict)

    def _run(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        full_env = {**os.environ, **self.env, **(env or {})}
        try:
            done = subprocess.run(
                list(argv),
                env=full_env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except FileNotFoundError:
            raise SlurmError(
                f"{argv[0]}: not found on PATH (expected Slurm's client commands, e.g. "
                "Debian's slurm-client; scripts/install_slurm.sh installs them)"
            ) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"{shlex.join(argv[:2])}: no answer after {COMMAND_TIMEOUT_S} s (expected a "
                "running slurmctld)"
            ) from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit status {done.returncode}"
            if argv[1:2] == ["--json"] and "serializer/json" in done.stderr:
                raise SlurmError(
                    f"{argv[0]} --json: this Slurm has no JSON output plugin (serializer/json; "
                    "expected Slurm >= 21.08 with serializer_json.so in its PluginDir, e.g. "
                    f"Debian's slurm-wlm): {last}"
                )
            raise SlurmError(f"{shlex.join(argv[:2])} failed: {last}")
        return done.stdout

    def submit(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        output: Path,
        chdir: Path,
        sbatch_args: Sequence[str] = (),
    ) -> int:
        """Submits ``argv`` as a batch job named ``name`` that inherits this environment with
        ``env`` over it (``--export=ALL``: a secret never enters the job's command line), its
        output to ``output``; returns the job id."""
        out = self._run(
            [
                "sbatch",
                "--parsable",
                f"--job-name={name}",
                f"--output={output}",
                f"--chdir={chdir}",
                "--export=ALL",
                *sbatch_args,
                f"--wrap=exec {shlex.join(argv)}",
            ],
            env,
        )
        return int(out.strip().split(";")[0])

    def jobs(self) -> dict[int, SlurmJob]:
        """Every job ``squeue --json`` lists (ended ones too, for Slurm's ``MinJobAge``)."""
        data = json.loads(self._run(["squeue", "--json"]))
        return {
            int(j["job_id"]): SlurmJob(
                int(j["job_id"]), j.get("name", ""), j.get("job_state", ""), j.get("batch_host", "")
            )
            for j in data.get("jobs", [])
        }

    def cancel(self, job_ids: Iterable[int], signal_name: str | None = None) -> None:
        """``scancel`` the jobs (``signal_name``: send that signal instead of ending them)."""
        ids = [str(j) for j in job_ids]
        if ids:
            self._run(["scancel", *([f"--signal={signal_name}"] if signal_name else []), *ids])


@dataclass(frozen=True)
class Submission:
    """What one job runs: ``argv`` with ``env`` over the runner's environment."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


GroupCommand = Callable[[int, int, str], Submission]
"""``(replica_id, attempt, lighthouse_address) -> Submission``: what group ``replica_id``'s
``attempt``-th job (0 for the first) runs."""


@dataclass(frozen=True)
class LighthouseJob:
    """The lighthouse run as a Slurm job by the runner."""

    min_replicas: int
    """``--min_replicas``: fewest groups a quorum may have."""
    port: int = LIGHTHOUSE_PORT
    """Its gRPC port; the status page is on ``port + 1``."""
    bind_host: str = "0.0.0.0"
    """The address it binds (all of its node's by default; 127.0.0.1 for a one-machine test)."""
    address_host: str = ""
    """The host the groups reach it at; empty: the node Slurm put it on (its ``batch_host``)."""
    args: tuple[str, ...] = ()
    """Further ``torchft_lighthouse`` flags (timeouts, ``--state_dir``, ...)."""
    sbatch_args: tuple[str, ...] = ()
    """Further ``sbatch`` flags for its job only, after the runner's (e.g. ``--nodelist``: a
    resubmitted lighthouse must come back on the same node, as the groups keep its address)."""
    python: str = sys.executable

    def submission(self) -> Submission:
        return Submission(
            (
                self.python,
                "-m",
                "torchtitan_ft.lighthouse.cli",
                f"--bind={self.bind_host}:{self.port}",
                f"--status_bind={self.bind_host}:{self.port + 1}",
                f"--min_replicas={self.min_replicas}",
                *self.args,
            )
        )


@dataclass(frozen=True)
class RunnerEvent:
    """One line of the runner's record."""

    time: float
    """Unix time."""
    event: str
    """``submitted``, ``ended`` (a job seen ended: ``state``), ``finished`` (a group
    completed), ``gave_up``, ``done`` (every group completed) or ``stopped`` (signal)."""
    role: str = ""
    """``lighthouse`` or ``group``."""
    replica: int = -1
    """The group's replica id (-1: the lighthouse or the whole job)."""
    attempt: int = -1
    """The job's submission number for this role (0: the first)."""
    job_id: int = -1
    state: str = ""


@dataclass
class _Tracked:
    role: str
    replica: int
    attempt: int
    job_id: int


def listening(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``address`` (``http://host:port``)."""
    url = urlparse(address if "://" in address else f"http://{address}")
    if url.hostname is None or url.port is None:
        return False
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class SlurmRunner:
    """Runs one fault-tolerant job on Slurm (module docstring): ``replicas`` group jobs named
    ``NAME-group-I`` running ``group_command``, under ``lighthouse`` (a :class:`LighthouseJob`
    it submits as ``NAME-lighthouse``, or the address of one that runs apart)."""

    def __init__(
        self,
        slurm: Slurm,
        *,
        name: str,
        replicas: int,
        min_replicas: int,
        group_command: GroupCommand,
        lighthouse: LighthouseJob | str,
        workdir: Path,
        max_resubmits: int = 10,
        poll_s: float = 0.5,
        lighthouse_start_timeout_s: float = 120.0,
        sbatch_args: Sequence[str] = (),
        events: TextIO | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        if replicas < min_replicas:
            raise ValueError(
                f"--replicas {replicas} is below --min_replicas {min_replicas}: no quorum could "
                f"ever be issued (expected replicas >= min_replicas)"
            )
        if max_resubmits < 0:
            raise ValueError(f"--max_resubmits must be >= 0, got {max_resubmits}")
        if poll_s <= 0:
            raise ValueError(f"--poll_s must be > 0, got {poll_s}")
        self.slurm = slurm
        self.name = name
        self.replicas = replicas
        self.group_command = group_command
        self.lighthouse = lighthouse
        self.workdir = workdir
        self.max_resubmits = max_resubmits
        self.poll_s = poll_s
        self.lighthouse_start_timeout_s = lighthouse_start_timeout_s
        self.sbatch_args = tuple(sbatch_args)
        self.events = events
        self.address = lighthouse if isinstance(lighthouse, str) else ""
        self._lighthouse_job = lighthouse if isinstance(lighthouse, LighthouseJob) else None
        self._jobs: list[_Tracked] = []
        self._stop = False

    def _record(self, event: str, tracked: _Tracked | None = None, state: str = "") -> None:
        if self.events is None:
            return
        where = (
            {"role": tracked.role, "replica": tracked.replica, "attempt": tracked.attempt}
            if tracked
            else {}
        )
        line = RunnerEvent(
            time.time(),
            event,
            job_id=tracked.job_id if tracked else -1,
            state=state,
            **where,  # type: ignore[arg-type]
        )
        self.events.write(json.dumps(asdict(line)) + "\n")
        self.events.flush()

    def _submit(self, role: str, replica: int, attempt: int) -> _Tracked:
        sbatch_args = self.sbatch_args
        if self._lighthouse_job is not None and role == "lighthouse":
            sub, name = self._lighthouse_job.submission(), f"{self.name}-lighthouse"
            sbatch_args += self._lighthouse_job.sbatch_args
        else:
            sub = self.group_command(replica, attempt, self.address)
            name = f"{self.name}-group-{replica}"
        job_id = self.slurm.submit(
            name,
            sub.argv,
            env=sub.env,
            output=self.workdir / f"{name}.{attempt}.out",
            chdir=self.workdir,
            sbatch_args=sbatch_args,
        )
        tracked = _Tracked(role, replica, attempt, job_id)
        self._jobs.append(tracked)
        self._record("submitted", tracked)
        return tracked

    def _start_lighthouse(self, lighthouse: LighthouseJob) -> _Tracked:
        tracked = self._submit("lighthouse", -1, len([j for j in self._jobs if j.replica < 0]))
        deadline = time.monotonic() + self.lighthouse_start_timeout_s
        while time.monotonic() < deadline and not self._stop:
            job = self.slurm.jobs().get(tracked.job_id)
            state = liveness(job.state if job else None)
            if state is not Liveness.ALIVE:
                raise SlurmError(
                    f"lighthouse job {tracked.job_id} ended ({job.state if job else 'gone'}) "
                    f"before it listened; see {self.workdir}/{self.name}-lighthouse.*.out"
                )
            if job and job.state == "RUNNING":
                host = lighthouse.address_host or job.node
                address = f"http://{host}:{lighthouse.port}"
                if listening(address, 0.5):
                    self.address = address
                    return tracked
            time.sleep(0.1)
        raise SlurmError(
            f"lighthouse job {tracked.job_id} not listening on port {lighthouse.port} "
            f"after {self.lighthouse_start_timeout_s} s"
        )

    def request_stop(self, *_: object) -> None:
        """Ends :meth:`run` at its next poll (a signal handler)."""
        self._stop = True

    def run(self) -> int:
        """Starts the job and watches it until it is done (0), a job used up its resubmits
        (1, one line on stderr), or :meth:`request_stop` (0). Cancels every job it submitted
        that still runs when it returns or raises, and waits (at most :data:`CANCEL_WAIT_S`)
        until they have ended."""
        self.slurm.jobs()  # fails first on a Slurm without squeue's JSON output
        if isinstance(self.lighthouse, str) and not listening(self.lighthouse):
            raise SlurmError(
                f"--lighthouse {self.lighthouse}: nobody listens there (expected a running "
                "torchft_lighthouse; without --lighthouse the runner runs one as a Slurm job)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        current: dict[int, _Tracked] = {}
        resubmits: dict[int, int] = {}
        try:
            if self._lighthouse_job is not None:
                current[-1] = self._start_lighthouse(self._lighthouse_job)
            for replica in range(self.replicas):
                current[replica] = self._submit("group", replica, 0)
            finished: set[int] = set()
            while not self._stop:
                time.sleep(self.poll_s)
                listed = self.slurm.jobs()
                for key, tracked in sorted(current.items()):
                    if key in finished:
                        continue
                    job = listed.get(tracked.job_id)
                    state = job.state if job else None
                    action = decide(
                        liveness(state),
                        resubmits.get(key, 0),
                        self.max_resubmits,
                        lighthouse=key < 0,
                    )
                    if action is Action.KEEP:
                        continue
                    self._record("ended", tracked, state or "GONE")
                    if action is Action.FINISHED:
                        finished.add(key)
                        self._record("finished", tracked, state or "")
                    elif action is Action.GIVE_UP:
                        self._record("gave_up", tracked, state or "GONE")
                        what = "the lighthouse job" if key < 0 else f"group {key}'s job"
                        print(
                            f"slurm runner: {what} ended ({state or 'GONE'}) after "
                            f"{resubmits.get(key, 0)} resubmits (--max_resubmits "
                            f"{self.max_resubmits}): stopping the job",
                            file=sys.stderr,
                        )
                        return 1
                    else:
                        resubmits[key] = resubmits.get(key, 0) + 1
                        if self._lighthouse_job is not None and key < 0:
                            current[key] = self._start_lighthouse(self._lighthouse_job)
                        else:
                            current[key] = self._submit("group", key, resubmits[key])
                if len(finished) == self.replicas:
                    self._record("done")
                    return 0
            self._record("stopped")
            return 0
        finally:
            self._cancel_all()

    def _cancel_all(self) -> None:
        try:
            listed = self.slurm.jobs()
            alive = [
                j.job_id
                for j in self._jobs
                if liveness(listed[j.job_id].state if j.job_id in listed else None)
                is Liveness.ALIVE
            ]
        except SlurmError:
            alive = [j.job_id for j in self._jobs]
        if not alive:
            return
        self.slurm.cancel(alive)
        # Returns once they ended (Slurm signals them, then kills them after its KillWait), so
        # that a caller that starts the job again finds none of this one's processes.
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            listed = self.slurm.jobs()
            if all(
                liveness(listed[j].state if j in listed else None) is not Liveness.ALIVE
                for j in alive
            ):
                return
            time.sleep(0.2)


def group_jobs(slurm: Slurm, name: str) -> list[SlurmJob]:
    """The running group jobs of the job ``name`` (the punisher's victims)."""
    prefix = f"{name}-group-"
    return sorted(
        (j for j in slurm.jobs().values() if j.name.startswith(prefix) and j.state == "RUNNING"),
        key=lambda j: j.job_id,
    )


@dataclass
class Punisher:
    """torchft's punisher's three commands, on the group jobs of the job ``name``: every group
    may be a victim (torchft's never kills group 0), and ``kill_loop`` waits exponential draws
    of mean ``mtbf_secs`` (torchft's sleeps the mean itself). Each kill is one JSON line on
    ``out``: ``{"time", "job_id", "name"}``."""

    slurm: Slurm
    name: str
    seed: int = 0
    out: TextIO = sys.stdout
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _kill(self, job: SlurmJob) -> None:
        self.slurm.cancel([job.job_id])
        self.out.write(json.dumps({"time": time.time(), "job_id": job.job_id, "name": job.name}))
        self.out.write("\n")
        self.out.flush()

    def kill_one(self) -> SlurmJob | None:
        """Cancels one running group job drawn at random; None when none runs."""
        jobs = group_jobs(self.slurm, self.name)
        if not jobs:
            return None
        victim = self.rng.choice(jobs)
        self._kill(victim)
        return victim

    def kill_all(self) -> list[SlurmJob]:
        """Cancels every running group job."""
        jobs = group_jobs(self.slurm, self.name)
        for job in jobs:
            self._kill(job)
        return jobs

    def kill_loop(
        self,
        mtbf_secs: float,
        kills: int | None = None,
        stop: Callable[[], bool] = lambda: False,
        after_kill: Callable[[SlurmJob], None] | None = None,
    ) -> int:
        """Cancels one group job after each wait of :func:`kill_intervals` (seeded by
        ``seed``), ``kills`` times (None: until ``stop``); a wait that finds no running group
        kills nobody and is not counted. ``after_kill`` runs after each kill, before the next
        wait starts (a benchmark waits there for the group to be back). Returns the number of
        kills."""
        done = 0
        for wait in kill_intervals(self.seed, mtbf_secs):
            if (kills is not None and done >= kills) or stop():
                break
            time.sleep(wait)
            if (victim := self.kill_one()) is not None:
                done += 1
                if after_kill is not None:
                    after_kill(victim)
        return done


def _mlp_command(work: Path, replicas: int) -> GroupCommand:
    # load order: testing.slurm_cluster imports this module
    from torchtitan_ft.testing.slurm_cluster import mlp_group_command

    return mlp_group_command(work, replicas)


def titan_command(replicas: int, workers: int, max_restarts: int, flags: list[str]) -> GroupCommand:
    """The group command of ``--job titan``: ``run_train.sh`` with the group's
    ``--fault_tolerance`` flags, ``NGPU=workers``, ``MAX_RESTARTS=max_restarts`` and the
    trainer's ``flags`` after them (``torchtitan_ft.titan.releases.job``)."""

    def group(replica: int, attempt: int, lighthouse: str) -> Submission:
        cmd = command(
            TitanJob(
                ngpu=workers,
                ft=FtGroup(replica_id=replica, group_size=replicas, lighthouse=lighthouse),
                flags=tuple(flags),
                env={"MAX_RESTARTS": str(max_restarts)},
            )
        )
        ids = {"REPLICA_GROUP_ID": str(replica), "NUM_REPLICA_GROUPS": str(replicas)}
        return Submission(("bash", *cmd.argv), {**cmd.env, **ids})

    return group


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ft.slurm",
        description="Run a fault-tolerant job on Slurm (docs/launchers.md, 'Slurm').",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="submit the lighthouse and the groups, and watch them")
    run.add_argument("--name", default="torchtitan_ft", help="job name prefix")
    run.add_argument("--replicas", type=int, default=2, help="replica groups (jobs)")
    run.add_argument("--workers_per_replica", type=int, default=1, help="ranks per group")
    run.add_argument("--max_restarts", type=int, default=10, help="torchrun restarts per group")
    run.add_argument("--min_replicas", type=int, default=1, help="the lighthouse's")
    run.add_argument(
        "--lighthouse", default="", help="URL of a lighthouse that runs apart (default: a job)"
    )
    run.add_argument("--lighthouse_port", type=int, default=LIGHTHOUSE_PORT)
    run.add_argument("--lighthouse_bind_host", default="0.0.0.0")
    run.add_argument(
        "--lighthouse_host", default="", help="host the groups reach the lighthouse job at"
    )
    run.add_argument(
        "--lighthouse_arg", action="append", default=[], help="a torchft_lighthouse flag"
    )
    run.add_argument(
        "--lighthouse_sbatch_arg",
        action="append",
        default=[],
        help="an sbatch flag for the lighthouse job only (e.g. --nodelist=NODE)",
    )
    run.add_argument("--max_resubmits", type=int, default=10, help="per job")
    run.add_argument("--poll_s", type=float, default=0.5, help="seconds between squeue polls")
    run.add_argument("--workdir", type=Path, default=Path("slurm_jobs"), help="job outputs")
    run.add_argument("--events", type=Path, help="append the runner's record (JSON lines)")
    run.add_argument("--sbatch_arg", action="append", default=[], help="an sbatch flag")
    run.add_argument(
        "--job",
        choices=["titan", "mlp"],
        default="titan",
        help="titan: run_train.sh per group; mlp: the test MLP (torchtitan_ft.testing)",
    )
    run.add_argument("trainer_args", nargs="*", help="after --: the trainer's flags")
    pun = sub.add_parser("punisher", help="cancel group jobs (torchft's punisher)")
    pun.add_argument("--name", default="torchtitan_ft")
    pun.add_argument("--seed", type=int, default=0)
    cmds = pun.add_subparsers(dest="action", required=True)
    cmds.add_parser("kill_one")
    cmds.add_parser("kill_all")
    loop = cmds.add_parser("kill_loop")
    loop.add_argument("--mtbf_secs", type=float, default=300.0, help="mean time between kills")
    loop.add_argument("--kills", type=int, default=None, help="stop after this many")
    return parser


def _punish(slurm: Slurm, args: argparse.Namespace) -> int:
    """``punisher``: cancels group jobs as torchft's punisher does."""
    punisher = Punisher(slurm, args.name, args.seed)
    if args.action == "kill_one":
        return 0 if punisher.kill_one() else 1
    if args.action == "kill_all":
        punisher.kill_all()
        return 0
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    punisher.kill_loop(args.mtbf_secs, args.kills, lambda: stop)
    return 0


def _run(slurm: Slurm, args: argparse.Namespace) -> int:
    """``run``: submits the lighthouse and the groups, and watches them until they end."""
    workdir = args.workdir.resolve()
    group = (
        _mlp_command(workdir, args.replicas)
        if args.job == "mlp"
        else titan_command(
            args.replicas, args.workers_per_replica, args.max_restarts, args.trainer_args
        )
    )
    lighthouse: LighthouseJob | str = args.lighthouse or LighthouseJob(
        args.min_replicas,
        args.lighthouse_port,
        args.lighthouse_bind_host,
        args.lighthouse_host,
        tuple(args.lighthouse_arg),
        tuple(args.lighthouse_sbatch_arg),
    )
    if args.events:
        args.events.parent.mkdir(parents=True, exist_ok=True)
    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    runner = SlurmRunner(
        slurm,
        name=args.name,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        group_command=group,
        lighthouse=lighthouse,
        workdir=workdir,
        max_resubmits=args.max_resubmits,
        poll_s=args.poll_s,
        sbatch_args=args.sbatch_arg,
        events=events,
    )
    signal.signal(signal.SIGTERM, runner.request_stop)
    signal.signal(signal.SIGINT, runner.request_stop)
    return runner.run()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    slurm = Slurm()
    try:
        return _punish(slurm, args) if args.command == "punisher" else _run(slurm, args)
    except (SlurmError, ValueError) as e:
        print(f"slurm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
