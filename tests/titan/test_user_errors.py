"""Mistakes a user makes when starting a job give one line naming the bad value and what to do
(docs/operations.md, "Common mistakes and their errors"), seen the way a user runs things:
``run_train.sh`` (torchrun) and the ``torchft_lighthouse`` command line. Config values are
tested in ``test_config.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_lighthouse_port_in_use_is_exactly_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "1",
             "--bind", f"127.0.0.1:{port}", "--status_bind", "off"],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        f"torchft_lighthouse: error: cannot bind the lighthouse to 127.0.0.1:{port}: port {port} "
        "is in use on 127.0.0.1 (another lighthouse?); pick another --bind (see --help)\n"
    )


def _run_train(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "run_train.sh"), f"--job.dump_folder={tmp_path}", *args],
        cwd=ROOT,
        env={
            **os.environ,
            "NGPU": "2",
            "PYTHON": sys.executable,
            "CONFIG_FILE": str(ROOT / "configs" / "debug_ft_cpu.toml"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.multiprocess
def test_unreachable_lighthouse_stops_the_group_with_one_line(tmp_path: Path) -> None:
    """A wrong TORCHFT_LIGHTHOUSE (nothing listens there): after quorum_timeout_ms every rank
    stops with the lighthouse's address and what to check, and no traceback."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _run_train(
        tmp_path,
        "--fault_tolerance.replica_id=0",
        "--fault_tolerance.group_size=1",
        "--fault_tolerance.connect_timeout_ms=2000",
        "--fault_tolerance.quorum_timeout_ms=3000",
        TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("[rank0]:torchtitan_ft: ")]
    assert len(errors) == 1, output[-3000:]
    assert f"no quorum from the lighthouse at http://127.0.0.1:{port}" in errors[0]
    assert "is it running" in errors[0]
    assert "Traceback" not in output and "ChildFailedError" not in output


@pytest.mark.multiprocess
def test_config_error_through_run_train_sh_is_the_workers_only_line(tmp_path: Path) -> None:
    """The worker's one line is all there is: torchtitan_ft.titan.launch leaves out torchrun's own
    failure report (its ERROR line and ChildFailedError traceback)."""
    env = {
        **os.environ,
        "NGPU": "1",
        "PYTHON": sys.executable,
        "CONFIG_FILE": str(ROOT / "configs" / "debug_ft_cpu.toml"),
    }
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.replica_id=2",
         f"--job.dump_folder={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if line.startswith("[rank0]")] == [
        "[rank0]:torchtitan_ft: config error: fault_tolerance.replica_id=2 must be < "
        "fault_tolerance.group_size=2"
    ]
    assert not [line for line in lines if "Traceback" in line or "failed (exitcode" in line]
