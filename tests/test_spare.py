"""The warm spare (``torchtitan_ft.spare``): the command parser and lock as units, and a real
takeover: an active replica group SIGKILLed, its spare taking over, healing from the survivor
and training on bitwise-identical to it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.spare import Command, CommandKind, open_lock, parse_command, try_lock
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank, write_stop_step

ROOT = Path(__file__).resolve().parent.parent
SPARE = [sys.executable, "-m", "torchtitan_ft.spare"]


def test_parse_command_script_and_module() -> None:
    assert parse_command(["train.py", "--steps", "3"]) == Command(
        CommandKind.SCRIPT, "train.py", ("--steps", "3")
    )
    assert parse_command(["-m", "pkg.train", "-x"]) == Command(
        CommandKind.MODULE, "pkg.train", ("-x",)
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no training command"),
        (["-m"], "'-m' must be followed by a module name, got nothing"),
        (["-m", "--steps"], "got '--steps'"),
        (["-c", "print(1)"], "unsupported interpreter option '-c'"),
    ],
)
def test_parse_command_rejects_what_cannot_run_in_the_spare(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_command(argv)


def test_lock_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        open_lock(str(tmp_path / "missing" / "group.lock"))


def test_lock_is_free_until_another_process_holds_it(tmp_path: Path) -> None:
    path = str(tmp_path / "group.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert not try_lock(open_lock(path))
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the SIGKILLed holder's lock.
    assert try_lock(open_lock(path))


_HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "ab")
fcntl.lockf(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_cli_names_the_bad_lock_path_and_loses_nothing(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    bad = tmp_path / "missing" / "x.lock"
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.spare", "--lock", str(bad), "--", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"--lock '{bad}'" in result.stderr and "does not exist" in result.stderr
    assert "must not run" not in result.stderr


@pytest.mark.parametrize(
    ("make", "flags", "message"),
    [
        # A FIFO: opening it for writing waited for a reader forever (issue 20, N12).
        (lambda d: os.mkfifo(d / "fifo"), ["--lock", "{d}/fifo"], "is not a regular file"),
        (lambda d: (d / "dir").mkdir(), ["--lock", "{d}/dir"], "--lock '{d}/dir'"),
        # Checked at start, not after the lock is taken (N13).
        (None, ["--lock", "{d}/l", "--preload", "no_such_mod"], "--preload 'no_such_mod'"),
        (None, ["--lock", "{d}/l", "--preload", "no_such.sub"], "--preload 'no_such.sub'"),
        (None, ["--lock", "{d}/l", "--ready-file", "{d}/no/r"], "--ready-file '{d}/no/r'"),
        (lambda d: (d / "r").mkdir(), ["--lock", "{d}/l", "--ready-file", "{d}/r"],
         "is not a regular file"),
    ],
    ids=["fifo-lock", "dir-lock", "preload", "preload-parent", "ready-dir-missing", "ready-is-dir"],
)  # fmt: skip
def test_cli_refuses_bad_options_at_start_without_running_anything(
    tmp_path: Path, make, flags: list[str], message: str
) -> None:
    if make is not None:
        make(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    args = [f.format(d=tmp_path) for f in flags]
    result = subprocess.run(
        [*SPARE, *args, "--", str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert message.format(d=tmp_path) in result.stderr.splitlines()[-1], result.stderr
    assert "must not run" not in result.stderr and "Traceback" not in result.stderr


def test_first_process_runs_at_once_with_the_script_as_main(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(7)\n")
    result = subprocess.run(
        [*SPARE, "--lock", str(tmp_path / "l"), "--", str(script), "a", "--b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 7, result.stderr
    assert result.stdout == "__main__ ['a', '--b']\n"
    assert "active at once" in result.stderr


def test_warm_up_leaves_the_random_state_and_settings_alone() -> None:
    from torchtitan_ft.spare import warm_up

    rng, threads, grad = torch.get_rng_state(), torch.get_num_threads(), torch.is_grad_enabled()
    warm_up()
    assert torch.equal(torch.get_rng_state(), rng)
    assert (torch.get_num_threads(), torch.is_grad_enabled()) == (threads, grad)


# ------------------------------------------------------------------ a real takeover


@pytest.fixture
def children() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for child in started:  # only our own children, by pid
        if isinstance(child, subprocess.Popen):
            if child.poll() is None:
                child.kill()
                child.wait(10)
        elif child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join(5)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for(condition: Any, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = {str(p): _records(p)[-3:] for p in logs}
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}: {tails}")
        time.sleep(0.1)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)  # the waits below add up to 400 s at most
def test_spare_takes_over_a_sigkilled_group_heals_and_trains_identically(
    tmp_path: Path, children: list[Any]
) -> None:
    """Replica group 1 runs under ``torchtitan_ft.spare`` (it takes the lock at once), a second
    ``torchtitan_ft.spare`` for group 1 warms up and waits; group 1 is SIGKILLed; the spare
    takes over, heals from group 0 and the two train on with bitwise-identical state."""
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=3000,
    )
    logs = {name: tmp_path / f"{name}.jsonl" for name in ("survivor", "active", "spare")}
    lock, ready, stop = tmp_path / "group1.lock", tmp_path / "group1.ready", tmp_path / "stop"

    def config(replica: int, name: str) -> WorkerConfig:
        return WorkerConfig(
            lighthouse_addr=lighthouse.address(),
            replica=replica,
            out_path=str(tmp_path / f"{name}.pt"),
            commit_log=str(logs[name]),
            stop_participants=2,
            stop_step_file=str(stop),
            step_sleep_s=0.05,
            max_iterations=1_000_000,  # they stop at the stop step; the waits below bound it
        )

    def under_spare(name: str, *options: str) -> subprocess.Popen:
        cfg = json.dumps(dataclasses.asdict(config(1, name)))
        command = [sys.executable, "-m", "torchtitan_ft.spare", "--lock", str(lock), *options]
        proc = subprocess.Popen(
            [*command, "--", "-m", "tests._spare_train", cfg],
            cwd=ROOT,
            stderr=open(tmp_path / f"{name}.err", "w"),  # noqa: SIM115 -- closed at exit
        )
        children.append(proc)
        return proc

    def together(name: str, after: float = 0.0) -> list[dict[str, Any]]:
        return [
            r
            for r in _records(logs[name])
            if r["committed"]
            and r["participants"] == 2
            and r["participating"]
            and r["time"] > after
        ]

    all_logs = list(logs.values())
    try:
        children.append(spawn_rank(config(0, "survivor")))
        active = under_spare("active")
        _wait_for(lambda: len(together("active")) >= 3, 90, "groups 0 and 1 to train", all_logs)
        spare = under_spare("spare", "--ready-file", str(ready))
        _wait_for(ready.exists, 90, "the spare to be warm", all_logs)
        assert spare.poll() is None and not _records(logs["spare"])  # waiting, not training

        os.kill(active.pid, signal.SIGKILL)
        assert active.wait(10) == -signal.SIGKILL
        killed = time.time()
        _wait_for(
            lambda: len(together("spare")) >= 3, 90, "the spare to take over and train", all_logs
        )
        assert not ready.exists()  # removed on takeover
        # A stop step a few steps ahead, the same for both.
        step = max(r["step"] for r in _records(logs["survivor"]))
        write_stop_step(stop, step + 10)
        assert spare.wait(60) == 0
        children[0].join(60)
        assert children[0].exitcode == 0
    finally:
        lighthouse.shutdown()

    spare_records = _records(logs["spare"])
    assert {r["pid"] for r in spare_records} == {spare.pid}
    # It healed first (committed, not participating), then participated.
    assert spare_records[0]["committed"] and not spare_records[0]["participating"]
    survivor_after = {r["step"]: r for r in together("survivor", after=killed)}
    common = [r for r in together("spare") if r["step"] in survivor_after]
    assert len(common) >= 3
    for record in common:  # every step they committed together: bitwise-identical state
        assert record["hash"] == survivor_after[record["step"]]["hash"], record["step"]
    survivor_out = torch.load(tmp_path / "survivor.pt", weights_only=False)
    spare_out = torch.load(tmp_path / "spare.pt", weights_only=False)
    assert spare_out["step"] == survivor_out["step"] >= step + 10
    for name, tensor in survivor_out["model"].items():
        assert torch.equal(tensor, spare_out["model"][name]), name
