"""TorchTitan jobs launched by the tests (and by ``scripts/gpu_check.py``): ``run_train.sh``
runs, waits inside the test's own timeout, and the runs' logs shown when a test fails. Needs a
checkout (``run_train.sh``, ``configs/``).

Every :class:`TrainRun` is registered in :data:`RUNS` (emptied before each test by
``tests/titan/conftest.py``). When a test fails, a pytest timeout included, the conftest hook
adds the tail of every run's log to the report and SIGKILLs what still runs. Every wait here
draws on the test's budget (:func:`set_budget`: its pytest timeout less a margin for cleanup
and the report), so a slow run fails with our own message and the logs, not with pytest's
bare timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from torchtitan_ft.events import Event, EventKind, read_events
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.testing.processes import descendants
from torchtitan_ft.titan.releases.job import TitanJob
from torchtitan_ft.titan.releases.job import command as titan_command

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
STEP_LINE = re.compile(r"\[rank(\d+)\]:.*step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+)")
_TIMESTAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
_FATAL = re.compile(r"Fatal Python error|terminate called|Traceback \(most recent call last\)")
"""Where a process's own account of its death begins: a faulthandler dump (a fatal signal), a
C++ abort, a Python traceback."""


_CURRENT_THREAD = re.compile(r"Current thread 0x[0-9a-fA-F]+ \(most recent call first\)")
_FRAME = re.compile(r"^(\[[^\]]*\]:)?\s+(File \"|<no Python frame>)")


def first_fatal_lines(lines: Sequence[str], head: int, shown_from: int | None = None) -> list[str]:
    """The first ``head`` lines of ``lines`` from where the first fatal error or traceback
    begins (:data:`_FATAL`); none if there is none. When that is a faulthandler dump (a fatal
    signal: "Fatal Python error: Aborted", "Segmentation fault"), the stack of the thread that
    crashed ("Current thread ...") follows where it comes later, after other threads' stacks.
    Only lines before ``shown_from`` count (a log's tail shown anyway)."""
    end = len(lines) if shown_from is None else shown_from
    start = next((i for i, line in enumerate(lines[:end]) if _FATAL.search(line)), None)
    if start is None:
        return []
    found = list(lines[start : min(start + head, end)])
    if "Fatal Python error" not in lines[start]:
        return found
    current = next((i for i in range(start, end) if _CURRENT_THREAD.search(lines[i])), None)
    if current is None or current < start + head:
        return found
    stop = current + 1
    while stop < end and _FRAME.search(lines[stop]):
        stop += 1
    return [*found, "[... the crashing thread:]\n", *lines[current:stop]]


def rank_log_errors(folder: Path, head: int = 40) -> str:
    """For every rank log under ``folder`` (torchrun's ``--log-dir``:
    ``<run id>/attempt_<n>/<local rank>/stdout.log`` and ``stderr.log``) that holds a fatal
    error or a traceback: its path and the first ``head`` lines from there."""
    found = []
    for log in sorted(folder.glob("*/attempt_*/*/std*.log")):
        lines = first_fatal_lines(log.read_text(errors="replace").splitlines(keepends=True), head)
        if lines:
            found.append(f"[{log}]\n{''.join(lines)}")
    return "".join(found)


CORE_PATTERN_FILE = Path("/proc/sys/kernel/core_pattern")
_CORES_ON = 'ulimit -c unlimited 2>/dev/null; exec "$0" "$@"'
"""A command prefix (``bash -c _CORES_ON``) that lets the processes under it leave a core."""


def core_file_name(core_pattern: str) -> str | None:
    """The name of the core that a process which crashes leaves in its working directory,
    from the kernel's ``core_pattern``, when that is a plain file name ("core"; the kernel
    may append ".<pid>"); None for a path, a template (%p, ...) or a pipe to a crash handler,
    where a run's cores are not looked for. Pure."""
    pattern = core_pattern.strip()
    if not pattern or any(c in pattern for c in "/%|"):
        return None
    return pattern


def native_stack(core: Path, executable: str, timeout: float = 120.0) -> str:
    """The native stack of the thread that crashed, from ``core`` with ``gdb -batch`` (a
    line saying why not where gdb is missing or fails)."""
    try:
        result = subprocess.run(
            ["gdb", "-batch", "-nx", "-q", "-ex", "bt 40", executable, str(core)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no native stack from {core}: {e})\n"
    frames = [line for line in result.stdout.splitlines(keepends=True) if line.startswith("#")]
    return "".join(frames) or f"(gdb found no stack in {core}: {result.stderr[-500:]})\n"


RUNS: list[TrainRun] = []
"""The runs of the current test, in start order."""
_budget = {"deadline": float("inf")}
CLEANUP_MARGIN_S = 30.0
"""What a test keeps of its pytest timeout for killing its runs and reporting their logs."""


def set_budget(seconds: float) -> None:
    """The current test may wait ``seconds`` in all (its pytest timeout less the margin)."""
    _budget["deadline"] = time.monotonic() + max(seconds - CLEANUP_MARGIN_S, 1.0)


def remaining(timeout: float | None = None) -> float:
    """Seconds a wait may take: ``timeout`` capped by what is left of the test's budget."""
    left = _budget["deadline"] - time.monotonic()
    return left if timeout is None else min(timeout, left)


class LoggedProcess:
    """A process of a test (a run, a lighthouse), its output collected by a thread and shown
    when the test fails (it is registered in :data:`RUNS`). ``command`` runs in the
    repository root with ``env`` (the full environment). With ``log_file``, the whole output
    is also written there as it comes (a failure report shows only :meth:`excerpt`; the test's
    ``tmp_path`` outlives the run)."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        env: dict[str, str],
        log_file: Path | None = None,
    ) -> None:
        self.name = name
        self.log_file = log_file
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        RUNS.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.ExitStack() as stack:
            log = None
            if self.log_file is not None:
                self.log_file.parent.mkdir(parents=True, exist_ok=True)
                log = stack.enter_context(self.log_file.open("w", buffering=1))
            for line in self.proc.stdout:
                self.lines.append(line)
                if log is not None:
                    log.write(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 150) -> str:
        return "".join(self.lines[-lines:])

    def excerpt(self, lines: int = 150, head: int = 40) -> str:
        """The last ``lines`` lines, preceded by the first ``head`` lines of the first fatal
        error or traceback when they fall before that tail (a faulthandler dump of every
        thread fills a tail and hides the signal and the crashing thread)."""
        tail_from = max(len(self.lines) - lines, 0)
        where = f"[whole log: {self.log_file}]\n" if self.log_file is not None else ""
        first = first_fatal_lines(self.lines, head, shown_from=tail_from)
        if not first:
            return where + self.tail(lines)
        return f"{where}{''.join(first)}[...]\n{self.tail(lines)}"

    def wait_for(self, pattern: str, timeout: float | None = None) -> re.Match[str]:
        """The first match of ``pattern`` in the output; fails if the run exits or the time
        (capped by the test's budget) runs out first."""
        limit = remaining(timeout)
        deadline = time.monotonic() + limit
        while True:
            found = re.search(pattern, self.output)
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited ({self.proc.returncode}) before logging {pattern!r}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not log {pattern!r} within {limit:.0f} s")
            time.sleep(0.1)

    def finish(self, timeout: float | None = None) -> str:
        """Wait for the run to exit (capped by the test's budget); its output."""
        limit = remaining(timeout)
        try:
            self.proc.wait(timeout=max(limit, 0.1))
        except subprocess.TimeoutExpired:
            self.sigkill()
            raise AssertionError(f"{self.name} did not finish within {limit:.0f} s") from None
        self._reader.join(timeout=10)
        return self.output

    def sigkill(self) -> None:
        """SIGKILL the torchrun agent and every process under it, and reap the agent."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def step_lines(self, rank: int = 0) -> list[tuple[int, float]]:
        """``(step, time)`` of every training-step line of ``rank``, in log order (a discarded
        step logs no line; its retry logs it once it commits), time in seconds from the log's
        timestamps."""
        lines = []
        for line in self.lines:
            step = STEP_LINE.search(line)
            stamp = _TIMESTAMP.search(line)
            if step and stamp and int(step.group(1)) == rank:
                when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                lines.append((int(step.group(2)), when))
        return lines


_RUN_NUMBERS = itertools.count()


class TrainRun(LoggedProcess):
    """One ``run_train.sh`` (a torchrun job: one replica group with FT). ``args`` go to the
    trainer; ``env`` is added to this process's environment; ``prefix`` is put before the
    command (e.g. ``Host.command([])`` of ``torchtitan_ft.testing.netns`` runs it on that
    host). Its Managers write their event streams to :attr:`events_dir`, a folder of its own
    under ``dump_folder`` (a restarted group's run, in the same dump folder, gets another),
    and torchrun every rank's output to :attr:`rank_logs` (the console shows ``log_rank``'s
    only): a failure report shows the fatal errors found there (:meth:`excerpt`). Where the
    kernel writes a crashing process's core to its working directory (``core_pattern`` a
    plain name, :func:`core_file_name`), the run's processes may leave one: the report moves
    it into ``dump_folder`` and adds the crashed thread's native stack (:meth:`collect_core`).
    """

    def __init__(
        self,
        name: str,
        steps: int,
        dump_folder: Path,
        *args: str,
        ngpu: int = 1,
        env: dict[str, str] | None = None,
        log_rank: str = "0",
        prefix: Sequence[str] = (),
    ) -> None:
        number = next(_RUN_NUMBERS)
        self.started_at = time.time()
        self.core_name = core_file_name(CORE_PATTERN_FILE.read_text())
        self.core = dump_folder / f"run{number}_core"
        """Where :meth:`collect_core` puts a core this run's processes left."""
        self.events_dir = dump_folder / "events" / f"run{number}"
        self.rank_logs = dump_folder / f"run{number}_ranks"
        cores_on = ["bash", "-c", _CORES_ON] if self.core_name is not None else []
        job = TitanJob(
            dump_folder=dump_folder,
            steps=steps,
            ngpu=ngpu,
            events_dir=self.events_dir,
            flags=args,
            env={
                "LOG_RANK": log_rank,
                "PET_LOG_DIR": str(self.rank_logs),  # torchrun's --log-dir
                **(env or {}),
            },
            prefix=(*prefix, *cores_on),
        )
        launch = titan_command(job)
        log_file = dump_folder / f"run{number}.log"
        super().__init__(name, launch.argv, launch.environ(), log_file=log_file)

    def excerpt(self, lines: int = 150, head: int = 40) -> str:
        """:meth:`LoggedProcess.excerpt`, then the start of every fatal error in the ranks'
        own logs (a rank other than ``log_rank`` that dies shows nowhere else)."""
        errors = rank_log_errors(self.rank_logs, head)
        own = super().excerpt(lines, head)
        if errors:
            own += f"[fatal errors in the ranks' logs]\n{errors}"
        if self.collect_core():
            stack = native_stack(self.core, os.path.realpath(sys.executable))
            own += f"[native stack of the crashed thread, from {self.core}]\n{stack}"
        return own

    def collect_core(self) -> bool:
        """Moves a core that a process of this run left in the working directory since the
        run started (:func:`core_file_name`) to :attr:`core`; whether there is one there."""
        if self.core_name is not None and not self.core.exists():
            for core in sorted(ROOT.glob(f"{self.core_name}*")):
                if core.name.split(".")[0] == self.core_name and core.is_file():
                    with contextlib.suppress(OSError):
                        if core.stat().st_mtime >= self.started_at:
                            shutil.move(core, self.core)
                            break
        return self.core.exists()

    def events(self, kind: EventKind, rank: int = 0) -> list[Event]:
        """The events of ``kind`` that group rank ``rank`` wrote, in time order."""
        return [e for e in read_events(self.events_dir) if e.kind is kind and e.group_rank == rank]


def step_durations(run: TrainRun, first: int, last: int) -> list[float]:
    """Seconds between consecutive step lines of ``run`` (group rank 0), for the lines of
    steps ``first``..``last`` (each duration is labelled by the later line)."""
    lines = run.step_lines()
    return [b[1] - a[1] for a, b in itertools.pairwise(lines) if first <= b[0] <= last]


def median_ratio(after: list[float], before: list[float]) -> float:
    """median(after) / median(before); both need at least 2 samples."""
    if len(after) < 2 or len(before) < 2:
        raise AssertionError(f"too few steps to compare: before {before}, after {after}")
    return statistics.median(after) / statistics.median(before)


def ft_env(config: str | Path, lighthouse: str, **extra: str) -> dict[str, str]:
    """Environment of an FT replica group of ``config`` (a name in ``configs/`` or a path)."""
    path = config if isinstance(config, Path) else CONFIGS / config
    return {"CONFIG_FILE": str(path), "TORCHFT_LIGHTHOUSE": lighthouse, **extra}


@contextlib.contextmanager
def lighthouse(min_replicas: int, **kwargs: Any) -> Iterator[str]:
    """A lighthouse on 127.0.0.1 (ephemeral port) for the block; yields its address."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, **kwargs)
    try:
        yield server.address()
    finally:
        server.shutdown()


def finish_all(runs: list[TrainRun], timeout: float | None = None) -> list[str]:
    """Wait for every run; each must exit 0. Their outputs."""
    outputs = [run.finish(timeout) for run in runs]
    for run in runs:
        assert run.returncode == 0, f"{run.name} exited {run.returncode}"
    return outputs


def run_train(
    tmp_path: Path, ngpu: int, steps: int, *args: str, env: dict[str, str] | None = None
) -> TrainRun:
    """One ``run_train.sh`` with NGPU=ngpu, waited for (it may exit non-zero)."""
    run = TrainRun("run_train.sh", steps, tmp_path / "outputs", *args, ngpu=ngpu, env=env)
    run.finish()
    return run


def run_ft_groups(
    tmp_path: Path,
    ngpu: int,
    steps: int,
    config: str | Path,
    *args: str,
    env: dict[str, str] | None = None,
    lighthouse_state_dir: Path | None = None,
) -> list[str]:
    """2 replica groups of ``run_train.sh`` with FT against a fresh lighthouse (min_replicas
    2; its ``state_dir`` ``lighthouse_state_dir``, default none), group ``r`` in
    ``tmp_path / f"replica{r}"`` with ``--fault_tolerance.replica_id=r``; each must exit 0.
    Their outputs."""
    state_dir = None if lighthouse_state_dir is None else str(lighthouse_state_dir)
    with lighthouse(min_replicas=2, state_dir=state_dir) as address:
        runs = [
            TrainRun(
                f"replica group {r}",
                steps,
                tmp_path / f"replica{r}" / "outputs",
                f"--fault_tolerance.replica_id={r}",
                *args,
                ngpu=ngpu,
                env={**ft_env(config, address), **(env or {})},
            )
            for r in range(2)
        ]
        return finish_all(runs)


def group_events(tmp_path: Path, replica: int, kind: EventKind, rank: int = 0) -> list[Event]:
    """The events of ``kind`` that group rank ``rank`` of replica group ``replica`` of
    :func:`run_ft_groups` wrote, in time order."""
    events = read_events(tmp_path / f"replica{replica}")
    return [e for e in events if e.kind is kind and e.group_rank == rank]


def logged_scalars(dump_folder: Path, replica: int, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every ``tag`` scalar TensorBoard recorded for replica group
    ``replica`` under ``dump_folder`` (all its runs: ``tb/<time>/replica_<id>``), by step."""
    # an optional dependency (TorchTitan's metrics extra), only for the tests that read it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for run_dir in sorted((dump_folder / "tb").glob(f"*/replica_{replica}")):
        events = EventAccumulator(str(run_dir))
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values.extend((e.step, e.value) for e in events.Scalars(tag))
    return sorted(values)


def step_metrics(output: str, rank: int = 0) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} logged by ``rank`` (the last line of a retried step)."""
    return {
        int(m.group(2)): (float(m.group(3)), float(m.group(4)))
        for m in STEP_LINE.finditer(output)
        if int(m.group(1)) == rank
    }


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts / lists of tensors and values) are bitwise equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
