"""What a lighthouse outage costs the training: three replica groups, the lighthouse SIGKILLed
and restarted ``--down-s`` later, with each ``lighthouse_outage`` setting; prints JSON.

Per run: three 1-rank MLP groups (``torchtitan_ft.testing.mlp``; an MLP step is tens of
milliseconds) under a lighthouse process (``--heartbeat_timeout_ms`` 5000, join timeout
1000 ms, no ``--state_dir``); once they committed ``--steady`` steps together the lighthouse is
SIGKILLed, restarted ``--down-s`` seconds later (the goodput schedule's 5 s), and the run ends
once every group committed ``--after`` steps together after the restart and all stopped at
the same step. From the groups' COMMIT events:

- **stall_s**: the longest time a group went without a commit between the kill and its
  ``--after``-th commit after the restart (the median over the groups), against the groups'
  median steady step before the kill (``steady_step_s``);
- **commits_while_down**: commits of the group with the fewest between the kill and the
  restart (the lighthouse listening again);
- **groups_identical**: all groups' parameters bitwise equal at the end.

The settings alternate (``previous_quorum``, then ``wait``) ``--trials`` times; ``summary``
has the medians per setting and ``stall_previous_quorum_over_wait``.

    python -m benchmarks.lighthouse_outage [--trials 2] [--down-s 5] [--steady 20] [--after 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import machine
from torchtitan_ft.testing.mlp_job import MlpJob, wait_until
from torchtitan_ft.testing.processes import LighthouseProcess

GROUPS = 3
SETTINGS = ("previous_quorum", "wait")


def _longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time without a commit in [start, end], given commit times."""
    marks = [start, *(t for t in times if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(marks))


def one_run(setting: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    log = (work / "lighthouse.log").open("a")
    lighthouse = LighthouseProcess(2, heartbeat_timeout_ms=5000, log=log)
    with MlpJob(work, lighthouse, stop_participants=GROUPS, lighthouse_outage=setting) as job:
        procs = [job.spawn(replica, f"g{replica}") for replica in range(GROUPS)]
        wait_until(
            f"{GROUPS} groups to commit {args.steady} steps together",
            lambda: (
                len(c := job.commits(participants=GROUPS)) == GROUPS
                and all(len(v) >= args.steady for v in c.values())
            ),
            timeout_s=300.0,
        )
        killed = time.time()
        lighthouse.kill()
        time.sleep(args.down_s)
        lighthouse.start()
        restarted = time.time()

        def after() -> dict[str, list[Any]] | None:
            c = job.commits(participants=GROUPS)
            late = {n: [e for e in v if e.time > restarted] for n, v in c.items()}
            ready = len(late) == GROUPS and all(len(v) >= args.after for v in late.values())
            return c if ready else None

        commits = wait_until(f"{args.after} steps together after the restart", after, 300.0)
        job.stop_at(max(e.step for v in commits.values() for e in v) + 2)
        job.join(procs, timeout_s=120)

    import torch

    stalls, steady, down = [], [], []
    for evs in commits.values():
        times = [e.time for e in evs]
        before = [t for t in times if t <= killed][-args.steady :]
        steady.append(statistics.median(b - a for a, b in itertools.pairwise(before)))
        end = [t for t in times if t > restarted][args.after - 1]
        stalls.append(_longest_gap(times, killed, end))
        down.append(sum(killed < t <= restarted for t in times))
    outs = [torch.load(job.state_path(f"g{r}"), weights_only=False) for r in range(GROUPS)]
    identical = len({o["step"] for o in outs}) == 1 and all(
        torch.equal(t, o["model"][n]) for o in outs[1:] for n, t in outs[0]["model"].items()
    )
    return {
        "setting": setting,
        "stall_s": round(statistics.median(stalls), 3),
        "stall_s_per_group": [round(s, 3) for s in stalls],
        "steady_step_s": round(statistics.median(steady), 4),
        "commits_while_down": min(down),
        "down_s": round(restarted - killed, 3),
        "groups_identical": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=2, help="runs per setting")
    parser.add_argument("--down-s", type=float, default=5.0, help="seconds the lighthouse is down")
    parser.add_argument("--steady", type=int, default=20, help="steps together before the kill")
    parser.add_argument("--after", type=int, default=10, help="steps together after the restart")
    args = parser.parse_args()
    for name, least in (("trials", 1), ("steady", 2), ("after", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be >= {least}, got {getattr(args, name)}")
    if args.down_s < 0:
        parser.error(f"--down-s must be >= 0, got {args.down_s}")
    load_before = os.getloadavg()[0]
    runs = []
    for _ in range(args.trials):
        for setting in SETTINGS:
            with tempfile.TemporaryDirectory(prefix="lighthouse_outage_") as tmp:
                runs.append(one_run(setting, args, Path(tmp)))
    summary = {
        s: {
            "stall_s_median": statistics.median(r["stall_s"] for r in runs if r["setting"] == s),
            "commits_while_down_median": statistics.median(
                r["commits_while_down"] for r in runs if r["setting"] == s
            ),
        }
        for s in SETTINGS
    }
    ratio = summary["previous_quorum"]["stall_s_median"] / summary["wait"]["stall_s_median"]
    print(
        json.dumps(
            {
                "setup": f"{GROUPS} MLP groups of 1 rank, lighthouse SIGKILLed and restarted "
                f"{args.down_s} s later (heartbeat timeout 5 s, join timeout 1 s, no state_dir)",
                "machine": machine(),
                "load_avg_1m": [load_before, os.getloadavg()[0]],
                "runs": runs,
                "summary": summary,
                "stall_previous_quorum_over_wait": round(ratio, 4),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
