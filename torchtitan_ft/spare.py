"""Warm spare: a pre-started process that has done a replica group's imports and one-time
set-up, and becomes the group's replacement the moment the active process dies.

A fresh replacement spends most of its start-up importing (``import torch`` and
``torch._dynamo``, which every torch optimizer imports in its constructor, cost 3-4 s of CPU
on a 2-core machine; docs/performance.md) before it can join a quorum. A spare pays that
while the group is healthy, then waits; when it takes over it runs the training command in
its own interpreter, where those imports are already done.

Who is active is decided by a lock file, not by a signal: the active process holds a POSIX
record lock (``fcntl.lockf``) on ``--lock``; a spare blocks on the same lock. The kernel
releases the lock when the holder exits for any reason (SIGKILL and OOM kills included), so
the spare wakes at once, with no polling and no supervisor in the loop. Children the training
forks (DataLoader workers, multiprocessing) do not inherit a record lock, so an orphaned child
cannot keep the spare waiting.

    python -m torchtitan_ft.spare --lock /run/ft/group1.lock -- train.py --flag ...
    python -m torchtitan_ft.spare --lock /run/ft/group1.lock -- -m my_pkg.train --flag ...

The first process started for a lock takes it at once and trains (no preloading: the command
imports what it needs). Each later one warms up and waits. To keep one spare per replica group
at all times, run two restart loops per group (each restarts its process once it has ended,
until one ends with exit status 0)::

    for i in 1 2; do
        (until python -m torchtitan_ft.spare --lock /run/ft/group1.lock -- train.py ...; do
            sleep 1; done) &
    done

Options:
    --lock PATH: the lock file, a regular file (created if missing; its directory must
        exist). One per replica group, or per rank for a group of several processes, each
        launched this way.
        Required. The training must not open this file: closing any descriptor of it releases
        a POSIX record lock. Do not delete it while processes use it: a spare waits on the
        file it opened, not on a new one at the same path.
    --preload MODULE: a module to import while waiting, beside the defaults (torch,
        torch._dynamo, torch.optim, torch.distributed and torchtitan_ft's runtime); repeat it.
        Preload what the training imports before its first step (e.g. ``torchtitan.train``).
        Default: none. Trade-off: every preloaded module is memory the spare holds while idle.
    --no-warmup: skip the warm-up (default: on): a forward, backward and SGD and AdamW steps
        on a 16x16 layer, and a one-process gloo allreduce, so that the first call of each
        (thread pools, lazy kernel and library set-up) is paid while idle, not while the peer
        groups wait for the replacement's first step. It seeds nothing and leaves torch's
        random number generators untouched.
    --ready-file PATH: created once the spare is warm and waiting, deleted when it takes over
        (default: none), for a supervisor's health check.

Exit status: the training command's (a spare that never took over is ended by a signal).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import importlib.util
import logging
import os
import runpy
import stat
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO

logger = logging.getLogger("torchtitan_ft.spare")

DEFAULT_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.optim",
    "torch.distributed",
    "torchtitan_ft.manager",
    "torchtitan_ft.process_group",
    "torchtitan_ft.checkpoint",
    "torchtitan_ft.ddp",
    "torchtitan_ft.optim",
)
"""What a replica group's first step needs, in import order."""


class CommandKind(Enum):
    SCRIPT = "script"
    MODULE = "module"


@dataclass(frozen=True)
class Command:
    """The training command a spare runs once it takes over."""

    kind: CommandKind
    target: str
    """The script's path, or the module's name."""
    args: tuple[str, ...]

    def describe(self) -> str:
        head = f"-m {self.target}" if self.kind is CommandKind.MODULE else self.target
        return " ".join((head, *self.args))


def parse_command(argv: list[str]) -> Command:
    """The command after ``--``: ``script.py args...`` or ``-m module args...``.

    Raises:
        ValueError: no command, ``-m`` without a module, or another interpreter option.
    """
    if not argv:
        raise ValueError(
            "no training command: expected '-- script.py [args...]' or '-- -m module [args...]'"
        )
    if argv[0] == "-m":
        if len(argv) < 2 or not argv[1] or argv[1].startswith("-"):
            got = repr(argv[1]) if len(argv) > 1 else "nothing"
            raise ValueError(f"'-m' must be followed by a module name, got {got}")
        return Command(CommandKind.MODULE, argv[1], tuple(argv[2:]))
    if argv[0].startswith("-"):
        raise ValueError(
            f"unsupported interpreter option {argv[0]!r} in the training command: only "
            "'script.py [args...]' and '-m module [args...]' can run inside the spare"
        )
    return Command(CommandKind.SCRIPT, argv[0], tuple(argv[1:]))


def check_command(command: Command) -> None:
    """Raises ValueError now, rather than after a takeover, if the command cannot run."""
    if command.kind is CommandKind.SCRIPT:
        if not Path(command.target).is_file():
            raise ValueError(f"training script {command.target!r} does not exist")
    elif importlib.util.find_spec(command.target) is None:
        raise ValueError(f"training module {command.target!r} is not importable")


def open_lock(path: str) -> IO[bytes]:
    """The lock file, opened for writing (a POSIX record lock needs a writable descriptor).

    Raises:
        ValueError: the directory does not exist, the path cannot be opened, or it is not a
            regular file (opening a FIFO for writing would wait for a reader forever).
    """
    directory = Path(path).resolve().parent
    if not directory.is_dir():
        raise ValueError(f"--lock {path!r}: directory {str(directory)!r} does not exist")
    not_regular = ValueError(f"--lock {path!r} is not a regular file; give the path of a file")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise not_regular
    try:
        # Non-blocking: a FIFO put there since the check fails at once instead of hanging.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise ValueError(f"--lock {path!r} cannot be opened for writing: {e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise not_regular
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")  # held open for the life of the process


def check_preload(modules: list[str]) -> None:
    """Raises ValueError now, rather than when the spare warms up, for a module that cannot
    be found."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a bad name
            found = False
        if not found:
            raise ValueError(f"--preload {name!r} is not an importable module")


def check_ready_file(path: str) -> None:
    """Raises ValueError now, rather than once warm, if the ready file cannot be created."""
    target = Path(path)
    if target.exists() and not target.is_file():
        raise ValueError(f"--ready-file {path!r} exists and is not a regular file")
    directory = target.resolve().parent
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"--ready-file {path!r}: directory {str(directory)!r} does not exist or is not writable"
        )


def try_lock(lock: IO[bytes]) -> bool:
    """Takes the lock if no other process holds it."""
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    return True


def preload(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)


def warm_up() -> None:
    """Pays first-call costs on a tiny model (see ``--no-warmup``), without touching torch's
    global random state or any setting the training would see."""
    import torch  # load order: the restart loop stays light; only a warming spare loads torch

    with torch.random.fork_rng(devices=[]):  # the layer's initialisation draws numbers
        layer = torch.nn.Linear(16, 16)
    for optimizer in (
        torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(layer.parameters()),
    ):
        optimizer.zero_grad()
        layer(torch.ones(4, 16)).square().mean().backward()
        optimizer.step()
    store = torch.distributed.HashStore()
    group = torch.distributed.ProcessGroupGloo(store, 0, 1)
    group.allreduce([torch.ones(4)]).wait()


def run(command: Command) -> None:
    """Runs ``command`` as ``python`` would run it as ``__main__`` (SystemExit propagates)."""
    if command.kind is CommandKind.MODULE:
        sys.argv = [command.target, *command.args]  # run_module sets argv[0] to the file
        runpy.run_module(command.target, run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(command.target)
    sys.argv = [command.target, *command.args]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def _log_to_stderr() -> None:
    """This module's lines on stderr, without configuring the root logger (the training's)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[spare pid=%(process)d] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_held_lock: IO[bytes] | None = None
"""The lock file, open for the life of the process once taken (closing it releases the lock)."""


def main(argv: list[str] | None = None) -> None:
    global _held_lock
    argv = sys.argv[1:] if argv is None else argv
    own, command_argv = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if ("--" in argv) else (argv, [])
    )
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_ft.spare",
        description=__doc__.split("\n")[0],
        usage="%(prog)s --lock PATH [options] -- (script.py | -m module) [args...]",
    )
    parser.add_argument(
        "--lock",
        required=True,
        metavar="PATH",
        help="lock file whose holder is the active process (created if missing); one per "
        "replica group (or rank); the training must not open it",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="also import MODULE while waiting (repeatable; default: only torch, "
        "torch._dynamo, torch.optim, torch.distributed, torchtitan_ft's runtime)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up (a tiny forward/backward, SGD and AdamW steps, a one-process "
        "gloo allreduce); default: warm up",
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        metavar="PATH",
        help="created once warm and waiting, deleted on takeover (default: none)",
    )
    args = parser.parse_args(own)
    _log_to_stderr()
    try:
        command = parse_command(command_argv)
        check_command(command)
        check_preload(args.preload)
        if args.ready_file:
            check_ready_file(args.ready_file)
        lock = open_lock(args.lock)
    except ValueError as e:
        parser.error(str(e))
    if try_lock(lock):
        logger.info("lock %s was free: active at once, running %s", args.lock, command.describe())
    else:
        started = time.monotonic()
        preload([*DEFAULT_PRELOAD, *args.preload])
        if not args.no_warmup:
            warm_up()
        if args.ready_file:
            Path(args.ready_file).touch()
        logger.info(
            "warm in %.1f s; waiting for lock %s to run %s",
            time.monotonic() - started,
            args.lock,
            command.describe(),
        )
        fcntl.lockf(lock, fcntl.LOCK_EX)
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
        logger.info("took over lock %s: running %s", args.lock, command.describe())
    _held_lock = lock
    run(command)


if __name__ == "__main__":
    main()
