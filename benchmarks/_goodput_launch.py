"""Launching for ``benchmarks.goodput``: the lighthouse and the ``./run_train.sh`` (torchrun)
jobs of one method (a replica group each, or the native HSDP job), each in its CPU budget and,
for this project's methods, in a network-namespace host of its own; finding, signalling and
killing their workers. The TorchTitan command line is spelled here, for TorchTitan 0.2.2's flags."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._goodput_job import (
    CONFIG,
    ROOT,
    Method,
    Options,
    checkpoint_every,
    launched_groups,
)
from benchmarks._reference import REFERENCE_DIR, RUNTIME_DEPS_DIR
from torchtitan_ft.testing import netns
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.processes import descendants, free_port
from torchtitan_ft.titan.releases.job import FtGroup, TitanCommand, TitanJob
from torchtitan_ft.titan.releases.job import command as titan_command

LIGHTHOUSE_PORT = 29510
TORCHFT_TIMEOUTS = {"TORCHFT_QUORUM_TIMEOUT_SEC": "300", "TORCHFT_QUORUM_RETRIES": "10"}
"""torchft's own settings for the torchft method (environment variables: TorchTitan's FTManager
passes only the process-group timeout): the quorum timeout of the torchtitan_ft groups, and
retries so that a quorum call that meets a restarting lighthouse does not end the group. Its
collective and commit timeout (``TORCHFT_TIMEOUT_SEC``) is set to the process-group timeout."""


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


class Launcher:
    """The processes of one method's run in ``folder``: the lighthouse (FT methods), one
    :class:`Launch` per replica group (FT; torchtitan_ft_spare's hot spare is the last) or one
    for the native job, and for this project's methods the network-namespace hosts where they
    work here. :meth:`prepare` builds them, :meth:`start` starts them, :meth:`close` leaves none
    behind."""

    def __init__(self, method: Method, opts: Options, folder: Path) -> None:
        self.method, self.opts, self.folder = method, opts, folder
        self.stop_file = folder / "stop"
        self.net: netns.HostNetwork | None = None
        self.launches: list[Launch] = []
        self.lighthouse: Lighthouse | None = None
        self.job_restarts = 0
        """Restarts of the native job (checkpoint-restart's recovery)."""

    @property
    def ft(self) -> bool:
        return self.method is not Method.CHECKPOINT_RESTART

    @property
    def ours(self) -> bool:
        """This project's per-step FT (torchtitan_ft, with or without the hot spare)."""
        return self.method in (Method.TORCHTITAN_FT, Method.TORCHTITAN_FT_SPARE)

    def prepare(self) -> None:
        """Builds the method's processes (and the hosts they run in), starting none."""
        opts = self.opts
        groups = launched_groups(self.method, opts)
        if self.ours and netns.unavailable_reason() is None:
            self.net = netns.HostNetwork(["L", *(f"G{g}" for g in range(groups))])
            self.net.start()
        net = self.net
        self.lighthouse = Lighthouse(
            opts,
            net["L"] if net else None,
            self.folder / "lh.log",
            reference=self.method is Method.TORCHFT,
        )
        if self.ft:
            self.launches = [
                self._group_launch(g, self.lighthouse, net[f"G{g}"] if net else None)
                for g in range(groups)
            ]
        else:
            self.launches = [self._native_launch()]

    def start(self) -> None:
        """Starts the method's processes, the lighthouse first (FT methods)."""
        if self.ft:
            self.lighthouse.start()
        for launch in self.launches:
            launch.start()

    def close(self) -> None:
        for launch in self.launches:
            launch.kill()
            for limit in launch.limits:
                limit.close()
        if self.lighthouse is not None:
            self.lighthouse.close()
        if self.net is not None:
            self.net.close()

    def tend(self) -> None:
        """The native job: its new workers into their cgroups, and a restart once it exited."""
        if self.ft:
            return
        self.launches[0].place_workers()
        if not self.launches[0].alive():
            self.restart_job()

    def restart_job(self) -> None:
        self.job_restarts += 1
        launch = self.launches[0]
        launch.kill()
        launch.start()

    def running_groups(self) -> list[int]:
        """Groups whose every rank runs."""
        return [
            g for g, launch in enumerate(self.launches) if len(launch.workers()) == self.opts.ranks
        ]

    def worker(self, group: int, rank: int) -> int | None:
        """The pid of rank ``rank`` of group ``group``, None when it does not run."""
        return self.launches[group].workers().get(rank)

    def kill_rank(self, group: int, rank: int) -> None:
        pid = self.worker(group, rank)
        if pid is not None:
            signal_pids([pid], signal.SIGCONT)
            signal_pids([pid], signal.SIGKILL)

    def wait_exit(self, deadline: float) -> None:
        """Waits (until ``deadline``, Unix time, at least 1 s each) for every launch to exit."""
        for launch in self.launches:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launch.proc.wait(max(deadline - time.time(), 1))

    def _job(self, ngpu: int, lighthouse: str, events: Path, **fields: Any) -> TitanCommand:
        """The ``run_train.sh`` command of one of this method's jobs (``fields``: the rest of
        its :class:`TitanJob`), on the installed TorchTitan release."""
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        extra: dict[str, str] = {}
        train_file = "torchtitan_ft.testing.goodput_worker"
        if self.method is Method.TORCHFT:  # the reference after this environment's packages
            paths += [str(REFERENCE_DIR), str(RUNTIME_DEPS_DIR)]
            extra = {
                **TORCHFT_TIMEOUTS,
                "TORCHFT_TIMEOUT_SEC": str(self.opts.process_group_timeout_ms // 1000),
            }
            train_file = "benchmarks._goodput_torchft_worker"
        env = {
            "TORCHFT_LIGHTHOUSE": lighthouse,
            "MASTER_ADDR": "127.0.0.1",
            "MAX_RESTARTS": "1000" if self.ft else "0",
            "GOODPUT_OUT": str(self.folder),
            "GOODPUT_STOP_FILE": str(self.stop_file),
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            **extra,
        }
        job = TitanJob(
            dump_folder=self.folder / "dump",
            steps=1_000_000,
            config_file=CONFIG,
            ngpu=ngpu,
            events_dir=events,
            train_file=train_file,
            env=env,
            **fields,
        )
        return titan_command(job)

    def _train_timeout_flag(self, ft: bool) -> str:
        """TorchTitan's own timeout: ``ft``, 1 s above the process group's, as the FT timeouts'
        order requires (docs/timeouts.md); else (native HSDP, whose failure detection it is)
        equal to it."""
        seconds = self.opts.process_group_timeout_ms // 1000 + (1 if ft else 0)
        return f"--comm.train_timeout_seconds={seconds}"

    def _checkpoint_flags(self) -> tuple[str, ...]:
        """TorchTitan's checkpoints of this method's job(s), as users run them: every
        :func:`~benchmarks._goodput_job.checkpoint_every` steps into ``checkpoint/`` of the
        method's folder, the newest 2 kept; none for ideal. An FT job's groups share the
        folder (this project's: the lowest participating group writes the full checkpoint,
        each group its reader files; torchft's: TorchTitan's FT checkpointer)."""
        every = checkpoint_every(self.method, self.opts)
        if every is None:
            return ()
        return (
            "--checkpoint.enable",
            f"--checkpoint.interval={every}",
            f"--checkpoint.folder={self.folder / 'checkpoint'}",
            "--checkpoint.keep_latest_k=2",
        )

    def _group_launch(self, g: int, lighthouse: Lighthouse, host: netns.Host | None) -> Launch:
        opts = self.opts
        hostname = host.address if host else "127.0.0.1"
        if self.method is Method.TORCHFT:  # TorchTitan's own fault_tolerance fields only
            own = ["--job.custom_config_module=torchtitan_ft.titan.config_schema"]
            ft = FtGroup(g, opts.groups, min_replica_size=1,
                         process_group_timeout_ms=opts.process_group_timeout_ms)  # fmt: skip
        else:
            own = [f"--fault_tolerance.replacement={opts.replacement}"]
            participants = 1
            if self.method is Method.TORCHTITAN_FT_SPARE:  # as benchmarks.recovery's spare row
                own.append("--fault_tolerance.world_size_mode=fixed_with_spares")
                participants = opts.groups
            ft = FtGroup(g, launched_groups(self.method, opts), min_replica_size=participants,
                         hostname=hostname, quorum_timeout_ms=300000,
                         process_group_timeout_ms=opts.process_group_timeout_ms)  # fmt: skip
        launch = self._job(
            opts.ranks, lighthouse.address, self.folder / "events" / f"g{g}", ft=ft,
            flags=(self._train_timeout_flag(ft=True), *own, *self._checkpoint_flags()),
        )  # fmt: skip
        limit = CpuLimit(f"goodput_g{g}", [], cpus=opts.cpus_per_group)
        log = self.folder / f"group{g}.log"
        return Launch(f"group {g}", list(launch.argv), launch.environ(), log, [limit],
                      opts.ranks, host)  # fmt: skip

    def _native_launch(self) -> Launch:
        opts = self.opts
        flags = (
            self._train_timeout_flag(ft=False),
            "--fault_tolerance.no-enable",
            f"--parallelism.data_parallel_replicate_degree={opts.groups}",
            f"--parallelism.data_parallel_shard_degree={opts.ranks}",
            *self._checkpoint_flags(),
        )
        limits = [
            CpuLimit(f"goodput_native{g}", [], cpus=opts.cpus_per_group) for g in range(opts.groups)
        ]
        launch = self._job(opts.groups * opts.ranks, "http://127.0.0.1:1", self.folder / "events",
                           flags=flags)  # fmt: skip
        return Launch("native job", list(launch.argv), launch.environ(), self.folder / "job.log",
                      limits, opts.ranks, None)  # fmt: skip
