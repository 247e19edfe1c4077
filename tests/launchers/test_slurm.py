"""The Slurm runner and punisher against a real Slurm (``munged``, ``slurmctld`` and ``slurmd``
started by ``testing.slurm_cluster``, no systemd, no mock of ``sbatch``/``squeue``/``scancel``):
the lighthouse and the groups as jobs, a cancelled group's place taken by a warm standby job and
back in a committed step, the groups identical at the end; a dead group resubmitted; bad input
stopping with one line. The runner's decisions are table-tested without Slurm, and a standby's
process is tested as a plain process."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.request import urlopen

import pytest

from torchtitan_ft.slurm import (
    Action,
    Liveness,
    SlurmRunner,
    decide,
    kill_intervals,
    liveness,
    pick_standby,
    standby_files,
    titan_command,
)
from torchtitan_ft.testing.commit_log import commit_log_path, read_commit_log
from torchtitan_ft.testing.mlp import write_stop_step
from torchtitan_ft.testing.mlp_job import wait_until
from torchtitan_ft.testing.processes import ROOT, free_port
from torchtitan_ft.testing.slurm_cluster import SlurmCluster, missing_daemons, mlp_group_command


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (None, Liveness.DEAD),
        ("PENDING", Liveness.ALIVE),
        ("RUNNING", Liveness.ALIVE),
        ("COMPLETING", Liveness.ALIVE),
        ("COMPLETED", Liveness.COMPLETED),
        ("CANCELLED", Liveness.DEAD),
        ("FAILED", Liveness.DEAD),
        ("NODE_FAIL", Liveness.DEAD),
        ("TIMEOUT", Liveness.DEAD),
    ],
)
def test_liveness(state: str | None, expected: Liveness) -> None:
    assert liveness(state) is expected


@pytest.mark.parametrize(
    ("state", "resubmits", "lighthouse", "expected"),
    [
        (Liveness.ALIVE, 0, False, Action.KEEP),
        (Liveness.ALIVE, 3, True, Action.KEEP),
        (Liveness.COMPLETED, 0, False, Action.FINISHED),
        (Liveness.COMPLETED, 0, True, Action.RESUBMIT),
        (Liveness.DEAD, 0, False, Action.RESUBMIT),
        (Liveness.DEAD, 2, False, Action.RESUBMIT),
        (Liveness.DEAD, 3, False, Action.GIVE_UP),
        (Liveness.DEAD, 3, True, Action.GIVE_UP),
    ],
)
def test_decide(state: Liveness, resubmits: int, lighthouse: bool, expected: Action) -> None:
    assert decide(state, resubmits, 3, lighthouse=lighthouse) is expected


def test_kill_intervals_are_seeded_exponential_draws() -> None:
    draws = list(itertools.islice(kill_intervals(7, 2.0), 2000))
    assert draws[:20] == list(itertools.islice(kill_intervals(7, 2.0), 20))
    assert draws[:20] != list(itertools.islice(kill_intervals(8, 2.0), 20))
    assert 1.8 < sum(draws) / len(draws) < 2.2  # the mean, within ~5 standard errors
    assert len(set(draws)) == len(draws)  # drawn, not the mean repeated
    with pytest.raises(ValueError, match="mtbf_secs must be > 0, got 0"):
        next(kill_intervals(1, 0))


@pytest.mark.parametrize(
    ("standbys", "expected"),
    [
        ([], None),
        ([(5, "RUNNING", True), (4, "RUNNING", False)], 5),  # imports done first
        ([(6, "PENDING", False), (7, "RUNNING", False)], 7),  # then running
        ([(9, "RUNNING", True), (8, "RUNNING", True)], 8),  # the oldest
        ([(3, "PENDING", False)], 3),  # pending is still ahead of a new submission
        ([(3, "COMPLETING", True), (4, "CANCELLED", True), (5, "", False)], None),
    ],
)
def test_pick_standby(standbys: list[tuple[int, str, bool]], expected: int | None) -> None:
    assert pick_standby(standbys) == expected


def _standby(tmp_path: Path, job_id: str, *preimport: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtitan_ft.slurm",
            "standby",
            f"--folder={tmp_path}",
            *(f"--preimport={m}" for m in preimport),
        ],
        cwd=ROOT,
        env={**os.environ, "SLURM_JOB_ID": job_id, "FROM_STANDBY": "standby"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _assign(tmp_path: Path, job_id: int, argv: list[str], env: dict[str, str]) -> None:
    ready, assignment = standby_files(tmp_path, job_id)
    wait_until("the standby ready", ready.exists, timeout_s=120)
    assignment.write_text(json.dumps({"argv": argv, "env": env}))


def test_a_standby_runs_a_python_module_in_its_own_process(tmp_path: Path) -> None:
    module = "tests.launchers._standby_probe"
    standby = _standby(tmp_path, "41", module)
    _assign(tmp_path, 41, [sys.executable, "-m", module, "a", "b"], {"FROM_ASSIGNMENT": "x"})
    out, err = standby.communicate(timeout=60)
    assert standby.returncode == 0, err
    seen = json.loads(out)
    # The same process (imported before the assignment), the group's argv and environment
    # over the standby's, and no warning about the module it had imported.
    assert seen["pid"] == standby.pid and seen["body_runs"] == 2
    assert seen["argv"] == [str(ROOT / "tests" / "launchers" / "_standby_probe.py"), "a", "b"]
    assert (seen["from_assignment"], seen["from_standby"]) == ("x", "standby")
    assert err == ""


def test_a_standby_becomes_any_other_command(tmp_path: Path) -> None:
    standby = _standby(tmp_path, "42")
    _assign(
        tmp_path,
        42,
        ["sh", "-c", 'echo "$FROM_ASSIGNMENT $FROM_STANDBY $$"'],
        {"FROM_ASSIGNMENT": "y"},
    )
    out, err = standby.communicate(timeout=60)
    assert standby.returncode == 0, err
    assert out.split() == ["y", "standby", str(standby.pid)]  # exec'd: the same pid


def test_a_standby_outside_slurm_stops_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    done = subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.slurm", "standby", f"--folder={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "slurm standby: SLURM_JOB_ID is '' (expected the id of the Slurm job the runner "
        "submitted; a standby runs only as such a job)"
    ]


def test_titan_group_command_runs_run_train_with_the_groups_flags() -> None:
    sub = titan_command(3, 2, 5, ["--training.steps", "7"])(1, 4, "http://node7:29510")
    assert sub.argv[0] == "bash" and sub.argv[1] == str(ROOT / "run_train.sh")
    flags = list(sub.argv[2:])
    assert "--fault_tolerance.enable" in flags
    assert "--fault_tolerance.replica_id=1" in flags
    assert "--fault_tolerance.group_size=3" in flags
    assert flags[-2:] == ["--training.steps", "7"]
    assert sub.env["TORCHFT_LIGHTHOUSE"] == "http://node7:29510"
    assert (sub.env["NGPU"], sub.env["MAX_RESTARTS"]) == ("2", "5")
    assert (sub.env["REPLICA_GROUP_ID"], sub.env["NUM_REPLICA_GROUPS"]) == ("1", "3")


def test_runner_refuses_fewer_groups_than_min_replicas(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--replicas 1 is below --min_replicas 2"):
        SlurmRunner(
            None,  # type: ignore[arg-type]
            name="x",
            replicas=1,
            min_replicas=2,
            group_command=mlp_group_command(tmp_path, 1),
            lighthouse="http://127.0.0.1:1",
            workdir=tmp_path,
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if missing := missing_daemons():
        pytest.skip(f"{', '.join(missing)} missing: scripts/install_slurm.sh")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c
    assert c.leftovers() == []


def _runner(
    cluster: SlurmCluster, work: Path, *args: str, conf: Path | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtitan_ft.slurm",
            "run",
            f"--workdir={work}",
            f"--events={work / 'runner.jsonl'}",
            "--job=mlp",
            "--lighthouse_bind_host=127.0.0.1",
            "--lighthouse_host=127.0.0.1",
            "--poll_s=0.2",
            *args,
        ],
        cwd=ROOT,
        env=cluster.environ(conf),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _while_running(
    runner: subprocess.Popen[str], ready: Callable[[], object]
) -> Callable[[], object]:
    """``ready``, raising once the runner has exited (with its stderr)."""

    def check() -> object:
        if runner.poll() is not None:
            raise AssertionError(f"runner exited {runner.returncode}: {runner.stderr.read()}")  # type: ignore[union-attr]
        return ready()

    return check


def _events(work: Path) -> list[dict]:
    path = work / "runner.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _committed(work: Path, replica: int, attempt: int, since: float = 0.0) -> list:
    path = commit_log_path(work / "commit_logs", replica, attempt)
    return [
        r
        for r in read_commit_log(path, replica, attempt)
        if r.committed and r.participating and r.time > since
    ]


FAST_LIGHTHOUSE = (
    "--lighthouse_arg=--join_timeout_ms=1000",
    "--lighthouse_arg=--heartbeat_timeout_ms=1000",
    "--lighthouse_arg=--quorum_tick_ms=50",
)
"""The lighthouse job's flags for a test: a lost or late group is noticed within a second."""


def _wait_both_committing(runner: subprocess.Popen[str], work: Path) -> None:
    """Until groups 0 and 1 each committed a step in their first job (raising if the runner
    exits first)."""
    wait_until(
        "both groups committing together",
        _while_running(runner, lambda: all(_committed(work, r, 0) for r in (0, 1))),
        timeout_s=300,
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # Python and torch imports in four jobs: minutes on a loaded machine
def test_a_cancelled_groups_place_goes_to_a_standby_and_it_rejoins(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    work = tmp_path / "job"
    port = free_port()
    runner = _runner(
        cluster,
        work,
        "--name=ft",
        "--replicas=2",
        "--min_replicas=1",
        f"--lighthouse_port={port}",
        *FAST_LIGHTHOUSE,
        "--max_resubmits=3",
        "--standbys=1",
    )
    try:
        _wait_both_committing(runner, work)
        victim = next(
            e["job_id"] for e in _events(work) if e["event"] == "submitted" and e["replica"] == 1
        )
        standby = next(e["job_id"] for e in _events(work) if e["role"] == "standby")
        wait_until(
            "the standby's imports done",
            _while_running(runner, standby_files(work / "standby", standby)[0].exists),
            timeout_s=300,
        )
        cancelled = time.time()
        subprocess.run(["scancel", str(victim)], env=cluster.environ(), check=True)
        wait_until(
            "group 1's second job in a committed step",
            _while_running(runner, lambda: _committed(work, 1, 1, since=cancelled)),
            timeout_s=300,
        )
        # Group 1's place went to the standby, which Slurm now lists under the group's name; a
        # new standby was submitted; group 0 trained on in its first job.
        submitted = [e for e in _events(work) if e["event"] == "submitted"]
        assert sorted((e["role"], e["replica"], e["attempt"]) for e in submitted) == [
            ("group", 0, 0),
            ("group", 1, 0),
            ("lighthouse", -1, 0),
            ("standby", -1, 0),
            ("standby", -1, 1),
        ]
        assigned = [e for e in _events(work) if e["event"] == "assigned"]
        assert [(e["replica"], e["attempt"], e["job_id"]) for e in assigned] == [(1, 1, standby)]
        assert cluster.slurm().jobs()[standby].name == "ft-group-1"
        ended = [e for e in _events(work) if e["event"] == "ended"]
        assert [(e["job_id"], e["state"]) for e in ended] == [(victim, "CANCELLED")]
        # The status page names each group's Slurm job: the live groups their current jobs,
        # the cancelled process its own.
        jobs = {(e["replica"], e["attempt"]): e["job_id"] for e in submitted + assigned}
        status = json.loads(urlopen(f"http://127.0.0.1:{port + 1}/status.json", timeout=10).read())
        in_quorum = {g["launcher_job"] for g in status["groups"] if g["in_quorum"]}
        assert in_quorum == {f"slurm:{jobs[0, 0]}", f"slurm:{jobs[1, 1]}"}, status["groups"]
        assert f"slurm:{victim}" in {g["launcher_job"] for g in status["groups"]}
        step = max(r.step for r in _committed(work, 0, 0)) + 10
        write_stop_step(work / "stop_step", step)
        _, err = runner.communicate(timeout=300)
        assert runner.returncode == 0, err
    finally:
        if runner.poll() is None:
            runner.terminate()
            runner.communicate(timeout=30)
    assert [e["event"] for e in _events(work)][-1] == "done"
    # Both groups stopped together (at the first step from the stop step on that both took
    # part in) with the same parameters and optimizer state.
    last = [_committed(work, 0, 0)[-1], _committed(work, 1, 1)[-1]]
    assert last[0].step == last[1].step >= step
    assert last[0].hash == last[1].hash
    # The lighthouse job was cancelled by the runner at the end: nothing of the job still runs.
    alive = [j for j in cluster.slurm().jobs().values() if liveness(j.state) is Liveness.ALIVE]
    assert alive == []


@pytest.mark.slow  # three more job starts: minutes on a loaded machine
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_cancelled_lighthouse_is_resubmitted_and_training_goes_on(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    work = tmp_path / "job"
    runner = _runner(
        cluster,
        work,
        "--name=lhft",
        "--replicas=2",
        f"--lighthouse_port={free_port()}",
        *FAST_LIGHTHOUSE,
    )
    try:
        _wait_both_committing(runner, work)
        lighthouse = next(e["job_id"] for e in _events(work) if e["role"] == "lighthouse")
        cancelled = time.time()
        subprocess.run(["scancel", str(lighthouse)], env=cluster.environ(), check=True)
        resubmitted = wait_until(
            "the lighthouse resubmitted",
            _while_running(
                runner,
                lambda: next(
                    (
                        e["time"]
                        for e in _events(work)
                        if e["event"] == "submitted"
                        and e["role"] == "lighthouse"
                        and e["attempt"] == 1
                    ),
                    None,
                ),
            ),
            timeout_s=60,
        )
        # Training went on while it was away (lighthouse_outage = "previous_quorum") and
        # both groups took part in a step under the new one.
        assert all(_committed(work, r, 0, since=cancelled) for r in (0, 1))
        wait_until(
            "a step of both groups under the new lighthouse",
            _while_running(
                runner,
                lambda: [
                    r for r in _committed(work, 0, 0, since=resubmitted) if r.participants == 2
                ],
            ),
            timeout_s=300,
        )
        step = max(r.step for r in _committed(work, 0, 0)) + 10
        write_stop_step(work / "stop_step", step)
        _, err = runner.communicate(timeout=300)
        assert runner.returncode == 0, err
    finally:
        if runner.poll() is None:
            runner.terminate()
            runner.communicate(timeout=30)
    groups = [(e["replica"], e["attempt"]) for e in _events(work) if e["event"] == "submitted"]
    assert sorted(groups) == [(-1, 0), (-1, 1), (0, 0), (1, 0)]  # no group restarted
    last = [_committed(work, 0, 0)[-1], _committed(work, 1, 0)[-1]]
    assert last[0].step == last[1].step >= step
    assert last[0].hash == last[1].hash


def test_a_group_dead_past_max_resubmits_stops_the_job_with_one_line(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lighthouse:  # something listens there
        port = lighthouse.getsockname()[1]
        runner = _runner(
            cluster,
            tmp_path,
            "--name=giveup",
            "--replicas=1",
            f"--lighthouse=http://127.0.0.1:{port}",
            "--max_resubmits=1",
        )
        try:
            for attempt in (0, 1):
                job_id = wait_until(
                    f"group 0's job {attempt} submitted",
                    _while_running(
                        runner,
                        lambda attempt=attempt: next(
                            (
                                e["job_id"]
                                for e in _events(tmp_path)
                                if e["event"] == "submitted" and e["attempt"] == attempt
                            ),
                            None,
                        ),
                    ),
                    timeout_s=60,
                )
                subprocess.run(["scancel", str(job_id)], env=cluster.environ(), check=True)
            _, err = runner.communicate(timeout=120)
        finally:
            if runner.poll() is None:
                runner.terminate()
                runner.communicate(timeout=30)
    assert runner.returncode == 1
    assert len(err.strip().splitlines()) == 1, err
    assert "group 0" in err and "CANCELLED" in err and "--max_resubmits 1" in err
    assert [e["event"] for e in _events(tmp_path)][-2:] == ["ended", "gave_up"]
    alive = [j for j in cluster.slurm().jobs().values() if liveness(j.state) is Liveness.ALIVE]
    assert alive == []


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--lighthouse=http://127.0.0.1:{port}"], ["--lighthouse http://127.0.0.1:{port}"]),
        (["--replicas=1", "--min_replicas=2"], ["--replicas 1", "--min_replicas 2"]),
    ],
)
def test_bad_input_stops_with_one_line(
    cluster: SlurmCluster, tmp_path: Path, args: list[str], names: list[str]
) -> None:
    port = free_port()  # nobody listens there
    runner = _runner(cluster, tmp_path, *[a.format(port=port) for a in args])
    _, err = runner.communicate(timeout=60)
    assert runner.returncode == 2
    assert len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name.format(port=port) in err
    assert not [e for e in _events(tmp_path) if e["event"] == "submitted"]


def test_slurm_without_json_output_stops_with_one_line(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    runner = _runner(cluster, tmp_path, conf=cluster.without_json_conf())
    _, err = runner.communicate(timeout=60)
    assert runner.returncode == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "squeue --json" in err and "serializer/json" in err
    assert not [e for e in _events(tmp_path) if e["event"] == "submitted"]
