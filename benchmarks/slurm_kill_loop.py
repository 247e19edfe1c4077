"""The Slurm runner under the punisher's ``kill_loop``; prints JSON.

A real one-node Slurm (``testing.slurm_cluster``) runs the runner's lighthouse job and
``--groups`` 1-rank MLP group jobs (``python -m torchtitan_ft.slurm run --job mlp``). Once every
group commits, the punisher cancels a running group job (``scancel``) after each seeded
exponential wait of mean ``--mtbf_secs``, ``--kills`` times or until ``--budget_s`` has passed,
whichever is first (``kills`` says how many were done). By default each wait starts once the
victim's group is back in a committed step (the kill loop's ``after_kill``), so that the job's
state always has a holder and each kill is timed alone; ``--no_pace`` kills on the draws alone.
Then every group must be back in a committed step, the groups stop together at a later step,
and the runner must end (``done``).

Figures:

* ``back_s``: for each kill, from the ``scancel`` to the first committed step a later job of
  the group took part in (its commit log): median, p95, max. It includes the runner noticing (its
  ``--poll_s``), then either a warm standby job taking the place (``--standbys``, default 6:
  the standby reads its assignment and builds the Manager) or Slurm starting a new job with its
  Python and torch imports, and the heal;
* ``noticed_s_median`` and ``resubmitted_s_median``: from the kill to the runner's ``ended``
  and to its ``submitted`` or ``assigned`` of the group's next job (the rest of ``back_s`` is
  the job's start and the heal); ``replaced_by_standby``: how many of those were standbys;
* ``back_s_ready_standby``: ``back_s`` of the kills whose place went to a standby that had
  finished its imports (the others waited for them); ``standby_warmup_s``: each standby's
  submission to its imports done (how fast the runner refills the pool);
* ``groups_back``: kills whose group came back; ``whole_job_restarts``: lighthouse
  resubmissions plus group resubmissions no kill explains (0 when only the killed group came
  back); ``identical_end``: every group's last commit at the same step with the same hash of
  parameters and optimizer state.

    python -m benchmarks.slurm_kill_loop [--groups 3] [--kills 50] [--mtbf_secs 10] [--seed 0]
        [--standbys 6]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import machine
from torchtitan_ft.slurm import Punisher, SlurmJob, standby_files
from torchtitan_ft.testing.commit_log import commit_log_path, read_commit_log
from torchtitan_ft.testing.mlp import write_stop_step
from torchtitan_ft.testing.mlp_job import wait_until
from torchtitan_ft.testing.processes import ROOT, free_port
from torchtitan_ft.testing.slurm_cluster import SlurmCluster

NAME = "bench"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _group_jobs(events: list[dict]) -> list[dict]:
    """The runner's record of each group job: a submission, or a standby given the place."""
    return [e for e in events if e["event"] in ("submitted", "assigned") and e["role"] == "group"]


def _first_commit(work: Path, replica: int, attempt: int, since: float) -> float | None:
    path = commit_log_path(work / "commit_logs", replica, attempt)
    for r in read_commit_log(path, replica, attempt):
        if r.committed and r.participating and r.time > since:
            return r.time
    return None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _runner_argv(args: argparse.Namespace, work: Path, events: Path) -> list[str]:
    """The Slurm runner's command line: the MLP job of ``args.groups`` groups, fast timeouts."""
    return [
        sys.executable,
        "-m",
        "torchtitan_ft.slurm",
        "run",
        f"--name={NAME}",
        f"--replicas={args.groups}",
        "--min_replicas=1",
        "--job=mlp",
        f"--workdir={work}",
        f"--events={events}",
        "--lighthouse_bind_host=127.0.0.1",
        "--lighthouse_host=127.0.0.1",
        f"--lighthouse_port={free_port()}",
        "--lighthouse_arg=--join_timeout_ms=1000",
        "--lighthouse_arg=--heartbeat_timeout_ms=1000",
        "--lighthouse_arg=--quorum_tick_ms=50",
        f"--poll_s={args.poll_s}",
        f"--max_resubmits={args.kills + 1}",
        f"--standbys={args.standbys}",
    ]


def _back(work: Path, events: Path, kill: dict) -> float | None:
    """From ``kill`` to the first committed step any later job of its group took
    part in; None before there is one."""
    jobs = _group_jobs(_events(events))
    old = next(e for e in jobs if e["job_id"] == kill["job_id"])
    firsts = [
        _first_commit(work, old["replica"], e["attempt"], kill["time"])
        for e in jobs
        if e["replica"] == old["replica"] and e["attempt"] > old["attempt"]
    ]
    at = min((f for f in firsts if f is not None), default=None)
    return None if at is None else at - kill["time"]


def _where_time_went(kills: list[dict], record: list[dict]) -> tuple[list[float], list[float]]:
    """Per kill: seconds to the runner seeing the job ended, and to the group's next job
    (submitted, or a standby given its place)."""
    noticed = [
        e["time"] - k["time"]
        for k in kills
        for e in record
        if e["event"] == "ended" and e["job_id"] == k["job_id"]
    ]
    resubmitted = []
    jobs = _group_jobs(record)
    for k in kills:
        old = next(e for e in jobs if e["job_id"] == k["job_id"])
        resubmitted += [
            e["time"] - k["time"]
            for e in jobs
            if e["replica"] == old["replica"] and e["attempt"] == old["attempt"] + 1
        ]
    return noticed, resubmitted


def _standby_readiness(work: Path, record: list[dict], kills: list[dict]) -> list[bool | None]:
    """Per kill: whether the group's next job was a standby whose imports were done when it
    was given the place (its ready file older than the ``assigned``); None: a new job, or none
    yet."""
    jobs = _group_jobs(record)
    out: list[bool | None] = []
    for k in kills:
        old = next(e for e in jobs if e["job_id"] == k["job_id"])
        nxt = next(
            (
                e
                for e in jobs
                if e["replica"] == old["replica"] and e["attempt"] == old["attempt"] + 1
            ),
            None,
        )
        if nxt is None or nxt["event"] != "assigned":
            out.append(None)
            continue
        ready = standby_files(work / "standby", nxt["job_id"])[0]
        out.append(ready.exists() and ready.stat().st_mtime < nxt["time"])
    return out


def _warmups(work: Path, record: list[dict]) -> list[float]:
    """Each standby's warm-up: from its submission to its ready file."""
    return [
        ready.stat().st_mtime - e["time"]
        for e in record
        if e["event"] == "submitted"
        and e["role"] == "standby"
        and (ready := standby_files(work / "standby", e["job_id"])[0]).exists()
    ]


def _stats(values: list[float]) -> dict:
    return {
        "median": statistics.median(values) if values else None,
        "p95": _percentile(values, 0.95) if values else None,
        "max": max(values) if values else None,
        "count": len(values),
    }


def _stop_at_a_common_step(args: argparse.Namespace, work: Path, events: Path) -> None:
    """Once every group's current job commits, tells all groups to stop 20 steps after the
    newest committed step (``work/stop_step``)."""
    last = {e["replica"]: e["attempt"] for e in _group_jobs(_events(events))}
    # A group's last job may have been killed at its start: wait for every current job.
    wait_until(
        "every group's current job committing",
        lambda: all(_first_commit(work, r, a, 0.0) for r, a in last.items()),
        timeout_s=args.back_timeout_s,
    )
    step = max(
        r.step
        for rep, att in last.items()
        for r in read_commit_log(commit_log_path(work / "commit_logs", rep, att), rep, att)
    )
    write_stop_step(work / "stop_step", step + 20)


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="slurm_kill_loop_"))
    work, events = root / "job", root / "runner.jsonl"
    with SlurmCluster(root / "slurm") as cluster:
        runner = subprocess.Popen(
            _runner_argv(args, work, events),
            cwd=ROOT,
            env=cluster.environ(),
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(
                "every group committing",
                lambda: all(_first_commit(work, r, 0, 0.0) for r in range(args.groups)),
                timeout_s=args.start_timeout_s,
            )
            kills_out = io.StringIO()
            punisher = Punisher(cluster.slurm(), NAME, seed=args.seed, out=kills_out)
            deadline = time.monotonic() + args.budget_s

            def back(kill: dict) -> float | None:
                return _back(work, events, kill)

            def last_kill() -> dict:
                return json.loads(kills_out.getvalue().splitlines()[-1])

            def wait_back(victim: SlurmJob) -> None:
                if args.pace:
                    kill = last_kill()
                    wait_until(
                        f"job {victim.job_id}'s group back",
                        lambda: back(kill),
                        timeout_s=args.back_timeout_s,
                    )

            done = punisher.kill_loop(
                args.mtbf_secs,
                args.kills,
                stop=lambda: time.monotonic() > deadline,
                after_kill=wait_back,
            )
            kills = [json.loads(line) for line in kills_out.getvalue().splitlines()]
            with contextlib.suppress(TimeoutError):
                wait_until(
                    "every killed group back",
                    lambda: all(back(k) is not None for k in kills),
                    timeout_s=args.back_timeout_s,
                )
            backs = [b for k in kills if (b := back(k)) is not None]
            readiness = _standby_readiness(work, _events(events), kills)
            backs_ready = [
                b for k, r in zip(kills, readiness, strict=True) if r and (b := back(k)) is not None
            ]
            # Where the time went: from the kill to the runner seeing the job ended, and to
            # its resubmission (the rest is Slurm starting the job, imports and the heal).
            noticed, resubmitted = _where_time_went(kills, _events(events))
            _stop_at_a_common_step(args, work, events)
            _, err = runner.communicate(timeout=args.back_timeout_s)
            outcome = _events(events)[-1]["event"]
        finally:
            if runner.poll() is None:
                runner.terminate()
                runner.communicate(timeout=60)
        record = _events(events)
        submitted = [e for e in record if e["event"] == "submitted"]
        last = {e["replica"]: e["attempt"] for e in _group_jobs(record)}
        finals = {
            rep: read_commit_log(commit_log_path(work / "commit_logs", rep, att), rep, att)[-1]
            for rep, att in last.items()
        }
        lighthouse_resubmits = sum(1 for e in submitted if e["role"] == "lighthouse") - 1
        group_resubmits = len(_group_jobs(record)) - args.groups
        to_standby = sum(1 for e in record if e["event"] == "assigned")
        warmups = _warmups(work, record)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "slurm_kill_loop",
        "machine": machine(),
        "groups": args.groups,
        "kills_asked": args.kills,
        "kills": done,
        "mtbf_secs": args.mtbf_secs,
        "seed": args.seed,
        "poll_s": args.poll_s,
        "standbys": args.standbys,
        "paced": args.pace,
        "groups_back": len(backs),
        "replaced_by_standby": to_standby,
        "whole_job_restarts": lighthouse_resubmits + max(0, group_resubmits - done),
        "runner_outcome": outcome,
        "runner_stderr": err.strip(),
        "identical_end": len({(r.step, r.hash) for r in finals.values()}) == 1,
        "end_step": sorted({r.step for r in finals.values()}),
        "noticed_s_median": statistics.median(noticed) if noticed else None,
        "resubmitted_s_median": statistics.median(resubmitted) if resubmitted else None,
        "back_s_ready_standby": _stats(backs_ready),
        "standby_warmup_s": _stats(warmups),
        "back_s": {**_stats(backs), "all": [round(b, 3) for b in backs]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--mtbf_secs", type=float, default=10.0, help="the punisher's mean wait")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no_pace",
        dest="pace",
        action="store_false",
        help="kill on the draws alone (default: each wait starts once the victim is back)",
    )
    parser.add_argument("--poll_s", type=float, default=0.2, help="the runner's squeue period")
    parser.add_argument(
        "--standbys", type=int, default=6, help="the runner's warm standby jobs (0: resubmit)"
    )
    parser.add_argument("--budget_s", type=float, default=600.0, help="the kill loop's most time")
    parser.add_argument("--start_timeout_s", type=float, default=300.0)
    parser.add_argument("--back_timeout_s", type=float, default=300.0)
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
