"""fault_tolerance.replacement = "zygote" (torchtitan_ft/titan/zygote.py): a SIGKILLed rank of a
``./run_train.sh`` group is replaced by torchrun from a pre-imported process; the group heals,
commits beside the survivor again and ends bitwise identical to it. The time it takes is
``benchmarks.recovery``'s TorchTitan row (a benchmark, not a timed test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_ft.events import Event, EventKind
from torchtitan_ft.testing.titan_dump import dump_path
from torchtitan_ft.testing.titan_jobs import assert_identical
from torchtitan_ft.testing.titan_replacement import kill_a_rank, timeline
from torchtitan_ft.titan.launch import ZYGOTE_MAX_RESTARTS, replacement, with_zygote


def test_with_zygote_starts_workers_through_the_client_and_allows_restarts() -> None:
    argv = ["--nproc_per_node=2", "--max-restarts=0", "-m", "torchtitan_ft.titan.train", "--x"]
    rewritten, note = with_zygote(argv, "/tmp/z.sock")
    assert rewritten == [
        "--nproc_per_node=2",
        f"--max-restarts={ZYGOTE_MAX_RESTARTS}",
        "-m",
        "torchtitan_ft.titan.zygote",
        "client",
        "/tmp/z.sock",
        "-m",
        "torchtitan_ft.titan.train",
        "--x",
    ]
    assert note is not None and f"up to {ZYGOTE_MAX_RESTARTS} times" in note
    kept, note = with_zygote(["--max-restarts=3", "-m", "m"], "/s")
    assert kept[0] == "--max-restarts=3" and note is None
    with pytest.raises(ValueError, match="-m MODULE"):
        with_zygote(["--nproc_per_node=2"], "/s")


def test_the_launcher_reads_the_replacement_from_the_command_line_or_the_toml(
    tmp_path: Path,
) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[fault_tolerance]\nenable = true\ngroup_size = 2\nreplacement = 'zygote'\n")
    assert replacement(["--job.config_file", str(config)]) == "zygote"
    flag = ["--fault_tolerance.replacement=cold"]
    assert replacement([f"--job.config_file={config}", *flag]) == "cold"
    plain = tmp_path / "plain.toml"
    plain.write_text("[fault_tolerance]\nenable = true\ngroup_size = 2\n")
    assert replacement(["--job.config_file", str(plain)]) == "cold"  # not parsed: cheap
    assert (
        replacement(["--job.config_file", str(plain), "--fault_tolerance.replacement=zygote"])
        == "zygote"
    )


def _event(time: float, kind: EventKind, rid: str, step: int = 0, **data: object) -> Event:
    return Event(time, kind, rid, 0, step, dict(data))


def test_the_timeline_measures_from_the_kill_to_each_milestone() -> None:
    killed = 100.0
    survivor = [
        _event(99.0, EventKind.COMMIT, "g0:a", 4, participants=2),
        _event(100.1, EventKind.COMMIT, "g0:a", 5, participants=2),  # the killed group's step
        _event(100.3, EventKind.QUORUM, "g0:a", 5, participants=1),
        _event(101.0, EventKind.COMMIT, "g0:a", 6, participants=1),
        _event(101.5, EventKind.QUORUM, "g0:a", 6, participants=2),
        _event(103.0, EventKind.COMMIT, "g0:a", 7, participants=2),
    ]
    group = [
        _event(99.0, EventKind.COMMIT, "g1:old", 4, participants=2),
        _event(100.05, EventKind.COMMIT, "g1:old", 5, participants=2),
        _event(100.9, EventKind.START, "g1:new", process_started=100.4),
        _event(101.5, EventKind.QUORUM, "g1:new", participants=2),
        _event(102.0, EventKind.HEAL_END, "g1:new", 6),
        _event(103.0, EventKind.COMMIT, "g1:new", 7, participants=2),
    ]
    assert timeline(survivor, group, killed, {"g1:old"}, killed_step=5) == {
        "process_started_s": 0.4,
        "manager_built_s": 0.9,
        "first_quorum_s": 1.5,
        "healed_s": 2.0,
        "back_s": 3.0,
        "full_quorum_s": 1.5,
        "replacement_s": 3.0,
        "survivor_median_step_s": 1.1,  # commits 99.0, 100.1, 101.0, 103.0: 1.1, 0.9, 2.0
    }
    never = timeline(survivor[:4], group[:2], killed, {"g1:old"}, killed_step=5)
    assert {k for k, v in never.items() if v is None} == {
        "process_started_s", "manager_built_s", "first_quorum_s", "healed_s", "back_s",
        "full_quorum_s", "replacement_s",
    }  # fmt: skip


WORKER = """
import os, sys, time
print(f"worker {os.getpid()} {os.environ['ZYGOTE_TEST']} {os.getcwd()} {sys.argv[1:]}", flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def zygote(tmp_path: Path):
    """A zygote without the preload (cheap), its socket, and a client factory."""
    (tmp_path / "zygote_test_worker.py").write_text(WORKER)
    socket_path = str(tmp_path / "z.sock")
    server = subprocess.Popen(
        [sys.executable, "-c", "from torchtitan_ft.titan import zygote; "
         f"zygote.run(zygote.serve({socket_path!r}))"]
    )  # fmt: skip
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}

    def client(arg: str) -> subprocess.Popen:
        command = ["-m", "torchtitan_ft.titan.zygote", "client", socket_path]
        command += ["-m", "zygote_test_worker", arg]
        return subprocess.Popen(
            [sys.executable, *command],
            cwd=tmp_path,
            env={**env, "ZYGOTE_TEST": f"env-of-{arg}"},
            stdout=subprocess.PIPE,
            text=True,
        )

    yield client
    server.kill()
    server.wait()


def _worker_pid(client: subprocess.Popen) -> int:
    assert client.stdout is not None
    line = client.stdout.readline()
    assert line.startswith("worker "), line
    return int(line.split()[1])


@pytest.mark.light
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_zygote_forks_a_worker_with_the_clients_env_stdio_and_exit_status(
    zygote, tmp_path: Path
) -> None:
    client = zygote("3")
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 3
    worker, env, cwd, argv = out.split(" ", 4)[1:]
    assert (env, cwd, argv.strip()) == ("env-of-3", str(tmp_path), "['3']")
    assert int(worker) != client.pid


@pytest.mark.light
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", ["worker", "client"])
def test_a_killed_worker_ends_its_client_and_the_clients_signals_reach_it(
    zygote, kill: str
) -> None:
    client = zygote("sleep")
    pid = _worker_pid(client)
    if kill == "worker":  # a SIGKILLed rank: torchrun sees its worker killed the same way
        os.kill(pid, signal.SIGKILL)
        assert client.wait(timeout=30) == -signal.SIGKILL
    else:  # torchrun stopping its workers
        os.kill(client.pid, signal.SIGTERM)
        assert client.wait(timeout=30) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}"), "the worker outlived its client"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_of_a_run_train_group_is_replaced_warm(tmp_path: Path) -> None:
    steps, ranks = 16, 2
    job = kill_a_rank(tmp_path, "zygote", steps=steps, ranks=ranks, kill_rank=1)
    assert "torchtitan_ft zygote: warm in" in job.group.output  # workers came from the zygote
    replacement_s = job.replacement_s()
    assert replacement_s is not None, "group 1's replacement never committed beside group 0"
    print(f"replacement participated {replacement_s:.2f} s after the SIGKILL", file=sys.stderr)
    for rank in range(ranks):
        import torch

        states = [torch.load(dump_path(tmp_path, r, rank), weights_only=False) for r in range(2)]
        assert [s["manager"]["step"] for s in states] == [steps, steps]
        assert_identical(states[0]["healed"], states[1]["healed"], f"rank{rank}")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hot_spare_group_takes_a_killed_groups_slot(tmp_path: Path) -> None:
    """Three ``./run_train.sh`` groups with ``world_size_mode = "fixed_with_spares"`` and
    ``min_replica_size = 2`` (docs/titan.md, "A hot spare group"): group 2 trains in step
    without a slot; group 1's rank is SIGKILLed; the job commits at full strength again with
    group 2 in the slot, group 1 comes back through the zygote, and all end bitwise
    identical."""
    steps, ranks = 16, 2
    job = kill_a_rank(tmp_path, "spare", steps=steps, ranks=ranks, kill_rank=1)
    assert job.spare is not None
    timeline = job.timeline()
    assert timeline["replacement_s"] is not None, "the job never committed at full strength"
    assert timeline["back_s"] is not None, "the killed group never took part again"
    roles = [(e.time > job.killed_at, e.data["role"]) for e in job.spare.events(EventKind.QUORUM)]
    assert (False, "spare") in roles and (True, "participant") in roles, roles
    print(f"job at full strength {timeline['replacement_s']:.2f} s after the SIGKILL")
    for rank in range(ranks):
        import torch

        states = [torch.load(dump_path(tmp_path, r, rank), weights_only=False) for r in range(3)]
        assert [s["manager"]["step"] for s in states] == [steps] * 3
        for other in states[1:]:
            assert_identical(states[0]["healed"], other["healed"], f"rank{rank}")
