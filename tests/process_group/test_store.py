"""Addresses of the quorum's TCPStore (``torchtitan_ft.process_group.store``)."""

from __future__ import annotations

import pytest

from torchtitan_ft.process_group import parse_store_addr


def test_parse_store_addr() -> None:
    assert parse_store_addr("127.0.0.1:29600/torchft/3/0") == ("127.0.0.1", 29600, "torchft/3/0")
    assert parse_store_addr("[::1]:5/p") == ("::1", 5, "p")
    for bad in ["127.0.0.1:29600", "127.0.0.1:29600/", "host/p", ":1/p", "h:x/p"]:
        with pytest.raises(ValueError, match="host:port/prefix"):
            parse_store_addr(bad)
