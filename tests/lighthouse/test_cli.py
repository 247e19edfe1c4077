"""``torchft_lighthouse``: the installed console script, its flags and its errors."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from tests.lighthouse._helpers import ask_all, free_port, free_port_pair, get, wait_serving
from torchtitan_ft.lighthouse import LighthouseClient
from torchtitan_ft.lighthouse.cli import AUTH_TOKEN_ENV, main, resolve_auth_token
from torchtitan_ft.lighthouse.summary import status_url
from torchtitan_ft.testing.processes import LighthouseProcess


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--min_replicas", "0"], "--min_replicas must be >= 1, got 0"),
        (["--min_replicas", "1", "--join_timeout_ms", "-1"], "--join_timeout_ms must be >= 0"),
        (["--min_replicas", "1", "--heartbeat_timeout_ms", "-3"], "--heartbeat_timeout_ms"),
        (["--min_replicas", "1", "--quorum_tick_ms", "0"], "--quorum_tick_ms must be > 0"),
        (["--min_replicas", "1", "--bind", "nowhere"], "--bind: bind address 'nowhere'"),
        (["--min_replicas", "1", "--bind", "127.0.0.1:70000"], "port 70000"),
        (["--min_replicas", "1", "--status_bind", "x:y"], "--status_bind"),
        (["--min_replicas", "two"], "--min_replicas: invalid int value: 'two'"),
        ([], "the following arguments are required: --min_replicas"),
        (["--min_replicas", "1", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (
            ["--min_replicas", "1", "--bind", "127.0.0.1:65535"],
            "--bind port 65535 leaves no port for the status page",
        ),
        (
            ["--min_replicas", "1", "--bind", "bad..host:4000", "--status_bind", "off"],
            "cannot bind the lighthouse to bad..host:4000: host 'bad..host' is not a valid host",
        ),
        (
            # TEST-NET-1 (RFC 5737): never an address of this machine; binding sends nothing.
            ["--min_replicas", "1", "--bind", "192.0.2.1:4000", "--status_bind", "off"],
            "'192.0.2.1' is not an address of this machine",
        ),
        (
            ["--min_replicas", "1", "--bind", "127.0.0.1:0", "--status_bind", "192.0.2.1:4000"],
            "cannot serve the status page on 192.0.2.1:4000: '192.0.2.1' is not an address",
        ),
        (["--min_replicas", "1", "--auth_token", ""], "--auth_token is empty"),
        # gRPC logged a line of its own before this error (issue 20, N14).
        (["--min_replicas", "1", "--bind", ":0"], "--bind ':0' has no host"),
        # No client can present these: a non-Latin-1 token compared equal to '?'s (N4), and a
        # trailing newline was kept by the server and dropped by every client (N5).
        (
            ["--min_replicas", "1", "--auth_token", "ключ-секрет"],
            "--auth_token may hold only visible ASCII characters",
        ),
        (["--min_replicas", "1", "--auth_token", "abc\n"], "it has '\\n'"),
        (["--straggler_policy", "drop"], "--straggler_policy: invalid StragglerPolicy value"),
        (
            ["--min_replicas", "1", "--straggler_max_exclusions", "0"],
            "--straggler_max_exclusions must be >= 1, got 0",
        ),
        (
            ["--min_replicas", "1", "--straggler_min_excluded_ms", "-1"],
            "--straggler_min_excluded_ms must be >= 0",
        ),
        (
            ["--min_replicas", "1", "--exit_when_idle_ms", "-1"],
            "--exit_when_idle_ms must be >= 0 (0: never), got -1",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(args, flag) -> None:
    result = run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("torchft_lighthouse: error: ")
    assert flag in lines[0]


@pytest.mark.multiprocess
def test_port_in_use_is_one_line_exit_2() -> None:
    port = free_port()
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtitan_ft.lighthouse.cli",
            "--min_replicas",
            "1",
            "--bind",
            f"127.0.0.1:{port}",
            "--status_bind",
            "off",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_serving(first)
        result = run("--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--status_bind", "off")
    finally:
        first.kill()
        first.wait()
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"cannot bind the lighthouse to 127.0.0.1:{port}: port {port} is in use" in line
    assert "pick another --bind" in line


@pytest.mark.multiprocess
def test_sigterm_as_soon_as_it_serves_exits_cleanly() -> None:
    """A SIGTERM between the serving line and the end of start-up used to leave the process
    waiting forever for its own server thread."""
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "1",
             "--bind", "127.0.0.1:0", "--status_bind", "127.0.0.1:0"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_serving(proc)
            proc.terminate()
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait()


@pytest.mark.multiprocess
def test_console_script_serves_and_stops_on_sigterm() -> None:
    exe = shutil.which("torchft_lighthouse")
    assert exe, "the console script is not installed (scripts/install.sh)"
    port, status_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--min_replicas",
            "1",
            "--bind",
            f"127.0.0.1:{port}",
            "--status_bind",
            f"127.0.0.1:{status_port}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_serving(proc)
        from tests.lighthouse._helpers import get

        code, page = get(f"http://127.0.0.1:{status_port}/")
        assert code == 200 and "torchft lighthouse" in page
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.multiprocess
def test_status_page_defaults_to_the_next_port_on_the_bind_host() -> None:
    port = free_port_pair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "1",
         "--bind", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_serving(proc)
        assert get(f"http://127.0.0.1:{port + 1}/status.json")[0] == 200
    finally:
        proc.kill()
        proc.wait()


def test_help_lists_torchft_flags_and_defaults() -> None:
    result = run("--help")
    assert result.returncode == 0
    for text in [
        "--bind",
        "[::]:29510",
        "--join_timeout_ms",
        "60000",
        "--quorum_tick_ms",
        "--heartbeat_timeout_ms",
        "5000",
        "--auth_token",
        "--status_bind",
    ]:
        assert text in result.stdout


def test_version_prints_the_package_version() -> None:
    result = run("--version")
    assert result.returncode == 0, result.stderr
    expected = importlib.metadata.version("torchtitan_ft")
    assert result.stdout.strip().startswith(f"torchft_lighthouse {expected} ")


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("a", {AUTH_TOKEN_ENV: "b"}, ("a", "--auth_token")),  # the flag wins
        (None, {AUTH_TOKEN_ENV: "b"}, ("b", "$TORCHFT_AUTH_TOKEN")),
        (None, {AUTH_TOKEN_ENV: ""}, (None, "none")),  # empty env var = unset
        (None, {}, (None, "none")),
    ],
)
def test_auth_token_precedence(flag, env, expected) -> None:
    assert resolve_auth_token(flag, env) == expected


def test_token_from_env_that_no_client_can_present_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"^\$TORCHFT_AUTH_TOKEN may hold only visible ASCII"):
        resolve_auth_token(None, {AUTH_TOKEN_ENV: "s3cret\n"})


@pytest.mark.multiprocess
def test_token_from_env_is_required_and_logged_once_without_the_secret() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "1",
         "--bind", f"127.0.0.1:{port}", "--status_bind", "off"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, AUTH_TOKEN_ENV: "env-s3cret"},
    )  # fmt: skip
    startup = []
    try:
        for line in proc.stderr:
            startup.append(line)
            if "lighthouse serving on" in line:
                break
        addr = f"http://127.0.0.1:{port}"
        with pytest.raises(PermissionError, match="QuorumStream refused"):
            LighthouseClient(addr).quorum("stranger", timedelta(seconds=10))
        quorum = LighthouseClient(addr, auth_token="env-s3cret").quorum("r", timedelta(seconds=10))
        assert [m.replica_id for m in quorum.participants] == ["r"]
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=10)
    stderr = "".join(startup) + rest
    assert stderr.count("job token from $TORCHFT_AUTH_TOKEN") == 1, stderr
    assert "env-s3cret" not in stderr


def test_status_command_prints_the_summary(servers, capsys) -> None:
    server = servers(min_replicas=2, status_bind="127.0.0.1:0")
    ask_all(server.address(), ["r-0", "r-1"])
    status = server.status_address()
    main(["status", "--lighthouse", server.address(), "--status", status, "--token", "t0ken"])
    out = capsys.readouterr().out
    assert "job: 0 batches committed" in out and "(2 groups)" in out
    rows = [line.split()[:3] for line in out.splitlines() if line.startswith("r-")]
    assert rows == [["r-0", "-", "yes"], ["r-1", "-", "yes"]]  # no launcher job said
    events = [line.split()[2:4] for line in out.splitlines() if line.startswith("  #")]
    assert events[-2:] == [["joined", "r-0"], ["joined", "r-1"]]


@pytest.mark.parametrize(
    ("lighthouse", "status", "expected"),
    [
        ("http://10.0.0.5:29510", None, "http://10.0.0.5:29511"),
        ("[::1]:7000", None, "http://[::1]:7001"),
        ("http://h:1", "other:80", "http://other:80"),
    ],
)
def test_status_url(lighthouse, status, expected) -> None:
    assert status_url(lighthouse, status) == expected


def test_status_command_names_an_unreachable_server(capsys) -> None:
    port = free_port()
    with pytest.raises(SystemExit) as e:
        main(["status", "--lighthouse", "127.0.0.1:1", "--status", f"127.0.0.1:{port}"])
    assert "cannot reach the lighthouse's status server at http://127.0.0.1:" in str(e.value.code)


@pytest.mark.multiprocess
def test_exit_when_idle_ends_the_lighthouse_once_the_job_is_over() -> None:
    """Never served: it waits on; served once, then no group for --exit_when_idle_ms: exit 0."""
    lighthouse = LighthouseProcess(1, heartbeat_timeout_ms=300)
    lighthouse.args.append("--exit_when_idle_ms=600")
    lighthouse.start()
    try:
        time.sleep(1.5)  # more than the idle time, before any quorum
        assert lighthouse.proc.poll() is None
        quorum = LighthouseClient(lighthouse.address).quorum("r", timedelta(seconds=10))
        assert [m.replica_id for m in quorum.participants] == ["r"]
        assert lighthouse.proc.wait(timeout=20) == 0
    finally:
        lighthouse.stop()
