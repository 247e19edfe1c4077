"""The lighthouse's own end (``--exit_when_idle_ms``), as a table of looks."""

from __future__ import annotations

import pytest

from torchtitan_ft.lighthouse.lifetime import Idle, look, should_exit

IDLE_S = 10.0


def run(looks: list[tuple[float, bool, int]]) -> list[bool]:
    """Each look (time, has_quorum, healthy groups) and whether the lighthouse exits after it."""
    idle, exits = Idle(), []
    for now, has_quorum, healthy in looks:
        idle = look(idle, has_quorum, healthy, now)
        exits.append(should_exit(idle, now, IDLE_S))
    return exits


@pytest.mark.parametrize(
    "looks, exits",
    [
        # Never served: groups still starting, however long it takes.
        ([(0, False, 0), (100, False, 0)], [False, False]),
        # Served, then every group gone for IDLE_S: the job is over.
        ([(0, True, 2), (1, True, 0), (10.9, True, 0), (11, True, 0)], [False] * 3 + [True]),
        # A group back within IDLE_S (a restart) resets the wait.
        ([(0, True, 1), (1, True, 0), (9, True, 1), (15, True, 0), (24, True, 0)], [False] * 5),
        # Groups healthy: never.
        ([(0, True, 2), (1000, True, 1)], [False, False]),
    ],
)
def test_exit_only_after_the_job_was_served_and_stayed_away(looks, exits) -> None:
    assert run(looks) == exits
