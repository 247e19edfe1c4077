"""A discrete-event model of a training job's time to N steps under failures (pure Python, no
processes; prints JSON): docs/performance.md, "From this machine to a cluster, on paper".

A job trains ``Job.steps`` steps of ``Job.step_s`` seconds (times a method's ``step_factor``)
and writes a checkpoint every ``checkpoint_every`` steps, each costing ``checkpoint_write_s``
of training time. Failures come at wall-clock times from a seeded schedule. A method recovers
in one of two ways (``Recovery``):

* ``RESTART`` (checkpoint-restart): the job stops; ``restart_s`` later it trains again from
  its newest complete checkpoint (a checkpoint whose write a failure interrupted does not
  count), the steps since redone. A failure during a restart starts the restart again.
* ``IN_PLACE`` (per-step FT, live migration): the job loses ``stall_s`` (the step in flight
  included; a failure during a stall adds another), keeps its steps, and the failed group is
  away for ``away_s``. With ``target="steps"`` a group away costs nothing (the survivors take
  full steps, as Clockwork counts them); with ``target="samples"`` a step counts the share of
  groups taking part when it starts (``(groups - away) / groups`` of a step's samples), so
  the job trains until it has N steps' worth of samples. A share ``state_loss_share`` of the
  failures takes every group at once: the job restarts from its newest checkpoint as
  ``RESTART`` does (this project's ``on_state_loss = "checkpoint"``).

:func:`simulate` runs one schedule; :func:`mean_time` averages seeds; :func:`fit` solves one
unknown input by bisection against a published time. ``main`` reproduces Clockwork's
published comparison (the fitted inputs named as such), then gives this project's figures
for the same job and for a 16,384-GPU job at Llama 3's published failure rate.

    python -m benchmarks.des_model [--seeds 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Literal

Target = Literal["steps", "samples"]


@dataclass(frozen=True)
class Job:
    """What is trained, fault-free."""

    steps: int
    """N: the steps (or steps' worth of samples) to reach."""
    step_s: float
    """Seconds per step without failures, before a method's ``step_factor``."""
    checkpoint_every: int
    """Steps between checkpoints (0: none; a restart then starts from step 0)."""
    checkpoint_write_s: float = 0.0
    """Training time one checkpoint write costs (the blocking part)."""
    groups: int = 1
    """Replica groups (the failure domain of an in-place method; ``target="samples"``)."""


class Recovery(Enum):
    """How a method recovers from a failure (module doc)."""

    RESTART = "restart"
    IN_PLACE = "in_place"


@dataclass(frozen=True)
class Method:
    """A fault-tolerance method's costs."""

    name: str
    recovery: Recovery
    step_factor: float = 1.0
    """Its step time over the job's ``step_s`` (its per-step overhead)."""
    restart_s: float = 0.0
    """``RESTART`` (and a state loss): seconds from the failure to training again."""
    stall_s: float = 0.0
    """``IN_PLACE``: seconds without progress after a failure."""
    away_s: float = 0.0
    """``IN_PLACE``: seconds the failed group is away (``target="samples"`` only)."""
    state_loss_share: float = 0.0
    """``IN_PLACE``: the share of failures that take every group (then a restart)."""


@dataclass
class Outcome:
    """One simulated run."""

    time_s: float = 0.0
    failures: int = 0
    restarts: int = 0
    steps_redone: int = 0
    steps_taken: int = 0


def uniform_failures(low_s: float, high_s: float, rng: random.Random) -> Iterator[float]:
    """Failure times whose gaps are uniform in [low_s, high_s] (Clockwork's schedule)."""
    t = 0.0
    while True:
        t += rng.uniform(low_s, high_s)
        yield t


def exponential_failures(mean_s: float, rng: random.Random) -> Iterator[float]:
    """Failure times of a Poisson process of mean gap ``mean_s``."""
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_s)
        yield t


def simulate(
    job: Job,
    method: Method,
    failures: Iterator[float],
    target: Target = "steps",
    rng: random.Random | None = None,
) -> Outcome:
    """The time ``method`` takes to ``job.steps`` under the failure times ``failures``
    (increasing; ``rng`` draws which failures lose the state, when its share is above 0)."""
    rng = rng or random.Random(0)
    step_s = job.step_s * method.step_factor
    out = Outcome()
    t, step, progress = 0.0, 0, 0.0
    saved = (0, 0.0)  # (step, progress) of the newest complete checkpoint
    away: list[float] = []  # when each group away comes back (``target="samples"`` only)
    counts_groups = target == "samples"
    next_failure = next(failures)

    def restart(at: float) -> float:
        """A restart from the newest checkpoint begun at ``at``; when training resumes."""
        nonlocal next_failure
        resume = at + method.restart_s
        while next_failure < resume:  # a failure during the restart starts it again
            out.failures += 1
            resume = next_failure + method.restart_s
            next_failure = next(failures)
        out.restarts += 1
        return resume

    while progress < job.steps - 1e-9:
        away = [back for back in away if back > t]
        share = (job.groups - len(away)) / job.groups
        k = job.checkpoint_every
        to_boundary = k - step % k if k else math.inf
        left = math.ceil((job.steps - progress) / share - 1e-9)
        if not away and next_failure > t + min(to_boundary, left) * step_s + (
            job.checkpoint_write_s if to_boundary <= left else 0.0
        ):  # no event before the next checkpoint (or the end): take those steps at once
            n = int(min(to_boundary, left))
            t += n * step_s
            step += n
            progress = min(job.steps, progress + n * share)
            out.steps_taken += n
            if k and step % k == 0 and progress < job.steps:
                t += job.checkpoint_write_s
                saved = (step, progress)
            continue
        end = t + step_s
        write_end = end + job.checkpoint_write_s if k and (step + 1) % k == 0 else end
        if next_failure < write_end and not (next_failure >= end and progress + share >= job.steps):
            failed_at = next_failure
            next_failure = next(failures)
            out.failures += 1
            if next_failure <= failed_at:
                raise ValueError("failure times must increase")
            if failed_at >= end:  # during the checkpoint write: the step counts, not the write
                step, progress = step + 1, progress + share
                out.steps_taken += 1
            loses_state = method.recovery is Recovery.IN_PLACE and (
                method.state_loss_share > 0 and rng.random() < method.state_loss_share
            )
            if method.recovery is Recovery.RESTART or loses_state:
                out.steps_redone += step - saved[0]
                step, progress = saved
                away = []
                t = restart(failed_at)
            else:
                t = failed_at + method.stall_s
                gone = [failed_at]
                while next_failure < t:  # a failure during the stall: another stall
                    out.failures += 1
                    gone.append(next_failure)
                    t = next_failure + method.stall_s
                    next_failure = next(failures)
                if counts_groups:
                    away += [at + method.away_s for at in gone]
            continue
        t, step, progress = end, step + 1, progress + share
        out.steps_taken += 1
        if write_end > end and progress < job.steps:
            t, saved = write_end, (step, progress)
    out.time_s = t
    return out


Schedule = Callable[[random.Random], Iterator[float]]


def mean_time(
    job: Job, method: Method, schedule: Schedule, seeds: range, target: Target = "steps"
) -> dict[str, float]:
    """``simulate`` over ``seeds`` (seed s draws the failures; s + 10**6 the state losses):
    the mean time (s) and the means of the outcome's counts."""
    runs = [
        simulate(job, method, schedule(random.Random(s)), target, random.Random(s + 10**6))
        for s in seeds
    ]
    n = len(runs)
    return {
        "time_s": sum(r.time_s for r in runs) / n,
        "failures": sum(r.failures for r in runs) / n,
        "restarts": sum(r.restarts for r in runs) / n,
        "steps_redone": sum(r.steps_redone for r in runs) / n,
    }


def fit(
    build: Callable[[float], tuple[Job, Method]],
    published_s: float,
    low: float,
    high: float,
    schedule: Schedule,
    seeds: range,
    iterations: int = 30,
) -> float:
    """The input ``x`` in [low, high] for which ``build(x)``'s mean time equals
    ``published_s`` (bisection; the time must grow with ``x``).

    Raises:
        ValueError: ``published_s`` is outside the times at ``low`` and ``high``.
    """

    def time_at(x: float) -> float:
        job, method = build(x)
        return mean_time(job, method, schedule, seeds)["time_s"]

    if not time_at(low) <= published_s <= time_at(high):
        raise ValueError(f"{published_s} s is not between the times at {low} and {high}")
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if time_at(mid) < published_s else (low, mid)
    return (low + high) / 2


# --- the published inputs and what is measured here ----------------------------------------

CLOCKWORK = {
    "source": "clockwork.io/blog/keeping-distributed-training-running-through-failures",
    "job": "TorchTitan Llama-4 Scout (109B MoE), 64 H200 (8 nodes x 8)",
    "steps": 3000,
    "checkpoint_every": 100,
    "failure_gap_s": [2700, 4500],
    "minutes": {"torchpass": 405, "checkpoint_restart": 818, "torchft": 930},
}
"""Clockwork's published comparison (every run wrote a checkpoint every 100 steps)."""

LLAMA3 = {
    "source": "Llama 3 paper (Dubey et al., 2024), section 3.3.4",
    "gpus": 16384,
    "interruptions": 419,
    "days": 54,
    "model_params": 405e9,
    "tokens_per_step": 16 * 2**20,
    "mfu": 0.38,
    "peak_flops": 989e12,
}
"""Llama 3 405B's pre-training: 419 unexpected interruptions in a 54-day snapshot on 16,384
H100s, BF16 MFU 38-43 % (the lower end taken), batch up to 16M tokens; H100 SXM dense BF16
peak 989 TFLOPS."""

MEASURED = {
    "torchtitan_ft_step_factor": 1.05,
    "torchtitan_ft_rebuild_s": 1.0,
    "heartbeat_timeout_s": 3.0,
    "torchft_stall_s": 24.0,
}
"""Per-fault costs measured here (docs/performance.md): FT ÷ native HSDP step time 1.045-1.06
("TorchTitan: FT ÷ native HSDP step time", CPU: no GPU figure exists); a kill costs the
survivors the step in flight plus a process-group rebuild of about 1 s, a hung or unreachable
host the heartbeat timeout (3 s) plus a step ("Goodput under routine failures"); torchft
0.2.0's survivors wait out the collective timeout, 23.6-24.4 s per SIGKILL (same section)."""

TORCHPASS_MIGRATION_S = 60.0
"""Assumed: TorchPass's time per live migration, not published with the comparison."""
GROUPS_64 = 8
"""Assumed: the 64-GPU job's replica groups, one 8-GPU node each (the failure domain)."""
GROUPS_16K = 128
"""Assumed: the 16,384-GPU job's replica groups (128 GPUs each, HSDP over Llama 3's DP 128)."""


def clockwork_schedule(rng: random.Random) -> Iterator[float]:
    low, high = CLOCKWORK["failure_gap_s"]
    return uniform_failures(low, high, rng)


def llama3_mtbf_s() -> float:
    """Seconds between interruptions at Llama 3's published rate."""
    return LLAMA3["days"] * 86400 / LLAMA3["interruptions"]


def llama3_step_s() -> float:
    """A 405B step of 16M tokens at the published MFU: 6 N D FLOPs over the cluster's
    sustained FLOP/s."""
    flops = 6 * LLAMA3["model_params"] * LLAMA3["tokens_per_step"]
    return flops / (LLAMA3["gpus"] * LLAMA3["peak_flops"] * LLAMA3["mfu"])


def torchtitan_ft(step_s: float, away_s: float) -> Method:
    """This project's per-step FT on a job of ``step_s``: its measured step overhead; a node
    failure costs the heartbeat timeout, the step in flight and a process-group rebuild; the
    group is away ``away_s``."""
    stall = MEASURED["heartbeat_timeout_s"] + step_s * MEASURED["torchtitan_ft_step_factor"]
    return Method(
        "torchtitan_ft",
        Recovery.IN_PLACE,
        step_factor=MEASURED["torchtitan_ft_step_factor"],
        stall_s=stall + MEASURED["torchtitan_ft_rebuild_s"],
        away_s=away_s,
    )


def _llama3_16k(
    seeds: int, restart_s: float, torchft: Method, checkpoint_restart: Method
) -> dict[str, object]:
    """A 16,384-GPU job at Llama 3's published interruption rate: each method's hours to
    100k steps' samples and its goodput, with the restart fitted on the 64-GPU job."""
    step16 = llama3_step_s()
    job16 = Job(100_000, step16, CLOCKWORK["checkpoint_every"], groups=GROUPS_16K)
    mtbf = llama3_mtbf_s()

    def schedule16(rng: random.Random) -> Iterator[float]:
        return exponential_failures(mtbf, rng)

    methods16 = [
        torchtitan_ft(step16, away_s=restart_s),
        dataclasses.replace(torchft, stall_s=MEASURED["torchft_stall_s"]),
        checkpoint_restart,
    ]
    ideal16 = job16.steps * step16
    large: dict[str, object] = {
        "ideal_h": round(ideal16 / 3600, 1),
        "mtbf_s": round(mtbf),
        "step_s": round(step16, 2),
    }
    for method in methods16:
        got = mean_time(job16, method, schedule16, range(max(4, seeds // 10)), "samples")
        large[method.name] = {
            "hours": round(got["time_s"] / 3600, 1),
            "goodput": round(ideal16 / got["time_s"], 3),
            "failures": round(got["failures"], 1),
        }
    return large


def run(seeds: int) -> dict:
    """The whole model: the fits, the reproduction, this project's figures."""
    fit_seeds, check_seeds = range(seeds), range(seeds, 2 * seeds)
    minutes = CLOCKWORK["minutes"]
    job64 = Job(CLOCKWORK["steps"], 8.0, CLOCKWORK["checkpoint_every"], groups=GROUPS_64)

    def torchpass(step_s: float) -> tuple[Job, Method]:
        method = Method("torchpass", Recovery.IN_PLACE, stall_s=TORCHPASS_MIGRATION_S)
        return dataclasses.replace(job64, step_s=step_s), method

    step_s = fit(torchpass, minutes["torchpass"] * 60, 1.0, 20.0, clockwork_schedule, fit_seeds)
    job64 = dataclasses.replace(job64, step_s=step_s)

    def checkpoint_restart(restart_s: float) -> tuple[Job, Method]:
        return job64, Method("checkpoint_restart", Recovery.RESTART, restart_s=restart_s)

    restart_s = fit(  # below the shortest gap, or a restart might never end
        checkpoint_restart, minutes["checkpoint_restart"] * 60, 0.0,
        0.9 * CLOCKWORK["failure_gap_s"][0], clockwork_schedule, fit_seeds,
    )  # fmt: skip

    def torchft(factor: float) -> tuple[Job, Method]:
        stall = MEASURED["torchft_stall_s"]
        return job64, Method("torchft", Recovery.IN_PLACE, factor, stall_s=stall, away_s=restart_s)

    torchft_factor = fit(torchft, minutes["torchft"] * 60, 1.0, 4.0, clockwork_schedule, fit_seeds)
    published = {
        "torchpass": torchpass(step_s)[1],
        "checkpoint_restart": checkpoint_restart(restart_s)[1],
        "torchft": torchft(torchft_factor)[1],
    }
    reproduced = {}
    for name, method in published.items():
        got = mean_time(job64, method, clockwork_schedule, check_seeds)
        reproduced[name] = {
            "published_min": minutes[name],
            "model_min": round(got["time_s"] / 60, 1),
            "error": round(got["time_s"] / 60 / minutes[name] - 1, 4),
            "failures": round(got["failures"], 2),
            "steps_redone": round(got["steps_redone"], 1),
        }
    ours64 = torchtitan_ft(step_s, away_s=restart_s)

    def minutes_to(method: Method, target: Target) -> float:
        return round(
            mean_time(job64, method, clockwork_schedule, check_seeds, target)["time_s"] / 60, 1
        )

    compared = (ours64, published["torchft"], published["checkpoint_restart"])
    same_job: dict[str, object] = {
        target: {m.name: minutes_to(m, target) for m in compared} for target in ("steps", "samples")
    }
    same_job["ideal_min"] = round(job64.steps * step_s / 60, 1)

    large = _llama3_16k(seeds, restart_s, published["torchft"], published["checkpoint_restart"])
    return {
        "clockwork": CLOCKWORK,
        "fitted": {
            "step_s": round(step_s, 3),
            "checkpoint_restart_restart_s": round(restart_s, 1),
            "torchft_step_factor": round(torchft_factor, 3),
        },
        "assumed": {
            "torchpass_migration_s": TORCHPASS_MIGRATION_S,
            "groups_64": GROUPS_64,
            "groups_16k": GROUPS_16K,
            "checkpoint_write_s": 0.0,
        },
        "measured_here": MEASURED,
        "reproduced": reproduced,
        "this_project_same_job_min": same_job,
        "llama3_16k": {"inputs": LLAMA3, **large},
        "seeds": {
            "fit": [fit_seeds.start, fit_seeds.stop],
            "check": [check_seeds.start, check_seeds.stop],
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, default=50, help="failure schedules per mean (default 50)"
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    print(json.dumps(run(args.seeds), indent=2))


if __name__ == "__main__":
    main()
