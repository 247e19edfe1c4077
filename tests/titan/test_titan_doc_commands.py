"""Every command of TorchTitan's FT doc has a working equivalent here: the table in
docs/titan.md ("TorchTitan's FT doc, command by command") is read and each of its commands run.

The lighthouse row runs as written plus a free port on 127.0.0.1; the training rows run in
their pairs (group 0 and group 1 of an example) against it, as written plus
``--training.steps 2``; the ``--help`` row as written. Also here: ``MODEL``/``CONFIG`` naming
and its errors, through ``run_train.sh``.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.titan._jobs import ROOT, TrainRun, finish_all, remaining
from torchtitan_ft.titan.named_configs import TITAN_CONFIGS, UnknownConfigName, resolve, resolve_env

DOC = ROOT / "docs" / "titan.md"
MARKER = "<!-- doc-commands:"


def doc_rows() -> dict[str, tuple[str, str]]:
    """``{row name: (TorchTitan's command, ours)}`` from the table after ``MARKER``."""
    lines = DOC.read_text().split(MARKER, 1)[1].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("#", "---"):
            continue
        commands = [re.fullmatch(r"`(.*)`", c) for c in cells[1:]]
        assert all(commands), f"a cell of row {cells[0]!r} is not one command in backticks"
        rows[cells[0]] = (commands[0].group(1), commands[1].group(1))
    return rows


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """Leading ``VAR=value`` assignments and the command's words."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def test_the_table_covers_the_docs_examples() -> None:
    rows = doc_rows()
    assert {"lighthouse", "options"} <= rows.keys()
    assert sum(name.startswith("example 1") for name in rows) == 2
    assert sum(name.startswith("example 2") for name in rows) == 2
    for theirs, ours in rows.values():
        assert split_command(theirs)[1][0] == split_command(ours)[1][0]  # same program


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_lighthouse(command: str) -> tuple[subprocess.Popen, str]:
    env, words = split_command(command)
    port = _free_port()
    proc = subprocess.Popen(
        [*words, "--bind", f"127.0.0.1:{port}", "--status_bind", "127.0.0.1:0"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + remaining(60)
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            raise AssertionError(f"the lighthouse exited: {proc.communicate()[0]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the lighthouse did not listen within 60 s")


def _run_pair(tmp_path: Path, rows: list[str], lighthouse: str) -> list[str]:
    runs = []
    for name in rows:
        env, words = split_command(doc_rows()[name][1])
        assert words[0] == "./run_train.sh", name
        runs.append(
            TrainRun(
                name,
                2,
                tmp_path / name.replace(" ", "_"),
                *words[1:],
                ngpu=int(env.pop("NGPU", "1")),
                env={**env, "TORCHFT_LIGHTHOUSE": lighthouse},
            )
        )
    return finish_all(runs)


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_each_doc_command_runs(tmp_path: Path) -> None:
    rows = doc_rows()
    lighthouse, address = _start_lighthouse(rows["lighthouse"][1])
    try:
        per_step = _run_pair(tmp_path, [n for n in rows if n.startswith("example 1")], address)
        semi_sync = _run_pair(tmp_path, [n for n in rows if n.startswith("example 2")], address)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    for output in per_step:
        assert "should_commit=True" in output
        assert "cross-replica gradient all-reduce hooked" in output
    for output in semi_sync:
        assert "-> configs/debug_ft_cpu.toml" in output  # named config, printed
        assert "implies a synchronous quorum" in output
        assert "should_commit=True" in output

    env, words = split_command(rows["options"][1])
    help_run = subprocess.run(
        words,
        cwd=ROOT,
        env={**os.environ, **env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=remaining(120),
    )
    assert help_run.returncode == 0, help_run.stderr[-2000:]
    for flag in ("semi-sync-method", "module-fqns-per-model-fragment", "quorum-mode"):
        assert f"--fault-tolerance.{flag}" in help_run.stdout


# --- naming a config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "config", "file"),
    [
        ("llama3", "llama3_8B", "llama3_8b_ft.toml"),
        ("llama3", "llama3_debugmodel", "debug_cpu.toml"),
        ("llama3_ft", "llama3_ft_debugmodel", "debug_ft_cpu.toml"),
        ("torchft.llama3", "llama3_torchft_debugmodel", "debug_ft_cpu.toml"),
        ("llama3", "debug_ft_diloco_cpu", "debug_ft_diloco_cpu.toml"),
        (None, "DEBUG_FT_CPU", "debug_ft_cpu.toml"),
        ("ft.llama3", None, "debug_ft_cpu.toml"),
    ],
)
def test_a_config_name_selects_a_file(model: str | None, config: str | None, file: str) -> None:
    path, line = resolve(model, config)
    assert path == ROOT / "configs" / file and path.exists()
    assert line.endswith(f"-> configs/{file}")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MODULE": "torchft.llama3"}, "MODULE=torchft.llama3 ->"),
        ({"MODEL": "llama3", "CONFIG": "llama3_debugmodel"}, "MODEL=llama3 CONFIG="),
        ({"MODEL": "ft.llama3", "MODULE": "FT.llama3"}, "MODEL=ft.llama3 ->"),
    ],
)
def test_the_line_names_the_variable_the_user_set(env: dict[str, str], named: str) -> None:
    assert named in resolve_env(env)[1]


def test_every_titan_name_has_a_config() -> None:
    for file in TITAN_CONFIGS.values():
        assert (ROOT / "configs" / file).exists(), file


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODEL": "llama4", "CONFIG": "llama3_8b"}, r"MODEL/MODULE='llama4'.*known: llama3, "),
        ({"MODEL": "llama3", "CONFIG": "llama3_70b"}, r"'llama3_70b'.*llama3_8b.*debug_ft_cpu"),
        ({"MODEL": "llama3", "MODULE": "ft.llama3"}, "disagree"),
    ],
)
def test_unknown_names_list_the_known_ones(env: dict[str, str], message: str) -> None:
    with pytest.raises(UnknownConfigName, match=message):
        resolve_env(env)


def _run_train_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=remaining(120),
    )


def test_unknown_name_stops_run_train_sh_with_one_line() -> None:
    result = _run_train_sh({"MODEL": "llama3", "CONFIG": "llama3_405b"})
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("torchtitan_ft: config error: CONFIG='llama3_405b' is not a known")


@pytest.mark.multiprocess
def test_config_file_wins_over_a_name_and_says_so(tmp_path: Path) -> None:
    env = {"CONFIG_FILE": "configs/debug_cpu.toml", "CONFIG": "llama3_8b"}
    result = _run_train_sh(env, "--training.steps=1", f"--job.dump_folder={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CONFIG_FILE=configs/debug_cpu.toml is set, so MODEL/MODULE/CONFIG are not used" in (
        result.stderr
    )
    assert "step:  1" in result.stdout + result.stderr  # debug_cpu.toml trained, not 8B
