"""``testing.titan_jobs``: a failure report keeps the start of a fatal error that a faulthandler
dump of many threads pushes out of the log's tail, the whole log is written to its file, and the
fatal error of a rank whose output only torchrun's per-rank logs hold is found there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ft.testing.titan_jobs import (
    _CORES_ON,
    CORE_PATTERN_FILE,
    LoggedProcess,
    core_file_name,
    native_stack,
    rank_log_errors,
)

CRASH = """
import faulthandler, os, threading, time
faulthandler.enable(all_threads=True)
go = threading.Event()
def crash():
    go.wait()
    os.abort()
for i in range(30):  # a crowd of threads: their stacks fill the log's tail
    threading.Thread(target=time.sleep, args=(60,), daemon=True, name=f"t{i}").start()
    if i == 15:  # the crashing thread's stack lies amid theirs
        threading.Thread(target=crash, daemon=True).start()
print("trained a step", flush=True)
go.set()
time.sleep(60)
"""


def test_a_crash_report_keeps_the_fatal_error_line_and_the_whole_log_is_on_disk(
    tmp_path: Path,
) -> None:
    log = tmp_path / "logs" / "crash.log"
    run = LoggedProcess("crasher", [sys.executable, "-c", CRASH], env={}, log_file=log)
    run.finish(timeout=60)

    assert run.returncode != 0
    tail = run.tail(20)
    assert "Fatal Python error" not in tail  # the dump of 32 threads fills the tail
    excerpt = run.excerpt(lines=20, head=5)
    assert excerpt.splitlines()[1].startswith("Fatal Python error: Aborted")
    crashed = excerpt.index("[... the crashing thread:]")  # after the first threads' stacks
    assert "Current thread" in excerpt[crashed:].splitlines()[1]
    assert 'File "<string>", line 7 in crash' in excerpt[crashed:].splitlines()[2]
    assert excerpt.endswith(tail)
    assert str(log) in excerpt.splitlines()[0]
    assert log.read_text() == run.output
    assert "trained a step" in run.output


def test_a_clean_log_is_reported_by_its_tail(tmp_path: Path) -> None:
    run = LoggedProcess("quiet", [sys.executable, "-c", "print('done')"], env={})
    run.finish(timeout=60)
    assert run.excerpt() == run.tail() == "done\n"


def test_rank_logs_report_the_fatal_error_of_a_rank_the_console_did_not_show(
    tmp_path: Path,
) -> None:
    """torchrun's ``--log-dir`` layout: ``<run id>/attempt_<n>/<local rank>/std{out,err}.log``."""
    attempt = tmp_path / "none_abc" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "stdout.log").write_text("step: 3 loss: 7.4\n")
    (attempt / "0" / "stderr.log").write_text("UserWarning: harmless\n")
    (attempt / "1" / "stderr.log").write_text(
        "UserWarning: harmless\nterminate called without an active exception\n"
        "Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n"
    )
    report = rank_log_errors(tmp_path, head=2)
    assert report == (
        f"[{attempt / '1' / 'stderr.log'}]\n"
        "terminate called without an active exception\nFatal Python error: Aborted\n"
    )


@pytest.mark.parametrize(
    ("pattern", "name"),
    [
        ("core\n", "core"),
        ("core.%p\n", None),  # a template: not looked for
        ("/var/crash/core\n", None),
        ("|/usr/lib/systemd/systemd-coredump %P %u %g %s %t %c %h\n", None),
        ("\n", None),
    ],
)
def test_where_a_runs_cores_are_looked_for(pattern: str, name: str | None) -> None:
    assert core_file_name(pattern) == name


def test_a_crash_leaves_a_core_whose_native_stack_shows_the_abort(tmp_path: Path) -> None:
    """What a failure report of a TrainRun adds after a fatal signal: the crashed thread's
    native stack (gdb on the core left under ``_CORES_ON``)."""
    name = core_file_name(CORE_PATTERN_FILE.read_text())
    if name is None:
        pytest.skip(f"core_pattern {CORE_PATTERN_FILE.read_text().strip()!r} is not a plain name")
    command = ["bash", "-c", _CORES_ON, sys.executable, "-c", "import os\nos.abort()\n"]
    subprocess.run(command, cwd=tmp_path, timeout=60)
    cores = [p for p in tmp_path.iterdir() if p.name.split(".")[0] == name]
    assert len(cores) == 1
    stack = native_stack(cores[0], os.path.realpath(sys.executable))
    assert stack.startswith("#0 ")
    assert "abort" in stack
