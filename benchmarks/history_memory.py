"""Lighthouse memory per 10,000 events of the job's history (issue 23 goal: <= 1 MB); prints
JSON.

A ``History`` is filled to its capacity with a mix like a bad night's, measured with
``tracemalloc`` (every allocation the history made, with the events in it):

- ``churn``: ``--groups`` groups with torchft-style ids (``name:uuid``, a new uuid at each
  restart) that die, are left out and come back: per cycle a ``stream_ended``, a ``quorum``
  (its reason names the new id, so every one differs), a ``left``, a ``joined``, a ``heal``
  with its own figures, and heartbeats lost and regained;
- ``steady``: the same kinds with repeated reasons (groups that keep their ids).

Also ``record_us``: the time to record one event (median of the fill, in memory); and
``groups_file``: what saving the groups' figures under ``--state_dir`` costs the lighthouse's
event loop (``groups.json``, ``lighthouse.groups.GroupsFile``) for ``--file_groups`` groups
with ``HEALS_KEPT`` heals each (the most it keeps): its size and the median time of a save,
which sets how often it is saved (``SAVE_SHARE``).

    python -m benchmarks.history_memory [--events 10000] [--groups 16] [--file_groups 1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Iterator

from benchmarks import machine
from torchtitan_ft.lighthouse.groups import HEALS_KEPT, SAVE_SHARE, GroupBook, GroupsFile
from torchtitan_ft.lighthouse.history import History, HistoryKind
from torchtitan_ft.proto import torchft_pb2 as pb

K = HistoryKind


def churn(groups: int) -> Iterator[tuple[HistoryKind, str, str]]:
    ids = [f"replica_group_{i}:{uuid.uuid4()}" for i in range(groups)]
    quorum_id = 1_764_000_000_000_000
    i = 0
    while True:
        g = i % groups
        quorum_id += 1
        yield K.STREAM_ENDED, ids[g], "heartbeat stream ended: the process died"
        yield (
            K.QUORUM,
            "",
            f"quorum {quorum_id}: {groups - 1} member(s), full round; left {ids[g]} "
            "(heartbeat stream ended (process died))",
        )
        yield K.LEFT, ids[g], "heartbeat stream ended (process died)"
        ids[g] = f"replica_group_{g}:{uuid.uuid4()}"
        yield K.JOINED, ids[g], "back in the quorum"
        yield (
            K.HEAL,
            ids[g],
            f"from {ids[(g + 1) % groups]}: {1000 + i} bytes in {0.1 + i / 1e6:.6f} s, applied",
        )
        yield K.HEARTBEAT_LOST, ids[g], "no heartbeat for 5 s"
        yield K.HEARTBEAT_REGAINED, ids[g], "heard from again"
        i += 1


def steady(groups: int) -> Iterator[tuple[HistoryKind, str, str]]:
    ids = [f"replica_group_{i}" for i in range(groups)]
    i = 0
    while True:
        g = ids[i % groups]
        yield K.LEFT, g, "heartbeat lost (hung or stopped)"
        yield K.JOINED, g, "back in the quorum"
        yield K.HEARTBEAT_LOST, g, "no heartbeat for 5 s"
        yield K.HEARTBEAT_REGAINED, g, "heard from again"
        i += 1


def measure(events: int, source: Iterator[tuple[HistoryKind, str, str]]) -> dict:
    mix = [next(source) for _ in range(events)]
    # As bytes: each record decodes fresh strings, as the server builds them per request, and
    # the history's own copies are what the trace counts.
    encoded = [(kind, group.encode(), reason.encode()) for kind, group, reason in mix]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    history = History(events, None, time.time)
    for kind, group, reason in encoded:
        history.record(kind, group.decode(), reason.decode())
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    times = []
    for kind, group, reason in mix:
        start = time.perf_counter()
        history.record(kind, group, reason)
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "events": events,
        "bytes": used,
        "mb_per_10k_events": round(used * 10_000 / events / 1e6, 3),
        "bytes_per_event": round(used / events, 1),
        "record_us": round(times[len(times) // 2] * 1e6, 2),
    }


def groups_file(groups: int, saves: int = 5) -> dict:
    """Size and median save time of ``groups.json`` for ``groups`` groups, each with
    ``HEALS_KEPT`` heals."""
    book = GroupBook()
    ids = [f"replica_group_{i}:{uuid.uuid4()}" for i in range(groups)]
    book.quorum(ids, 0.0)
    for i, rid in enumerate(ids):
        progress = pb.GroupProgress(batches_committed=1000, samples_committed=8000)
        progress.discarded_steps = 3
        progress.heals.extend(
            pb.HealReport(
                to_step=h, source_address=f"http://host-{i}:29512", bytes=123_456_789,
                seconds=1.25, outcome="applied", started=1.7e9 + h,
            )
            for h in range(HEALS_KEPT)
        )  # fmt: skip
        book.report(rid, progress, 1.0)
    with tempfile.TemporaryDirectory() as folder:
        store = GroupsFile(folder)
        times = []
        for k in range(saves):
            start = time.perf_counter()
            store.save(book, 2.0 + k)
            times.append(time.perf_counter() - start)
        size = store.path.stat().st_size
    save_s = statistics.median(times)
    return {
        "groups": groups,
        "heals_per_group": HEALS_KEPT,
        "bytes": size,
        "save_ms": round(save_s * 1000, 2),
        "saved_every_s": round(max(1.0, save_s / SAVE_SHARE), 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=10_000, help="events recorded (the capacity)")
    p.add_argument("--groups", type=int, default=16, help="replica groups in the mix")
    p.add_argument("--file_groups", type=int, default=1000, help="replica groups in groups.json")
    args = p.parse_args(argv)
    if args.events < 1 or args.groups < 2 or args.file_groups < 1:
        p.error(
            f"--events and --file_groups must be >= 1 and --groups >= 2, got {args.events}, "
            f"{args.file_groups}, {args.groups}"
        )
    results = {
        "churn": measure(args.events, churn(args.groups)),
        "steady": measure(args.events, steady(args.groups)),
    }
    out = {
        "goal_mb_per_10k_events": 1.0,
        "results": results,
        "groups_file": groups_file(args.file_groups),
        "machine": machine(),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
