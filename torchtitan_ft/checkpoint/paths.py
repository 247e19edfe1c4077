"""Which of a donor's addresses a healing group fetches the state from, and the fallback when
one fails (pure: the interfaces, candidates, measurements, time and the attempt are inputs;
``HTTPTransport`` supplies them).

torchft #329: the donor advertised a host name that resolved to its Ethernet interface, so
the state crossed Ethernet (800 s) while InfiniBand sat idle (20 s when pinned by hand). Here:

- the donor offers every address it can serve on (:func:`offered`: the address its
  ``hostname`` resolves to first, then every other up, non-loopback interface's address of the
  same family; or only the interfaces an operator allows), in the URL it publishes
  (:func:`encode_offer`; the wire format is described there);
- the healer reads them back as :class:`Candidate` s (:func:`decode_offer`), measures each
  with a short probe, cached per donor (:class:`ProbeCache`), and orders them by what it knows
  (:func:`order`): a measured probe rate first (fastest first), then the link speed the
  kernel reports, then the donor's own order; a pinned interface keeps only the candidates on
  it;
- it then tries them in that order (:func:`first_that_works`) and falls back to the next when
  one fails on the way (:func:`falls_back`: a network error, not the donor's refusal); when
  none works, one error names each address tried and why (:class:`NoPathError`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit

from torchtitan_ft.addresses import Interface, interface_with, is_loopback
from torchtitan_ft.netaddr import ip_literal, join_host_port, url_host

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """One address a donor can serve its state on."""

    address: str
    """``host:port`` (or a URL) to fetch from."""
    interface: str | None = None
    """The donor's interface name for it (``ib0``, ``eth0``), when the donor said."""
    link_mbit_s: float | None = None
    """The link speed the kernel reports for the path (Mbit/s), when known."""
    probe_mb_s: float | None = None
    """The rate a short probe measured towards it (MB/s), when probed."""


def order(candidates: Sequence[Candidate], pinned: Sequence[str] = ()) -> list[Candidate]:
    """The candidates in the order to try them: probed ones by measured rate (fastest first),
    then the others by reported link speed (fastest first), then in the donor's order (the
    sort is stable). ``pinned`` (interface names) keeps only the candidates on them.

    Raises:
        ValueError: no candidates; ``pinned`` names no offered interface (the message lists
            those offered).
    """
    if not candidates:
        raise ValueError("the donor offered no address to heal from")
    if pinned:
        kept = [c for c in candidates if c.interface in pinned]
        if not kept:
            offered = ", ".join(
                f"{c.address} ({c.interface or 'interface not said'})" for c in candidates
            )
            raise ValueError(
                f"the pinned heal interface {', '.join(repr(p) for p in pinned)} is not among "
                f"the donor's addresses: {offered}; pin one of those interfaces or unpin it"
            )
        candidates = kept

    def key(c: Candidate) -> tuple[int, float, float]:
        if c.probe_mb_s is not None:
            return (0, -c.probe_mb_s, 0.0)
        return (1, 0.0, -(c.link_mbit_s or 0.0))

    return sorted(candidates, key=key)


@dataclass(frozen=True)
class PathUsed:
    """The path a heal's state came over, for the event stream and the status page."""

    address: str
    """``host:port`` dialled."""
    interface: str | None
    """The donor's interface for it, when the donor said."""
    probe_mb_s: float | None
    """What the probe measured towards it (MB/s), when probed."""
    failures: tuple[str, ...] = ()
    """The paths tried before it, each ``address (why)``, in order."""

    def label(self) -> str:
        """``address on interface`` (what the status page shows as the heal's path)."""
        return self.address + (f" on {self.interface}" if self.interface else "")


@dataclass(frozen=True)
class Failure:
    """An address tried in vain, and why."""

    candidate: Candidate
    error: BaseException

    def describe(self) -> str:
        """``address (ErrorType: message)``."""
        return f"{self.candidate.address} ({type(self.error).__name__}: {self.error})"


class NoPathError(RuntimeError):
    """None of the donor's addresses worked; ``failures`` says each one tried and why."""

    def __init__(self, failures: Sequence[Failure]) -> None:
        self.failures = list(failures)
        super().__init__(
            "no address of the donor worked; tried, in order: "
            + "; ".join(f.describe() for f in self.failures)
        )


def falls_back(error: BaseException) -> bool:
    """Whether a heal whose attempt on one path raised ``error`` tries the next path: yes for
    a network error (``OSError``: refused, reset, unreachable, a stalled or timed-out read),
    which another path may not have; no for anything else (the donor refused or sent
    something malformed: every path leads to the same donor and would get the same answer)."""
    return isinstance(error, OSError)


def first_that_works(
    ordered: Sequence[Candidate],
    attempt: Callable[[Candidate], T],
    fall_back: Callable[[BaseException], bool] = falls_back,
) -> tuple[T, Candidate, list[Failure]]:
    """Calls ``attempt`` on each candidate in turn until one returns; returns its result, the
    candidate and the failures before it (for the event stream and the log). An attempt that
    raises an error ``fall_back`` refuses ends the heal with that error.

    Raises:
        NoPathError: every attempt raised an error ``fall_back`` accepts.
        ValueError: no candidates.
    """
    if not ordered:
        raise ValueError("no address to try")
    failures: list[Failure] = []
    for candidate in ordered:
        try:
            return attempt(candidate), candidate, failures
        except Exception as e:
            if not fall_back(e):
                raise
            failures.append(Failure(candidate, e))  # the next candidate is tried
    raise NoPathError(failures)


# ------------------------------------------------------------------------- the donor's offer

OFFER_KEY = "via"
"""The query key of each offered path in the published URL (see :func:`encode_offer`)."""


@dataclass(frozen=True)
class Offer:
    """An address the donor serves on, and the donor's interface that holds it."""

    address: str
    """An IP literal, or the host name itself when it did not resolve to a local address."""
    interface: str | None


def offered(
    primary: str, interfaces: Sequence[Interface], allowed: Sequence[str] = ()
) -> list[Offer]:
    """The addresses a donor offers, in its order of preference.

    Args:
        primary: the address its ``hostname`` resolves to (what torchft offers alone).
        interfaces: this host's interfaces (``addresses.local_interfaces()``).
        allowed: the interfaces an operator allows (pins); empty: every interface.

    Returns:
        with nothing allowed: ``primary`` first, then every address of the same IP family on
        each other interface that is up and not loopback; only ``primary`` when it is a
        loopback address (a single-host job). With ``allowed``: the addresses of the same
        family as ``primary`` on those interfaces, ``primary`` first if it is one of them
        (any family when none of that family is there).

    Raises:
        ValueError: an allowed interface does not exist here, or none of them is up with an
            address (the message names them and this host's interfaces).
    """
    problem = missing_interfaces(allowed, interfaces)
    if problem is not None:
        raise ValueError(problem)
    by_name = {i.name: i for i in interfaces}
    home = interface_with(primary, interfaces)
    if not allowed and (is_loopback(primary) or (home is not None and home.loopback)):
        return [Offer(primary, home.name if home is not None else None)]
    family = _family(primary)
    offers: list[Offer] = []
    if home is not None and (not allowed or home.name in allowed):
        offers.append(Offer(primary, home.name))
    elif not allowed:
        offers.append(Offer(primary, None))
    pool = [by_name[n] for n in allowed] if allowed else [i for i in interfaces if not i.loopback]
    usable = [i for i in pool if i.up and i.addresses]
    for interface in usable:
        for address in interface.addresses:
            if _family(address) == family and Offer(address, interface.name) not in offers:
                offers.append(Offer(address, interface.name))
    if allowed and not offers:
        offers = [Offer(a, i.name) for i in usable for a in i.addresses]
    if not offers:
        raise ValueError(
            f"no heal interface of {', '.join(allowed)} is up with an address here; "
            "bring one up or name another"
        )
    return offers


def missing_interfaces(names: Sequence[str], interfaces: Sequence[Interface]) -> str | None:
    """What is wrong when some of ``names`` (pinned heal interfaces) are not among this host's
    ``interfaces``, in one line naming them and the host's interfaces; ``None`` if all are."""
    present = {i.name for i in interfaces}
    missing = [name for name in names if name not in present]
    if not missing:
        return None
    return (
        f"heal interface {', '.join(repr(n) for n in missing)} does not exist on this host "
        f"(its interfaces: {', '.join(sorted(present)) or 'none'}); name an existing one or "
        "leave the setting empty to use every interface"
    )


def _family(address: str) -> int:
    literal = ip_literal(address)
    return literal.version if literal is not None else 0


def encode_offer(host: str, port: int, path: str, offers: Sequence[Offer]) -> str:
    """The URL a donor publishes: ``http://<host>:<port><path>``, and a query with one
    ``via=<interface>/<address>`` per offer, in its order (``<interface>`` empty when unknown;
    ``/`` cannot occur in an interface name); no query for a single offer whose interface is
    unknown (nothing to add to the URL).

    Backward compatible: the URL without its query is what a single-address reader dials
    (this project's readers before the query existed ignore it: they take only the host,
    port and path), and ``host`` is kept as given (the name peers resolved before)."""
    base = f"http://{url_host(host)}:{port}{path}"
    if len(offers) <= 1 and all(o.interface is None for o in offers):
        return base
    query = urlencode([(OFFER_KEY, f"{o.interface or ''}/{o.address}") for o in offers])
    return f"{base}?{query}"


def decode_offer(metadata: str) -> tuple[str, list[Candidate]]:
    """The path and the candidates of a donor's URL (:func:`encode_offer`): one per ``via``
    in the donor's order, or the URL's own host alone when it has none.

    Raises:
        ValueError: not an ``http://host:port/...`` URL, or a malformed ``via``.
    """
    url = urlsplit(metadata)
    if url.scheme != "http" or url.hostname is None or url.port is None:
        raise ValueError(f"metadata {metadata!r} is not an http://host:port/... URL")
    vias = parse_qs(url.query).get(OFFER_KEY, [])
    candidates = []
    for via in vias:
        interface, sep, address = via.partition("/")
        if not sep or not address:
            raise ValueError(f"{OFFER_KEY}={via!r} in {metadata!r} is not <interface>/<address>")
        candidates.append(Candidate(join_host_port(address, url.port), interface or None))
    if not candidates:
        candidates = [Candidate(join_host_port(url.hostname, url.port))]
    return url.path.rstrip("/"), candidates


# ----------------------------------------------------------------------- what the healer knows


def not_here(candidates: Sequence[Candidate], is_local: Callable[[str], bool]) -> list[Candidate]:
    """``candidates`` without those whose host is an address of the healer's own host
    (``is_local``), unless the donor's first one is too (donor and healer share a host).

    A donor on another host may offer an address that every host of the cluster holds (a
    container bridge's, say): dialled here it reaches this host, not the donor."""
    if not candidates or is_local(_host(candidates[0])):
        return list(candidates)
    return [c for c in candidates if not is_local(_host(c))]


def _host(candidate: Candidate) -> str:
    return candidate.address.rpartition(":")[0].strip("[]")


class ProbeCache:
    """Each donor's probed rates, kept for ``ttl_s`` seconds (pure: the time is an input).

    Keyed by the donor's published URL (a donor restarted elsewhere publishes another one).
    """

    def __init__(self, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        self._ttl_s = ttl_s
        self._entries: dict[str, tuple[float, dict[str, float]]] = {}

    def rates(self, peer: str, now: float) -> dict[str, float] | None:
        """The rates (MB/s by candidate address) probed towards ``peer`` at most ``ttl_s``
        before ``now``; ``None``: probe again."""
        entry = self._entries.get(peer)
        if entry is None or now - entry[0] > self._ttl_s or now < entry[0]:
            return None
        return dict(entry[1])

    def store(self, peer: str, rates: Mapping[str, float], now: float) -> None:
        """Keeps the rates just probed towards ``peer``."""
        self._entries[peer] = (now, dict(rates))

    def forget(self, peer: str) -> None:
        """Drops ``peer``'s rates (a path failed: the next heal probes again)."""
        self._entries.pop(peer, None)


def measured(
    candidates: Sequence[Candidate],
    rates: Mapping[str, float],
    speeds: Mapping[str, float | None],
) -> list[Candidate]:
    """``candidates`` with the probed rate (MB/s) and the reported link speed (Mbit/s) of each
    filled in from ``rates`` and ``speeds`` (by address; a missing one stays unknown)."""
    return [
        replace(c, probe_mb_s=rates.get(c.address), link_mbit_s=speeds.get(c.address))
        for c in candidates
    ]
