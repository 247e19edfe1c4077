"""What the groups report and the job's figures made from it (pure, no processes)."""

from __future__ import annotations

from collections import deque

import pytest

from torchtitan_ft.lighthouse.groups import (
    GroupBook,
    availability,
    discarded_total,
    window_rate,
)
from torchtitan_ft.lighthouse.history import EventKind
from torchtitan_ft.proto import torchft_pb2 as pb


@pytest.mark.parametrize(
    ("total", "last", "reported", "expected"),
    [
        (0, 0, 0, (0, 0)),
        (3, 3, 5, (5, 5)),
        (5, 5, 1, (6, 1)),  # the process restarted: its count began again at 0
    ],
)
def test_discarded_total(total, last, reported, expected) -> None:
    assert discarded_total(total, last, reported) == expected


def test_window_rate_spans_the_window_before_it_answers() -> None:
    window: deque[tuple[float, int]] = deque()
    got = [window_rate(window, (t, b), 10.0) for t, b in [(0, 0), (5, 10), (10, 20), (20, 20)]]
    assert got == [None, None, 2.0, 0.0]
    assert window[0][0] == 10  # samples older than the window's start are dropped


@pytest.mark.parametrize(
    ("changes", "full", "now", "expected"),
    [
        ([], 2, 10.0, None),
        ([(0.0, 2)], 2, 10.0, 1.0),
        ([(0.0, 2), (4.0, 1), (6.0, 2)], 2, 10.0, 0.8),
        ([(0.0, 1), (5.0, 2)], 2, 10.0, 0.5),
    ],
)
def test_availability(changes, full, now, expected) -> None:
    assert availability(changes, full, now) == expected


def test_book_keeps_steps_heals_and_time_in_and_out_of_the_quorum() -> None:
    book = GroupBook()
    book.quorum(["a", "b"], now=100.0)
    progress = pb.GroupProgress(
        steps=[pb.StepTiming(step=3, step_seconds=0.5)],
        batches_committed=8,
        heals=[
            pb.HealReport(
                to_step=3, source_address="http://b:1", bytes=64, seconds=0.25, outcome="applied"
            )
        ],
    )
    events = book.report("a", progress, now=101.0)
    assert events == [
        (
            EventKind.HEAL,
            "a",
            "healed to step 3 from http://b:1: 64 bytes in 0.250 s, applied",
        )
    ]
    book.quorum(["b"], now=110.0)
    book.quorum(["a", "b"], now=115.0)
    a = {v["replica_id"]: v for v in book.views(now=120.0)}["a"]
    assert (a["in_quorum_s"], a["away_s"], a["steps_per_s"], a["heal_count"]) == (15, 5, 2.0, 1)
    job = book.job(now=120.0)
    assert (job["full_membership"], job["batches_committed"]) == (2, 8)
    assert job["availability"] == 0.75
