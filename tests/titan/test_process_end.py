"""How a trainer process whose run finished ends (``titan.train.run_trainer`` and
``end_finished_process``): the trainer closed, non-daemon threads joined, exit handlers run,
buffered output written, exit status 0, and nothing after it runs (no interpreter
finalization, which a gloo worker thread of torch's groups can abort); a run that fails
still ends with its error."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, threading, time
from torchtitan_ft.titan.train import run_trainer

closed = threading.Event()

class Trainer:
    def close(self):
        print("closed")
        closed.set()

def late_writer():  # still writing when the process starts to end
    closed.wait()
    time.sleep(0.3)
    print("non-daemon thread done")

def run(trainer):
    threading.Thread(target=late_writer).start()

atexit.register(lambda: print("exit handler ran"))
print("buffered", end="")  # no newline: still in the pipe's buffer
run_trainer(Trainer, run)
print("after run_trainer")
"""


def test_a_finished_run_ends_after_threads_and_exit_handlers_without_going_on() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace("buffered", "buffered\n", 1).splitlines()
    assert lines == ["buffered", "closed", "non-daemon thread done", "exit handler ran"], lines


def test_a_failed_run_still_closes_the_trainer_and_ends_with_its_error() -> None:
    """In this process: were the process ended (``end_finished_process``), pytest would end
    with it."""
    from torchtitan_ft.titan.train import run_trainer

    closed = []

    class Trainer:
        def close(self) -> None:
            closed.append(True)

    def run(trainer: Trainer) -> None:
        raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        run_trainer(Trainer, run)
    assert closed == [True]
