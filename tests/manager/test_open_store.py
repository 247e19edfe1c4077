"""``manager.rendezvous.open_store``: group rank 0 joins a store that already listens on the
group's port (TorchTitan's own process group's, or torchrun's agent's) as a client, quietly."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from torchtitan_ft.manager.rendezvous import open_store


def test_rank_0_joins_a_store_already_served_there_without_a_line_above_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    caplog.set_level(logging.DEBUG, logger="torchtitan_ft.manager.rendezvous")
    store = open_store("127.0.0.1", served.port, host_it=True, timeout=timedelta(seconds=10))
    store.set("from_rank_0", "x")
    assert served.get("from_rank_0") == b"x"  # a client of the store that was there
    records = [r for r in caplog.records if r.name == "torchtitan_ft.manager.rendezvous"]
    assert records and all(r.levelno == logging.DEBUG for r in records)
