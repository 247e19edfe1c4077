"""The discrete-event model's arithmetic (``benchmarks.des_model``), on tiny cases computed by
hand: a 10-step job of 1 s steps, a checkpoint every 4 steps costing 0.5 s, 2 groups."""

from __future__ import annotations

import random

import pytest

from benchmarks.des_model import (
    Job,
    Method,
    Recovery,
    fit,
    mean_time,
    simulate,
    uniform_failures,
)

JOB = Job(steps=10, step_s=1.0, checkpoint_every=4, checkpoint_write_s=0.5, groups=2)
RESTART = Method("restart", Recovery.RESTART, restart_s=2.0)
IN_PLACE = Method("in_place", Recovery.IN_PLACE, stall_s=0.3, away_s=2.0)
NEVER = 1e12


def _at(*times: float):
    return iter([*times, NEVER])


@pytest.mark.parametrize(
    "method, failures, target, time_s, redone",
    [
        # no failure: 10 steps and the writes after steps 4 and 8
        (RESTART, (), "steps", 11.0, 0),
        # step 6 in flight at 6.2; back at 8.2 from the step-4 checkpoint; steps 5-8 end at
        # 12.2, the write at 12.7, steps 9-10 at 14.7; steps 5 (done) redone
        (RESTART, (6.2,), "steps", 14.7, 1),
        # the same, a second failure during the restart: it starts again at 7.0, back at 9.0
        (RESTART, (6.2, 7.0), "steps", 15.5, 1),
        # during the step-4 write (4.0-4.5): the step counts, the checkpoint does not; back at
        # 6.2 from step 0: steps 1-4 to 10.2, write, 5-8 to 14.7, write, 9-10 to 17.2
        (RESTART, (4.2,), "steps", 17.2, 4),
        # in place: step 6 lost, 0.3 s stall; steps 6-8 end at 9.5, the write at 10.0, 9-10
        # at 12.0
        (IN_PLACE, (6.2,), "steps", 12.0, 0),
        # counting samples, one group of 2 away until 8.2: the steps starting at 6.5 and 7.5
        # count half; 10 steps' worth at 13.0 (the write after the 8th step, at 9.5-10.0)
        (IN_PLACE, (6.2,), "samples", 13.0, 0),
    ],
)
def test_hand_computed_cases(method, failures, target, time_s, redone) -> None:
    out = simulate(JOB, method, _at(*failures), target)
    assert out.time_s == pytest.approx(time_s)
    assert out.steps_redone == redone
    assert out.failures == len(failures)


def test_a_state_loss_restarts_from_the_checkpoint() -> None:
    method = Method("ft", Recovery.IN_PLACE, restart_s=2.0, stall_s=0.3, state_loss_share=1.0)
    out = simulate(JOB, method, _at(6.2))
    assert (out.time_s, out.restarts, out.steps_redone) == (pytest.approx(14.7), 1, 1)


def test_fit_finds_the_input_that_gives_a_time() -> None:
    def schedule(rng: random.Random):
        return uniform_failures(30.0, 50.0, rng)

    def build(restart_s: float):
        return Job(100, 1.0, 10), Method("r", Recovery.RESTART, restart_s=restart_s)

    target = mean_time(*build(7.0), schedule, range(8))["time_s"]
    assert fit(build, target, 0.0, 30.0, schedule, range(8)) == pytest.approx(7.0, abs=0.05)
    with pytest.raises(ValueError, match="not between"):
        fit(build, 1.0, 0.0, 30.0, schedule, range(8))
