"""``torchtitan_ft.deadlines``: one thread firing callbacks at deadlines."""

from __future__ import annotations

import threading
import time

from torchtitan_ft.deadlines import Deadlines


def test_an_earlier_deadline_set_later_fires_first() -> None:
    deadlines = Deadlines()
    fired: list[str] = []
    done = threading.Event()
    deadlines.schedule(30.0, lambda: fired.append("late"))
    deadlines.schedule(0.05, lambda: (fired.append("early"), done.set()))
    assert done.wait(10), "the earlier deadline did not wake the thread"
    assert fired == ["early"]


def test_a_later_deadline_does_not_delay_the_earlier_one() -> None:
    deadlines = Deadlines()
    done = threading.Event()
    start = time.monotonic()
    deadlines.schedule(0.1, done.set)
    deadlines.schedule(30.0, lambda: None)
    assert done.wait(10)
    assert time.monotonic() - start < 5


def test_cancelled_deadlines_are_dropped_in_order_and_never_fire() -> None:
    deadlines = Deadlines()
    fired: list[int] = []
    cancels = [deadlines.schedule(0.2 + i / 100, lambda i=i: fired.append(i)) for i in range(5)]
    for cancel in cancels:
        cancel()
    assert deadlines._heap == []  # nothing held until the deadlines pass
    time.sleep(0.4)
    assert fired == []
