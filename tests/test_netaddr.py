"""Host and port strings (``torchtitan_ft.netaddr``): parsing with IPv6 brackets, loopback,
formatting, and the port probe against a real listening socket."""

from __future__ import annotations

import socket

import pytest

from torchtitan_ft.netaddr import (
    advertised_host,
    is_loopback,
    join_host_port,
    port_in_use,
    split_host_port,
    url_host,
)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:29510", ("127.0.0.1", 29510)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:29510", ("::1", 29510)),
        ("[::]:0", ("::", 0)),
        (":29510", ("", 29510)),
        ("host.example:65535", ("host.example", 65535)),
    ],
)
def test_split_host_port(address: str, expected: tuple[str, int]) -> None:
    assert split_host_port(address) == expected
    host, port = expected
    if host:  # formatting gives back what parsing takes
        assert split_host_port(join_host_port(host, port)) == expected


@pytest.mark.parametrize(
    ("address", "match"),
    [
        ("localhost", r"bind address 'localhost' is not host:port \(e.g. 127.0.0.1:29510\)"),
        ("host:http", "is not host:port"),
        ("host:", "is not host:port"),
        ("host:70000", "has port 70000, expected 0-65535"),
        ("[::1:29510", "unbalanced IPv6 bracket"),
        ("::1]:29510", "unbalanced IPv6 bracket"),
    ],
)
def test_split_host_port_names_the_bad_value(address: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_host_port(address, "bind address")


def test_url_host_brackets_ipv6_once() -> None:
    assert url_host("::1") == "[::1]"
    assert url_host("[::1]") == "[::1]"
    assert url_host("127.0.0.1") == "127.0.0.1"
    assert join_host_port("::", 5) == "[::]:5"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example-host", False),  # names are not resolved
        ("", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_advertised_host_replaces_wildcards() -> None:
    for wildcard in ("", "0.0.0.0", "::"):
        assert advertised_host(wildcard) == socket.gethostname()
    assert advertised_host("127.0.0.1") == "127.0.0.1"


def test_port_in_use_sees_a_listener_only() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)  # closed: free again (TIME_WAIT or not)
    assert not port_in_use("127.0.0.1", 0)
