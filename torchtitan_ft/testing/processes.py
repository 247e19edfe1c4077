"""Processes for tests, benchmarks and scripts: a lighthouse as a killable subprocess, and a
worker process driven by JSON lines over its stdin and stdout.

- :func:`free_port`: a free 127.0.0.1 port;
- :class:`LighthouseProcess`: ``python -m torchtitan_ft.lighthouse.cli`` on a fixed port, which
  can be SIGKILLed and started again on the same port (the chaos test, the failure demo);
- :class:`Worker` (the parent's side) with :func:`send` and :func:`recv` (the worker's side):
  a fresh ``python -m <module>`` process (not a fork) exchanging one JSON object per line (the
  benchmarks' workers).

Only the standard library is imported: ``benchmarks.recovery`` times a worker's imports from
its first line.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (a worker runs there, so ``python -m benchmarks.X`` finds its module)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from ``/proc`` (torchrun starts its workers in their
    own sessions, so a process-group signal would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class LighthouseProcess:
    """``python -m torchtitan_ft.lighthouse.cli`` on a fixed 127.0.0.1 port, restartable.

    ``status_port``: serve the status page there (default: none); ``state_dir``: its
    ``--state_dir``, so that a restarted one keeps the job's history (default: none)."""

    def __init__(
        self,
        min_replicas: int,
        *,
        port: int | None = None,
        join_timeout_ms: int = 1000,
        heartbeat_timeout_ms: int = 1000,
        quorum_tick_ms: int = 50,
        log: IO[str] | None = None,
        status_port: int | None = None,
        state_dir: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.status_port = status_port
        self.args = [
            sys.executable,
            "-m",
            "torchtitan_ft.lighthouse.cli",
            f"--bind=127.0.0.1:{self.port}",
            f"--min_replicas={min_replicas}",
            f"--join_timeout_ms={join_timeout_ms}",
            f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
            f"--quorum_tick_ms={quorum_tick_ms}",
            f"--status_bind=127.0.0.1:{status_port}" if status_port else "--status_bind=off",
        ]
        if state_dir is not None:
            self.args.append(f"--state_dir={state_dir}")
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def status_address(self) -> str | None:
        """The status page's URL, or None when not served."""
        return f"http://127.0.0.1:{self.status_port}/" if self.status_port else None

    def start(self, timeout_s: float = 30.0) -> None:
        self.proc = subprocess.Popen(
            self.args, stdout=self.log or subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lighthouse exited with {self.proc.returncode}: {self.args}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"lighthouse not listening on port {self.port} after {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL (no goodbye to clients), by pid."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


# ------------------------------------------------------------------ JSON-lines workers


def send(msg: Any) -> None:
    """Worker side: one JSON line to the parent."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def recv() -> Any:
    """Worker side: one JSON line from the parent (None at EOF)."""
    line = sys.stdin.readline()
    return json.loads(line) if line else None


_EXITED = object()
"""What :meth:`Worker.next` gets once the worker's output ended."""


class Worker:
    """A fresh ``python -m <module> <args>`` process driven by JSON lines, run in :data:`ROOT`
    with this environment plus ``env``."""

    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.spawned = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self._lines: queue.Queue[Any] | None = None

    def send(self, msg: Any) -> None:
        if self.proc.stdin is None:
            raise RuntimeError("the worker's stdin is closed")
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> Any:
        """The next message, blocking until the worker writes one; raises RuntimeError when
        it exited. Not after :meth:`stream`."""
        if self.proc.stdout is None or self._lines is not None:
            raise RuntimeError("recv() after stream(): use next()")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker pid {self.proc.pid} exited ({self.proc.wait()})")
        return json.loads(line)

    def stream(self) -> None:
        """From now on a thread reads the worker's JSON lines, for :meth:`next` (a wait with a
        timeout) and :meth:`ready` (what arrived, without waiting)."""
        self._lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None and self._lines is not None  # set by __init__/stream
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(_EXITED)

    def next(self, timeout: float) -> Any:
        """The next message (after :meth:`stream`), waiting at most ``timeout`` seconds;
        raises ``queue.Empty`` when none came, RuntimeError when the worker exited."""
        msg = self._queue().get(timeout=timeout)
        if msg is _EXITED:
            raise RuntimeError(f"worker pid {self.proc.pid} exited ({self.proc.wait()})")
        return msg

    def ready(self) -> list[Any]:
        """The messages that arrived and were not read yet (after :meth:`stream`); never
        waits, and stops at the end of the worker's output."""
        lines = self._queue()
        out = []
        while True:
            try:
                msg = lines.get_nowait()
            except queue.Empty:
                return out
            if msg is _EXITED:
                lines.put(_EXITED)  # for the next next()
                return out
            out.append(msg)

    def _queue(self) -> queue.Queue[Any]:
        if self._lines is None:
            raise RuntimeError("call stream() before next() or ready()")
        return self._lines

    def close(self) -> None:
        """Asks the worker to quit (``{"cmd": "quit"}``), and kills it if it has not after 30 s."""
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
