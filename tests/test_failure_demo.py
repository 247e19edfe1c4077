"""scripts/failure_demo.py: its schedule and its verdict as pure functions, and two short runs
(the tiny MLP and TorchTitan), each of which must inject its faults and exit 0."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from torchtitan_ft.testing.processes import descendants

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "failure_demo.py"


def _demo() -> ModuleType:
    """The script as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("failure_demo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_schedule_spreads_the_faults() -> None:
    demo = _demo()
    assert demo.schedule(["sigkill"]) == [("sigkill", 1 / 3)]
    fractions = [f for _, f in demo.schedule(demo.DEFAULT_FAULTS)]
    assert fractions == [1 / 6, 2 / 6, 3 / 6, 4 / 6]


def test_check_run_names_every_problem() -> None:
    demo = _demo()
    assert demo.check_run(scheduled=2, injected=2, unanswered=[], silent=[]) == []
    problems = demo.check_run(
        scheduled=4, injected=0, unanswered=["SIGKILL group 1"], silent=["group 0 process #1"]
    )
    assert problems == [
        "injected 0 of the 4 scheduled faults",
        "no commit after SIGKILL group 1",
        "group 0 process #1 never committed a step",
    ]


def test_bad_arguments_are_refused() -> None:
    demo = _demo()
    with pytest.raises(SystemExit):
        demo.parse_args(["--groups", "1"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--groups", "2", "--min_replicas", "3"])


def _run(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The demo with ``args``, writing to ``out``. Past ``timeout`` it is SIGKILLed with every
    process under it (torchrun's workers run in sessions of their own: they would outlive it
    and load the next test), and the test fails with its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"the demo ran past {timeout:.0f} s; its output:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _check(result: subprocess.CompletedProcess[str], out: Path, faults: list[str]) -> None:
    """The run exited 0, and its ``summary.json`` says it injected ``faults`` (their kinds, in
    order), the job committed after each, and every killed group's restart healed."""
    report = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == [], summary
    assert [f["kind"] for f in summary["faults"]] == faults, summary
    assert all(f["survived"] for f in summary["faults"]), summary
    kills = [f for f in summary["faults"] if f["kind"] == "SIGKILL"]
    assert all(f["healed_to_step"] is not None for f in kills), summary
    assert summary["steps_committed"] >= summary["steps"], summary
    assert (out / "failure_demo.png").stat().st_size > 0


@pytest.mark.slow  # the default tier: tests/titan030/test_failure_demo.py, test_chaos.py
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_mlp_demo_survives_a_kill(tmp_path: Path) -> None:
    args = ["--model", "mlp", "--steps", "120", "--faults", "sigkill", "--groups", "2"]
    result = _run(tmp_path, *args, timeout=150)
    _check(result, tmp_path, ["SIGKILL"])


@pytest.mark.slow  # the 0.2.2 twin of tests/titan030/test_failure_demo.py (the default release)
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_titan_demo_survives_a_kill(tmp_path: Path) -> None:
    """TorchTitan mode, the suite's short schedule: 2 groups, one SIGKILL and restart. With
    min_replicas 2 the survivor waits for the restarted group, which heals from it, however
    slowly the machine starts it. Once it injected nothing (its progress came from a log line
    that had been reworded)."""
    args = ["--groups", "2", "--min_replicas", "2", "--faults", "sigkill", "--steps", "30"]
    result = _run(tmp_path, *args, timeout=390)
    _check(result, tmp_path, ["SIGKILL"])
