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
group, and the other groups keep training; the lighthouse job likewise. With ``--standbys K``
the runner keeps K warm standby jobs (``NAME-standby``: allocated, the group's Python modules
imported) and hands a dead group's place to one of them instead of submitting a new job
(:func:`pick_standby`, :func:`run_standby`), then submits a standby in its place. The runner
ends when every group job has completed (it then cancels the lighthouse), when a job has used up its
resubmits (one line on stderr, every job cancelled, exit status 1), or on SIGTERM/SIGINT (every
job cancelled). Its record (``--events``) has one JSON object a line, :class:`RunnerEvent`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import runpy
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TextIO

from torchtitan_ft.addresses import listening
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

WAITING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "RUNNING"})
"""The states of a standby that can still take a group's place (not on its way out)."""


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


STANDBY_WARM_MODULES = ("torch._dynamo",)
"""What a standby imports beside the group's module: what a PyTorch training process imports
lazily, at its first optimizer's construction (``torch.optim`` imports ``torch._dynamo``, with
sympy: 2.4-2.9 s of a 2-core machine)."""

STANDBY_POLL_S = 0.02
"""How often a waiting standby looks for its assignment file (a ``stat``)."""


def standby_files(folder: Path, job_id: int) -> tuple[Path, Path]:
    """The standby job ``job_id``'s ``(ready, assignment)`` files in the runner's ``folder``:
    the standby writes the first once its imports are done; the runner writes the second, the
    JSON ``{"argv": [...], "env": {...}}`` of the group job it is to become."""
    return folder / f"{job_id}.ready", folder / f"{job_id}.json"


def pick_standby(standbys: Sequence[tuple[int, str, bool]]) -> int | None:
    """Which standby takes a dead group's place, from ``(job_id, squeue state, ready)`` of
    each: one whose imports are done, else one that runs, else one still pending (each is
    ahead of a new submission in Slurm's queue), the oldest first; None if none can."""
    ranked = [
        (0 if ready else 1, job_id) if state == "RUNNING" else (2, job_id)
        for job_id, state, ready in standbys
        if state in WAITING_STATES
    ]
    return min(ranked)[1] if ranked else None


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

    def rename(self, job_id: int, name: str) -> None:
        """``scontrol update``: the job's name becomes ``name`` (a standby that became a
        group takes the group's name, so that ``squeue`` and the punisher see it as one)."""
        self._run(["scontrol", "update", f"JobId={job_id}", f"JobName={name}"])

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
    """``submitted``, ``assigned`` (a standby job took a dead group's place: ``job_id`` is
    the standby's, ``attempt`` the group's), ``ended`` (a job seen ended: ``state``),
    ``finished`` (a group completed), ``gave_up``, ``done`` (every group completed) or
    ``stopped`` (signal)."""
    role: str = ""
    """``lighthouse``, ``group`` or ``standby``."""
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


class SlurmRunner:
    """Runs one fault-tolerant job on Slurm (module docstring): ``replicas`` group jobs named
    ``NAME-group-I`` running ``group_command``, under ``lighthouse`` (a :class:`LighthouseJob`
    it submits as ``NAME-lighthouse``, or the address of one that runs apart), with
    ``standbys`` warm standby jobs named ``NAME-standby`` (module docstring)."""

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
        standbys: int = 0,
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
        if standbys < 0:
            raise ValueError(f"--standbys must be >= 0, got {standbys}")
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
        self.standbys = standbys
        self._jobs: list[_Tracked] = []
        self._standbys: list[_Tracked] = []
        self._standby_failures = 0
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
        elif role == "standby":
            sub, name = self._standby_submission(), f"{self.name}-standby"
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

    @property
    def _standby_folder(self) -> Path:
        return self.workdir / "standby"

    def _standby_submission(self) -> Submission:
        """A standby job: ``run_standby`` with the module of the group's ``python -m`` and
        :data:`STANDBY_WARM_MODULES` (none for another command), in the environment of group
        0's first job, which the assignment's overrides (so that what is read at import, e.g.
        ``OMP_NUM_THREADS``, is the groups')."""
        group = self.group_command(0, 0, self.address)
        in_python = len(group.argv) > 2 and group.argv[1] == "-m"
        modules = [group.argv[2], *STANDBY_WARM_MODULES] if in_python else []
        return Submission(
            (
                sys.executable,
                "-m",
                "torchtitan_ft.slurm",
                "standby",
                f"--folder={self._standby_folder}",
                *(f"--preimport={m}" for m in modules),
            ),
            group.env,
        )

    def _keep_standbys(self, listed: Mapping[int, SlurmJob]) -> None:
        """Drops the standbys that ended before they were needed and submits new ones up to
        ``standbys``. After ``max_resubmits`` such failures the job runs on without standbys
        (one line on stderr): a dead group is then resubmitted as a new job."""
        for tracked in list(self._standbys):
            job = listed.get(tracked.job_id)
            if liveness(job.state if job else None) is not Liveness.ALIVE:
                self._standbys.remove(tracked)
                self._record("ended", tracked, job.state if job else "GONE")
                self._standby_failures += 1
                if self._standby_failures == self.max_resubmits + 1:
                    print(
                        f"slurm runner: {self._standby_failures} standby jobs ended before "
                        f"they were needed (--max_resubmits {self.max_resubmits}): going on "
                        f"without standbys; see {self.workdir}/{self.name}-standby.*.out",
                        file=sys.stderr,
                    )
        if self._standby_failures > self.max_resubmits:
            return
        submitted = sum(1 for j in self._jobs if j.role == "standby")
        while len(self._standbys) < self.standbys:
            self._standbys.append(self._submit("standby", -1, submitted))
            submitted += 1

    def _replace(self, replica: int, attempt: int, listed: Mapping[int, SlurmJob]) -> _Tracked:
        """Group ``replica``'s next job: a standby given its place (:func:`pick_standby`),
        else a new submission."""
        ready = {
            j.job_id: standby_files(self._standby_folder, j.job_id)[0].exists()
            for j in self._standbys
        }
        chosen = pick_standby(
            [(j, listed[j].state if j in listed else "", is_ready) for j, is_ready in ready.items()]
        )
        if chosen is None:
            return self._submit("group", replica, attempt)
        self._standbys = [j for j in self._standbys if j.job_id != chosen]
        sub = self.group_command(replica, attempt, self.address)
        assignment = standby_files(self._standby_folder, chosen)[1]
        partial = assignment.with_suffix(".partial")
        partial.write_text(json.dumps({"argv": list(sub.argv), "env": dict(sub.env)}))
        partial.replace(assignment)  # the standby reads a whole file or none
        tracked = _Tracked("group", replica, attempt, chosen)
        self._jobs.append(tracked)
        self._record("assigned", tracked)
        try:
            self.slurm.rename(chosen, f"{self.name}-group-{replica}")
        except SlurmError as e:  # the group runs either way; only its name in squeue is off
            print(f"slurm runner: renaming standby job {chosen}: {e}", file=sys.stderr)
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
        if self.standbys:
            self._standby_folder.mkdir(exist_ok=True)
        current: dict[int, _Tracked] = {}
        resubmits: dict[int, int] = {}
        try:
            if self._lighthouse_job is not None:
                current[-1] = self._start_lighthouse(self._lighthouse_job)
            for replica in range(self.replicas):
                current[replica] = self._submit("group", replica, 0)
            finished: set[int] = set()
            listed: Mapping[int, SlurmJob] = {}
            while not self._stop:
                self._keep_standbys(listed)
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
                            current[key] = self._replace(key, resubmits[key], listed)
                if len(finished) == self.replicas:
                    self._record("done")
                    return 0
            self._record("stopped")
            return 0
        finally:
            self._cancel_all()

    def _cancel_all(self) -> None:
        ids = sorted({j.job_id for j in self._jobs})  # a standby that became a group: once
        try:
            listed = self.slurm.jobs()
            alive = [
                j
                for j in ids
                if liveness(listed[j].state if j in listed else None) is Liveness.ALIVE
            ]
        except SlurmError:
            alive = ids
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


def run_standby(folder: Path, job_id: int, preimport: Sequence[str]) -> int:
    """A standby job's process: imports ``preimport``, says it is ready, waits for its
    assignment (:func:`standby_files`), then becomes that group job: a ``python -m MODULE``
    of this interpreter and a pre-imported module runs in this process (what the standby
    saves is the imports); any other command replaces this process (what it saves is Slurm's
    queue and the allocation)."""
    for module in preimport:
        importlib.import_module(module)
    ready, assignment = standby_files(folder, job_id)
    ready.touch()
    while not assignment.exists():
        time.sleep(STANDBY_POLL_S)
    spec = json.loads(assignment.read_text())
    argv, env = list(spec["argv"]), dict(spec["env"])
    os.environ.update(env)
    in_process = (
        len(argv) > 2
        and argv[1] == "-m"
        and argv[2] in preimport
        and os.path.realpath(argv[0]) == os.path.realpath(sys.executable)
    )
    if not in_process:
        os.execvpe(argv[0], argv, os.environ)
    sys.argv = [argv[2], *argv[3:]]
    # runpy warns when the module it runs as __main__ is imported already; what it imported
    # stays cached, which is the point.
    sys.modules.pop(argv[2], None)
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


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
    run.add_argument(
        "--standbys",
        type=int,
        default=0,
        help="warm standby jobs that take a dead group's place (each holds an allocation)",
    )
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
    standby = sub.add_parser("standby", help="a warm standby job (the runner submits it)")
    standby.add_argument("--folder", type=Path, required=True, help="the runner's standby folder")
    standby.add_argument(
        "--preimport", action="append", default=[], help="a module to import while waiting"
    )
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
        standbys=args.standbys,
    )
    signal.signal(signal.SIGTERM, runner.request_stop)
    signal.signal(signal.SIGINT, runner.request_stop)
    return runner.run()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "standby":
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if not job_id.isdigit():
            print(
                f"slurm standby: SLURM_JOB_ID is {job_id!r} (expected the id of the Slurm job "
                "the runner submitted; a standby runs only as such a job)",
                file=sys.stderr,
            )
            return 2
        return run_standby(args.folder, int(job_id), args.preimport)
    slurm = Slurm()
    try:
        return _punish(slurm, args) if args.command == "punisher" else _run(slurm, args)
    except (SlurmError, ValueError) as e:
        print(f"slurm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
