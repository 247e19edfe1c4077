"""A warm replacement for ``./run_train.sh``'s workers (``fault_tolerance.replacement =
"zygote"``): a process that has done the trainer's imports once forks every worker torchrun
starts, so a worker group that torchrun restarts after a rank died skips the imports.

torchrun restarts the whole worker group when one rank dies (the survivors' in-group
collectives are broken anyway). Cold, each new worker is a fresh interpreter that imports
torch, TorchTitan and this package again (several seconds of CPU on 2 cores) before it can
build the model, join a quorum and heal. Here :mod:`~torchtitan_ft.titan.launch` starts one
zygote per torchrun agent, which imports those modules and then waits, and rewrites the worker
command to this module's light client::

    python -m torchtitan_ft.titan.zygote client SOCKET -m torchtitan_ft.titan.train ARGS...

The client (no torch import) hands the zygote its argv, environment, working directory and
stdin/stdout/stderr (``SCM_RIGHTS``); the zygote forks, and the child runs the command as
``python -m`` would, with the client's environment (torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_PORT``...). The client stays as torchrun's worker process: it forwards torchrun's
signals to the child and ends with the child's exit status (killing itself with the same
signal when the child was killed), so torchrun sees what it would see without the zygote. A
client that dies takes its child down with it (SIGKILL), so no worker outlives torchrun's view
of it. The zygote itself does no computation before it forks (an OpenMP thread pool does not
survive a fork).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from torchtitan_ft.spare import Command, parse_command, run

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.optim",
    "torch.distributed",
    "torchtitan_ft.titan.train",
    "torchtitan.train",
    "torchtitan_ft.titan.trainer",
    "torchtitan_ft.titan.config",
    "torchtitan_ft.titan.training_data",
    "torchtitan_ft.titan.known_warnings",
    "torchtitan_ft.manager",
    "torchtitan_ft.checkpoint",
)
"""What a TorchTitan worker imports before its first step, in import order
(``torchtitan_ft.titan.train`` first: it applies the CPU fixes before TorchTitan is imported)."""

CONNECT_TIMEOUT_S = 300.0
"""How long a client waits for the zygote's socket (the zygote imports for several seconds
after the agent starts it; a loaded machine can take much longer)."""

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""What the client passes on to its worker (torchrun stops workers with SIGTERM)."""

_MAX_MESSAGE = 1 << 20


@dataclass(frozen=True)
class Request:
    """What a client asks the zygote to run: ``python`` + ``argv`` in ``cwd`` with ``env``."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def encode(self) -> bytes:
        return json.dumps({"argv": self.argv, "env": self.env, "cwd": self.cwd}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        raw = json.loads(data)
        if not (
            isinstance(raw.get("argv"), list)
            and isinstance(raw.get("env"), dict)
            and isinstance(raw.get("cwd"), str)
        ):
            raise ValueError(f"a zygote request needs argv (list), env (dict), cwd (str): {raw!r}")
        return cls(
            [str(a) for a in raw["argv"]],
            {str(k): str(v) for k, v in raw["env"].items()},
            raw["cwd"],
        )


def exit_status(wait_status: int) -> int:
    """``os.waitpid``'s status as torchrun reports a worker's: the exit code, or minus the
    signal that killed it."""
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status)


# --- the zygote -------------------------------------------------------------------------------


class _Child:
    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.conn = conn
        self.pidfd = os.pidfd_open(pid)


def _receive_request(conn: socket.socket) -> tuple[Request, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a zygote request carries stdin, stdout and stderr, got {len(fds)} fds")
    return Request.decode(data), fds


def _become_worker(request: Request, fds: list[int]) -> Command:
    """In the forked child: the client's stdio, environment and directory; the command."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    threads = request.env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch  # load order: the zygote's own imports are the preload it times

        torch.set_num_threads(int(threads))
    return parse_command(request.argv)


def serve(path: str) -> Command:
    """Listen on the unix socket ``path`` and fork a worker per request; returns only in a
    forked child, with the command it must run. Ends the process, and the workers it forked,
    once its parent (the torchrun agent) is gone or the socket was removed."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.replace(tmp, path)  # the socket appears whole: a client never connects half-bound
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listen")
    children: dict[int, _Child] = {}
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "listen":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive_request(conn)
                except (ValueError, OSError) as e:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for child in children.values():
                        child.conn.close()
                        os.close(child.pidfd)
                    conn.close()
                    return _become_worker(request, fds)
                for fd in fds:
                    os.close(fd)
                child = _Child(pid, conn)
                children[pid] = child
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                selector.register(child.pidfd, selectors.EVENT_READ, ("exit", pid))
                selector.register(conn, selectors.EVENT_READ, ("client", pid))
            else:
                what, pid = key.data
                child = children.get(pid)
                if child is None:
                    continue
                if what == "client":  # the client hung up (or died): so does its worker
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    continue
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    child.conn.sendall(json.dumps({"status": exit_status(status)}).encode() + b"\n")
                selector.unregister(child.pidfd)
                selector.unregister(child.conn)
                os.close(child.pidfd)
                child.conn.close()
                del children[pid]
        if os.getppid() != parent or not os.path.exists(path):  # the agent is gone
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise SystemExit(0)


def preload(modules: tuple[str, ...] = PRELOAD) -> float:
    """Import ``modules``; seconds it took."""
    started = time.monotonic()
    for name in modules:
        importlib.import_module(name)
    return time.monotonic() - started


# --- the client -------------------------------------------------------------------------------


def _read_message(stream: Any) -> dict[str, Any]:
    line = stream.readline()
    if not line:
        raise ConnectionError("the zygote closed the connection")
    return json.loads(line)


def _connect(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"torchtitan_ft zygote: no zygote listening at {path} after {timeout:.0f} s"
                ) from None
            time.sleep(0.05)


def client(path: str, argv: list[str]) -> int:
    """Run ``argv`` in a worker forked by the zygote at ``path``; its exit status."""
    parse_command(argv)  # a bad command fails here, not in the zygote
    sock = _connect(path, CONNECT_TIMEOUT_S)
    request = Request(argv, dict(os.environ), os.getcwd())
    socket.send_fds(sock, [request.encode()], [0, 1, 2])
    stream = sock.makefile("r")
    reply = _read_message(stream)
    if "error" in reply:
        raise RuntimeError(f"torchtitan_ft zygote refused the worker: {reply['error']}")
    pid = int(reply["pid"])

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    return int(_read_message(stream)["status"])


def main(argv: list[str] | None = None) -> None:
    """``serve SOCKET`` (the zygote: preload, then fork workers) or ``client SOCKET COMMAND``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("serve", "client"):
        raise SystemExit(
            "usage: python -m torchtitan_ft.titan.zygote serve SOCKET | client SOCKET "
            "-m module [args...]"
        )
    if argv[0] == "serve":
        took = preload()
        print(
            f"torchtitan_ft zygote: warm in {took:.1f} s, forking workers from {argv[1]}",
            flush=True,
        )
        run(serve(argv[1]))
        return
    status = client(argv[1], argv[2:])
    if status < 0:  # die of the worker's signal, as torchrun would have seen the worker die
        if -status in FORWARDED_SIGNALS:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
