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


def _run_train(
    tmp_path: Path, *args: str, timeout_s: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
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
        timeout=timeout_s,
    )


@pytest.mark.light
@pytest.mark.multiprocess
def test_unreachable_lighthouse_stops_the_group_with_one_line(tmp_path: Path) -> None:
    """A wrong TORCHFT_LIGHTHOUSE (nothing listens there): after quorum_timeout_ms every rank
    stops with the lighthouse's address and what to check, and no traceback. The same error
    from a trainer starved of CPU across the deadline, on purpose:
    tests/manager/test_server_threads.py (the in-process client, its loop or its whole
    process stopped)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _run_train(
        tmp_path,
        "--fault_tolerance.replica_id=0",
        "--fault_tolerance.group_size=1",
        "--fault_tolerance.connect_timeout_ms=2000",
        "--fault_tolerance.quorum_timeout_ms=3000",
        "--fault_tolerance.process_group_timeout_ms=3000",  # <= quorum_timeout_ms
        TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("[rank0]:torchtitan_ft: ")]
    assert len(errors) == 1, output[-3000:]
    assert f"no quorum from the lighthouse at http://127.0.0.1:{port}" in errors[0]
    assert "is it running" in errors[0]
    assert "Traceback" not in output and "ChildFailedError" not in output


@pytest.mark.light
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
        timeout=400,  # torchrun and the imports: past 120 s at load 20 on a 2-core machine
    )  # fmt: skip
    assert result.returncode == 2
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if line.startswith("[rank0]")] == [
        "[rank0]:torchtitan_ft: config error: fault_tolerance.replica_id=2 must be < "
        "fault_tolerance.group_size=2"
    ]
    assert not [line for line in lines if "Traceback" in line or "failed (exitcode" in line]


# The default tier: the same line from the entry point in one process
# (test_bad_torchft_env_var_stops_the_entry_point_before_any_process_group[...abc...]) and
# the chain leaving only the worker's line
# (test_config_error_through_run_train_sh_is_the_workers_only_line).
@pytest.mark.slow
def test_bad_torchft_env_var_through_run_train_sh_is_one_line(tmp_path: Path) -> None:
    """TORCHFT_MANAGER_PORT=abc gave about 100 lines and 3 tracebacks (issue 20, N8)."""
    env = {
        **os.environ,
        "NGPU": "1",
        "PYTHON": sys.executable,
        "CONFIG_FILE": str(ROOT / "configs" / "debug_ft_cpu.toml"),
        "TORCHFT_MANAGER_PORT": "abc",
    }
    result = subprocess.run(
        [str(ROOT / "run_train.sh"), "--fault_tolerance.replica_id=0",
         f"--job.dump_folder={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if line.startswith("[rank0]")] == [
        "[rank0]:torchtitan_ft: config error: env var TORCHFT_MANAGER_PORT must be an integer, "
        "got 'abc'"
    ]
    assert not [line for line in lines if "Traceback" in line]


# The default tier: the same line from the entry point in one process
# (test_timeouts_out_of_order_stop_the_entry_point_before_any_process_group) and the chain
# leaving only the worker's line
# (test_config_error_through_run_train_sh_is_the_workers_only_line).
@pytest.mark.slow
@pytest.mark.light
@pytest.mark.multiprocess
def test_timeouts_out_of_order_through_run_train_sh_stop_before_training(tmp_path: Path) -> None:
    """A quorum timeout below the process-group timeout started, and failed at the first
    quorum as "no quorum from the lighthouse" (issue 37): now every rank stops at start with
    one line, before any process group (no lighthouse runs: none is reached)."""
    result = _run_train(
        tmp_path,
        "--fault_tolerance.replica_id=0",
        "--fault_tolerance.process_group_timeout_ms=30000",
        "--fault_tolerance.quorum_timeout_ms=5000",
        "--fault_tolerance.connect_timeout_ms=5000",
        timeout_s=400,  # torchrun and the imports: 160 s measured on a loaded 2-core machine
        NGPU="1",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = (result.stdout + result.stderr).splitlines()
    (line,) = [line for line in lines if line.startswith("[rank0]")]
    assert line.startswith("[rank0]:torchtitan_ft: config error: timeouts out of order: "), line
    for value in ("quorum_timeout_ms=5000", "process_group_timeout_ms=30000", "at least 30000"):
        assert value in line, line
    assert not [line for line in lines if "Traceback" in line or "step:" in line]


def test_timeouts_out_of_order_stop_the_entry_point_before_any_process_group(capsys) -> None:
    """A quorum timeout below the process-group timeout: one line naming both values and the
    value to raise, exit status 2, before any process group (issue 37)."""
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    with pytest.raises(SystemExit) as stop:
        main(["--fault_tolerance.enable", "--fault_tolerance.group_size=1",
              "--fault_tolerance.lighthouse_addr=http://127.0.0.1:29510",
              "--fault_tolerance.hostname=127.0.0.1",
              "--fault_tolerance.process_group_timeout_ms=30000",
              "--fault_tolerance.quorum_timeout_ms=5000",
              "--fault_tolerance.connect_timeout_ms=5000"])  # fmt: skip
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("torchtitan_ft: config error: timeouts out of order: "), line
    for value in ("quorum_timeout_ms=5000", "process_group_timeout_ms=30000", "at least 30000"):
        assert value in line, line
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("TORCHFT_MANAGER_PORT", "abc", "TORCHFT_MANAGER_PORT must be an integer, got 'abc'"),
        ("TORCHFT_MANAGER_PORT", "70000", "TORCHFT_MANAGER_PORT must be a port in [0, 65536)"),
        ("TORCHFT_TIMEOUT_SEC", "nan", "TORCHFT_TIMEOUT_SEC must be a number of seconds"),
        ("TORCHFT_QUORUM_RETRIES", "-1", "TORCHFT_QUORUM_RETRIES must be >= 0"),
        ("TORCHFT_AUTH_TOKEN", "s3cret\n", "$TORCHFT_AUTH_TOKEN may hold only visible ASCII"),
    ],
)
def test_bad_torchft_env_var_stops_the_entry_point_before_any_process_group(
    monkeypatch, capsys, var: str, value: str, message: str
) -> None:
    """Checked even though the plugin passes every timeout as an argument (N9)."""
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as stop:
        main(["--fault_tolerance.enable", "--fault_tolerance.group_size=1",
              "--fault_tolerance.lighthouse_addr=http://127.0.0.1:29510",
              "--fault_tolerance.hostname=127.0.0.1"])  # fmt: skip
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchtitan_ft: config error: env var {message}") or err.startswith(
        f"torchtitan_ft: config error: {message}"
    ), err
    assert not dist.is_initialized()


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_bad_ngpu_is_one_line_before_torchrun(value: str) -> None:
    """NGPU=abc or 0 ended in a torchrun traceback (N10)."""
    result = subprocess.run(
        [str(ROOT / "run_train.sh")], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHON": sys.executable, "NGPU": value},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"run_train.sh: NGPU={value} is not a count; set NGPU to a whole number >= 1"
    ]


def test_trainer_outside_torchrun_is_one_line() -> None:
    """``python -m torchtitan_ft.train`` alone raised KeyError: 'LOCAL_RANK' (N11). Run under
    the old entry name, in a process of its own; the new name's ``python -m`` runs in
    ``test_config.py::test_bad_cli_value_exits_with_one_line``, and its check in-process in
    :func:`test_trainer_outside_torchrun_stops_the_entry_point_before_any_process_group`."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.train", "--training.steps=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,  # importing TorchTitan
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "torchtitan_ft: the trainer runs under torchrun, which sets LOCAL_RANK"
    )


def test_trainer_outside_torchrun_stops_the_entry_point_before_any_process_group(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stop:
        main(["--training.steps=1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(
        "torchtitan_ft: the trainer runs under torchrun, which sets LOCAL_RANK"
    ), err
    assert "Traceback" not in err
    assert not dist.is_initialized()
