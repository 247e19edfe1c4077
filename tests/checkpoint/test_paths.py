"""The heal's choice among a donor's addresses and its fallback (``checkpoint.paths``)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from torchtitan_ft.addresses import Interface
from torchtitan_ft.checkpoint.paths import (
    Candidate,
    NoPathError,
    Offer,
    PathUsed,
    ProbeCache,
    decode_offer,
    encode_offer,
    falls_back,
    first_that_works,
    measured,
    missing_interfaces,
    not_here,
    offered,
    order,
)

ETH = Candidate("10.0.0.1:80", "eth0", link_mbit_s=100)
IB = Candidate("10.1.0.1:80", "ib0", link_mbit_s=100_000)
WIFI = Candidate("10.2.0.1:80", "wlan0")


@pytest.mark.parametrize(
    ("candidates", "pinned", "expected"),
    [
        # by the kernel's link speed, whatever the donor's order (torchft #329: Ethernet first)
        ([ETH, IB], (), [IB, ETH]),
        # unknown speed last; equal keys keep the donor's order
        ([WIFI, ETH, IB], (), [IB, ETH, WIFI]),
        (
            [ETH, Candidate("10.3.0.1:80", "eth1", link_mbit_s=100)],
            (),
            [ETH, Candidate("10.3.0.1:80", "eth1", link_mbit_s=100)],
        ),
        # a measurement wins over the reported speed
        (
            [
                Candidate("a:1", "ib0", 100_000, probe_mb_s=12.0),
                Candidate("b:1", "eth0", 100, 90.0),
            ],
            (),
            [Candidate("b:1", "eth0", 100, 90.0), Candidate("a:1", "ib0", 100_000, 12.0)],
        ),
        (
            [IB, Candidate("c:1", "eth2", probe_mb_s=5.0)],
            (),
            [Candidate("c:1", "eth2", probe_mb_s=5.0), IB],
        ),
        # the operator's pin keeps only its interfaces, even the slow one
        ([ETH, IB], ("eth0",), [ETH]),
        ([ETH, IB, WIFI], ("wlan0", "eth0"), [ETH, WIFI]),
    ],
)
def test_order(
    candidates: list[Candidate], pinned: tuple[str, ...], expected: list[Candidate]
) -> None:
    assert order(candidates, pinned) == expected


def test_a_pinned_interface_the_donor_does_not_offer_is_named() -> None:
    with pytest.raises(ValueError, match=r"'ib1' is not among .*10.0.0.1:80 \(eth0\)"):
        order([ETH, IB], ("ib1",))
    with pytest.raises(ValueError, match="offered no address"):
        order([])


def test_falls_back_in_order_and_reports_what_failed() -> None:
    tried: list[str] = []

    def attempt(c: Candidate) -> str:
        tried.append(c.address)
        if c is IB:
            raise ConnectionRefusedError("refused")
        return f"state via {c.address}"

    result, used, failures = first_that_works([IB, ETH, WIFI], attempt)
    assert (result, used) == ("state via 10.0.0.1:80", ETH)
    assert tried == ["10.1.0.1:80", "10.0.0.1:80"]  # WIFI not tried
    assert [f.candidate for f in failures] == [IB]


def test_no_working_address_names_each_one_tried_and_why() -> None:
    def attempt(c: Candidate) -> str:
        raise TimeoutError(f"no answer from {c.interface}")

    with pytest.raises(NoPathError) as error:
        first_that_works([IB, ETH], attempt)
    assert [f.candidate for f in error.value.failures] == [IB, ETH]
    message = str(error.value)
    assert "10.1.0.1:80 (TimeoutError: no answer from ib0)" in message
    assert "10.0.0.1:80 (TimeoutError: no answer from eth0)" in message
    with pytest.raises(ValueError, match="no address to try"):
        first_that_works([], attempt)


def test_only_network_errors_fall_back_to_the_next_path() -> None:
    refusal = ValueError("donor answered 400 Bad Request: it offers step 9")

    def attempt(c: Candidate) -> str:
        if c is IB:
            raise refusal  # the donor's answer: the same over every path
        return "state"

    with pytest.raises(ValueError) as error:
        first_that_works([IB, ETH], attempt)
    assert error.value is refusal


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ConnectionRefusedError("refused"), True),
        (ConnectionResetError("reset"), True),
        (TimeoutError("no byte from the donor for 10 s (stalled)"), True),
        (OSError(113, "No route to host"), True),
        (ValueError("donor answered 401 Unauthorized"), False),
        (ValueError("header describes 10 bytes, response has 9"), False),
        (RuntimeError("bug"), False),
    ],
)
def test_falls_back(error: BaseException, expected: bool) -> None:
    assert falls_back(error) is expected


LO = Interface("lo", ("127.0.0.1",), up=True, loopback=True, speed_mbit_s=None)
ETH0 = Interface("eth0", ("10.0.0.5", "fd00::5"), up=True, loopback=False, speed_mbit_s=1000)
IB0 = Interface("ib0", ("10.1.0.5",), up=True, loopback=False, speed_mbit_s=100_000)
DOWN = Interface("eth9", ("10.9.0.5",), up=False, loopback=False, speed_mbit_s=None)
BARE = Interface("eth8", (), up=True, loopback=False, speed_mbit_s=None)
HOST = [LO, ETH0, IB0, DOWN, BARE]


@pytest.mark.parametrize(
    ("primary", "allowed", "expected"),
    [
        # torchft #329: the name resolves to Ethernet; InfiniBand is offered too, after it
        ("10.0.0.5", (), [Offer("10.0.0.5", "eth0"), Offer("10.1.0.5", "ib0")]),
        # whatever the name resolves to comes first; down and address-less interfaces are not
        # offered, nor loopback, nor another family's address
        ("10.1.0.5", (), [Offer("10.1.0.5", "ib0"), Offer("10.0.0.5", "eth0")]),
        ("fd00::5", (), [Offer("fd00::5", "eth0")]),
        # a loopback name: a one-host job, offered alone
        ("127.0.0.1", (), [Offer("127.0.0.1", "lo")]),
        ("127.0.1.1", (), [Offer("127.0.1.1", None)]),
        # an address of no interface (resolved elsewhere): kept first, the others after it
        (
            "10.7.0.5",
            (),
            [Offer("10.7.0.5", None), Offer("10.0.0.5", "eth0"), Offer("10.1.0.5", "ib0")],
        ),
        # pinned: only the allowed interfaces, even when the name resolves to another
        ("10.0.0.5", ("ib0",), [Offer("10.1.0.5", "ib0")]),
        ("10.0.0.5", ("ib0", "eth0"), [Offer("10.0.0.5", "eth0"), Offer("10.1.0.5", "ib0")]),
        # a pinned interface with only another family's address still offers it
        ("fd00::9", ("ib0",), [Offer("10.1.0.5", "ib0")]),
    ],
)
def test_offered(primary: str, allowed: tuple[str, ...], expected: list[Offer]) -> None:
    assert offered(primary, HOST, allowed) == expected


def test_a_pinned_interface_that_does_not_exist_is_named_in_one_line() -> None:
    with pytest.raises(ValueError) as error:
        offered("10.0.0.5", HOST, ("ib0", "ib7"))
    message = str(error.value)
    assert "'ib7' does not exist on this host" in message and "\n" not in message
    assert "eth0, eth8, eth9, ib0, lo" in message
    assert missing_interfaces(("ib0", "eth0"), HOST) is None
    with pytest.raises(ValueError, match="no heal interface of eth9, eth8 is up with an address"):
        offered("10.0.0.5", HOST, ("eth9", "eth8"))


@pytest.mark.parametrize(
    ("offers", "candidates"),
    [
        (
            [Offer("10.0.0.5", "eth0"), Offer("10.1.0.5", "ib0")],
            [Candidate("10.0.0.5:8080", "eth0"), Candidate("10.1.0.5:8080", "ib0")],
        ),
        ([Offer("fd00::5", "eth0")], [Candidate("[fd00::5]:8080", "eth0")]),
        ([Offer("10.0.0.5", None)], [Candidate("node1:8080")]),  # no query: the URL's host
        (
            [Offer("10.7.0.5", None), Offer("10.0.0.5", "eth0")],
            [Candidate("10.7.0.5:8080"), Candidate("10.0.0.5:8080", "eth0")],
        ),
    ],
)
def test_the_offer_round_trips_through_the_url(
    offers: list[Offer], candidates: list[Candidate]
) -> None:
    url = encode_offer("node1", 8080, "/checkpoint", offers)
    assert decode_offer(url) == ("/checkpoint", candidates)
    # What a single-address reader takes from it (this project's before the offer): the host
    # name, the port and the path, the query ignored.
    old = urlsplit(url)
    assert (old.hostname, old.port, old.path) == ("node1", 8080, "/checkpoint")


def test_a_url_without_an_offer_is_its_own_one_path() -> None:
    assert decode_offer("http://[::1]:81/checkpoint/") == (
        "/checkpoint",
        [Candidate("[::1]:81")],
    )
    for bad in ("ftp://h:1/checkpoint", "http://h/checkpoint", "http://h:1/c?via=eth0"):
        with pytest.raises(ValueError, match=r"URL|<interface>/<address>"):
            decode_offer(bad)


@pytest.mark.parametrize(
    ("stored_at", "now", "expected"),
    [
        (100.0, 100.0, {"a:1": 5.0}),
        (100.0, 700.0, {"a:1": 5.0}),  # at the TTL: still fresh
        (100.0, 700.5, None),  # past it: probe again
        (100.0, 99.0, None),  # a clock that went back: probe again
    ],
)
def test_probe_cache_keeps_a_donors_rates_for_its_ttl(
    stored_at: float, now: float, expected: dict[str, float] | None
) -> None:
    cache = ProbeCache(ttl_s=600.0)
    cache.store("http://d:1/checkpoint?via=x", {"a:1": 5.0}, stored_at)
    assert cache.rates("http://d:1/checkpoint?via=x", now) == expected
    assert cache.rates("http://other:1/checkpoint", stored_at) is None  # per donor


def test_probe_cache_forgets_a_donor_whose_path_failed() -> None:
    cache = ProbeCache(ttl_s=600.0)
    cache.store("d", {"a:1": 5.0}, 0.0)
    cache.forget("d")
    assert cache.rates("d", 0.0) is None
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        ProbeCache(ttl_s=0)


def test_measured_then_ordered_takes_the_fastest_probe() -> None:
    slow = Candidate("10.0.0.5:1", "eth0")  # the host name's: first in the donor's order
    fast = Candidate("10.1.0.5:1", "ib0")
    got = measured([slow, fast], {"10.0.0.5:1": 11.8, "10.1.0.5:1": 950.0}, {"10.0.0.5:1": 10_000})
    assert order(got) == [
        Candidate("10.1.0.5:1", "ib0", None, 950.0),
        Candidate("10.0.0.5:1", "eth0", 10_000, 11.8),
    ]


def test_path_label_names_the_link() -> None:
    assert PathUsed("10.1.0.5:1", "ib0", 950.0).label() == "10.1.0.5:1 on ib0"
    assert PathUsed("node1:1", None, None).label() == "node1:1"


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        # a donor elsewhere: its address that is also this host's (a bridge's) is dropped
        (["10.0.0.5:1", "172.17.0.1:1", "10.1.0.5:1"], ["10.0.0.5:1", "10.1.0.5:1"]),
        # donor and healer on one host: every path stays
        (["172.17.0.1:1", "10.0.0.5:1"], ["172.17.0.1:1", "10.0.0.5:1"]),
        (["[fd00::9]:1", "[fd00::1]:1"], ["[fd00::9]:1"]),
        ([], []),
    ],
)
def test_paths_that_lead_back_to_this_host_are_dropped(
    addresses: list[str], expected: list[str]
) -> None:
    here = {"172.17.0.1", "fd00::1"}
    got = not_here([Candidate(a) for a in addresses], lambda host: host in here)
    assert [c.address for c in got] == expected
