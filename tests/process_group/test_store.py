"""Addresses of the quorum's TCPStore (``torchtitan_ft.process_group.store``)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchtitan_ft.process_group import create_store_client, parse_store_addr


def test_parse_store_addr() -> None:
    assert parse_store_addr("127.0.0.1:29600/torchft/3/0") == ("127.0.0.1", 29600, "torchft/3/0")
    assert parse_store_addr("[::1]:5/p") == ("::1", 5, "p")
    for bad in ["127.0.0.1:29600", "127.0.0.1:29600/", "host/p", ":1/p", "h:x/p"]:
        with pytest.raises(ValueError, match="host:port/prefix"):
            parse_store_addr(bad)


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        # torchft 0.2.0's forms (its process_group_test.py): IPv4, a name, bare and bracketed
        # IPv6 (the port is the field after the last colon).
        ("localhost:1234/my/prefix", ("localhost", 1234, "my/prefix")),
        ("127.0.0.1:29500/torchft/0/1", ("127.0.0.1", 29500, "torchft/0/1")),
        ("fdaa:0:1:2:3:4:5:6:29521/torchft/0/1", ("fdaa:0:1:2:3:4:5:6", 29521, "torchft/0/1")),
        ("::1:29521/torchft/0/1", ("::1", 29521, "torchft/0/1")),
        ("[fdaa:0:1:2:3:4:5:6]:29521/torchft/0/1", ("fdaa:0:1:2:3:4:5:6", 29521, "torchft/0/1")),
    ],
)
def test_torchft_store_address_forms(addr: str, expected: tuple[str, int, str]) -> None:
    assert parse_store_addr(addr) == expected


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("form", ["localhost:{port}/a/b", "127.0.0.1:{port}/a/b", "::1:{port}/a/b"])
def test_create_store_client_scopes_keys_to_the_prefix(form: str) -> None:
    if form.startswith("::1") and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    server = dist.TCPStore("::" if form.startswith("::1") else "127.0.0.1", 0, is_master=True)
    client = create_store_client(form.format(port=server.port), timedelta(seconds=5))
    client.set("k", "v")
    assert server.get("a/b/k") == b"v"
