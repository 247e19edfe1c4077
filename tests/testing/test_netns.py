"""The multi-host test bed: hosts as network namespaces, their links, and their removal."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from torchtitan_ft.testing import netns
from torchtitan_ft.testing.netns import SUBNET, HostNetwork, NetworkSetupError

_UNAVAILABLE = netns.limit_unavailable_reason()
needs_namespaces = pytest.mark.skipif(
    _UNAVAILABLE is not None, reason=f"no network namespaces: {_UNAVAILABLE}"
)

_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)"
_SERVE = "import socket, sys, time; s = socket.create_server((sys.argv[1], 7000)); time.sleep(60)"


def _namespaces(pid: int | None = None) -> set[str]:
    """The test bed's namespaces of process ``pid`` (default: this one); other runs of the
    suite may make their own meanwhile."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = f"{netns.PREFIX}-{os.getpid() if pid is None else pid}-"
    return {line.split()[0] for line in out.splitlines() if line.startswith(mine)}


def _connect(host: netns.Host, address: str, port: int) -> str:
    """How a TCP connect from ``host`` to ``address:port`` ends: "ok" or the error's name."""
    done = host.run(
        [sys.executable, "-c", _CONNECT, address, str(port)], capture_output=True, text=True
    )
    return "ok" if done.returncode == 0 else done.stderr.strip().splitlines()[-1].split(":")[0]


def _until_reachable(host: netns.Host, address: str, port: int) -> None:
    deadline = time.monotonic() + 20
    while (outcome := _connect(host, address, port)) != "ok":
        assert time.monotonic() < deadline, f"{address}:{port} unreachable from {host}: {outcome}"
        time.sleep(0.2)


def test_host_names_are_checked() -> None:
    with pytest.raises(ValueError, match="1-10 letters or digits"):
        HostNetwork(["A", "b-c"])
    with pytest.raises(ValueError, match="distinct"):
        HostNetwork(["A", "A"])
    with pytest.raises(ValueError, match="not 'sw'"):
        HostNetwork(["sw"])
    with pytest.raises(ValueError, match="link rate must be > 0"):
        netns.Host("A", "ns", ["10.0.0.2"], "sw", ["p0"]).limit(0)
    with pytest.raises(ValueError, match="links must be 1 to 3, got 0"):
        HostNetwork(["A"], links=0)


@pytest.mark.multihost
@needs_namespaces
def test_hosts_reach_each_other_and_nothing_else() -> None:
    with HostNetwork(["A", "B"]) as net:
        a, b = net["A"], net["B"]
        assert [a.address, b.address] == [str(SUBNET[2]), str(SUBNET[3])]
        for host in net:
            routes = host.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
            assert "default" not in routes
            assert ipaddress.ip_network(routes.split()[0]) == SUBNET
        server = b.popen([sys.executable, "-c", _SERVE, b.address])
        _until_reachable(a, b.address, 7000)
        assert _connect(a, "127.0.0.1", 7000) == "ConnectionRefusedError"  # A's own loopback
        # No route beyond the subnet (a route lookup only: nothing is sent anywhere else).
        lookup = a.run(["ip", "-4", "route", "get", "192.0.2.1"], capture_output=True, text=True)
        assert lookup.returncode != 0 and "unreachable" in lookup.stderr, lookup
        a.disconnect()  # a pulled cable: packets vanish, the connect times out
        assert _connect(a, b.address, 7000) == "TimeoutError"
        a.reconnect()
        _until_reachable(a, b.address, 7000)  # once the kernel retries its neighbour lookup
        server.kill()
        server.wait()


@pytest.mark.multihost
@needs_namespaces
def test_two_links_are_separate_networks_pulled_one_at_a_time() -> None:
    with HostNetwork(["A", "B"], links=2) as net:
        a, b = net["A"], net["B"]
        assert b.addresses == [str(netns.SUBNETS[0][3]), str(netns.SUBNETS[1][3])]
        routes = a.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        assert {ipaddress.ip_network(line.split()[0]) for line in routes.splitlines()} == set(
            netns.SUBNETS[:2]
        )
        assert netns.interface(1) in routes
        server = b.popen([sys.executable, "-c", _SERVE, "0.0.0.0"])
        for address in b.addresses:
            _until_reachable(a, address, 7000)
        a.disconnect(1)  # link 1 pulled: link 0 still carries
        assert _connect(a, b.addresses[1], 7000) == "TimeoutError"
        assert _connect(a, b.addresses[0], 7000) == "ok"
        a.reconnect(1)
        _until_reachable(a, b.addresses[1], 7000)
        server.kill()
        server.wait()


@pytest.mark.multihost
@needs_namespaces
def test_link_limit_bounds_the_throughput_and_is_counted() -> None:
    with HostNetwork(["A", "B"]) as net:
        a, b = net["A"], net["B"]
        a.limit(20)
        sent_before = a.bytes_sent()
        nbytes = 2_500_000  # 1 s at 20 Mbit/s
        probe = [sys.executable, "-m", "benchmarks._link_probe"]
        server = b.popen(
            [*probe, "serve", b.address, "7001"],
            stdout=subprocess.PIPE,
            text=True,
        )
        a.run(
            [
                sys.executable,
                "-m",
                "benchmarks._link_probe",
                "send",
                b.address,
                "7001",
                str(nbytes),
            ],
            check=True,
            timeout=60,
        )
        out, _ = server.communicate(timeout=60)
        measured = json.loads(out)
        mbit = measured["bytes"] * 8 / measured["seconds"] / 1e6
        assert measured["bytes"] == nbytes
        assert 10 < mbit < 24, f"{mbit:.1f} Mbit/s through a 20 Mbit/s link"
        assert a.bytes_sent() - sent_before >= nbytes  # payload plus headers
        assert b.bytes_received() >= nbytes
        a.limit(None)
        a.limit(None)  # lifting a limit that is not there is fine


@pytest.mark.multihost
@needs_namespaces
def test_everything_is_removed_on_exit_and_after_a_crash() -> None:
    with pytest.raises(RuntimeError, match="boom"), HostNetwork(["A"]) as net:
        sleeper = net["A"].popen(["sleep", "60"])
        assert net["A"].namespace in _namespaces()
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # killed with its host
    assert not _namespaces()
    # A run that was SIGKILLed leaves its namespaces; the next one removes them.
    crashed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from torchtitan_ft.testing.netns import HostNetwork; "
            "HostNetwork(['A']).start(); print(os.getpid(), flush=True); os._exit(0)",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(crashed.stdout)
    left = _namespaces(pid)
    assert len(left) == 2  # host A and the switch
    assert left <= set(netns.remove_leftovers())
    assert not _namespaces(pid)


@pytest.mark.multihost
@needs_namespaces
def test_a_failed_setup_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(host: netns.Host) -> None:
        raise NetworkSetupError(f"{host.name} has a default route: (pretend)")

    monkeypatch.setattr(netns, "_check_isolated", fail)
    with pytest.raises(NetworkSetupError, match="default route"):
        HostNetwork(["A", "B"]).start()
    assert not _namespaces()
