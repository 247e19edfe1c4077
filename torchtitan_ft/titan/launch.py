"""torchrun for ``run_train.sh``, the agent of one replica group's trainer processes:
``python -m torchtitan_ft.titan.launch [torchrun arguments]``.

It is ``python -m torch.distributed.run`` in every respect but three. The workers' store
port is one that nothing takes between torchrun's pick and group rank 0's bind
(:mod:`torchtitan_ft.titan.store_port`). A failed worker's error
file that is not JSON (empty: the worker was killed while writing it) counts as no error file,
where torchrun's agent would die of the ``JSONDecodeError`` and never restart the group
(:func:`tolerate_torn_error_files`). When the failed workers
exited with :data:`USER_ERROR_EXIT` or :data:`STATE_LOST_EXIT` (or were stopped by torchrun's
SIGTERM once the first of them had exited), the workers have already said what is wrong in one
line (``torchtitan_ft: config error: ...`` and the other mistakes ``torchtitan_ft.titan.train``
reports; the job's state lost), so torchrun's own report of the failure (an ERROR log line and a
``ChildFailedError`` traceback) is left out and the launcher exits with the same status. Any
other failure is reported by torchrun as usual.

With ``fault_tolerance.replacement = "zygote"`` in the trainer's config it also starts a
pre-imported process that forks every worker torchrun starts (:mod:`torchtitan_ft.titan.zygote`),
so a worker group that torchrun restarts after one of its ranks died skips the imports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan_ft.titan import store_port

USER_ERROR_EXIT = 2
"""Exit status of a worker stopped by a mistake it explained in one line: a bad configuration,
an unreachable lighthouse, a replica group inconsistent with the job, a port in use."""

STATE_LOST_EXIT = 3
"""Exit status of a worker that stopped because the lighthouse reported the job's state lost
(``fault_tolerance.on_state_loss = "stop"``; ``manager.state_loss.STATE_LOST_EXIT``, not
imported here: that package imports the whole Manager into the torchrun agent). Explained in
one ERROR line, as a user error is."""

_EXPLAINED_EXITS = (USER_ERROR_EXIT, STATE_LOST_EXIT)

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"

ZYGOTE_MAX_RESTARTS = 100
"""torchrun's ``--max-restarts`` with ``replacement = "zygote"`` when run_train.sh's
``MAX_RESTARTS`` is left at 0 (a warm replacement that torchrun never starts is no use)."""


class _DropUserErrorFailure(logging.Filter):
    """Drops torchrun's "failed (exitcode: 2) ..." line; other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(f"failed (exitcode: {c})") for c in _EXPLAINED_EXITS)


def tolerate_torn_error_files() -> None:
    """Makes torchrun's agent take a failed worker's error file that does not parse as JSON for
    no error file. torchrun stops a group's other ranks as soon as one dies; a rank whose peer
    died inside a collective is by then writing its exception to its error file
    (``open(..., "w")`` then ``write``), and a kill between the two leaves it empty. The agent
    then raised ``JSONDecodeError`` out of its monitoring loop and exited, so the group was
    never restarted (seen in ``benchmarks.goodput``: a two-group kill). torchrun 2.13 behaves
    so; the launcher says it in one line when it happens."""
    # load order: run_train.sh and the agent import this module torch-free (test_cpu_compat)
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    original = ProcessFailure.__post_init__
    if getattr(original, "tolerates_torn_files", False):
        return

    def post_init(self: ProcessFailure) -> None:
        try:
            original(self)
        except ValueError:  # json.JSONDecodeError: a torn or empty file
            print(
                f"torchtitan_ft: worker {self.local_rank} (pid {self.pid}) left an error file "
                f"that is not JSON ({self.error_file}, killed while writing it); torchrun would "
                "stop here, the launcher treats it as no error file and restarts the group",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(OSError):
                os.remove(self.error_file)
            original(self)

    post_init.tolerates_torn_files = True  # type: ignore[attr-defined]
    ProcessFailure.__post_init__ = post_init  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    """Runs torchrun with ``argv`` (default: the command line)."""
    # load order: importing this module stays torch-free; only the agent runs torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger(_AGENT_LOGGER).addFilter(_DropUserErrorFailure())
    tolerate_torn_error_files()
    argv = list(sys.argv[1:] if argv is None else argv)
    # A store per rendezvous round for the workers. By default it is the rendezvous store,
    # without a per-round prefix: the workers torchrun restarts (MAX_RESTARTS, a zygote) read
    # the gloo addresses of the previous round's workers and fail ("connectFullMesh failed
    # ... Connection refused"), on one machine as on several. The Manager reads the same
    # variable (manager.settings.PER_ROUND_STORE_ENV, not imported here: that package
    # imports the whole Manager into the torchrun agent).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    store_port.install()  # that store's port: one nothing else takes before rank 0 binds it
    with contextlib.ExitStack() as stack:
        if replacement(worker_args(argv)) == "zygote":
            argv = stack.enter_context(zygote_workers(argv))
        try:
            torchrun_main(argv)
        except ChildFailedError as e:
            if (status := _explained(list(e.failures.values()))) is not None:
                raise SystemExit(status) from None
            raise


def module_index(argv: list[str]) -> int:
    """Index of torchrun's ``-m`` / ``--module`` flag in ``argv`` (run_train.sh always passes
    one, followed by the worker module); -1 if there is none."""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module"):
            return i
    return -1


def worker_args(argv: list[str]) -> list[str]:
    """The worker module's arguments in torchrun's ``argv`` (after ``-m MODULE``)."""
    i = module_index(argv)
    return argv[i + 2 :] if i >= 0 else []


def mentions_replacement(args: list[str]) -> bool:
    """Whether the trainer arguments ``args`` or their ``--job.config_file`` contain the word
    "replacement": a cheap test before :func:`replacement` parses the config (which imports
    TorchTitan into the agent, seconds of CPU on every launch otherwise)."""
    if any("replacement" in arg for arg in args):
        return True
    files = [
        arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        for i, arg in enumerate(args)
        if arg.partition("=")[0] in ("--job.config_file", "--job.config-file")
    ]
    with contextlib.suppress(OSError):
        return bool(files) and "replacement" in Path(files[-1]).read_text()
    return False


def replacement(args: list[str]) -> str:
    """``fault_tolerance.replacement`` of the trainer arguments ``args`` ("cold" when FT is
    off or the config does not parse: the worker then reports the config error itself)."""
    if not mentions_replacement(args):
        return "cold"
    from torchtitan_ft.titan.config import ConfigError, parse_job  # load order: torch-free import

    try:
        ft = parse_job(args).config.fault_tolerance
    except (ConfigError, SystemExit):
        return "cold"
    return ft.replacement if ft.enable else "cold"


def with_zygote(argv: list[str], socket_path: str) -> tuple[list[str], str | None]:
    """torchrun's ``argv`` with each worker started through the zygote at ``socket_path``,
    and the line to print when ``--max-restarts`` was raised (None: it was not)."""
    i = module_index(argv)
    if i < 0:
        raise ValueError(f"expected torchrun's -m MODULE in {argv}")
    out = [*argv[: i + 1], "torchtitan_ft.titan.zygote", "client", socket_path, "-m"]
    out += argv[i + 1 :]
    note = None
    for j, arg in enumerate(out[: i + 1]):
        name, _, value = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts") and value == "0":
            out[j] = f"{name}={ZYGOTE_MAX_RESTARTS}"
            note = (
                "torchtitan_ft: fault_tolerance.replacement='zygote': a pre-imported process "
                "forks this group's workers, and torchrun restarts the group up to "
                f"{ZYGOTE_MAX_RESTARTS} times (MAX_RESTARTS was 0)"
            )
    return out, note


@contextlib.contextmanager
def zygote_workers(argv: list[str]) -> Iterator[list[str]]:
    """Start the zygote for the block; yields torchrun's argv that starts workers through it."""
    folder = tempfile.mkdtemp(prefix="torchtitan_ft_zygote_")
    socket_path = os.path.join(folder, "zygote.sock")
    rewritten, note = with_zygote(argv, socket_path)
    sys.stderr.write(
        (
            note
            or "torchtitan_ft: fault_tolerance.replacement='zygote': a pre-imported "
            "process forks this group's workers"
        )
        + "\n"
    )
    zygote = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_ft.titan.zygote", "serve", socket_path]
    )
    try:
        yield rewritten
    finally:
        zygote.kill()
        zygote.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _explained(failures: list[Any]) -> int | None:
    """The status the workers explained in one line, when ``failures`` (torchrun's
    ``ProcessFailure``s) are such: the first to fail exited with USER_ERROR_EXIT or
    STATE_LOST_EXIT, and the others did the same or were terminated by torchrun after it;
    else None."""
    if not failures:
        return None
    first = min(failures, key=lambda f: f.timestamp)
    if first.exitcode not in _EXPLAINED_EXITS:
        return None
    if all(f.exitcode in (first.exitcode, -signal.SIGTERM) for f in failures):
        return first.exitcode
    return None


if __name__ == "__main__":
    main()
