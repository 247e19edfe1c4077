"""The ManagerServer's lighthouse quorum requests (``manager.lighthouse_quorum``): the pure
retry policy and the request's budget. The I/O loop around them runs against real lighthouses
in ``tests/manager/test_server.py`` and ``test_lighthouse_outage.py``."""

from __future__ import annotations

import pytest

from torchtitan_ft.manager.lighthouse_quorum import lighthouse_budget, retry_delay


@pytest.mark.parametrize(
    ("attempts", "retries", "left_s", "delay"),
    [
        (1, 0, 10.0, None),  # no retries allowed
        (1, 3, 10.0, 0.1),  # the first pause
        (2, 3, 10.0, 0.2),  # doubled
        (3, 3, 10.0, 0.4),
        (4, 3, 10.0, None),  # the retries are spent
        (5, 9, 10.0, 1.0),  # 1.6 capped at the longest pause
        (9, 9, 10.0, 1.0),
        (1, 3, 0.1, None),  # no time left after the pause
        (1, 3, 0.11, 0.1),
        (3, 3, 0.4, None),
        (1, 3, -1.0, None),  # the budget is spent
    ],
)
def test_retry_delay(attempts: int, retries: int, left_s: float, delay: float | None) -> None:
    assert retry_delay(attempts, retries, left_s) == pytest.approx(delay)


def test_retry_delay_with_another_backoff() -> None:
    assert [retry_delay(n, 9, 100.0, (1.0, 3.0)) for n in (1, 2, 3)] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("remaining_s", "budget_s"),
    [
        (20.0, 19.0),  # a margin of 1 s
        (4.0, 3.0),
        (2.0, 1.5),  # at most a quarter of the time left
        (0.0, 0.0),
    ],
)
def test_lighthouse_budget(remaining_s: float, budget_s: float) -> None:
    assert lighthouse_budget(remaining_s) == pytest.approx(budget_s)
