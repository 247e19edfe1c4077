"""Replica groups on separate hosts: partitions, a group across two hosts, address mistakes.

The hosts are Linux network namespaces on this machine (``torchtitan_ft.testing.netns``): the
lighthouse (``torchft_lighthouse``) runs on host L, each replica group's ``run_train.sh`` on its
own host with ``--fault_tolerance.hostname`` set to that host's address, all training the
TorchTitan debug model (small shape) with per-step FT. The runs use
``torchtitan_ft.testing.titan_dump`` as their ``TRAIN_FILE``: it dumps each rank's state at the
end, and ends training at the step the test writes to ``FT_E2E_STOP_FILE`` once it has seen
what it watches for.

A *partition* pulls a host's cable at the switch (``Host.disconnect``): its processes live on,
and its packets are dropped silently, so nothing fails at once; only timeouts tell.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from torchtitan_ft.testing.mlp import write_stop_step
from torchtitan_ft.testing.netns import INTERFACE, Host, HostNetwork, unavailable_reason
from torchtitan_ft.testing.processes import descendants
from torchtitan_ft.testing.titan_jobs import (
    LoggedProcess,
    TrainRun,
    assert_identical,
    finish_all,
    ft_env,
    remaining,
)

_UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.multiprocess,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no network namespaces: {_UNAVAILABLE}"),
]

LIGHTHOUSE_PORT = 29510
RDZV_PORT = 29400
MAX_STEPS = 1000
"""``--training.steps``: only an upper bound, the stop file ends the runs."""
PG_TIMEOUT_S = 5.0
"""``process_group_timeout_ms`` of the runs: how long a silent peer holds a collective."""
HEARTBEAT_TIMEOUT_S = 2.0
"""The lighthouse's ``--heartbeat_timeout_ms``: how soon a silent group is unhealthy."""
QUORUM_TIMEOUT_S = 60.0
"""``quorum_timeout_ms`` of ``configs/debug_ft_cpu.toml``, the documented bound for a
lighthouse that cannot be reached."""
GROUP_PARTITION_S = 3 * PG_TIMEOUT_S
LIGHTHOUSE_PARTITION_S = 10.0
STOP_MARGIN = 4
"""Steps between the last one seen and the step the runs stop after."""

HEAL_FROM_0 = r"healing to step (\d+) from replica rank 0 \(http://([\d.]+):"
"""What a group logs when it heals from group 0 (the donor's step and address)."""
HEAL_FROM_ANY = r"healing to step \d+ from replica rank \d+ \(http://([\d.]+):"
_COMMIT = re.compile(
    r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - torchtitan_ft\.manager[\w.]* - .*?"
    r"rank=0 train_step=\d+ committed_steps=(\d+)\] should_commit=(True|False) "
    r"\(local vote \w+: (\d+) participants"
)
"""A group rank 0's commit decision (its time, the Manager's step, the decision and how many
groups took part), under TorchTitan's log prefix (``torchtitan_ft.titan.metrics``)."""


@dataclass(frozen=True)
class Commit:
    """One ``should_commit`` decision of a group's rank 0, from its log."""

    time: float
    step: int
    committed: bool
    participants: int


def commits(run: LoggedProcess) -> list[Commit]:
    found = []
    for m in _COMMIT.finditer(run.output):
        when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        found.append(Commit(when, int(m.group(2)), m.group(3) == "True", int(m.group(4))))
    return found


def wait_until(check: Callable[[], bool], what: str, timeout: float | None = None) -> None:
    """Polls ``check`` until it holds, within ``timeout`` capped by the test's budget."""
    limit = remaining(timeout)
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit:.0f} s: {what}")
        time.sleep(0.2)


def joint_commits(run: LoggedProcess, after: float = 0.0) -> int:
    return sum(1 for c in commits(run) if c.committed and c.participants == 2 and c.time > after)


def lighthouse(host: Host) -> tuple[LoggedProcess, str]:
    """``torchft_lighthouse`` on ``host`` (min_replicas 1) and its URL, once it serves."""
    run = LoggedProcess(
        f"lighthouse on {host.name}",
        host.command(
            [
                *(sys.executable, "-m", "torchtitan_ft.lighthouse.cli"),
                *("--bind", f"{host.address}:{LIGHTHOUSE_PORT}", "--min_replicas", "1"),
                *("--heartbeat_timeout_ms", str(int(HEARTBEAT_TIMEOUT_S * 1000))),
                *("--join_timeout_ms", "20000"),
            ]
        ),
        dict(os.environ),
    )
    run.wait_for("lighthouse serving on", 60)
    return run, f"http://{host.address}:{LIGHTHOUSE_PORT}"


def group(
    name: str,
    replica: int,
    host: Host,
    out: Path,
    url: str,
    *args: str,
    ngpu: int = 2,
    hostname: str | None = None,
    **env: str,
) -> TrainRun:
    """Replica group ``replica`` (or one node of it) on ``host``, FT per step, advertising
    ``hostname`` (default: the host's address; "" leaves it unset)."""
    return TrainRun(
        name,
        MAX_STEPS,
        out / f"outputs_{name.replace(' ', '_')}",
        f"--fault_tolerance.replica_id={replica}",
        f"--fault_tolerance.hostname={host.address if hostname is None else hostname}",
        f"--fault_tolerance.process_group_timeout_ms={int(PG_TIMEOUT_S * 1000)}",
        *args,
        ngpu=ngpu,
        env=ft_env(
            "debug_ft_cpu.toml",
            url,
            TRAIN_FILE="torchtitan_ft.testing.titan_dump",
            FT_E2E_OUT=str(out),
            FT_E2E_STOP_FILE=str(out / "stop"),
            **env,
        ),
        prefix=host.command([]),
    )


def stop_after_next_steps(out: Path, runs: list[TrainRun]) -> int:
    """Ends every run a few steps past the furthest step seen; that step."""
    last = max(c.step for run in runs for c in commits(run))
    stop = last + STOP_MARGIN
    write_stop_step(out / "stop", stop)
    return stop


def assert_identical_states(out: Path, replicas: list[int], ranks: int, step: int) -> None:
    """Every rank of the groups ends at ``step`` with bitwise the same healed state."""
    import torch

    for rank in range(ranks):
        states = [
            torch.load(out / f"state_r{r}_rank{rank}.pt", weights_only=False) for r in replicas
        ]
        for state in states:
            assert state["healed"]["train_state"]["step"] == step
        assert_identical(states[0]["healed"], states[1]["healed"], f"rank{rank}")
        assert states[0]["manager"]["step"] == states[1]["manager"]["step"]


def _ready_pid(out: Path, rank: int) -> int | None:
    """The pid of group 0's rank ``rank`` once its trainer is built (``test_ft_e2e``)."""
    path = out / f"ready_r0_rank{rank}"
    return int(path.read_text()) if path.exists() and path.read_text() else None


_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d{3}")


def logged_between(
    run: LoggedProcess,
    start: float,
    end: float,
    pattern: str = r" (WARNING|ERROR) ",
    limit: int = 8,
) -> str:
    """The first ``limit`` lines matching ``pattern`` that ``run`` logged between two times
    (printed, so that docs/operations.md can show what a partition looks like in the logs)."""
    found = []
    for line in run.output.splitlines():
        stamp = _LOG_TIME.search(line)
        if stamp and re.search(pattern, line):
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            if start - 1 <= when <= end + 1:
                found.append(f"  {run.name}: {line[:300]}")
    return "\n".join(found[:limit])


def median_step_s(run: TrainRun) -> float:
    times = [c.time for c in commits(run) if c.committed]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps[1:]) if len(gaps) > 2 else 1.0


def print_logged_while_cut_off(
    host: str, runs: list[LoggedProcess], lh: LoggedProcess, cut: float, back: float
) -> None:
    """What ``runs`` and the lighthouse ``lh`` logged while ``host`` was cut off (the report)."""
    print(f"logged while {host} was cut off:")
    print("\n".join(logged_between(run, cut, back) for run in runs))
    print(logged_between(lh, cut, back, "lighthouse: "))


# ------------------------------------------------------------------------------ the tests


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_groups_on_two_hosts_heal_across_hosts_and_ride_out_partitions(tmp_path: Path) -> None:
    """Groups 0 and 1 (2 ranks each) on hosts A and B, the lighthouse on L.

    1. Every step commits with both groups; group 1 healed from group 0 at step 0, across
       hosts.
    2. B's cable is pulled: group 0 stalls until its collective with B times out (and B's
       heartbeat has aged out), then commits alone; group 1 commits nothing alone and its
       processes neither exit nor restart.
    3. B's cable is back: group 1 rejoins and heals from group 0, across hosts.
    4. L's cable is pulled for less than the quorum timeout: both groups wait, no step is
       discarded, both continue when it is back.
    5. Both groups end bitwise identical, rank by rank.
    """
    with HostNetwork(["L", "A", "B"]) as net:
        lh, url = lighthouse(net["L"])
        a = group("group 0 on A", 0, net["A"], tmp_path, url)
        b = group("group 1 on B", 1, net["B"], tmp_path, url)

        # 1. Training together, healed across hosts.
        wait_until(
            lambda: joint_commits(a) >= 3 and joint_commits(b) >= 3, "both groups commit together"
        )
        # Whichever group asked first was the step-0 source; the other healed from it.
        donors = {run.name: re.findall(HEAL_FROM_ANY, run.output) for run in (a, b)}
        assert donors[b.name][:1] == [net["A"].address] or donors[a.name][:1] == [
            net["B"].address
        ], f"no step-0 heal across hosts: {donors}"
        step_s = max(median_step_s(a), median_step_s(b))

        # 2. Partition B.
        cut = time.time()
        net["B"].disconnect()
        wait_until(
            lambda: (
                sum(1 for c in commits(a) if c.time > cut and c.participants == 1) >= 3
                and time.time() > cut + GROUP_PARTITION_S
            ),
            "group 0 commits alone while B is cut off",
            PG_TIMEOUT_S + HEARTBEAT_TIMEOUT_S + GROUP_PARTITION_S + 60 * step_s,
        )
        back = time.time()
        net["B"].reconnect()
        first_alone = min(c.time for c in commits(a) if c.time > cut and c.participants == 1)
        last_joint = max(c.time for c in commits(a) if c.time < cut and c.committed)
        stall_a = first_alone - last_joint
        during = [c for c in commits(b) if cut < c.time < back and c.committed]
        assert not any(c.participants < 2 for c in commits(b) if c.committed), (
            "group 1 committed a step without group 0"
        )
        assert len(during) <= 1, f"group 1 committed {during} while cut off"  # the one in flight
        # MAX_RESTARTS is 0: a worker that failed would have ended the launcher.
        assert b.returncode is None, "group 1's launcher exited during the partition"
        print(
            f"partition of B: group 0's stall {stall_a:.1f} s (last joint commit -> first "
            f"alone; median step {step_s:.2f} s, process_group_timeout {PG_TIMEOUT_S} s, "
            f"heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)"
        )
        assert stall_a < PG_TIMEOUT_S + HEARTBEAT_TIMEOUT_S + 15 * step_s
        print_logged_while_cut_off("B", [a, b], lh, cut, back)

        # 3. B rejoins and heals from A.
        wait_until(lambda: joint_commits(b, after=back) >= 2, "group 1 commits with group 0 again")
        rejoin_s = min(c.time for c in commits(b) if c.time > back and c.participants == 2) - back
        heals = re.findall(HEAL_FROM_0, b.output)
        assert heals and heals[-1][1] == net["A"].address
        last_b = max(c.step for c in commits(b) if c.time < back and c.committed)
        assert int(heals[-1][0]) > last_b + 1  # group 0's steps taken alone
        print(f"group 1 committed with group 0 {rejoin_s:.1f} s after B's cable was back")

        # 4. Partition the lighthouse.
        wait_until(lambda: joint_commits(a, after=back) >= 2, "group 0 commits with group 1")
        cut = time.time()
        net["L"].disconnect()
        time.sleep(LIGHTHOUSE_PARTITION_S)
        back = time.time()
        net["L"].reconnect()
        wait_until(
            lambda: joint_commits(a, after=back) >= 1 and joint_commits(b, after=back) >= 1,
            "both groups commit again once L is back",
            QUORUM_TIMEOUT_S,
        )
        print_logged_while_cut_off("L", [a, b], lh, cut, back)
        for run in (a, b):
            around = [c for c in commits(run) if c.time > cut - 3 * step_s]
            assert all(c.committed for c in around), f"{run.name} discarded a step: {around}"
            before = max(c.time for c in commits(run) if c.time <= cut)
            after = min(c.time for c in commits(run) if c.time > back)
            print(
                f"partition of L for {back - cut:.1f} s: {run.name} stalled {after - before:.1f} s"
                f" (quorum timeout {QUORUM_TIMEOUT_S:.0f} s)"
            )
            assert after - before < QUORUM_TIMEOUT_S
            assert run.returncode is None

        # 5. Stop together; identical.
        stop = stop_after_next_steps(tmp_path, [a, b])
        finish_all([a, b])
        assert_identical_states(tmp_path, [0, 1], ranks=2, step=stop)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_group_across_two_hosts_is_restarted_by_torchrun_and_heals(tmp_path: Path) -> None:
    """Group 0 has its 2 ranks on hosts A and C (torchrun ``--nnodes 2``, c10d rendezvous on
    A), group 1 its 2 ranks on host B. The rank on C is SIGKILLed: torchrun restarts the
    whole group on both hosts, the new incarnation heals from group 1, and both groups end
    identical."""
    with HostNetwork(["L", "A", "B", "C"]) as net:
        _, url = lighthouse(net["L"])
        rdzv = f"{net['A'].address}:{RDZV_PORT}"
        nodes = [
            group(
                f"group 0 node {i} on {h}",
                0,
                net[h],
                tmp_path,
                url,
                ngpu=1,
                NNODES="2",
                RDZV_ENDPOINT=rdzv,
                LOCAL_ADDR=net[h].address,
                MAX_RESTARTS="1",
                # TorchTitan's own (inner) gloo groups span A and C.
                GLOO_SOCKET_IFNAME=INTERFACE,
            )
            for i, h in enumerate("AC")
        ]
        other = group("group 1 on B", 1, net["B"], tmp_path, url)
        runs = [*nodes, other]

        def group0_joint(after: float = 0.0) -> int:
            return max(joint_commits(n, after) for n in nodes)

        wait_until(lambda: group0_joint() >= 3, "group 0 (A + C) commits with group 1")
        first = [_ready_pid(tmp_path, rank) for rank in range(2)]
        workers = descendants(nodes[1].proc.pid)
        assert workers, "no worker under the launcher on C"
        killed = time.time()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: all(_ready_pid(tmp_path, rank) not in (None, first[rank]) for rank in range(2)),
            "torchrun starts group 0's ranks again on both hosts",
        )
        for rank, node in enumerate(nodes):  # the same launchers restarted their workers
            assert node.returncode is None
            assert _ready_pid(tmp_path, rank) in [node.proc.pid, *descendants(node.proc.pid)]
        wait_until(lambda: group0_joint(after=killed) >= 2, "restarted group 0 trains with 1")
        heal = r"healing to step [1-9]\d* from replica rank 1"
        assert any(re.search(heal, n.output) for n in nodes), "group 0 did not heal from 1"
        assert other.returncode is None
        stop = stop_after_next_steps(tmp_path, runs)
        finish_all(runs)
        assert_identical_states(tmp_path, [0, 1], ranks=2, step=stop)


@pytest.mark.slow  # the default tier: tests/manager/test_server.py, test_decisions.py's gate
@pytest.mark.timeout(240)
def test_group_advertising_loopback_while_peers_are_remote_is_told_what_to_set(
    tmp_path: Path,
) -> None:
    """Group 0 on A is set up right; group 1 on B leaves ``hostname`` unset (this machine's
    name, which resolves to loopback here) and group 2 on C sets it to 127.0.0.1. Both
    misconfigured groups stop at their first quorum with one line naming the address to set;
    group 0 warns about the peer it cannot reach and carries on."""
    with HostNetwork(["L", "A", "B", "C"]) as net:
        _, url = lighthouse(net["L"])
        three = "--fault_tolerance.group_size=3"
        good = group("group 0 on A", 0, net["A"], tmp_path, url, three, ngpu=1)
        bad = [
            group(f"group {r} on {h}", r, net[h], tmp_path, url, three, ngpu=1, hostname=name)
            for r, (h, name) in enumerate([("B", ""), ("C", "127.0.0.1")], start=1)
        ]
        for run, host in zip(bad, (net["B"], net["C"]), strict=True):
            run.finish()
            assert run.returncode == 2, f"{run.name} exited {run.returncode}"
            line = re.search(r"torchtitan_ft: replica group .*", run.output)
            assert line, f"{run.name} did not say what is wrong"
            assert "advertises loopback" in line.group(0)
            assert f"runs on another host ({net['A'].address})" in line.group(0)
            assert f"set fault_tolerance.hostname to {host.address}" in line.group(0)
        good.wait_for(r"advertises loopback .* unless it runs on this host", 30)
        assert good.returncode is None


@pytest.mark.slow  # the default tier: tests/manager/test_server.py's scripted quorums
@pytest.mark.timeout(240)
def test_loopback_group_that_trained_alone_stops_when_a_remote_group_joins(
    tmp_path: Path,
) -> None:
    """The start order a slow machine allows (min_replicas 1): group 1 on B, advertising
    127.0.0.1, commits steps alone before group 0 on A (set up right) asks. Group 1 stops at
    its first quorum with A all the same, with the line naming the address to set, and group 0
    then trains on alone."""
    with HostNetwork(["L", "A", "B"]) as net:
        _, url = lighthouse(net["L"])
        two = "--fault_tolerance.group_size=2"
        bad = group("group 1 on B", 1, net["B"], tmp_path, url, two, ngpu=1, hostname="127.0.0.1")
        wait_until(lambda: any(c.committed for c in commits(bad)), "group 1 commits alone")
        good = group("group 0 on A", 0, net["A"], tmp_path, url, two, ngpu=1)
        bad.finish()
        assert bad.returncode == 2, f"{bad.name} exited {bad.returncode}"
        line = re.search(r"torchtitan_ft: replica group .*", bad.output)
        assert line, f"{bad.name} did not say what is wrong"
        assert f"runs on another host ({net['A'].address})" in line.group(0)
        assert f"set fault_tolerance.hostname to {net['B'].address}" in line.group(0)
        wait_until(lambda: any(c.committed for c in commits(good)), "group 0 trains alone")
        stop_after_next_steps(tmp_path, [good])
        finish_all([good])
