"""``testing.titan_jobs.LoggedProcess``: a failure report keeps the start of a fatal error that a
faulthandler dump of many threads pushes out of the log's tail, and the whole log is written to
its file."""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan_ft.testing.titan_jobs import LoggedProcess

CRASH = """
import faulthandler, os, threading, time
faulthandler.enable(all_threads=True)
for i in range(30):  # a crowd of threads: their stacks fill the log's tail
    threading.Thread(target=time.sleep, args=(60,), daemon=True, name=f"t{i}").start()
print("trained a step", flush=True)
os.abort()
"""


def test_a_crash_report_keeps_the_fatal_error_line_and_the_whole_log_is_on_disk(
    tmp_path: Path,
) -> None:
    log = tmp_path / "logs" / "crash.log"
    run = LoggedProcess("crasher", [sys.executable, "-c", CRASH], env={}, log_file=log)
    run.finish(timeout=60)

    assert run.returncode != 0
    tail = run.tail(20)
    assert "Fatal Python error" not in tail  # the dump of 31 threads fills the tail
    excerpt = run.excerpt(lines=20, head=5)
    assert excerpt.splitlines()[1].startswith("Fatal Python error: Aborted")
    assert excerpt.endswith(tail)
    assert str(log) in excerpt.splitlines()[0]
    assert log.read_text() == run.output
    assert "trained a step" in run.output


def test_a_clean_log_is_reported_by_its_tail(tmp_path: Path) -> None:
    run = LoggedProcess("quiet", [sys.executable, "-c", "print('done')"], env={})
    run.finish(timeout=60)
    assert run.excerpt() == run.tail() == "done\n"
