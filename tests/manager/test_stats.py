"""The Manager's counters (``torchtitan_ft.manager.stats``); what a real Manager counts is tested
in ``test_manager.py``."""

from __future__ import annotations

import threading

import torch

from torchtitan_ft.manager.stats import Counters, tensor_bytes


def test_tensor_bytes() -> None:
    tree = {"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.float64), 3], "c": "x"}
    assert tensor_bytes(tree) == 4 * 4 + 2 * 8


def test_counters_add_from_threads_and_count_heals() -> None:
    counters = Counters()
    threads = [
        threading.Thread(target=lambda: [counters.add(allreduce_bytes=1) for _ in range(1000)])
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counters.heal_applied(0.5)
    counters.heal_applied(0.25)
    snap = counters.snapshot()
    assert snap["allreduce_bytes"] == 4000
    assert (snap["heal_count"], snap["last_heal_seconds"], snap["heal_seconds"]) == (2, 0.25, 0.75)
