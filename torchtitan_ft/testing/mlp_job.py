"""A job of 1-rank MLP replica groups (``testing.mlp``) under a lighthouse process that a test or
a benchmark kills and restarts: the groups it spawns, what their event streams say, and the
cleanup that leaves no process behind whatever happened.

    with MlpJob(tmp_path, LighthouseProcess(2, log=...), stop_participants=3) as job:
        groups = [job.spawn(r, f"g{r}") for r in range(3)]
        wait_until("5 commits together", lambda: ..., timeout_s=60)
        job.stop_at(step)
        job.join(groups, timeout_s=90)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank
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


class MlpJob(contextlib.AbstractContextManager["MlpJob"]):
    """1-rank MLP replica groups of one job under ``lighthouse`` (started on entry), in
    ``work``: their events go to ``work/events``, each group's final state to
    ``work/<tag>.pt``, and every group stops at the step :meth:`stop_at` writes (with
    ``stop_participants`` groups taking part). ``worker`` holds the other
    :class:`WorkerConfig` fields of every group. On exit every group still running is
    SIGKILLed, the lighthouse killed and its log closed."""

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
        self.procs: list[Any] = []
        self._stop_file = work / "stop_step"
        self._config = WorkerConfig(
            lighthouse_addr=lighthouse.address,
            replica=0,
            out_path="",
            stop_step_file=str(self._stop_file),
            stop_participants=stop_participants,
            step_sleep_s=0.02,
            max_iterations=1_000_000,
            timeout_s=10.0,
            events_dir=str(self.events),
            **worker,
        )

    def __enter__(self) -> MlpJob:
        self.lighthouse.start()
        return self

    def __exit__(self, *exc: object) -> None:
        kill_workers(self.procs)
        self.lighthouse.kill()
        if self.lighthouse.log is not None:
            self.lighthouse.log.close()

    def spawn(self, replica: int, tag: str) -> Any:
        """Starts replica group ``replica``; its final state goes to ``state_path(tag)``."""
        cfg = replace(self._config, replica=replica, out_path=str(self.state_path(tag)))
        self.procs.append(spawn_rank(cfg))
        return self.procs[-1]

    def state_path(self, tag: str) -> Path:
        return self.work / f"{tag}.pt"

    def stop_at(self, step: int) -> None:
        """Every group stops once it committed ``step`` with ``stop_participants`` groups."""
        self._stop_file.write_text(str(step))

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
