"""Address syntax (``torchtitan_ft.netaddr``): parsing with IPv6 brackets, formatting, IP
literals, and the port probe against a real listening socket."""

from __future__ import annotations

import socket

import pytest

from torchtitan_ft.netaddr import (
    ip_literal,
    join_host_port,
    port_in_use,
    split_host_port,
    url_host,
    url_hostname,
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


def test_url_hostname_takes_the_host_of_a_url_or_of_host_port() -> None:
    assert url_hostname("http://10.0.0.2:1234") == "10.0.0.2"
    assert url_hostname("node-a:5678") == "node-a"
    assert url_hostname("http://[::1]:1") == "::1"


def test_ip_literal_parses_addresses_only() -> None:
    assert str(ip_literal("[::1]")) == "::1"
    assert str(ip_literal("127.0.0.1")) == "127.0.0.1"
    assert ip_literal("localhost") is None
    assert ip_literal("") is None


def test_port_in_use_sees_a_listener_only() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)  # closed: free again (TIME_WAIT or not)
    assert not port_in_use("127.0.0.1", 0)
