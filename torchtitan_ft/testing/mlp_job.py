"""A job of 1-rank MLP replica groups (``testing.mlp``) under a lighthouse process that a test,
a benchmark or the failure demo kills and restarts: the groups it spawns, what their commit logs
and event streams say, the faults a fault injector does to them, and the cleanup that leaves no
process behind whatever happened. The one MLP job of the chaos and soak tests, the failure demo's
``--model mlp`` and the lighthouse tests.

    with MlpJob(tmp_path, LighthouseProcess(2, log=...), stop_participants=3) as job:
        groups = [job.spawn(r, f"g{r}") for r in range(3)]
        wait_until("5 commits together", lambda: ..., timeout_s=60)
        job.stop_at(step)
        job.join(groups, timeout_s=90)

A job whose groups are killed and replaced: :meth:`MlpJob.start` starts a group's next process
(its incarnation), with a commit log (``testing.commit_log``) and an event stream of its own;
:meth:`MlpJob.kill`, :meth:`MlpJob.hang` and :meth:`MlpJob.resume` act on its current process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.testing.commit_log import (
    Record,
    commit_log_path,
    read_commit_log,
    read_commit_logs,
)
from torchtitan_ft.testing.faults import FaultKind, donor_may_die
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank, write_stop_step
from torchtitan_ft.testing.processes import LighthouseProcess

T = TypeVar("T")


def wait_until(what: str, ready: Callable[[], T], timeout_s: float) -> T:
    """Polls ``ready`` every 50 ms until it returns something truthy, and returns that; raises
    ``TimeoutError`` naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout_s} s still waiting for {what}")
        time.sleep(0.05)
    return got


def kill_workers(procs: Iterable[Any]) -> None:
    """SIGKILLs every one of ``procs`` (this process's own ``multiprocessing`` children) that
    still runs, a stopped one too, and reaps them. A child not yet joined keeps its pid, so
    the signal cannot reach another process."""
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        os.kill(proc.pid, signal.SIGKILL)
    for proc in alive:
        proc.join(5)


@dataclass(frozen=True)
class FaultPauses:
    """How long :meth:`MlpJob.inject`'s faults last (seconds)."""

    hang_s: float
    """A SIGSTOP's length: past the collective and heartbeat timeouts to test them."""
    restart_delay_s: float = 0.0
    """From a kill to the replacement's start (a launcher's restart delay)."""
    lighthouse_down_s: float = 0.5
    """From the lighthouse's SIGKILL to its restart on the same address."""


class MlpJob(contextlib.AbstractContextManager["MlpJob"]):
    """1-rank MLP replica groups of one job under ``lighthouse`` (started on entry), in
    ``work``: their events go to ``work/events`` (a process of :meth:`start`: to its own folder
    under it), each group's final state to ``work/<tag>.pt``, and every group stops at the step
    :meth:`stop_at` writes (with ``stop_participants`` groups taking part; no step written: it
    trains until it is killed). ``worker`` holds the other :class:`WorkerConfig` fields of
    every group (they override the defaults here: 20 ms sleep a step, 10 s timeout). On exit
    every group still running is SIGKILLed, the lighthouse killed and its log closed."""

    def __init__(
        self,
        work: Path,
        lighthouse: LighthouseProcess,
        stop_participants: int,
        **worker: Any,
    ) -> None:
        self.work = work
        self.events = work / "events"
        self.lighthouse = lighthouse
        self.commit_logs = work / "commit_logs"
        self.procs: list[Any] = []
        self.current: dict[int, Any] = {}
        """Replica group -> its process started last by :meth:`start`."""
        self.incarnations: dict[int, int] = {}
        """Replica group -> the number of its current process (0 for the first)."""
        self._stop_file = work / "stop_step"
        defaults: dict[str, Any] = {"step_sleep_s": 0.02, "timeout_s": 10.0}
        self._config = WorkerConfig(
            lighthouse_addr=lighthouse.address,
            replica=0,
            out_path="",
            stop_step_file=str(self._stop_file),
            stop_participants=stop_participants,
            max_iterations=1_000_000,
            events_dir=str(self.events),
            **{**defaults, **worker},
        )

    def __enter__(self) -> MlpJob:
        try:
            self.lighthouse.start()
        except BaseException:  # a lighthouse that never listened still runs: end it
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """SIGKILLs every group still running, kills the lighthouse and closes its log; a
        second call does nothing more."""
        kill_workers(self.procs)
        self.lighthouse.kill()
        if self.lighthouse.log is not None:
            self.lighthouse.log.close()

    def spawn(self, replica: int, tag: str) -> Any:
        """Starts replica group ``replica``; its final state goes to ``state_path(tag)``."""
        cfg = replace(self._config, replica=replica, out_path=str(self.state_path(tag)))
        self.procs.append(spawn_rank(cfg))
        return self.procs[-1]

    def start(self, replica: int) -> Any:
        """Starts the next process of replica group ``replica`` (incarnation 0, 1, ...): its
        commit log at ``commit_log_path(commit_logs, replica, n)``, its events in
        :meth:`events_of`, its final state at ``state_path(f"r{replica}_i{n}")``."""
        n = self.incarnations.get(replica, -1) + 1
        self.incarnations[replica] = n
        self.commit_logs.mkdir(parents=True, exist_ok=True)
        cfg = replace(
            self._config,
            replica=replica,
            out_path=str(self.state_path(f"r{replica}_i{n}")),
            commit_log=str(commit_log_path(self.commit_logs, replica, n)),
            events_dir=str(self.events_of(replica, n)),
        )
        self.procs.append(spawn_rank(cfg))
        self.current[replica] = self.procs[-1]
        return self.procs[-1]

    def events_of(self, replica: int, incarnation: int) -> Path:
        """The event stream folder of process ``incarnation`` of group ``replica``."""
        return self.events / f"r{replica}_i{incarnation}"

    def alive(self, replica: int) -> bool:
        proc = self.current.get(replica)
        return proc is not None and proc.is_alive()

    def kill(self, replica: int) -> None:
        """SIGKILLs group ``replica``'s current process (a stopped one too) and reaps it."""
        kill_workers([self.current[replica]])

    def hang(self, replica: int) -> None:
        """SIGSTOPs group ``replica``'s current process (:meth:`resume` lets it go on)."""
        os.kill(self.current[replica].pid, signal.SIGSTOP)

    def resume(self, replica: int) -> None:
        os.kill(self.current[replica].pid, signal.SIGCONT)

    def records(self) -> list[Record]:
        """Every commit-log record of every process :meth:`start` started, time-ordered."""
        return read_commit_logs(self.commit_logs)

    def latest(self, replica: int) -> list[Record]:
        """The commit-log records of group ``replica``'s current process."""
        n = self.incarnations[replica]
        return read_commit_log(commit_log_path(self.commit_logs, replica, n), replica, n)

    def participating(self, since: float = 0.0) -> list[int]:
        """Groups whose current process's latest iteration (after ``since``, Unix time) was a
        commit it took part in: the holders of the job's state."""
        out = []
        for replica in sorted(self.current):
            latest = self.latest(replica)
            last = latest[-1] if latest else None
            if last is not None and last.committed and last.participating and last.time > since:
                out.append(replica)
        return out

    def donor_of_first_heal(self, replica: int, since: float) -> int | None:
        """The group that group ``replica``'s current process first healed from after
        ``since`` (Unix time), as its quorum named it; None before it starts healing."""
        events = [
            e
            for e in read_events(self.events_of(replica, self.incarnations[replica]))
            if e.time > since
        ]
        heal = next((e for e in events if e.kind is EventKind.HEAL_START), None)
        if heal is None:
            return None
        quorum = [e for e in events if e.kind is EventKind.QUORUM and e.time <= heal.time][-1]
        donor_id = quorum["replica_ids"][heal["source_replica_rank"]]
        return int(donor_id.split(":")[0].removeprefix("replica_"))

    def inject(
        self,
        kind: FaultKind,
        victims: Sequence[int],
        pause: FaultPauses,
        wait: Callable[[Callable[[], Any], str], Any] | None = None,
    ) -> dict[str, Any]:
        """Does fault ``kind`` to groups ``victims`` (chosen by ``faults.fault_victims``) and
        replaces every process it killed, as a launcher would; returns what it did
        (``{"donor": g}`` for a donor kill). ``wait(predicate, what)`` waits for the donor
        kill's heal (default: :func:`wait_until`, 120 s); a donor that is the last holder of
        the state when the heal starts is not killed (``{"donor": None}``). Link faults need
        network hosts, which these groups do not have: ``ValueError``."""
        if wait is None:

            def wait(ready: Callable[[], Any], what: str) -> Any:
                return wait_until(what, ready, 120.0)

        did: dict[str, Any] = {}
        if kind is FaultKind.SIGSTOP:
            self.hang(victims[0])
            time.sleep(pause.hang_s)
            self.resume(victims[0])
        elif kind in (FaultKind.LIGHTHOUSE, FaultKind.LIGHTHOUSE_GROUP_AWAY):
            self.lighthouse.kill()
            # a group away across the restart: its replacement's first quorum is the
            # restarted lighthouse's, which knows the job's step from its --state_dir
            self._replace(victims, pause.restart_delay_s)
            time.sleep(pause.lighthouse_down_s)
            self.lighthouse.start()
        elif kind in (FaultKind.SIGKILL, FaultKind.TWO_GROUPS, FaultKind.CORRELATED):
            self._replace(victims, pause.restart_delay_s)
        elif kind is FaultKind.DONOR_KILL:
            since = time.time()
            self._replace(victims, pause.restart_delay_s)
            donor = wait(lambda: self.donor_of_first_heal(victims[0], since), "the heal")
            did["donor"] = donor if donor_may_die(donor, self.participating()) else None
            if did["donor"] is not None:
                self._replace([donor], pause.restart_delay_s)
        else:
            raise ValueError(f"an MLP job cannot inject {kind!r}: its groups have no network hosts")
        return did

    def _replace(self, replicas: Sequence[int], delay_s: float) -> None:
        for replica in replicas:
            self.kill(replica)
        time.sleep(delay_s)
        for replica in replicas:
            self.start(replica)

    def state_path(self, tag: str) -> Path:
        return self.work / f"{tag}.pt"

    def stop_at(self, step: int) -> None:
        """Every group stops once it committed ``step`` with ``stop_participants`` groups."""
        write_stop_step(self._stop_file, step)

    def join(self, procs: Iterable[Any], timeout_s: float) -> None:
        """Waits for ``procs`` to exit; each must exit 0."""
        for proc in procs:
            proc.join(timeout_s)
            if proc.exitcode != 0:
                raise RuntimeError(f"MLP group pid {proc.pid} exited with {proc.exitcode}")

    def replica_id(self, pid: int) -> str | None:
        """The replica id of the group process ``pid`` once its Manager started, else None."""
        return next(
            (
                e.replica_id
                for e in read_events(self.events)
                if e.kind is EventKind.START and e["pid"] == pid
            ),
            None,
        )

    def commits(
        self, since: float = 0.0, participants: int | None = None
    ) -> dict[str, list[Event]]:
        """Replica id -> its COMMIT events after ``since`` (wall time), oldest first; with
        ``participants``, only commits with that many groups taking part."""
        out: dict[str, list[Event]] = {}
        for e in read_events(self.events):
            if e.kind is not EventKind.COMMIT or e.time <= since:
                continue
            if participants is None or e["participants"] == participants:
                out.setdefault(e.replica_id, []).append(e)
        return out
