"""A real one-node Slurm for tests and benchmarks, started without systemd: ``munged``,
``slurmctld`` and ``slurmd`` (Debian's ``slurm-wlm``, scripts/install_slurm.sh) under a folder of
their own, with the node declared at 16 CPUs and the partition oversubscribed so that a
lighthouse and several groups run at once on a 2-core machine. On exit every job is cancelled,
the daemons stopped, any process still carrying this cluster's ``SLURM_CONF`` killed, and the
folder removed.

    with SlurmCluster(tmp_path / "slurm") as cluster:
        subprocess.run(["sbatch", "--wrap", "sleep 1"], env=cluster.environ())

Also :func:`mlp_group_command`, the runner's group command for the tiny-MLP job
(``python -m torchtitan_ft.testing.mlp_rank``): each job's commit log, state and events under the
work folder, by replica and attempt.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from torchtitan_ft.slurm import Liveness, Slurm, Submission, liveness
from torchtitan_ft.testing.commit_log import commit_log_path
from torchtitan_ft.testing.mlp import WorkerConfig
from torchtitan_ft.testing.processes import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
NODE = "tnode"
CPUS = 16
"""The CPUs the node is declared with (more than the machine has: the jobs share its cores)."""
PLUGIN_DIR = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")
"""Debian's plugin folder."""


def missing_daemons() -> list[str]:
    """The Slurm and munge programs not on PATH (or in /usr/sbin)."""
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    return [d for d in (*DAEMONS, "sbatch", "squeue") if shutil.which(d, path=path) is None]


class SlurmCluster(contextlib.AbstractContextManager["SlurmCluster"]):
    """One node (``tnode``, :data:`CPUS` CPUs) and one partition (``test``) under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []

    def environ(self, conf: Path | None = None) -> dict[str, str]:
        """This process's environment pointing Slurm's commands at this cluster (``conf``:
        another configuration for the client commands)."""
        sbin = "/usr/sbin:/sbin"
        return {
            **os.environ,
            "SLURM_CONF": str(conf or self.conf),
            "PATH": f"{os.environ['PATH']}:{sbin}",
        }

    def slurm(self) -> Slurm:
        """The runner's client of this cluster."""
        return Slurm({"SLURM_CONF": str(self.conf)})

    def _write_conf(self) -> None:
        r = self.root
        host = socket.gethostname()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=tftest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r}/munge/socket",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "MpiDefault=none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MailProg=/bin/true",
                    "KillWait=2",
                    "MinJobAge=600",
                    f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={CPUS} "
                    "State=UNKNOWN",
                    f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP "
                    f"OverSubscribe=FORCE:{CPUS}",
                    "",
                ]
            )
        )

    def without_json_conf(self) -> Path:
        """A client configuration of this cluster whose ``PluginDir`` has every plugin but
        ``serializer_json.so``: a Slurm without the JSON output plugin, to its commands."""
        plugins = self.root / "plugins_nojson"
        plugins.mkdir(exist_ok=True)
        for so in PLUGIN_DIR.glob("*.so"):
            if so.name != "serializer_json.so" and not (plugins / so.name).exists():
                (plugins / so.name).symlink_to(so)
        conf = self.root / "slurm_nojson.conf"
        conf.write_text(self.conf.read_text() + f"PluginDir={plugins}\n")
        return conf

    def _start(self, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{Path(argv[0]).name}.out", "ab")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                argv,
                env=self.environ(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()

    def __enter__(self) -> SlurmCluster:
        if missing := missing_daemons():
            raise RuntimeError(
                f"{', '.join(missing)} not installed: run scripts/install_slurm.sh "
                "(Debian's slurm-wlm and munge)"
            )
        try:
            for sub in ("munge", "state", "spool", "log"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            munge = self.root / "munge"
            munge.chmod(0o755)
            key = munge / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
            self._write_conf()
            self._start(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={munge}/socket",
                    f"--pid-file={munge}/munged.pid",
                    f"--seed-file={munge}/seed",
                    f"--log-file={self.root}/log/munged.log",
                ]
            )
            self._wait("munged's socket", lambda: (munge / "socket").exists())
            self._start(["slurmctld", "-D", "-i"])
            self._start(["slurmd", "-D", "-N", NODE])
            self._wait("the node idle", self._node_idle)
        except BaseException:
            self.close()
            raise
        return self

    def _node_idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=self.environ(), capture_output=True, text=True
        )
        return done.stdout.strip() == "idle"

    def _wait(self, what: str, ready: object, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():  # type: ignore[operator]
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{proc.args[0]} exited ({proc.returncode}) waiting for {what}; "
                        f"see {self.root}/log"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"after {timeout_s} s still waiting for {what}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancels every job, stops the daemons, kills what still runs with this cluster's
        configuration, and removes the folder."""
        if self.procs and all(p.poll() is None for p in self.procs):
            with contextlib.suppress(Exception):
                slurm = self.slurm()
                slurm.cancel(slurm.jobs())
                self._wait(
                    "the jobs to end",
                    lambda: all(
                        liveness(j.state) is not Liveness.ALIVE for j in slurm.jobs().values()
                    ),
                    timeout_s=30,
                )
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = []
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[int]:
        """Processes whose environment names this cluster's configuration (jobs and their
        children), other than this one."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                found.append(int(entry.name))
        return found


def mlp_group_command(work: Path, replicas: int, **worker: object):  # type: ignore[no-untyped-def]
    """The runner's group command for 1-rank MLP groups: attempt ``n`` of group ``r`` logs its
    commits to ``commit_log_path(work / "commit_logs", r, n)``, its events to
    ``work/events/r{r}_i{n}`` and its final state to ``work/r{r}_i{n}.pt``; every group stops
    at the step written to ``work/stop_step`` once all ``replicas`` take part. ``worker``
    overrides the other ``WorkerConfig`` fields (default: 20 ms a step, 10 s timeouts)."""

    def group(replica: int, attempt: int, lighthouse: str) -> Submission:
        cfg = WorkerConfig(
            lighthouse_addr=lighthouse,
            replica=replica,
            out_path=str(work / f"r{replica}_i{attempt}.pt"),
            commit_log=str(commit_log_path(work / "commit_logs", replica, attempt)),
            events_dir=str(work / "events" / f"r{replica}_i{attempt}"),
            stop_step_file=str(work / "stop_step"),
            stop_participants=replicas,
            max_iterations=1_000_000,
            **{"step_sleep_s": 0.02, "timeout_s": 10.0, **worker},  # type: ignore[arg-type]
        )
        (work / "commit_logs").mkdir(parents=True, exist_ok=True)
        return Submission(
            (sys.executable, "-m", "torchtitan_ft.testing.mlp_rank", json.dumps(asdict(cfg))),
            {"OMP_NUM_THREADS": "1"},
        )

    return group
