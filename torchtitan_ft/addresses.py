"""Address policy: what counts as loopback, which address a server binds and advertises, and
whether the replica groups can reach each other; in every trainer rank (the ManagerServer's
checks on group rank 0's ManagerServer loop) and the lighthouse. (Address syntax:
:mod:`torchtitan_ft.netaddr`.)

A replica group is reached by the other groups at three addresses, all advertised to the
lighthouse by its ManagerServer: the ManagerServer itself (``http://<hostname>:<port>``), the
checkpoint servers of its ranks (``http://<hostname>:<port>/checkpoint``) and its TCPStore
(``<store host>:<port>``, where the cross-group process groups rendezvous). On one machine
everything may be loopback; across machines a loopback address names the dialer's own machine,
and a group advertising one cannot be reached. Nothing fails at once then: the quorum forms,
and every reconfiguration with that group times out. The functions here decide the
addresses, and turn a wrong one into one clear line at the group's first quorum, naming the
address to set:

- :func:`is_loopback`: the one definition of a loopback host (an address in ``127.0.0.0/8``
  or ``::1``, or a name in :data:`LOOPBACK_NAMES`), without a name lookup;
  :func:`resolves_to_loopback` also resolves other names; :func:`loopback_address` is the
  address a server listens on for a loopback host.
- :func:`advertised_host`: the name peers dial for a server bound to a wildcard address.
- :func:`advertised_store_host`: the TCPStore host to advertise. torchrun gives its workers
  ``MASTER_ADDR`` = the node's ``--local-addr``, else its FQDN, which is often ``localhost``;
  the store (torchrun's agent store) then runs on this machine and listens on every interface,
  so it is advertised under ``hostname`` instead.
- :func:`quorum_address_problem` (pure; resolution and routing are passed in): after every
  quorum, a group that advertises loopback while a member runs on another host gets an error
  (fatal, even for a group that trained before: ``manager.decisions.QuorumGate``); a group
  seeing a member that advertises loopback gets a warning naming it.
  :class:`QuorumAddressCheck` runs it with the real resolver, once per set of member addresses.
- :func:`listening`: whether a server accepts connections at a URL; :func:`absent_here`: a URL
  of this machine where nothing does (a launcher's check of a lighthouse it is given).
- :func:`hostname_problem`: at start-up, a ``hostname`` that is not an address of this host
  (the checkpoint server could not listen on it).
- :func:`gloo_bind_address`: the local address the cross-group gloo transport listens on and
  advertises, by the heal's rule where it is ours to choose (:func:`gloo_address`, pure): the
  pinned heal interface, else a link faster than the route's that the store answers from,
  else the one the kernel routes towards the quorum's store; ``GLOO_SOCKET_IFNAME`` leaves
  the choice to gloo.
- :func:`local_interfaces`: this host's network interfaces, their addresses, whether they are
  up and the link speed the kernel reports (the heal's paths, ``checkpoint.paths``).
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlparse

from torchtitan_ft.netaddr import WILDCARD_HOSTS, ip_literal, url_hostname

LOOPBACK_NAMES = {
    "localhost": "127.0.0.1",
    "localhost.localdomain": "127.0.0.1",
    "ip6-localhost": "::1",
}
"""The names that are loopback without a lookup (lower case), and the address a server that
peers reach under that name listens on."""
logger = logging.getLogger(__name__)

GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
HOSTNAME_SETTING = "fault_tolerance.hostname"
"""How the setting is named in messages (the Manager's ``hostname`` argument)."""
_DISCARD_PORT = 9
"""Any port: connecting a UDP socket only picks a route, it sends nothing."""
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IF6_TABLE = "/proc/net/if_inet6"
_SYS_NET = "/sys/class/net"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback without a name lookup: an address in
    ``127.0.0.0/8`` or ``::1`` (brackets allowed), or one of :data:`LOOPBACK_NAMES` (any
    case). Other names count as not loopback (:func:`resolves_to_loopback` resolves them)."""
    literal = ip_literal(host)
    return literal.is_loopback if literal is not None else host.lower() in LOOPBACK_NAMES


def loopback_address(host: str) -> str:
    """The address a server listens on when peers dial it at the loopback ``host``
    (:func:`is_loopback`): ``host`` itself if it is an address (brackets removed), else the
    address :data:`LOOPBACK_NAMES` gives its name."""
    literal = ip_literal(host)
    if literal is not None:
        return str(literal)
    try:
        return LOOPBACK_NAMES[host.lower()]
    except KeyError:
        raise ValueError(
            f"host {host!r} is not a loopback address or name, expected one of "
            f"127.0.0.0/8, ::1, {', '.join(sorted(LOOPBACK_NAMES))}"
        ) from None


def advertised_host(host: str) -> str:
    """The name peers should dial for a server bound to ``host``: this machine's host name
    (looked up now) for a wildcard bind, else ``host`` itself."""
    return socket.gethostname() if host in WILDCARD_HOSTS else host


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to here (``[]`` if it does not resolve)."""
    literal = ip_literal(host)
    if literal is not None:
        return [str(literal)]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def resolves_to_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (by name, or every address it resolves
    to is loopback, e.g. a host name mapped to 127.0.1.1 in /etc/hosts)."""
    if is_loopback(host):
        return True
    addresses = resolve(host)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_local_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) belongs to this host: a socket can bind it."""
    literal = ip_literal(address)
    if literal is None:
        return False
    family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(literal), 0))
        except OSError:
            return False
    return True


def runs_here(host: str) -> bool:
    """Whether ``host`` (a name or address) resolves to an address of this host."""
    return any(is_local_address(a) for a in resolve(host))


def listening(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``address`` (``http://host:port``)."""
    url = urlparse(address if "://" in address else f"http://{address}")
    if url.hostname is None or url.port is None:
        return False
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def absent_here(address: str, wait_s: float = 10.0) -> bool:
    """Whether ``address`` (``http://host:port``) names this machine (loopback, or one of its
    addresses) and nothing accepts TCP connections there within ``wait_s`` seconds (a server
    started just before, e.g. with ``&``, is given that long): a server that is not running.
    An address of another host is not probed (False): a launcher may not reach a cluster's
    network from where it submits."""
    host = urlparse(address if "://" in address else f"http://{address}").hostname
    if host is None or not (resolves_to_loopback(host) or runs_here(host)):
        return False
    deadline = time.monotonic() + wait_s
    while not listening(address, timeout_s=1.0):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)
    return False


def route_source(host: str) -> str | None:
    """This host's address on the route towards ``host``: the address peers there can dial
    back. ``None`` if ``host`` does not resolve or is unreachable. Sends nothing."""
    for address in resolve(host):
        literal = ipaddress.ip_address(address)
        family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, _DISCARD_PORT))
            except OSError:
                continue
            return str(probe.getsockname()[0])
    return None


@dataclass(frozen=True)
class Interface:
    """One network interface of this host, as the kernel reports it."""

    name: str
    addresses: tuple[str, ...]
    """Its IPv4 address (the primary one) and its global IPv6 addresses, in that order."""
    up: bool
    loopback: bool
    speed_mbit_s: float | None
    """The link speed the kernel reports (``/sys/class/net/<name>/speed``); ``None`` when it
    reports none (loopback, virtual or down links)."""


def local_interfaces() -> list[Interface]:
    """This host's network interfaces (``socket.if_nameindex``), each with its primary IPv4
    address (``SIOCGIFADDR``), its global-scope IPv6 addresses (``/proc/net/if_inet6``; a
    link-local one needs a scope and is left out), its flags and link speed. Linux only."""
    ipv6: dict[str, list[str]] = {}
    try:
        with open(_IF6_TABLE) as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6 and fields[3] == "00":  # scope: global
                    ipv6.setdefault(fields[5], []).append(
                        str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                    )
    except OSError:
        pass  # no IPv6 here
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request)
            except OSError:
                continue  # gone since the listing
            flags = struct.unpack("H", reply[16:18])[0]
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
                v4 = [socket.inet_ntoa(reply[20:24])]
            except OSError:
                v4 = []  # no IPv4 address
            found.append(
                Interface(
                    name,
                    tuple(v4 + ipv6.get(name, [])),
                    bool(flags & _IFF_UP),
                    bool(flags & _IFF_LOOPBACK),
                    link_speed_mbit_s(name),
                )
            )
    return found


def link_speed_mbit_s(name: str) -> float | None:
    """The speed the kernel reports for interface ``name`` in Mbit/s, ``None`` if none (a
    virtual link reports -1 or nothing, a tunnel or loopback an error)."""
    try:
        with open(f"{_SYS_NET}/{name}/speed") as f:
            speed = float(f.read().strip())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None


def interface_with(address: str, interfaces: Sequence[Interface]) -> Interface | None:
    """The interface of ``interfaces`` that holds ``address`` (an IP literal), if any."""
    literal = ip_literal(address)
    if literal is None:
        return None
    for interface in interfaces:
        if any(ipaddress.ip_address(a) == literal for a in interface.addresses):
            return interface
    return None


# ---------------------------------------------------------------------------- what to advertise


def advertised_store_host(store_host: str, hostname: str) -> str:
    """The host to advertise for the replica group's TCPStore, found at ``store_host``
    (``MASTER_ADDR``): ``hostname`` when ``store_host`` is a loopback name and ``hostname``
    is not (the store is on this machine, and peers on other machines dial ``hostname``),
    else ``store_host``."""
    if is_loopback(store_host) and not is_loopback(hostname):
        return hostname
    return store_host


class GlooRule(Enum):
    """Why the cross-group gloo group listens on the address it does (:func:`gloo_address`)."""

    LOOPBACK = "loopback store"
    """The store is on loopback: every peer is on this host."""
    GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
    """The operator named gloo's interface: gloo's own choice, left alone."""
    PINNED = "pinned heal interface"
    """The interface the operator pinned heals to (``TORCHFT_HEAL_INTERFACES``)."""
    FASTEST_LINK = "fastest link"
    """A link the kernel reports faster than the route's, from which the store answers."""
    ROUTE = "route to the store"
    """The address the kernel routes towards the store from."""
    DEFAULT = "gloo's default"
    """No route towards the store: gloo's default (the address of this machine's name)."""


@dataclass(frozen=True)
class GlooAddress:
    """The address a cross-group gloo group listens on and advertises, and why."""

    address: str | None
    """``None``: gloo chooses (``GLOO_SOCKET_IFNAME``, or its default)."""
    rule: GlooRule
    interface: str | None = None
    """This host's interface holding ``address`` (or ``GLOO_SOCKET_IFNAME``'s), when known."""
    speed_mbit_s: float | None = None
    """The link speed the kernel reports for ``interface``, when it does."""
    passed_over: tuple[str, ...] = ()
    """Faster or pinned interfaces not taken, each ``name (why)``."""

    def describe(self, store_host: str) -> str:
        """One line for the log: the address, its interface and link speed, the rule."""
        where = self.address or "gloo's choice"
        if self.interface:
            where += f" on {self.interface}"
        if self.speed_mbit_s:
            where += f" ({self.speed_mbit_s:g} Mbit/s)"
        skipped = f"; not {', '.join(self.passed_over)}" if self.passed_over else ""
        return (
            f"cross-group gloo group listens on {where}: {self.rule.value} (store "
            f"{store_host}){skipped}"
        )


def gloo_address(
    store_host: str,
    env: Mapping[str, str],
    interfaces: Sequence[Interface],
    route: str | None,
    pinned: Sequence[str],
    answers_from: Callable[[str], bool],
) -> GlooAddress:
    """The address a cross-group gloo group whose store is at ``store_host`` listens on and
    advertises (pure: the interfaces, the route and the reachability test are inputs).

    Gloo takes one address per group and every peer dials the address each rank advertises,
    so the choice is one address, and it must be one the peers reach. In order:

    1. ``127.0.0.1`` for a loopback store (every peer is on this host);
    2. ``None`` when ``GLOO_SOCKET_IFNAME`` is set (gloo then uses that interface; unchanged);
    3. ``None`` without a ``route`` (this host's address towards the store): gloo's default;
    4. the first ``pinned`` interface (the heal pin) that is up with an address of the route's
       family, if it holds the route or the store answers from its address;
    5. with no pin, the fastest up, non-loopback interface whose reported link speed exceeds
       that of the route's interface (which must report one), holding an address of the
       route's family that the store answers from (a link the kernel cannot compare, or one
       the store's host cannot route back to, is not taken);
    6. ``route``.

    Args:
        store_host: the quorum's store host (a name or an address).
        env: the environment (``GLOO_SOCKET_IFNAME``).
        interfaces: this host's interfaces (:func:`local_interfaces`).
        route: :func:`route_source` of ``store_host``.
        pinned: the heal interfaces the operator pinned (empty: none).
        answers_from: whether the store's host answers a connection from a local address
            (:func:`store_answers_from`): its host routes back to that address.
    """
    if is_loopback(store_host):
        return GlooAddress("127.0.0.1", GlooRule.LOOPBACK)
    if env.get(GLOO_SOCKET_IFNAME_ENV):
        name = env[GLOO_SOCKET_IFNAME_ENV].split(",")[0]
        return GlooAddress(None, GlooRule.GLOO_SOCKET_IFNAME, name)
    if route is None:
        return GlooAddress(None, GlooRule.DEFAULT)
    family = ipaddress.ip_address(route).version
    home = interface_with(route, interfaces)
    speed = home.speed_mbit_s if home is not None else None
    passed: list[str] = []

    def address_on(interface: Interface) -> str | None:
        found = [a for a in interface.addresses if ipaddress.ip_address(a).version == family]
        return found[0] if interface.up and found else None

    by_name = {i.name: i for i in interfaces}
    for name in pinned:
        interface = by_name.get(name)
        address = address_on(interface) if interface is not None else None
        if interface is None or address is None:
            passed.append(f"{name} (not up with an IPv{family} address)")
        elif interface == home:
            return GlooAddress(route, GlooRule.PINNED, name, speed, tuple(passed))
        elif answers_from(address):
            return GlooAddress(
                address, GlooRule.PINNED, name, interface.speed_mbit_s, tuple(passed)
            )
        else:
            passed.append(f"{name} (the store does not answer from {address})")
    if not pinned and speed is not None:
        faster = [
            (i, address)
            for i in interfaces
            if not i.loopback and i != home and (i.speed_mbit_s or 0) > speed
            if (address := address_on(i)) is not None
        ]
        for interface, address in sorted(faster, key=lambda pair: -(pair[0].speed_mbit_s or 0)):
            if answers_from(address):
                return GlooAddress(
                    address,
                    GlooRule.FASTEST_LINK,
                    interface.name,
                    interface.speed_mbit_s,
                    tuple(passed),
                )
            passed.append(f"{interface.name} (the store does not answer from {address})")
    return GlooAddress(
        route, GlooRule.ROUTE, home.name if home is not None else None, speed, tuple(passed)
    )


ANSWER_TIMEOUT_S = 1.0
"""How long :func:`store_answers_from` waits for the store's host to answer."""


def store_answers_from(source: str, host: str, timeout_s: float = ANSWER_TIMEOUT_S) -> bool:
    """Whether ``host`` answers a TCP connection made from the local address ``source``: an
    accepted or refused connection (the refusal came back to ``source``) means its host
    routes back to that address; silence or an error means not. Dials the discard port."""
    for address in resolve(host)[:1]:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout_s)
            try:
                probe.bind((source, 0))
                probe.connect((address, _DISCARD_PORT))
            except ConnectionRefusedError:
                return True
            except OSError:
                return False
            return True
    return False


def gloo_bind_address(
    store_host: str, env: Mapping[str, str], pinned: Sequence[str] | None = None
) -> str | None:
    """The address a cross-group gloo group whose store is at ``store_host`` listens on (and
    tells its peers): :func:`gloo_address` with this host's interfaces, its route towards the
    store and the heal pin: ``pinned`` (the group's ``heal_interfaces``), else that of ``env``
    (``TORCHFT_HEAL_INTERFACES``). Decided once per store host, environment and pin in a
    process, and said in one log line then."""
    if pinned is None:
        # load order: the Manager package imports this module (through the process groups)
        from torchtitan_ft.manager.settings import resolve_heal_interfaces

        pinned = resolve_heal_interfaces(None, env).value
    gloo_env = env.get(GLOO_SOCKET_IFNAME_ENV, "")
    return _decided(store_host, gloo_env, tuple(pinned)).address


@functools.lru_cache(maxsize=16)
def _decided(store_host: str, gloo_env: str, pinned: tuple[str, ...]) -> GlooAddress:
    env = {GLOO_SOCKET_IFNAME_ENV: gloo_env} if gloo_env else {}
    loopback = is_loopback(store_host)
    choice = gloo_address(
        store_host,
        env,
        [] if loopback or gloo_env else local_interfaces(),
        None if loopback or gloo_env else route_source(store_host),
        pinned,
        lambda source: store_answers_from(source, store_host),
    )
    logger.info(choice.describe(store_host))
    return choice


def hostname_problem(hostname: str, lighthouse_addr: str, unset: bool = False) -> str | None:
    """Why this group cannot listen on ``hostname`` (it is not an address of this host), or
    ``None``. ``unset``: ``hostname`` is the machine's name, used because the setting is
    empty. The message suggests this host's address towards the lighthouse."""
    addresses = resolve(hostname)
    if not addresses:
        what = "does not resolve to an address here"
    elif any(is_local_address(a) for a in addresses):
        return None
    else:
        what = f"resolves to {', '.join(addresses)}, which is not an address of this host"
    suggestion = route_source(url_hostname(lighthouse_addr))
    towards = (
        f"e.g. {suggestion}, this host's address towards the lighthouse at {lighthouse_addr}"
        if suggestion
        else "one the other replica groups can reach"
    )
    setting = (
        f"{HOSTNAME_SETTING} is unset and this machine's name {hostname!r}"
        if unset
        else f"{HOSTNAME_SETTING}={hostname!r}"
    )
    return (
        f"{setting} {what}; the other replica groups dial it and this "
        f"group's servers listen on it: set it to an address of this host ({towards})"
    )


# ------------------------------------------------------------------------ checks after a quorum


class Severity(Enum):
    ERROR = "error"
    """This group cannot be reached by a member: it cannot train with it."""
    WARNING = "warning"
    """A member advertises loopback: it cannot be reached unless it runs on this host."""


@dataclass(frozen=True)
class Advertised:
    """What one member of a quorum advertises (``QuorumMember.address`` / ``store_address``)."""

    replica_id: str
    manager_address: str
    """``http://host:port`` of its ManagerServer."""
    store_address: str
    """``host:port`` of its TCPStore."""

    def hosts(self) -> list[str]:
        return list(
            dict.fromkeys([url_hostname(self.manager_address), url_hostname(self.store_address)])
        )


@dataclass(frozen=True)
class AddressProblem:
    severity: Severity
    message: str


def quorum_address_problem(
    me: Advertised,
    members: Sequence[Advertised],
    loopback: Callable[[str], bool],
    here: Callable[[str], bool],
    towards: Callable[[str], str | None],
) -> AddressProblem | None:
    """Whether the members of a quorum can reach each other at what they advertise.

    Args:
        me: this replica group.
        members: every member of the quorum (``me`` may be among them; it is skipped).
        loopback: whether a host names loopback (:func:`resolves_to_loopback`).
        here: whether a host is an address of this machine (:func:`runs_here`).
        towards: this machine's address on the route to a host (:func:`route_source`).

    Returns:
        an ERROR when this group advertises a loopback host and some member runs on another
        machine (its host is neither loopback nor one of this machine's), naming the address
        to set; else a WARNING when some member advertises a loopback host while this group
        does not (fine if that member runs on this machine, fatal for it otherwise); else
        ``None``.
    """
    peers = [m for m in members if m.replica_id != me.replica_id]
    mine = [h for h in me.hosts() if loopback(h)]
    if mine:
        for peer in peers:
            remote = [h for h in peer.hosts() if not loopback(h) and not here(h)]
            if remote:
                return AddressProblem(
                    Severity.ERROR, _unreachable(me, mine, peer, remote[0], towards)
                )
        return None
    for peer in peers:
        theirs = [h for h in peer.hosts() if loopback(h)]
        if theirs:
            return AddressProblem(
                Severity.WARNING,
                f"replica group {peer.replica_id!r} advertises loopback ({', '.join(theirs)}: "
                f"manager {peer.manager_address}, store {peer.store_address}); unless it runs "
                f"on this host no other group can reach it: set its {HOSTNAME_SETTING} to "
                "its host's address",
            )
    return None


def _unreachable(
    me: Advertised,
    mine: list[str],
    peer: Advertised,
    peer_host: str,
    towards: Callable[[str], str | None],
) -> str:
    address = towards(peer_host)
    target = (
        f"{address} (this host's address towards {peer_host})"
        if address
        else (f"an address of this host that {peer_host} can reach")
    )
    store = ""
    if url_hostname(me.store_address) in mine:
        store = (
            "; the TCPStore follows it unless MASTER_ADDR is a loopback address set by hand "
            "(with torchrun, pass --local-addr, run_train.sh: LOCAL_ADDR)"
        )
    return (
        f"replica group {me.replica_id!r} advertises loopback ({', '.join(mine)}: manager "
        f"{me.manager_address}, store {me.store_address}) but replica group "
        f"{peer.replica_id!r} runs on another host ({peer_host}) and cannot reach it; set "
        f"{HOSTNAME_SETTING} to {target}{store}"
    )


class QuorumAddressCheck:
    """:func:`quorum_address_problem` with this machine's resolver, computed again only when
    the members' addresses change (resolving names may be slow)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._problem: AddressProblem | None = None

    def known(self, me: Advertised, members: Sequence[Advertised]) -> bool:
        """Whether the answer for these addresses is computed already (a call returns at
        once, with no name lookup)."""
        return self._key_of(me, members) == self._key

    @staticmethod
    def _key_of(me: Advertised, members: Sequence[Advertised]) -> tuple[object, ...]:
        return (me, tuple(sorted(members, key=lambda m: m.replica_id)))

    def __call__(self, me: Advertised, members: Sequence[Advertised]) -> AddressProblem | None:
        key = self._key_of(me, members)
        if key != self._key:
            self._problem = quorum_address_problem(
                me, members, resolves_to_loopback, runs_here, route_source
            )
            self._key = key
        return self._problem
