"""Which addresses a replica group advertises, and the checks that say which one to set."""

from __future__ import annotations

import socket

import pytest

from torchtitan_ft.addresses import (
    Advertised,
    GlooRule,
    Interface,
    QuorumAddressCheck,
    Severity,
    advertised_host,
    advertised_store_host,
    gloo_address,
    gloo_bind_address,
    hostname_problem,
    is_local_address,
    is_loopback,
    loopback_address,
    quorum_address_problem,
    resolves_to_loopback,
    route_source,
)

# Two machines as the pure check sees them: this one (loopback, 10.0.0.2) and another (10.0.0.3).
_LOOPBACK = {"127.0.0.1", "localhost", "vm"}
_HERE = {"10.0.0.2"}


def _check(me: Advertised, *members: Advertised):
    return quorum_address_problem(
        me,
        [me, *members],
        loopback=lambda h: h in _LOOPBACK,
        here=lambda h: h in _HERE,
        towards=lambda h: "10.0.0.2" if h.startswith("10.0.0.") else None,
    )


def _group(replica: str, host: str, store_host: str | None = None) -> Advertised:
    return Advertised(replica, f"http://{host}:1234", f"{store_host or host}:5678")


def test_loopback_group_with_a_peer_on_another_host_is_told_which_address_to_set() -> None:
    problem = _check(_group("ft_1:u", "127.0.0.1"), _group("ft_0:u", "10.0.0.3"))
    assert problem is not None and problem.severity is Severity.ERROR
    assert problem.message == (
        "replica group 'ft_1:u' advertises loopback (127.0.0.1: manager "
        "http://127.0.0.1:1234, store 127.0.0.1:5678) but replica group 'ft_0:u' runs on "
        "another host (10.0.0.3) and cannot reach it; set fault_tolerance.hostname to "
        "10.0.0.2 (this host's address towards 10.0.0.3); the TCPStore follows it unless "
        "MASTER_ADDR is a loopback address set by hand (with torchrun, pass --local-addr, "
        "run_train.sh: LOCAL_ADDR)"
    )


def test_host_name_that_resolves_to_loopback_counts_as_loopback() -> None:
    """``hostname`` unset: the machine's name, mapped to 127.0.0.1 in /etc/hosts."""
    problem = _check(_group("ft_1:u", "vm", store_host="10.0.0.2"), _group("ft_0:u", "10.0.0.3"))
    assert problem is not None and problem.severity is Severity.ERROR
    assert "loopback (vm: manager http://vm:1234, store 10.0.0.2:5678)" in problem.message
    assert "set fault_tolerance.hostname to 10.0.0.2" in problem.message
    assert "TCPStore" not in problem.message  # the store is fine


def test_loopback_is_fine_when_every_peer_runs_on_this_host() -> None:
    assert _check(_group("a", "127.0.0.1"), _group("b", "localhost")) is None
    # A peer advertising one of this host's own addresses is on this host too.
    assert _check(_group("a", "127.0.0.1"), _group("b", "10.0.0.2")) is None
    assert _check(_group("a", "10.0.0.2")) is None  # alone


def test_peer_that_advertises_loopback_gets_a_warning_naming_it() -> None:
    problem = _check(_group("ft_0:u", "10.0.0.2"), _group("ft_1:u", "10.0.0.3", "localhost"))
    assert problem is not None and problem.severity is Severity.WARNING
    assert problem.message == (
        "replica group 'ft_1:u' advertises loopback (localhost: manager "
        "http://10.0.0.3:1234, store localhost:5678); unless it runs on this host no other "
        "group can reach it: set its fault_tolerance.hostname to its host's address"
    )


def test_without_a_route_the_message_still_says_what_to_set() -> None:
    problem = quorum_address_problem(
        _group("a", "127.0.0.1"),
        [_group("b", "192.0.2.9")],
        loopback=lambda h: h == "127.0.0.1",
        here=lambda h: False,
        towards=lambda h: None,
    )
    assert problem is not None
    assert "set fault_tolerance.hostname to an address of this host that 192.0.2.9 can reach" in (
        problem.message
    )


def test_check_runs_again_only_when_the_addresses_change(monkeypatch) -> None:
    import torchtitan_ft.addresses as addresses

    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return None

    monkeypatch.setattr(addresses, "quorum_address_problem", counted)
    check = QuorumAddressCheck()
    me, peer = _group("a", "10.0.0.2"), _group("b", "10.0.0.3")
    check(me, [me, peer])
    check(me, [peer, me])  # same members, other order
    assert len(calls) == 1
    check(me, [me, _group("b", "10.0.0.4")])
    assert len(calls) == 2


def test_store_behind_a_loopback_master_addr_is_advertised_under_hostname() -> None:
    """torchrun sets MASTER_ADDR to the node's FQDN, here often "localhost"."""
    assert advertised_store_host("localhost", "10.0.0.2") == "10.0.0.2"
    assert advertised_store_host("127.0.0.1", "node-a.example") == "node-a.example"
    assert advertised_store_host("localhost", "127.0.0.1") == "localhost"  # one machine
    assert advertised_store_host("10.0.0.5", "10.0.0.2") == "10.0.0.5"  # a node 0 elsewhere


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("LocalHost", True),
        ("localhost.localdomain", True),
        ("ip6-localhost", True),
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.2", False),
        ("vm", False),  # names are not resolved
        ("", False),
    ],
)
def test_is_loopback_is_one_definition_without_lookups(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_loopback_address_is_where_a_server_for_a_loopback_host_listens() -> None:
    assert loopback_address("localhost") == "127.0.0.1"
    assert loopback_address("localhost.localdomain") == "127.0.0.1"
    assert loopback_address("ip6-localhost") == "::1"
    assert loopback_address("[::1]") == "::1"
    assert loopback_address("127.0.0.2") == "127.0.0.2"
    with pytest.raises(ValueError, match="host 'vm' is not a loopback address or name"):
        loopback_address("vm")


def test_advertised_host_replaces_wildcards() -> None:
    for wildcard in ("", "0.0.0.0", "::"):
        assert advertised_host(wildcard) == socket.gethostname()
    assert advertised_host("127.0.0.1") == "127.0.0.1"


def test_names_and_addresses() -> None:
    assert resolves_to_loopback("localhost") and resolves_to_loopback("127.0.0.1")
    assert not resolves_to_loopback("192.0.2.77")
    assert is_local_address("127.0.0.1")
    assert not is_local_address("192.0.2.77")  # TEST-NET-1: never an address of this host
    assert not is_local_address("not-an-address")
    assert route_source("127.0.0.1") == "127.0.0.1"


# A host as the pure rule sees it: the route towards the store leaves over eth0 (1 Gbit/s);
# ib0 is faster, eth1 reports no speed, docker0 is a bridge of this host alone.
_ETH0 = Interface("eth0", ("10.0.0.2",), True, False, 1000.0)
_IB0 = Interface("ib0", ("10.1.0.2", "fd00::2"), True, False, 100000.0)
_IB1 = Interface("ib1", ("10.2.0.2",), True, False, 200000.0)
_ETH1 = Interface("eth1", ("10.3.0.2",), True, False, None)
_DOWN = Interface("ib2", ("10.4.0.2",), False, False, 400000.0)
_V6 = Interface("ib3", ("fd00::9",), True, False, 400000.0)
_LO = Interface("lo", ("127.0.0.1",), True, True, None)
_HOST = [_LO, _ETH0, _IB0, _ETH1, _DOWN, _V6]


@pytest.mark.parametrize(
    ("store", "env", "interfaces", "route", "pinned", "answering", "expected"),
    [
        # a loopback store: every peer is here, whatever else is set
        ("127.0.0.1", {"GLOO_SOCKET_IFNAME": "ib0"}, _HOST, None, ("ib0",), set(),
         ("127.0.0.1", GlooRule.LOOPBACK, None)),
        # GLOO_SOCKET_IFNAME: gloo's own choice, unchanged
        ("10.0.0.1", {"GLOO_SOCKET_IFNAME": "eth1,eth0"}, _HOST, "10.0.0.2", ("ib0",),
         {"10.1.0.2"}, (None, GlooRule.GLOO_SOCKET_IFNAME, "eth1")),
        # no route towards the store: gloo's default
        ("10.0.0.1", {}, _HOST, None, (), {"10.1.0.2"}, (None, GlooRule.DEFAULT, None)),
        # the fastest link the store answers from (down, other-family and silent ones skipped)
        ("10.0.0.1", {}, _HOST, "10.0.0.2", (), {"10.1.0.2"},
         ("10.1.0.2", GlooRule.FASTEST_LINK, "ib0")),
        ("10.0.0.1", {}, [*_HOST, _IB1], "10.0.0.2", (), {"10.1.0.2", "10.2.0.2"},
         ("10.2.0.2", GlooRule.FASTEST_LINK, "ib1")),
        ("10.0.0.1", {}, [*_HOST, _IB1], "10.0.0.2", (), {"10.1.0.2"},
         ("10.1.0.2", GlooRule.FASTEST_LINK, "ib0")),
        # the store's host cannot route back to the faster link: the route
        ("10.0.0.1", {}, _HOST, "10.0.0.2", (), set(), ("10.0.0.2", GlooRule.ROUTE, "eth0")),
        # the route's link reports no speed: nothing to compare, the route
        ("10.3.0.1", {}, _HOST, "10.3.0.2", (), {"10.1.0.2"},
         ("10.3.0.2", GlooRule.ROUTE, "eth1")),
        # the route already is the fastest link
        ("10.1.0.1", {}, _HOST, "10.1.0.2", (), {"10.0.0.2"}, ("10.1.0.2", GlooRule.ROUTE, "ib0")),
        # IPv6 store: only IPv6 addresses
        ("fd00::1", {}, _HOST, "fd00::2", (), {"fd00::9"},
         ("fd00::9", GlooRule.FASTEST_LINK, "ib3")),
        # the operator's heal pin wins over a faster link, if the store answers from it
        ("10.0.0.1", {}, [*_HOST, _IB1], "10.0.0.2", ("ib0",), {"10.1.0.2", "10.2.0.2"},
         ("10.1.0.2", GlooRule.PINNED, "ib0")),
        ("10.0.0.1", {}, _HOST, "10.0.0.2", ("eth0",), {"10.1.0.2"},
         ("10.0.0.2", GlooRule.PINNED, "eth0")),
        ("10.0.0.1", {}, _HOST, "10.0.0.2", ("ib7", "ib2", "ib0"), {"10.1.0.2"},
         ("10.1.0.2", GlooRule.PINNED, "ib0")),
        # a pin the store does not answer from: the route (not a faster link: the pin says
        # which network to use)
        ("10.0.0.1", {}, _HOST, "10.0.0.2", ("ib0",), set(), ("10.0.0.2", GlooRule.ROUTE, "eth0")),
    ],
)  # fmt: skip
def test_gloo_takes_the_pin_else_the_fastest_link_the_store_answers_from(
    store, env, interfaces, route, pinned, answering, expected
) -> None:
    asked: list[str] = []

    def answers_from(source: str) -> bool:
        asked.append(source)
        return source in answering

    choice = gloo_address(store, env, interfaces, route, pinned, answers_from)
    assert (choice.address, choice.rule, choice.interface) == expected
    assert "127.0.0.1" not in asked and "10.4.0.2" not in asked  # never loopback, never down
    line = choice.describe(store)
    assert "\n" not in line and choice.rule.value in line and store in line


def test_gloo_says_which_links_it_passed_over() -> None:
    choice = gloo_address("10.0.0.1", {}, _HOST, "10.0.0.2", ("ib7", "ib0"), lambda a: False)
    assert choice.passed_over == (
        "ib7 (not up with an IPv4 address)",
        "ib0 (the store does not answer from 10.1.0.2)",
    )
    assert choice.speed_mbit_s == 1000.0


def test_gloo_listens_on_the_route_towards_the_store() -> None:
    assert gloo_bind_address("localhost", {}) == "127.0.0.1"
    assert gloo_bind_address("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth0"}) == "127.0.0.1"
    assert gloo_bind_address("10.0.0.3", {"GLOO_SOCKET_IFNAME": "eth0"}) is None  # gloo's choice
    assert gloo_bind_address("192.0.2.77", {}) == route_source("192.0.2.77")


@pytest.mark.parametrize("hostname", ["127.0.0.1", "localhost"])
def test_hostname_of_this_host_is_accepted(hostname: str) -> None:
    assert hostname_problem(hostname, "http://127.0.0.1:29510") is None


def test_hostname_of_another_host_is_refused_with_the_address_to_use() -> None:
    message = hostname_problem("192.0.2.77", "http://127.0.0.1:29510")
    assert message == (
        "fault_tolerance.hostname='192.0.2.77' resolves to 192.0.2.77, which is not an address "
        "of this host; the other replica groups dial it and this group's servers listen on "
        "it: set it to an address of this host (e.g. 127.0.0.1, this host's address towards "
        "the lighthouse at http://127.0.0.1:29510)"
    )


def test_hostname_that_does_not_resolve_is_refused(monkeypatch) -> None:
    import torchtitan_ft.addresses as addresses

    monkeypatch.setattr(addresses, "resolve", lambda host: [])  # no DNS query from a test
    unresolved = hostname_problem("no-such-host.invalid", "http://no-such-host.invalid:1")
    assert unresolved is not None
    assert "'no-such-host.invalid' does not resolve to an address here" in unresolved
    assert "one the other replica groups can reach" in unresolved
