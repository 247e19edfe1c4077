"""The project's reconfigurable gloo group beside torch's native one, at 3 groups; prints JSON.

Three processes (one per replica group, loopback) each hold both group types,
``ProcessGroupGloo`` (rebuilt over a fresh store prefix at each quorum, as the Manager does) and
``ProcessGroupNativeGloo`` (torch >= 2.14's ``enable_reconfigure=True`` gloo, reconfigured with
the members' handles, which the quorum carries). In one run, for each type:

- ``membership_ms``: a member leaves (3 -> 2) or comes back (2 -> 3): from the moment a member
  knows the new quorum (its store address or its handles) to the end of its first allreduce of
  4 floats on it; the slower of groups 0 and 1 (group 2 is SIGKILLed at the end and
  reports nothing) for each change, median over ``2 x --trials`` changes
  (``membership_form_ms``: the configure or reconfigure alone);
- ``steady_allreduce_ms``: an allreduce of ``--numel`` floats, median of 20;
- ``hung_abort``: a member stays alive but never joins an allreduce; the others ``abort()``
  after 200 ms: ``release_ms`` from the abort until the waiter got its error, and
  ``usable_ms`` until the survivors' first allreduce on a 2-member group succeeded (while the
  abandoned collective may still be pending inside gloo until its 5 s timeout);
- ``sigkill``: a member is SIGKILLed during an allreduce on both groups: ``detect_ms`` from the
  kill to the survivors' error, ``usable_ms`` from the kill to their first allreduce on a
  2-member group.

    python -m benchmarks.native_pg [--trials 5] [--numel 262144]

Needs torch >= 2.14 (the native group); on an older torch it prints the reason and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks import machine
from torchtitan_ft.process_group import (
    ProcessGroupGloo,
    ProcessGroupNativeGloo,
    ReconfigureOptions,
)

GROUPS = 3
TIMEOUT_S = 5.0
TARGET_MS = 50


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="membership changes per type")
    parser.add_argument("--numel", type=int, default=262144, help="floats per steady allreduce")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return parser


# ------------------------------------------------------------------------------- the workers


class _Worker:
    """One replica group's process: both group types, driven through a shared TCPStore."""

    def __init__(self, rank: int, port: int, numel: int) -> None:
        self.rank, self.port, self.numel = rank, port, numel
        timeout = timedelta(seconds=TIMEOUT_S)
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(60))
        self.groups = {
            "ours": ProcessGroupGloo(timeout=timeout),
            "native": ProcessGroupNativeGloo(f"127.0.0.1:{port}/native", rank, GROUPS, timeout),
        }
        self.generation = 0
        self.last_form_ms = 0.0
        self.out: dict[str, dict[str, list[float]]] = {k: {} for k in self.groups}

    def sync(self, name: str, members: list[int]) -> None:
        self.store.set(f"sync/{name}/{self.rank}", "1")
        self.store.wait([f"sync/{name}/{m}" for m in members])

    def record(self, kind: str, key: str, value: float) -> None:
        self.out[kind].setdefault(key, []).append(round(value, 3))

    def form(self, kind: str, members: list[int]) -> float:
        """Form ``members`` on group ``kind``; returns ms from knowing the quorum to the end
        of the first allreduce."""
        self.generation += 1
        gen, pg = self.generation, self.groups[kind]
        rank = members.index(self.rank)
        if kind == "native":  # the quorum carries the handles: exchanged before the clock
            self.store.set(f"h/{gen}/{self.rank}", pg.get_reconfigure_handle())
            keys = [f"h/{gen}/{m}" for m in members]
            self.store.wait(keys)
            handles = [h.decode() for h in self.store.multi_get(keys)]
        self.sync(f"form{gen}", members)
        start = time.perf_counter()
        if kind == "native":
            opts = ReconfigureOptions()
            opts.uuid = 1000 + gen
            opts.handles = handles
            pg.reconfigure(opts).wait()
        else:
            pg.configure(f"127.0.0.1:{self.port}/ours/{gen}", f"g{self.rank}", rank, len(members))
        formed = time.perf_counter()
        t = torch.ones(4)
        pg.allreduce([t]).wait()
        if t[0].item() != len(members):
            raise RuntimeError(f"{kind}: allreduce gave {t[0].item()}, want {len(members)}")
        self.last_form_ms = (formed - start) * 1e3
        return (time.perf_counter() - start) * 1e3

    def membership(self, kind: str, trials: int) -> None:
        everyone = list(range(GROUPS))
        self.form(kind, everyone)
        for _ in range(trials):
            for members in (everyone[:-1], everyone):  # the last group leaves, comes back
                if self.rank in members:
                    self.record(kind, "membership_ms", self.form(kind, members))
                    self.record(kind, "membership_form_ms", self.last_form_ms)
                else:
                    self.generation += 1
                    self.sync(f"form{self.generation}", [*members, self.rank])

    def steady(self, kind: str) -> None:
        t = torch.ones(self.numel)
        for _ in range(20):
            start = time.perf_counter()
            self.groups[kind].allreduce([t]).wait()
            self.record(kind, "steady_allreduce_ms", (time.perf_counter() - start) * 1e3)

    def hung(self, kind: str) -> None:
        everyone = list(range(GROUPS))
        self.form(kind, everyone)
        survivors = everyone[:-1]
        if self.rank in survivors:
            pg = self.groups[kind]
            work = pg.allreduce([torch.ones(4)])
            time.sleep(0.2)
            aborted = time.perf_counter()
            pg.abort()
            try:
                work.wait()
            except (RuntimeError, OSError):
                self.record(kind, "hung_release_ms", (time.perf_counter() - aborted) * 1e3)
            else:
                raise RuntimeError(f"{kind}: a hung allreduce succeeded")
            self.form(kind, survivors)
            self.record(kind, "hung_usable_ms", (time.perf_counter() - aborted) * 1e3)
        else:
            self.generation += 1
            self.sync(f"form{self.generation}", [*survivors, self.rank])
        self.sync(f"hung-{kind}", everyone)

    def sigkill(self) -> None:
        everyone = list(range(GROUPS))
        for kind in self.groups:
            self.form(kind, everyone)
        if self.rank == GROUPS - 1:
            time.sleep(0.2)
            self.store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), 9)
        works = {kind: pg.allreduce([torch.ones(4)]) for kind, pg in self.groups.items()}
        failed: dict[str, float] = {}
        for kind, work in works.items():
            try:
                work.wait()
            except (RuntimeError, OSError):
                failed[kind] = time.time()
            else:
                raise RuntimeError(f"{kind}: the allreduce with a killed member succeeded")
        killed = float(self.store.get("killed_at"))
        for kind in self.groups:
            self.record(kind, "kill_detect_ms", (failed[kind] - killed) * 1e3)
            self.form(kind, everyone[:-1])
            self.record(kind, "kill_usable_ms", (time.time() - killed) * 1e3)

    def run(self, trials: int) -> None:
        for kind in self.groups:
            self.membership(kind, trials)
            self.steady(kind)
        for kind in self.groups:
            self.hung(kind)
        self.sigkill()
        print(json.dumps(self.out), flush=True)


# ------------------------------------------------------------------------------- the parent


def _summary(outs: list[dict]) -> dict:
    """Per type: the steady allreduce's median over groups 0 and 1 (group 2 is SIGKILLed at
    the end and reports nothing); every other figure as the slower of the two for each event,
    then the median over the events."""
    result: dict[str, dict[str, float]] = {}
    for kind in outs[0]:
        figures: dict[str, float] = {}
        for key in outs[0][kind]:
            per_rank = [o[kind][key] for o in outs if key in o[kind]]
            if key == "steady_allreduce_ms":
                figures[key] = round(statistics.median(v for r in per_rank for v in r), 2)
            else:  # the slowest member of each event, then the median over events
                slowest = [max(vals) for vals in zip(*per_rank, strict=False)]
                figures[key] = round(statistics.median(slowest), 2)
        result[kind] = figures
    return result


def main() -> None:
    args = _parser().parse_args()
    if args.worker is not None:
        _Worker(args.worker, args.port, args.numel).run(args.trials)
        return
    if not hasattr(dist.ProcessGroup, "reconfigure"):
        print(f"benchmarks.native_pg: torch {torch.__version__} has no native reconfigure")
        sys.exit(2)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    argv = [sys.executable, "-m", "benchmarks.native_pg", "--port", str(store.port)]
    argv += ["--trials", str(args.trials), "--numel", str(args.numel)]
    load_before = os.getloadavg()[0]
    procs = [
        subprocess.Popen([*argv, "--worker", str(r)], stdout=subprocess.PIPE, text=True)
        for r in range(GROUPS)
    ]
    outs = []
    for proc in procs[:-1]:  # the last one is SIGKILLed
        line, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"a worker failed (exit {proc.returncode})")
        outs.append(json.loads(line.strip().splitlines()[-1]))
    procs[-1].wait(timeout=60)
    results = _summary(outs)
    print(
        json.dumps(
            {
                "benchmark": "native_pg",
                "machine": machine(),
                "torch": torch.__version__,
                "command": " ".join(["python -m benchmarks.native_pg", *sys.argv[1:]]),
                "setup": f"{GROUPS} groups (1 process each) on loopback, group timeout "
                f"{TIMEOUT_S:g} s, steady allreduce of {args.numel} floats",
                "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "target_membership_ms": TARGET_MS,
                "results": results,
                "faster_membership": min(results, key=lambda k: results[k]["membership_ms"]),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
