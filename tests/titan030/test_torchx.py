"""TorchX, as a user starts it: one ``torchx run -s local_cwd torchtitan_ft/torchx.py:titan``
starts a lighthouse and two replica groups of TorchTitan 0.3.0 (the job of ``./run_local.sh``);
group 1's trainer is SIGKILLed mid-run, its torchrun restarts it inside the group (the other
group and the lighthouse never restart), it heals from group 0, both groups end with
bitwise-identical state, and the application ends by itself once training is over (the
lighthouse role's ``--exit_when_idle_ms``). The groups share one dump folder: each keeps its
TensorBoard scalars (the job's loss once per commit through the kill and the heal) and its
profiler traces in its own ``replica_<id>`` folder, and no trainer writes colour codes to its
log file. This is the default tier's kill and heal on 0.3.0; ``tests/titan030/test_ft_e2e.py``
runs the same checks on the job restarted by hand (``--full``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.titan.test_ft_e2e import (
    MAX_ALONE,
    STEPS,
    assert_groups_identical,
    assert_loss_logged_per_commit,
)
from tests.titan030.test_ft_e2e import (
    FT,
    NO_ACTIVATION_CHECKPOINTING,
    OBSERVED,
    SMALL_CPU,
    assert_traces_per_replica,
)
from torchtitan_ft.events import Event, EventKind, HealOutcome, read_events
from torchtitan_ft.testing.processes import descendants, free_port
from torchtitan_ft.testing.titan_dump import ready_path
from torchtitan_ft.testing.titan_jobs import remaining

ROOT = Path(__file__).resolve().parents[2]
KILL_AFTER_COMMITS = 6
TIMEOUT_S = 420


def _group(events: list[Event], replica: int) -> list[Event]:
    return [e for e in events if e.replica_name == f"torchtitan_ft_{replica}"]


def _wait_for(what: str, check, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + remaining(TIMEOUT_S) - 30
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(
                f"{what}: not seen (torchx exited {proc.poll()}); its log's end:\n"
                + "\n".join(log.read_text(errors="replace").splitlines()[-80:])
            )
        time.sleep(0.2)


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT_S)
def test_torchx_job_restarts_a_killed_rank_inside_its_group(tmp_path: Path) -> None:
    events_dir = tmp_path / "events"
    env_arg = ",".join(
        f"{k}={v}"
        for k, v in {
            "TRAIN_FILE": "torchtitan_ft.testing.titan_dump",
            "FT_E2E_OUT": tmp_path,
            "FT_E2E_ALONE_SLEEP_S": "0.7",
            "FT_E2E_MAX_ALONE": MAX_ALONE,
            "TORCHFT_EVENTS_DIR": events_dir,
        }.items()
    )
    ft_flags = [f for f in FT if not f.startswith("--fault_tolerance.group_size")]
    command = [
        sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd",
        "-cfg", f"log_dir={tmp_path / 'torchx'}",
        "torchtitan_ft/torchx.py:titan",
        "--replicas", "2",
        "--lighthouse_port", str(free_port()),
        "--lighthouse_idle_exit_ms", "3000",
        "--env", env_arg,
        "--",
        "--module", "llama3", "--config", "llama3_debugmodel",
        *SMALL_CPU, *ft_flags,
        f"--training.steps={STEPS}", f"--dump_folder={tmp_path / 'dump'}", *OBSERVED,
        NO_ACTIVATION_CHECKPOINTING,  # a tyro subcommand: the flags after it would be its own
    ]  # fmt: skip
    log = tmp_path / "torchx.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:

        def group1_committed() -> bool:
            commits = [e for e in _group(read_events(events_dir), 1) if e.kind is EventKind.COMMIT]
            return len(commits) >= KILL_AFTER_COMMITS

        _wait_for("group 1's commits before the kill", group1_committed, proc, log)
        (started,) = [e for e in _group(read_events(events_dir), 1) if e.kind is EventKind.START]
        os.kill(started["pid"], signal.SIGKILL)
        # The survivor waits for the restarted group's ready file after MAX_ALONE steps alone
        # (titan_dump), so that the two train together again after the heal.
        ready_path(tmp_path, 1, 0).unlink(missing_ok=True)

        def group1_restarted() -> bool:
            starts = [e for e in _group(read_events(events_dir), 1) if e.kind is EventKind.START]
            return len(starts) == 2

        _wait_for("group 1's restart by its torchrun", group1_restarted, proc, log)
        try:
            rc = proc.wait(timeout=max(1.0, remaining(TIMEOUT_S) - 15))
        except subprocess.TimeoutExpired:
            pytest.fail("torchx did not end; its log's end:\n" + log.read_text()[-6000:])
        assert rc == 0, log.read_text(errors="replace")[-6000:]
    finally:
        # torchx starts each role in a session of its own: a signal to torchx's process group
        # would leave the lighthouse and the groups running.
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()

    events = read_events(events_dir)
    # Group 0 started once, group 1 twice (the kill), its second process healed.
    assert len([e for e in _group(events, 0) if e.kind is EventKind.START]) == 1
    restarted = [e for e in _group(events, 1) if e.kind is EventKind.START][1]
    heals = [
        e
        for e in _group(events, 1)
        if e.kind is EventKind.HEAL_END and e.replica_id == restarted.replica_id
    ]
    assert [h["outcome"] for h in heals][:1] == [HealOutcome.APPLIED.value], heals
    assert_groups_identical(tmp_path, ranks=1)

    def commits(replica: int, run: str | None = None) -> list[int]:
        return [
            e.step
            for e in _group(events, replica)
            if e.kind is EventKind.COMMIT and run in (None, e.replica_id)
        ]

    killed = next(e for e in _group(events, 1) if e.kind is EventKind.START)
    dump = tmp_path / "dump"
    assert_loss_logged_per_commit(
        (dump, dump),
        commits(0),
        set(commits(1, killed.replica_id)),
        set(commits(1, restarted.replica_id)),
    )
    assert_traces_per_replica({0: dump, 1: dump}, ranks=1)
    logs = list((tmp_path / "torchx").rglob("std*.log"))
    assert logs, "torchx wrote no role logs"
    for path in logs:
        assert b"\x1b[" not in path.read_bytes(), path  # no colour codes: not a terminal
