"""Several hosts on one Linux machine: network namespaces joined by a bridge.

Each *host* is a network namespace with one interface, ``eth0``, holding one address of
:data:`SUBNET`, and its loopback. The hosts' ``eth0`` are veth pairs whose other ends are ports
of a bridge, which lives in a namespace of its own (the *switch*). Nothing is added to the
machine's own namespace, and no namespace has a default route: traffic between the hosts stays
on the bridge and nothing can leave. :meth:`HostNetwork.start` checks that after setting up.

    with HostNetwork(["L", "A", "B"]) as net:
        proc = net["A"].popen(["python", "-m", "..."])  # runs inside host A (ip netns exec)
        net["B"].limit(100)        # B's link: 100 Mbit/s each way (tc tbf)
        net["B"].disconnect()      # B's cable pulled at the switch; its processes live on
        net["B"].reconnect()

A network of ``links=2`` or more joins the hosts by that many separate links, each its own
bridge and subnet (:data:`SUBNETS`): a host's link ``k`` is its interface ``eth<k>``
(:func:`interface`) with address ``host.addresses[k]``; ``limit``, ``disconnect`` and
``reconnect`` take the link (default 0). Two hosts with a slow and a fast link, say
(``benchmarks.heal_paths``).

What a partition looks like here: :meth:`Host.disconnect` sets the switch's end of the host's
veth pair down. Packets to and from the host are dropped silently, as when a cable or a switch
fails; the host's own interface keeps its address and route, so its connections are not reset
and stall until a timeout or until the link is back.

The kernel here has no ``netem``, so there is no added delay; bandwidth limits use ``tc qdisc
... tbf`` on both ends of the link (the host's sending and receiving direction).

Every namespace is named ``ttft-<pid>-<n>-<host>`` (``<pid>`` the owning process, ``<n>``
numbering the networks it made, the switch is ``sw``). :meth:`HostNetwork.close` (also on any
failure of ``start`` and at the end of the ``with`` block) kills every process left in the
hosts and deletes the namespaces, which removes the veth pairs and the bridge with them.
Namespaces of a process that no longer exists (a run that was SIGKILLed) are removed by
:func:`remove_leftovers`, which ``start`` calls first; ``python -m torchtitan_ft.testing.netns
--remove-leftovers`` does the same by hand.

Needs Linux, root and iproute2's ``ip`` (``tc`` for :meth:`Host.limit`);
:func:`unavailable_reason` says what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

PREFIX = "ttft"
"""Start of every namespace name this module makes (torchtitan_ft)."""
SUBNET = ipaddress.IPv4Network("10.213.77.0/24")
"""The private /24 the hosts' addresses come from; they exist only inside the namespaces."""
SUBNETS = (SUBNET, ipaddress.IPv4Network("10.213.78.0/24"), ipaddress.IPv4Network("10.213.79.0/24"))
"""Link ``k``'s subnet (a network has at most this many links)."""
INTERFACE = "eth0"
"""Each host's interface towards the switch (its link 0)."""
_SWITCH = "sw"
_FIRST_HOST = 2
"""Host ``i`` gets ``SUBNET[_FIRST_HOST + i]`` (.1 stays unused, as a gateway would be)."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9]{1,10}$")
_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([A-Za-z0-9]+)$")
_COMMAND_TIMEOUT_S = 30.0
_KILL_WAIT_S = 10.0
_BURST_S = 0.004
"""tbf bucket: the link may send this many seconds' worth of bytes at once (at least
:data:`MIN_BURST_BYTES`)."""
MIN_BURST_BYTES = 128 * 1024
"""The smallest tbf bucket, so that one full-size TCP segment batch (a GSO packet of up to 64
KiB of payload) always fits whole. tbf counts such a packet at its payload plus one set of
headers per segment (about 67 KiB), and splits any packet larger than the bucket into
single segments in software: with a 64 KiB bucket every batch was split, and each of its ~45
segments then crossed the veth pair, the bridge and both tbf queues on its own. That cost
~70 ms of kernel CPU (softirq) per 2.45 MB sent at 100 Mbit/s, taken from the processes
sharing the machine's cores; at 128 KiB it is ~7 ms (docs/performance.md, issue 22 part 3)."""
_QUEUE_LATENCY = "100ms"
"""How long a packet may wait in the tbf queue before it is dropped (TCP then backs off)."""

_counter = iter(range(1, 1 << 30))


def interface(link: int) -> str:
    """A host's interface name for link ``link`` (``eth0``, ``eth1``, ...)."""
    return f"eth{link}"


def _bridge(link: int) -> str:
    return f"br{link}"


def _switch_port(host_index: int, link: int) -> str:
    return f"p{host_index}" if link == 0 else f"p{host_index}l{link}"


class NetworkSetupError(RuntimeError):
    """An ``ip``/``tc`` command failed, or a namespace is not isolated as it must be."""


def _tool(name: str) -> str | None:
    # Root's tools are in sbin, which a non-login shell's PATH may lack.
    return shutil.which(
        name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    )


def unavailable_reason() -> str | None:
    """Why a :class:`HostNetwork` cannot be made here, or ``None`` if it can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    ip = _tool("ip")
    if ip is None:
        return "the `ip` command (iproute2) is not installed"
    probe = subprocess.run(
        [ip, "netns", "list"], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
    )
    if probe.returncode != 0:
        return f"`ip netns list` fails here: {probe.stderr.strip()}"
    return None


def limit_unavailable_reason() -> str | None:
    """Why :meth:`Host.limit` cannot work here (no ``tc``), or ``None``."""
    return unavailable_reason() or (None if _tool("tc") else "the `tc` command is not installed")


def _run(tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    path = _tool(tool)
    if path is None:
        raise NetworkSetupError(f"the `{tool}` command is not installed")
    done = subprocess.run([path, *args], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetworkSetupError(
            f"`{tool} {' '.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", *args, check=check)


def _pids_in(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _delete_namespace(namespace: str) -> None:
    """SIGKILLs every process in ``namespace``, waits for them, deletes it."""
    pids = _pids_in(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _KILL_WAIT_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    _ip("netns", "delete", namespace)


def _namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Deletes the namespaces of this module whose owning process is gone; their names."""
    removed = []
    for namespace in _namespaces():
        match = _NAMESPACE.match(namespace)
        if match and not _alive(int(match.group(1))):
            _delete_namespace(namespace)
            removed.append(namespace)
    return removed


def _tbf(mbit: float, min_burst_bytes: int) -> list[str]:
    rate_bytes = mbit * 1e6 / 8
    burst = max(min_burst_bytes, int(rate_bytes * _BURST_S))
    return [
        "tbf",
        "rate",
        f"{round(mbit * 1000)}kbit",
        "burst",
        str(burst),
        "latency",
        _QUEUE_LATENCY,
    ]


class Host:
    """One host of a :class:`HostNetwork`: a namespace, its address, its link to the switch."""

    def __init__(
        self, name: str, namespace: str, addresses: Sequence[str], switch: str, ports: Sequence[str]
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.addresses = list(addresses)
        """This host's IPv4 address on each link (link ``k``'s in ``SUBNETS[k]``)."""
        self.address = self.addresses[0]
        """This host's IPv4 address on link 0 (in :data:`SUBNET`)."""
        self._switch = switch
        self._ports = list(ports)
        self._port = self._ports[0]
        self.link_mbit: float | None = None
        """The bandwidth limit of this host's link 0 in Mbit/s (each way); ``None``:
        unlimited."""
        self._started: list[subprocess.Popen[Any]] = []
        """What :meth:`popen` started: killed on close even if it had not yet entered the
        namespace when the namespace's processes were listed."""

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec``; the environment is inherited)."""
        ip = _tool("ip")
        if ip is None:
            raise NetworkSetupError("the `ip` command is not installed")
        return [ip, "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside this host; ``kwargs`` go to ``subprocess.Popen``."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self._started.append(proc)
        return proc

    def kill_started(self) -> None:
        """SIGKILLs what :meth:`popen` started that still runs (``ip netns exec`` becomes the
        command in the same process, so this reaches it before and after it entered)."""
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
        self._started = []

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Runs ``argv`` inside this host to completion; ``kwargs`` go to ``subprocess.run``."""
        return subprocess.run(self.command(argv), **kwargs)

    def limit(
        self, mbit: float | None, *, min_burst_bytes: int = MIN_BURST_BYTES, link: int = 0
    ) -> None:
        """Limits this host's link ``link`` to ``mbit`` Mbit/s in each direction; ``None``
        lifts it.

        A token bucket (``tc ... tbf``) on the host's interface bounds what it sends, and one
        on the switch's port bounds what it receives. ``min_burst_bytes``: the bucket's floor
        (:data:`MIN_BURST_BYTES`; ``benchmarks.link_cpu`` compares it with the old 64 KiB).
        """
        if mbit is not None and not mbit > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s or None (unlimited), got {mbit!r}")
        if min_burst_bytes < 1:
            raise ValueError(f"min_burst_bytes must be >= 1, got {min_burst_bytes}")
        ends = ((self.namespace, interface(link)), (self._switch, self._ports[link]))
        for namespace, device in ends:
            if mbit is not None:
                _run(
                    "tc",
                    "-n",
                    namespace,
                    "qdisc",
                    "replace",
                    "dev",
                    device,
                    "root",
                    *_tbf(mbit, min_burst_bytes),
                )
            elif "tbf" in _run("tc", "-n", namespace, "qdisc", "show", "dev", device).stdout:
                _run("tc", "-n", namespace, "qdisc", "del", "dev", device, "root")
        if link == 0:
            self.link_mbit = mbit

    def disconnect(self, link: int = 0) -> None:
        """Pulls this host's cable of link ``link`` at the switch: its traffic is dropped
        silently."""
        _ip("-n", self._switch, "link", "set", self._ports[link], "down")

    def reconnect(self, link: int = 0) -> None:
        """Plugs the cable back in (undoes :meth:`disconnect`)."""
        _ip("-n", self._switch, "link", "set", self._ports[link], "up")

    def _port_stats(self, link: int) -> dict[str, Any]:
        done = _ip("-n", self._switch, "-s", "-j", "link", "show", "dev", self._ports[link])
        return json.loads(done.stdout)[0]["stats64"]

    def bytes_sent(self, link: int = 0) -> int:
        """Bytes this host has put on its link ``link`` so far (Ethernet frames, headers
        included)."""
        return int(self._port_stats(link)["rx"]["bytes"])

    def bytes_received(self, link: int = 0) -> int:
        """Bytes delivered to this host over its link ``link`` so far."""
        return int(self._port_stats(link)["tx"]["bytes"])


class HostNetwork:
    """Hosts named ``hosts`` on one bridge per link (``links``, default 1, at most
    ``len(SUBNETS)``); a context manager (see the module doc).

    Host ``i`` of ``hosts`` gets address ``SUBNETS[k][2 + i]`` on link ``k``. Names are 1-10
    letters or digits.
    """

    def __init__(self, hosts: Sequence[str], links: int = 1) -> None:
        names = list(hosts)
        bad = [n for n in names if not _HOST_NAME.match(n) or n == _SWITCH]
        if bad or not names:
            raise ValueError(
                f"host names must be 1-10 letters or digits, not {_SWITCH!r}; got {names!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct, got {names!r}")
        if len(names) > SUBNET.num_addresses - _FIRST_HOST - 1:
            raise ValueError(f"{SUBNET} holds at most {SUBNET.num_addresses - 3} hosts")
        if not 1 <= links <= len(SUBNETS):
            raise ValueError(f"links must be 1 to {len(SUBNETS)}, got {links!r}")
        self._links = links
        base = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self._switch = f"{base}-{_SWITCH}"
        self._hosts = {
            name: Host(
                name,
                f"{base}-{name}",
                [str(SUBNETS[k][_FIRST_HOST + i]) for k in range(links)],
                self._switch,
                [_switch_port(i, k) for k in range(links)],
            )
            for i, name in enumerate(names)
        }
        self._made: list[str] = []

    def __getitem__(self, name: str) -> Host:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r}; hosts: {sorted(self._hosts)}") from None

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts.values())

    def __enter__(self) -> HostNetwork:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Makes the namespaces, the bridge and the links, and checks that they are isolated.

        Raises:
            NetworkSetupError: a command failed or a host could reach beyond :data:`SUBNET`
                (everything made so far is removed first).
        """
        reason = unavailable_reason()
        if reason is not None:
            raise NetworkSetupError(reason)
        remove_leftovers()
        try:
            self._add_namespace(self._switch)
            for link in range(self._links):
                _ip("-n", self._switch, "link", "add", _bridge(link), "type", "bridge")
                _ip("-n", self._switch, "link", "set", _bridge(link), "up")
            for host in self:
                self._add_host(host)
            for host in self:
                _check_isolated(host)
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)

    def _add_host(self, host: Host) -> None:
        self._add_namespace(host.namespace)
        ns = host.namespace
        _ip("-n", ns, "link", "set", "lo", "up")
        for link, (port, address) in enumerate(zip(host._ports, host.addresses, strict=True)):
            device = interface(link)
            _ip(
                "-n",
                self._switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                device,
                "netns",
                ns,
            )
            _ip("-n", self._switch, "link", "set", port, "master", _bridge(link), "up")
            # No IPv6 link-local address: the host's only addresses are its ones in SUBNETS.
            _ip("-n", ns, "link", "set", device, "addrgenmode", "none")
            prefix = SUBNETS[link].prefixlen
            _ip("-n", ns, "address", "add", f"{address}/{prefix}", "dev", device)
            _ip("-n", ns, "link", "set", device, "up")

    def close(self) -> None:
        """Kills every process left in the hosts and deletes everything :meth:`start` made.
        Idempotent. Raises ``NetworkSetupError`` naming what could not be removed."""
        failures = []
        for host in self._hosts.values():
            host.kill_started()
        for namespace in reversed(self._made):
            try:
                _delete_namespace(namespace)
            except (NetworkSetupError, OSError, subprocess.SubprocessError) as e:
                failures.append(f"{namespace}: {e}")
        self._made = []
        if failures:
            raise NetworkSetupError("could not remove " + "; ".join(failures))


def _check_isolated(host: Host) -> None:
    """Raises unless ``host`` has no default route, routes only into SUBNETS, and holds no
    address but its own and loopback's."""
    ns = host.namespace
    for family in ("-4", "-6"):
        default = _ip("-n", ns, family, "route", "show", "default").stdout.strip()
        if default:
            raise NetworkSetupError(f"host {host.name} ({ns}) has a default route: {default}")
    for route in json.loads(_ip("-n", ns, "-j", "-4", "route", "show").stdout or "[]"):
        dst = ipaddress.ip_network(route["dst"], strict=False)
        if not any(dst.subnet_of(net) for net in SUBNETS):
            raise NetworkSetupError(f"host {host.name} ({ns}) routes {dst} outside {SUBNETS}")
    for link in json.loads(_ip("-n", ns, "-j", "address", "show").stdout or "[]"):
        for info in link.get("addr_info", []):
            address = ipaddress.ip_address(info["local"])
            if not (address.is_loopback or str(address) in host.addresses):
                raise NetworkSetupError(
                    f"host {host.name} ({ns}) has address {address} on {link['ifname']}; "
                    f"expected only {', '.join(host.addresses)} and loopback"
                )


def main(argv: list[str] | None = None) -> None:
    """``python -m torchtitan_ft.testing.netns --remove-leftovers``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--remove-leftovers",
        action="store_true",
        help=f"delete the {PREFIX}-* namespaces of processes that no longer run",
    )
    args = parser.parse_args(argv)
    if not args.remove_leftovers:
        parser.error("nothing to do: pass --remove-leftovers")
    reason = unavailable_reason()
    if reason is not None:
        parser.exit(2, f"{parser.prog}: {reason}\n")
    removed = remove_leftovers()
    print("removed: " + (", ".join(removed) if removed else "nothing"))


if __name__ == "__main__":
    main()
