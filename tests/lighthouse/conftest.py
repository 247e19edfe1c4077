"""Fixtures of the lighthouse tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from torchtitan_ft.lighthouse import LighthouseServer


@pytest.fixture
def servers() -> Iterator[Callable[..., LighthouseServer]]:
    started: list[LighthouseServer] = []

    def start(**kw) -> LighthouseServer:
        kw.setdefault("bind", "127.0.0.1:0")
        server = LighthouseServer(**kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
