"""Survivor stall after a SIGKILL, and replacement time, for 2 replica groups; prints JSON.

Time must be recorded before the first import, so only the standard library is imported here
at module level (torch is imported inside the worker, and timed).

For each size (a 2-layer MLP of ~10 MB and ~200 MB of fp32 parameters) and implementation
(``--impls``: ``ours``, torchtitan_ft; ``torchft``, torchft 0.2.0's own Python runtime and Rust
servers, see ``benchmarks._mlp.IMPLS``), in rotating order, two replica groups of one process
each (``Manager`` with async quorum + ``DistributedDataParallel`` + ``OptimizerWrapper`` + SGD,
``ProcessGroupGloo``, ``HTTPTransport``, the implementation's lighthouse with its default
timeouts in this process, min_replicas=1) train as fast as they can. Every worker is a fresh
``python -m benchmarks.recovery --worker ...`` process (not a fork), so a replacement pays its
imports honestly. Replica 0 survives
throughout; replica 1 is the victim, then its replacements, one per kill:

1. once both have committed ``--steady`` steps together, replica 1 is SIGKILLed at a random
   moment of a step (uniform over one steady step);
   **stall** = SIGKILL -> the survivor's next committed step (``stall_s``), against the
   survivor's median steady step (commit to commit) before the kill. Also reported: SIGKILL ->
   the survivor's first commit of a step whose quorum excluded the victim (the same unless the
   kill fell after the victim's last allreduce), and the survivor's steps in between (start,
   end, time blocked waiting for the quorum);
2. a replacement is spawned for replica 1 and heals from the survivor. Reported: spawn ->
   first committed step as a participant, and Manager constructed -> that step; plus
   Manager constructed -> the start of that step (the time before it contributes, without
   the participating step's own compute), its import and setup times (wall, and CPU time of
   the imports: the machine is shared, wall times grow with its load), its first steps, the
   survivor's steps meanwhile (the donor's slowest over its steady step), and (ours) a heal
   profile: first quorum, connecting to the donor, the metadata RPC, the transfer, and when
   the donor had staged and offered its snapshot.
   With an async quorum the replacement's first step heals and does not participate (its
   gradients would be stale), so it participates in its second step at the earliest.
   Replacement kinds (they alternate):

   - ``cold``: a fresh process that imports everything at startup (torch, torchtitan_ft,
     torch._dynamo -- which any torch optimizer imports, in its constructor or first step;
     imported explicitly here so it is timed on its own);
   - ``warm`` (ours only): a warm spare, ``python -m torchtitan_ft.spare --lock L -- -m
     benchmarks.recovery --worker ...`` (docs/operations.md), started and warm before the
     steady steps; the parent holds the lock ``L`` in the victim's place and releases it once
     the stall is measured. Timed from that release (a spare behind an active process that
     dies is released by the kernel at the same moment);
   - ``bg_dynamo``: like ``cold``, but torch._dynamo is imported on a background thread while
     the main thread imports torchtitan_ft and builds the model (the optimizer, built next,
     needs the import done).

3. the replacement trains ``--steady`` steps, and is itself the victim of the next kill.
4. the hang row (``--hangs``, after the kills): once both committed ``--steady`` steps
   together, the last replacement is SIGSTOPped at a random moment of a step and SIGCONTed
   ``--hang-hold-s`` later (default 35 s: longer than the lighthouse's heartbeat timeout and
   than the Managers' 30 s collective timeout). Its connections stay open, unlike a killed
   process's. **hang stall** = SIGSTOP -> the survivor's first commit of a step without the
   hung group (``stall_s``), against the goal ``heartbeat timeout + one steady step``
   (``stall_over_goal``); and SIGCONT -> the hung group's first committed participating step
   (``rejoin_s``).

    python -m benchmarks.recovery [--sizes-mb 10 200] [--kinds cold warm bg_dynamo]
        [--impls ours torchft] [--trials 3] [--repeats 1] [--steady 8] [--seed N]
        [--hangs 1] [--hang-hold-s 35] [--heartbeat-timeout-ms 5000]

Summaries give medians and ranges per row and ``ours_over_torchft`` (``RATIO_ROWS``); runs whose
worker died are listed under ``failed_runs``.

The TorchTitan row (``--titan cold zygote spare``; ``--sizes-mb`` with no value runs it
alone): two ``./run_train.sh`` replica groups of ``--titan-ranks`` ranks (the debug model,
per-step FT, ``torchtitan_ft.testing.titan_replacement``); once they committed together, one
rank of group 1 is SIGKILLed, and torchrun restarts the group: ``cold`` (``MAX_RESTARTS=1``,
fresh interpreters) or ``zygote`` (``fault_tolerance.replacement = "zygote"``, workers forked
from a pre-imported process; ``zygote_sync``: with ``quorum_mode = "sync"``, so the healing
group takes part in its healing step); ``spare``: as zygote, with a third group as a hot spare
(``world_size_mode = "fixed_with_spares"``, ``min_replica_size = 2``: two groups average, the
spare takes the killed group's slot at the next quorum). The kinds alternate ``--repeats``
times. **replacement_s** = SIGKILL -> the first later step committed at full strength (two
groups averaging; from the event stream), against the 2 s goal; **full_quorum_s** = SIGKILL
-> the quorum that began that step; ``zygote_over_cold`` and ``spare_over_cold`` = ratios of
the replacement_s medians. Per run also the restarted group's phases (``process_started_s``,
``manager_built_s``, ``first_quorum_s``, ``healed_s``, ``back_s``: see
``titan_replacement.timeline``) and the survivor's median step.

    python -m benchmarks.recovery --sizes-mb --titan cold zygote spare [--titan-ranks 2]
        [--titan-steps 16] [--repeats 2]

The group-rank row (``--rank-faults N``): 3 replica groups of 2 ranks each (the tiny-MLP
harness, ``torchtitan_ft.testing.mlp``; an in-process lighthouse with
``--heartbeat-timeout-ms``, collective timeout 30 s). Group rank 1 of group 2 is the victim,
the rank whose group rank 0 goes on heartbeating for the group. N times: once the groups
committed ``--steady`` steps together, it is SIGSTOPped at a random moment of a step and
SIGCONTed ``--hang-hold-s`` later (**hang**: often between collectives, where its group does
not ask for the next quorum and the join timeout leaves it out); then it stops itself right
before an allreduce (the harness's ``hang_file``), its peers' ranks 1 waiting in the
collective with it, and is SIGCONTed as long after (**hang_in_collective**: what the
heartbeat timeout must catch); then it is SIGKILLed with its group rank 0, as torchrun would
tear the group down (**kill**; the group is restarted for the next round). **stall** = the
stop or kill (for ``hang_in_collective``: when the parent sees the rank stopped, polling every
10 ms) -> the first step groups 0 and 1 commit without group 2 (both their ranks, from the
event stream), against the goal ``heartbeat timeout + one steady step``; ``hang_over_kill`` =
the ratio of the ``hang_in_collective`` and ``kill`` medians.

    python -m benchmarks.recovery --sizes-mb --rank-faults 2 [--steady 8]
        [--hang-hold-s 35] [--heartbeat-timeout-ms 5000]
"""

from __future__ import annotations

import time

T_MAIN = time.time()  # the interpreter is up and running this module
CPU_MAIN = time.process_time()

import argparse  # noqa: E402
import fcntl  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import _mlp, machine  # noqa: E402
from torchtitan_ft.testing import processes  # noqa: E402

MODULE = "benchmarks.recovery"
TARGETS = {"stall_s": 0.5, "spawn_to_participating_s": 3.0, "manager_to_participating_s": 0.5}
TITAN_TARGET_S = 2.0
"""The goal of the TorchTitan row: a run_train.sh group participates again 2 s after a SIGKILL."""


# ------------------------------------------------------------------ worker


def worker(replica: int, size_mb: float, lighthouse: str, kind: str, impl: str) -> None:
    marks: dict[str, float] = {"main": T_MAIN}
    cpu: dict[str, float] = {"main": CPU_MAIN}
    import torch

    marks["torch"] = time.time()
    cpu["torch"] = time.process_time()
    dynamo_thread = None
    if kind == "bg_dynamo":
        dynamo_thread = threading.Thread(target=_import_dynamo, name="import-dynamo")
        dynamo_thread.start()
    if impl == "torchft":
        from benchmarks._reference import import_torchft

        import_torchft()
    else:
        import torchtitan_ft.checkpoint
        import torchtitan_ft.ddp
        import torchtitan_ft.manager
        import torchtitan_ft.optim
        import torchtitan_ft.process_group  # noqa: F401

    marks["ft_library"] = time.time()
    cpu["ft_library"] = time.process_time()
    if dynamo_thread is None:
        import torch._dynamo

        marks["dynamo"] = time.time()
        cpu["dynamo"] = time.process_time()
    torch.set_num_threads(1)
    model = _mlp.mlp(size_mb)
    marks["model"] = time.time()
    if dynamo_thread is not None:
        # The optimizer is built inside ft_setup: it would wait for the import anyway.
        dynamo_thread.join()
        marks["dynamo"] = time.time()
    manager, _pg, ddp, optim = _mlp.ft_setup(replica, lighthouse, model, marks=marks, impl=impl)
    processes.send({"marks": marks, "cpu": cpu})
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    dim = _mlp.mlp_dim(size_mb)
    probe = {"wait_quorum": 0.0}
    real_wait = manager.wait_quorum

    def timed_wait() -> None:
        t = time.perf_counter()
        try:
            real_wait()
        finally:
            probe["wait_quorum"] += time.perf_counter() - t

    manager.wait_quorum = timed_wait
    heal = _time_heal(manager) if impl == "ours" else {}
    i = 0
    while not stop.is_set():
        probe["wait_quorum"] = 0.0
        t0 = time.time()
        optim.zero_grad()
        x, y = _mlp.batch(dim, replica, i)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        before = manager.current_step()
        optim.step()  # torchft's wrapper returns None: a commit is seen in the step count
        committed = manager.current_step() > before
        processes.send(
            {
                "t0": t0,
                "t": time.time(),
                "step": manager.current_step(),
                "committed": committed,
                "participants": manager.num_participants(),
                "participating": manager.is_participating(),
                "wait_quorum_s": probe["wait_quorum"],
                # ours only (torchft's Manager has no stats): the last heal's transfer time
                "last_heal_s": manager.stats().last_heal_seconds if impl == "ours" else None,
                "heal_marks": dict(heal),
            }
        )
        i += 1
    manager.shutdown(wait=False)


def _time_heal(manager: Any) -> dict[str, float]:
    """Wall-clock marks of this process's last heal (ours): ``receive`` (the quorum thread
    starts receiving: quorum and reconfiguration done), ``fetch`` (the donor's metadata RPC
    done, the transfer starts), ``received``; and of its last serve: ``offer`` (the donor starts
    staging its snapshot), ``offered`` (the snapshot is offered)."""
    marks: dict[str, float] = {}
    healing = manager._heal
    transport = healing.transport

    def timed(start: str, end: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            marks[start] = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                marks[end] = time.time()

        return wrapper

    import torchtitan_ft.manager.healing as healing_module

    client_class = healing_module.ManagerClient

    class TimedClient(client_class):  # the donor's client: connect, metadata RPC, close
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            timed("connect", "connected", super().__init__)(*args, **kwargs)

        def _checkpoint_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return timed("rpc", "rpc_done", super()._checkpoint_metadata)(*args, **kwargs)

    healing_module.ManagerClient = TimedClient
    healing._receive = timed("receive", "received", healing._receive)
    transport.recv_checkpoint = timed("fetch", "fetched", transport.recv_checkpoint)
    transport.send_checkpoint = timed("offer", "offered", transport.send_checkpoint)
    return marks


def _import_dynamo() -> None:
    import torch._dynamo  # noqa: F401


# ------------------------------------------------------------------ parent


class Proc:
    """A worker process whose JSON lines are read on a thread into a queue."""

    def __init__(
        self,
        replica: int,
        size_mb: float,
        lighthouse: str,
        kind: str,
        impl: str,
        spare: list[str] | None = None,
    ) -> None:
        """``spare``: the spare's own options (a ``warm`` worker runs under
        ``torchtitan_ft.spare``)."""
        args = ["--worker", "--replica", str(replica), "--size-mb", str(size_mb)]
        args += ["--lighthouse", lighthouse, "--kind", kind, "--impl", impl]
        self.kind = kind
        if spare is None:
            self.w = processes.Worker(MODULE, args)
        else:
            self.w = processes.Worker("torchtitan_ft.spare", [*spare, "--", "-m", MODULE, *args])
        self.events: list[dict[str, Any]] = []
        self.marks: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.w.stream()

    def next(self, timeout: float = 180.0) -> dict[str, Any]:
        msg = self.w.next(timeout)
        if "marks" in msg:
            self.marks = msg["marks"]
            self.cpu = msg["cpu"]
        elif "t" in msg:
            self.events.append(msg)
        return msg

    def wait_for(self, pred: Any, timeout: float = 180.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.next(max(0.1, deadline - time.monotonic()))
            if pred(msg):
                return msg

    def drain(self) -> None:
        """Records the step messages that arrived, without waiting."""
        self.events.extend(msg for msg in self.w.ready() if "t" in msg)

    def kill(self) -> float:
        t = time.time()
        os.kill(self.w.proc.pid, signal.SIGKILL)
        self.w.proc.wait()
        return t

    def signal(self, sig: signal.Signals) -> float:
        t = time.time()
        os.kill(self.w.proc.pid, sig)
        return t

    def stop(self) -> None:
        if self.w.proc.poll() is None:
            try:
                assert self.w.proc.stdin is not None
                self.w.proc.stdin.write("quit\n")
                self.w.proc.stdin.flush()
                self.w.proc.wait(30)
            except (OSError, Exception):
                self.w.proc.kill()
                self.w.proc.wait()


def _together(msg: dict[str, Any]) -> bool:
    return "t" in msg and msg["committed"] and msg["participants"] == 2


def _steady_steps(events: list[dict[str, Any]], n: int) -> list[float]:
    """Commit-to-commit intervals of the last ``n`` committed 2-participant steps."""
    times = [e["t"] for e in events if e["committed"] and e["participants"] == 2][-(n + 1) :]
    return [b - a for a, b in itertools.pairwise(times)]


def _lighthouse(impl: str, heartbeat_timeout_ms: int) -> Any:
    """The impl's own lighthouse (torchft's Rust one for the reference), defaults but the
    heartbeat timeout."""
    if impl == "torchft":
        from benchmarks._reference import load_reference

        # torchft's Rust servers log every quorum at INFO; its workers inherit this too.
        os.environ.setdefault("RUST_LOG", "warn")

        reference = load_reference()
        if reference is None:
            raise SystemExit("torchft 0.2.0 is not installed: run scripts/install_reference.sh")
        return reference.LighthouseServer(
            bind=f"{_mlp.HOST}:0", min_replicas=1, heartbeat_timeout_ms=heartbeat_timeout_ms
        )
    from torchtitan_ft.lighthouse import LighthouseServer

    return LighthouseServer(
        bind=f"{_mlp.HOST}:0", min_replicas=1, heartbeat_timeout_ms=heartbeat_timeout_ms
    )


class _Spare:
    """The parent's side of a warm spare: it holds the spare's lock in place of the active
    process, and releases it to make the spare take over."""

    def __init__(self, tmp: str, n: int) -> None:
        self.lock_path = os.path.join(tmp, f"replica1-{n}.lock")
        self.ready_path = os.path.join(tmp, f"replica1-{n}.ready")
        self.lock = open(self.lock_path, "ab")  # noqa: SIM115 -- closed by release()
        fcntl.lockf(self.lock, fcntl.LOCK_EX)
        self.options = ["--lock", self.lock_path, "--ready-file", self.ready_path]

    def wait_ready(self, proc: Proc, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_path):
            if proc.w.proc.poll() is not None:
                raise RuntimeError(f"spare pid {proc.w.proc.pid} exited ({proc.w.proc.poll()})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"spare not warm after {timeout:.0f} s")
            time.sleep(0.05)

    def release(self) -> None:
        self.lock.close()


def _heal_profile(replacement: Proc, donor: Proc) -> dict[str, float] | None:
    """Where the replacement's heal went (ours): from its Manager to the start of the receive
    (first quorum and reconfiguration), the donor's metadata RPC, the transfer, and when the
    donor had staged and offered its snapshot, relative to the transfer's start."""
    mine = next((e["heal_marks"] for e in replacement.events if e.get("heal_marks")), None)
    theirs = next(
        (
            e["heal_marks"]
            for e in donor.events
            if e.get("heal_marks", {}).get("offered", 0) >= replacement.marks["manager"]
        ),
        None,
    )
    if not mine or not {"receive", "fetch", "fetched", "received"} <= mine.keys():
        return None
    m = replacement.marks["manager"]
    out = {
        "manager_to_receive": round(mine["receive"] - m, 3),
        "metadata_rpc": round(mine["fetch"] - mine["receive"], 3),
        "of_which_connect": round(mine["connected"] - mine["connect"], 3)
        if "connected" in mine
        else None,
        "of_which_rpc": round(mine["rpc_done"] - mine["rpc"], 3) if "rpc_done" in mine else None,
        "transfer": round(mine["fetched"] - mine["fetch"], 3),
        "receive_total": round(mine["received"] - mine["receive"], 3),
    }
    if theirs and "offer" in theirs:
        out["donor_staging"] = round(theirs["offered"] - theirs["offer"], 3)
        out["donor_offered_after_transfer_start"] = round(theirs["offered"] - mine["fetch"], 3)
    return out


def _donor_slowest(survivor: Proc, joined_from: float, participated: float, steady: float) -> float:
    """The survivor's slowest step overlapping [the replacement's Manager is ready, its first
    participating step ended], over its steady step."""
    survivor.drain()
    events = survivor.events
    overlapping = [
        e["t"] - e["t0"] for e in events if joined_from <= e["t"] and e["t0"] <= participated
    ]
    return round(max(overlapping) / steady, 2) if overlapping else 0.0


@dataclass(frozen=True)
class HangOptions:
    count: int
    """Hangs after the kills (``--hangs``)."""
    hold_s: float
    """How long the hung group stays SIGSTOPped (``--hang-hold-s``)."""
    heartbeat_timeout_s: float
    """The lighthouse's heartbeat timeout (``--heartbeat-timeout-ms``)."""


def _steady_state(survivor: Proc, victim: Proc, steady: int) -> float:
    """Waits for ``steady`` steps committed together; the survivor's median steady step."""
    count = 0
    while count < steady:
        if _together(survivor.next()):
            count += 1
    victim.drain()
    return statistics.median(_steady_steps(survivor.events, steady - 1))


def _hang(
    survivor: Proc, victim: Proc, steady: int, rng: random.Random, opts: HangOptions
) -> dict[str, Any]:
    """One hang of ``victim`` (SIGSTOP, hold, SIGCONT): see the module doc, step 4."""
    steady_s = _steady_state(survivor, victim, steady)
    time.sleep(rng.uniform(0.0, steady_s))
    stopped = victim.signal(signal.SIGSTOP)
    alone = survivor.wait_for(
        lambda m: "t" in m and m["committed"] and m["participants"] == 1 and m["t"] > stopped,
        timeout=opts.hold_s + 180,
    )
    time.sleep(max(0.0, stopped + opts.hold_s - time.time()))
    resumed = victim.signal(signal.SIGCONT)
    back = victim.wait_for(
        lambda m: "t" in m and m["committed"] and m["participating"] and m["t"] > resumed
    )
    lost = [e for e in survivor.events if stopped < e["t"] <= alone["t"]]
    goal = opts.heartbeat_timeout_s + steady_s
    return {
        "stall_s": round(alone["t"] - stopped, 3),
        "steady_step_s": round(steady_s, 3),
        "goal_s": round(goal, 3),
        "stall_over_goal": round((alone["t"] - stopped) / goal, 2),
        "held_s": round(resumed - stopped, 3),
        "discarded_steps": sum(not e["committed"] for e in lost),
        "rejoin_s": round(back["t"] - resumed, 3),
    }


def _stall_row(
    victim_kind: str,
    survivor_events: list[dict[str, Any]],
    killed: float,
    after: dict[str, Any],
    alone: dict[str, Any],
    steady_s: float,
) -> dict[str, Any]:
    """The stall row of one kill at ``killed`` (a time): the survivor's first commit ``after``
    it, its first commit ``alone``, and its steps (``survivor_events``) in between."""
    lost = [e for e in survivor_events if killed < e["t"] <= alone["t"]]
    return {
        "victim_kind": victim_kind,
        "stall_s": round(after["t"] - killed, 3),
        "steady_step_s": round(steady_s, 3),
        "stall_over_steady": round((after["t"] - killed) / steady_s, 2),
        "next_commit_included_victim": after["participants"] == 2,
        "to_first_commit_without_victim_s": round(alone["t"] - killed, 3),
        "discarded_steps": sum(not e["committed"] for e in lost),
        "first_failed_step_s_after_kill": next(
            (round(e["t"] - killed, 3) for e in lost if not e["committed"]), None
        ),
        "participants_after": after["participants"],
        "survivor_steps_after_kill": [
            {
                "start_s": round(e["t0"] - killed, 3),
                "end_s": round(e["t"] - killed, 3),
                "committed": e["committed"],
                "participants": e["participants"],
                "wait_quorum_s": round(e["wait_quorum_s"], 3),
            }
            for e in survivor_events
            if e["t"] > killed and e["t0"] <= alone["t"]
        ],
    }


def run_size(
    size_mb: float,
    kinds: list[str],
    steady: int,
    rng: random.Random,
    impl: str,
    hangs: HangOptions,
) -> dict[str, Any]:
    if impl != "ours":  # the warm spare is torchtitan_ft's; torchft has none
        kinds = [kind for kind in kinds if kind != "warm"]
    lighthouse = _lighthouse(impl, round(hangs.heartbeat_timeout_s * 1000))
    addr = lighthouse.address()
    tmp = tempfile.mkdtemp(prefix="recovery-spare-")
    survivor = Proc(0, size_mb, addr, "cold", impl)
    victim = Proc(1, size_mb, addr, "cold", impl)
    procs = [survivor, victim]
    stalls: list[dict[str, Any]] = []
    replacements: list[dict[str, Any]] = []
    hang_rows: list[dict[str, Any]] = []
    try:
        for p in (survivor, victim):
            p.wait_for(lambda m: "marks" in m)
        for kind in kinds:
            spare = None
            if kind == "warm":
                # Started and warm before the steady steps (its warm-up takes CPU from them).
                spare = _Spare(tmp, len(procs))
                replacement = Proc(1, size_mb, addr, kind, impl, spare=spare.options)
                procs.append(replacement)
                spare.wait_ready(replacement)
            steady_s = _steady_state(survivor, victim, steady)
            time.sleep(rng.uniform(0.0, steady_s))
            killed = victim.kill()
            victim.drain()
            after = survivor.wait_for(
                lambda m, killed=killed: "t" in m and m["committed"] and m["t"] > killed
            )
            alone = (
                after
                if after["participants"] == 1
                else survivor.wait_for(
                    lambda m: "t" in m and m["committed"] and m["participants"] == 1
                )
            )
            stalls.append(_stall_row(victim.kind, survivor.events, killed, after, alone, steady_s))
            print(f"[{size_mb} MB] stall {stalls[-1]}", file=sys.stderr)
            # replacement
            if spare is not None:
                go = time.time()
                spare.release()
            else:
                replacement = Proc(1, size_mb, addr, kind, impl)
                procs.append(replacement)
            replacement.wait_for(lambda m: "marks" in m)
            first = replacement.wait_for(lambda m: "t" in m and m["committed"])
            part = (
                first
                if first["participating"]
                else replacement.wait_for(
                    lambda m: "t" in m and m["committed"] and m["participating"]
                )
            )
            report = _replacement_report(replacement, go if kind == "warm" else None, first, part)
            report["donor_slowest_step_over_steady"] = _donor_slowest(
                survivor, replacement.marks["manager"], part["t"], steady_s
            )
            report["donor_steps_while_joining"] = [
                {
                    "start_s": round(e["t0"] - replacement.marks["manager"], 3),
                    "dur_over_steady": round((e["t"] - e["t0"]) / steady_s, 2),
                    "wait_quorum_s": round(e["wait_quorum_s"], 3),
                    "participants": e["participants"],
                    "committed": e["committed"],
                }
                for e in survivor.events
                if replacement.marks["manager"] <= e["t"] and e["t0"] <= part["t"]
            ]
            report["heal_profile_s"] = _heal_profile(replacement, survivor)
            report["participating_step_over_steady"] = round(
                report["participating_step_s"] / steady_s, 2
            )
            replacements.append(report)
            print(f"[{size_mb} MB] replacement {replacements[-1]}", file=sys.stderr)
            victim = replacement
        for _ in range(hangs.count):
            hang_rows.append(_hang(survivor, victim, steady, rng, hangs))
            print(f"[{size_mb} MB] hang {hang_rows[-1]}", file=sys.stderr)
    finally:
        for p in procs:
            p.stop()
        lighthouse.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "impl": impl,
        "size_mb": size_mb,
        "stalls": stalls,
        "replacements": replacements,
        "hangs": hang_rows,
    }


def _replacement_report(
    p: Proc, go: float | None, first: dict[str, Any], part: dict[str, Any]
) -> dict[str, Any]:
    m = p.marks
    start = go if go is not None else p.w.spawned
    out: dict[str, Any] = {"kind": p.kind}
    out["spawn_to_participating_s"] = round(part["t"] - start, 3)
    out["manager_to_participating_s"] = round(part["t"] - m["manager"], 3)
    out["spawn_to_first_commit_s"] = round(first["t"] - start, 3)
    # The participating step's own compute is in both figures above; this one excludes it:
    # Manager ready -> the replacement starts the step in which it contributes gradients.
    out["manager_to_participating_step_start_s"] = round(part["t0"] - m["manager"], 3)
    out["participating_step_s"] = round(part["t"] - part["t0"], 3)
    if go is None:
        out["phases_s"] = {
            "spawn_to_python_main": round(m["main"] - p.w.spawned, 3),
            "import_torch": round(m["torch"] - m["main"], 3),
            "import_ft_library": round(m["ft_library"] - m["torch"], 3),
            "import_torch_dynamo": round(m["dynamo"] - m["ft_library"], 3)
            if p.kind == "cold"
            else None,
            "build_model": round(m["model"] - m.get("dynamo", m["ft_library"]), 3)
            if p.kind == "cold"
            else round(m["model"] - m["ft_library"], 3),
            "wait_bg_dynamo_after_model": round(m["dynamo"] - m["model"], 3)
            if p.kind == "bg_dynamo"
            else None,
        }
        c = p.cpu
        out["import_cpu_s"] = {
            "python_startup_and_this_module": round(c["main"], 3),
            "import_torch": round(c["torch"] - c["main"], 3),
            "import_ft_library": round(c["ft_library"] - c["torch"], 3),
            "import_torch_dynamo": round(c["dynamo"] - c["ft_library"], 3)
            if "dynamo" in c
            else None,
        }
        before_optimizer = m["dynamo"] if p.kind == "bg_dynamo" else m["model"]
    else:
        out["phases_s"] = {"prestarted_spare": "imports and model done before go"}
        before_optimizer = go
    out["phases_s"]["build_optimizer"] = round(m["optimizer"] - before_optimizer, 3)
    out["phases_s"]["construct_manager"] = round(m["manager"] - m["optimizer"], 3)
    first_event = p.events[0]
    out["phases_s"]["manager_to_first_step_start"] = round(first_event["t0"] - m["manager"], 3)
    out["first_steps"] = [
        {
            "dur_s": round(e["t"] - e["t0"], 3),
            "committed": e["committed"],
            "participating": e["participating"],
            "participants": e["participants"],
            "wait_quorum_s": round(e["wait_quorum_s"], 3),
            "last_heal_s": e["last_heal_s"] and round(e["last_heal_s"], 3),
        }
        for e in p.events
        if e["t"] <= part["t"]
    ]
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _range(values: list[float]) -> list[float] | None:
    return [round(min(values), 3), round(max(values), 3)] if values else None


def summarize(runs: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    """Medians and ranges over every kill and replacement of ``runs`` (one impl, one size)."""
    stalls = [s for r in runs for s in r["stalls"]]
    stall = [s["stall_s"] for s in stalls]
    out: dict[str, Any] = {
        "kills": len(stalls),
        "stall_s_median": _median(stall),
        "stall_s_range": _range(stall),
        "to_first_commit_without_victim_s_median": _median(
            [s["to_first_commit_without_victim_s"] for s in stalls]
        ),
        "steady_step_s_median": _median([s["steady_step_s"] for s in stalls]),
        "hangs": sum(len(r["hangs"]) for r in runs),
    }
    hangs = [h for r in runs for h in r["hangs"]]
    for key in ("stall_s", "stall_over_goal", "rejoin_s"):
        values = [h[key] for h in hangs]
        out[f"hang_{key}_median"] = _median(values)
        out[f"hang_{key}_range"] = _range(values)
    for kind in kinds:
        reps = [rep for r in runs for rep in r["replacements"] if rep["kind"] == kind]
        for key in (
            "spawn_to_participating_s",
            "manager_to_participating_s",
            "manager_to_participating_step_start_s",
            "donor_slowest_step_over_steady",
            "participating_step_over_steady",
        ):
            values = [rep[key] for rep in reps]
            out[f"{kind}_{key}_median"] = _median(values)
            out[f"{kind}_{key}_range"] = _range(values)
    return out


RATIO_ROWS = {
    "stall_s_median": "stall_s_median",
    "cold_spawn_to_participating_s_median": "cold_spawn_to_participating_s_median",
    "warm_spare_go_to_participating_over_torchft_cold_spawn": (
        "cold_spawn_to_participating_s_median"
    ),
    "cold_donor_slowest_step_over_steady_median": "cold_donor_slowest_step_over_steady_median",
    "warm_donor_slowest_step_over_steady_median": "cold_donor_slowest_step_over_steady_median",
    "cold_participating_step_over_steady_median": "cold_participating_step_over_steady_median",
    "hang_stall_s_median": "hang_stall_s_median",
}
"""ours' row -> torchft's row it is divided by (torchft has no warm spare: ours' spare is
compared with its fresh process)."""


def _ours_row(row: str) -> str:
    return (
        "warm_spawn_to_participating_s_median"
        if row == "warm_spare_go_to_participating_over_torchft_cold_spawn"
        else row
    )


def titan_row(replacements: list[str], repeats: int, ranks: int, steps: int) -> dict[str, Any]:
    """The TorchTitan row (see the module docstring)."""
    from torchtitan_ft.testing.titan_replacement import kill_a_rank

    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for replacement in replacements:
            work = tempfile.mkdtemp(prefix="recovery_titan_")
            entry: dict[str, Any] = {"replacement": replacement, "repeat": repeat}
            try:
                job = kill_a_rank(Path(work), replacement, steps, ranks, kill_rank=ranks - 1)
                entry.update(job.timeline())
            except AssertionError as e:  # a group failed or never trained together: recorded
                entry["error"] = str(e)[:2000]
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(f"[titan] {entry}", file=sys.stderr)
            runs.append(entry)

    def medians(field: str) -> dict[str, float | None]:
        return {
            kind: _median(
                [r[field] for r in runs if r["replacement"] == kind and r.get(field) is not None]
            )
            for kind in replacements
        }

    summary = medians("replacement_s")
    row: dict[str, Any] = {
        "setup": f"2 run_train.sh groups of {ranks} rank(s) (kind spare: and a third, the hot "
        f"spare), llama3 debug model (debug_ft_cpu.toml), {steps} steps, per-step FT, "
        "lighthouse min_replicas=1, heartbeat 2 s; group 1's last rank SIGKILLed once the "
        "groups committed 2 steps together",
        "target_s": TITAN_TARGET_S,
        "runs": runs,
        "replacement_s_median": summary,
        "full_quorum_s_median": medians("full_quorum_s"),
    }
    for kind in ("zygote", "zygote_sync", "spare"):
        if summary.get("cold") and summary.get(kind):
            row[f"{kind}_over_cold"] = round(summary[kind] / summary["cold"], 3)
    return row


RANK_GROUPS = 3
RANK_VICTIM = (2, 1)
"""(group, group rank) of the group-rank row's victim."""
RANK_FAULTS = ("hang", "hang_in_collective", "kill")


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


class _RankJob:
    """The group-rank row's job: ``RANK_GROUPS`` groups of 2 ranks training the tiny MLP."""

    def __init__(self, work: Path, lighthouse: str) -> None:
        from torchtitan_ft.testing.mlp import WorkerConfig

        self.work = work
        self.events = work / "events"
        self.hang_file = work / "hang"
        self.common = dict(
            lighthouse_addr=lighthouse,
            group_world_size=2,
            stop_step_file=str(work / "stop_step"),
            stop_participants=RANK_GROUPS,
            step_sleep_s=0.02,
            max_iterations=1_000_000,
            timeout_s=30.0,
            events_dir=str(self.events),
        )
        self.config = WorkerConfig
        self.procs: dict[tuple[int, int], Any] = {}
        for group in range(RANK_GROUPS):
            self.start(group)

    def start(self, group: int) -> None:
        from torchtitan_ft.testing.mlp import spawn_rank

        port = processes.free_port()
        for rank in range(2):
            out = str(self.work / f"g{group}r{rank}_{time.monotonic_ns()}.pt")
            hang = str(self.hang_file) if (group, rank) == RANK_VICTIM else None
            cfg = self.config(
                replica=group,
                group_rank=rank,
                store_port=port,
                out_path=out,
                hang_file=hang,
                **self.common,
            )
            self.procs[(group, rank)] = spawn_rank(cfg)

    def commits(self, since: float) -> list[Any]:
        from torchtitan_ft.events import EventKind, read_events

        return [
            e for e in read_events(self.events) if e.kind is EventKind.COMMIT and e.time > since
        ]

    def wait(self, what: str, found: Any, timeout_s: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (got := found()):
            dead = [k for k, p in self.procs.items() if p.exitcode not in (None, -9)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"group-rank row: {what}: not seen ({dead=})")
            time.sleep(0.05)
        return got

    def steady(self, steps: int) -> float:
        """Waits for ``steps`` steps committed by all groups; the median step of group 0's
        rank 0 over them."""
        since = time.time()

        def together() -> list[float] | None:
            times = [
                e.time
                for e in self.commits(since)
                if e.replica_name == "replica_0"
                and e.group_rank == 0
                and e["participants"] == RANK_GROUPS
            ]
            return times if len(times) > steps else None

        times = self.wait(f"{steps} steps of all groups together", together)
        return statistics.median(b - a for a, b in itertools.pairwise(times))

    def alone(self, since: float) -> float:
        """When groups 0 and 1 (both ranks of each) committed a step without group 2."""

        def first() -> float | None:
            seen: dict[tuple[str, int], float] = {}
            for e in self.commits(since):
                if e.replica_name != "replica_2" and e["participants"] == RANK_GROUPS - 1:
                    seen.setdefault((e.replica_name, e.group_rank), e.time)
            return max(seen.values()) if len(seen) == 2 * (RANK_GROUPS - 1) else None

        return self.wait("groups 0 and 1 committing without group 2", first)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)


def rank_row(count: int, steady: int, rng: random.Random, hangs: HangOptions) -> dict[str, Any]:
    """The group-rank row (see the module docstring)."""
    from torchtitan_ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=500,
        heartbeat_timeout_ms=round(hangs.heartbeat_timeout_s * 1000),
    )
    work = Path(tempfile.mkdtemp(prefix="recovery_rank_"))
    job = _RankJob(work, lighthouse.address())
    runs: list[dict[str, Any]] = []
    try:
        for _ in range(count):
            for fault in RANK_FAULTS:
                steady_s = job.steady(steady)
                victim = job.procs[RANK_VICTIM]
                if fault == "hang_in_collective":
                    job.hang_file.touch()
                    while not _stopped(victim.pid):
                        time.sleep(0.01)
                    signalled = time.time()
                else:
                    time.sleep(rng.uniform(0.0, steady_s))
                    if fault == "hang":
                        os.kill(victim.pid, signal.SIGSTOP)
                    else:
                        os.kill(victim.pid, signal.SIGKILL)
                        os.kill(job.procs[(RANK_VICTIM[0], 0)].pid, signal.SIGKILL)
                    signalled = time.time()
                alone = job.alone(signalled)
                goal = hangs.heartbeat_timeout_s + steady_s
                entry: dict[str, Any] = {
                    "fault": fault,
                    "stall_s": round(alone - signalled, 3),
                    "steady_step_s": round(steady_s, 3),
                    "goal_s": round(goal, 3),
                    "stall_over_goal": round((alone - signalled) / goal, 2),
                }
                if fault != "kill":
                    time.sleep(max(0.0, signalled + hangs.hold_s - time.time()))
                    os.kill(victim.pid, signal.SIGCONT)
                    resumed = time.time()
                    back = job.wait(
                        "group 2 committing with the others after SIGCONT",
                        lambda t=resumed: [
                            e
                            for e in job.commits(t)
                            if e.replica_name == "replica_2" and e["participants"] == RANK_GROUPS
                        ],
                    )
                    entry["rejoin_s"] = round(back[0].time - resumed, 3)
                else:
                    for rank in range(2):
                        job.procs[(RANK_VICTIM[0], rank)].join(10)
                    job.start(RANK_VICTIM[0])
                print(f"[group rank] {entry}", file=sys.stderr)
                runs.append(entry)
    finally:
        job.close()
        lighthouse.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    medians = {
        fault: _median([r["stall_s"] for r in runs if r["fault"] == fault]) for fault in RANK_FAULTS
    }
    row: dict[str, Any] = {
        "setup": f"{RANK_GROUPS} groups of 2 ranks (tiny MLP, testing/mlp.py), lighthouse "
        f"min_replicas=2, heartbeat timeout {hangs.heartbeat_timeout_s} s, collective timeout "
        f"30 s; group rank 1 of group 2 SIGSTOPped ({hangs.hold_s} s) at a random moment of "
        "a step or right before an allreduce, or SIGKILLed with its group rank 0 at a random "
        "moment of a step",
        "runs": runs,
        "stall_s_median": medians,
        "hang_in_collective_stall_over_goal_median": _median(
            [r["stall_over_goal"] for r in runs if r["fault"] == "hang_in_collective"]
        ),
    }
    if medians["hang_in_collective"] and medians["kill"]:
        row["hang_over_kill"] = round(medians["hang_in_collective"] / medians["kill"], 2)
    return row


def _parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks.recovery``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-mb",
        type=float,
        nargs="*",
        default=[10.0, 200.0],
        help="MLP sizes (none: only the TorchTitan row)",
    )
    parser.add_argument(
        "--titan",
        nargs="*",
        choices=["cold", "zygote", "zygote_sync", "spare"],
        default=[],
        help="the TorchTitan row's kinds (default: no TorchTitan row)",
    )
    parser.add_argument("--titan-ranks", type=int, default=2, help="ranks per TorchTitan group")
    parser.add_argument("--titan-steps", type=int, default=16, help="TorchTitan steps per run")
    parser.add_argument(
        "--kinds", nargs="+", choices=["cold", "warm", "bg_dynamo"], default=["cold", "warm"]
    )
    parser.add_argument("--impls", nargs="+", choices=_mlp.IMPLS, default=["ours"])
    parser.add_argument("--repeats", type=int, default=2, help="kills per replacement kind")
    parser.add_argument(
        "--trials", type=int, default=1, help="runs per impl and size (alternating impls)"
    )
    parser.add_argument("--steady", type=int, default=8, help="steady steps before each kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hangs", type=int, default=1, help="hangs after the kills")
    parser.add_argument(
        "--rank-faults",
        type=int,
        default=0,
        help="rounds of the group-rank row (two hangs and a kill of group rank 1 each; default "
        "0: no such row)",
    )
    parser.add_argument(
        "--hang-hold-s",
        type=float,
        default=35.0,
        help="seconds a hung group stays SIGSTOPped (default 35: past the 30 s collective "
        "timeout, so that a survivor that waits for it shows)",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="the lighthouse's heartbeat timeout (default 5000, the lighthouses' default)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="cold", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.worker:
        worker(args.replica, args.size_mb, args.lighthouse, args.kind, args.impl)
        return

    if min(args.hangs, args.hang_hold_s, args.rank_faults) < 0 or args.heartbeat_timeout_ms <= 0:
        parser.error(
            "--hangs, --hang-hold-s and --rank-faults must be >= 0 and --heartbeat-timeout-ms "
            f"> 0, got {args.hangs}, {args.hang_hold_s}, {args.rank_faults}, "
            f"{args.heartbeat_timeout_ms}"
        )
    hangs = HangOptions(args.hangs, args.hang_hold_s, args.heartbeat_timeout_ms / 1000)
    started = time.time()
    rng = random.Random(args.seed)
    kinds = [k for _ in range(args.repeats) for k in args.kinds]
    sizes = []
    errors: list[dict[str, Any]] = []
    for size_mb in args.sizes_mb:
        runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in args.impls}
        for trial in range(args.trials):
            order = args.impls[trial % len(args.impls) :] + args.impls[: trial % len(args.impls)]
            for impl in order:
                try:
                    runs[impl].append(run_size(size_mb, kinds, args.steady, rng, impl, hangs))
                except (RuntimeError, queue.Empty) as e:  # a worker died or hung: recorded
                    print(f"[{size_mb} MB] {impl} trial {trial} failed: {e}", file=sys.stderr)
                    errors.append(
                        {"impl": impl, "size_mb": size_mb, "trial": trial, "error": str(e)}
                    )
        summaries = {impl: summarize(runs[impl], args.kinds) for impl in args.impls}
        entry: dict[str, Any] = {"size_mb": size_mb, "summary": summaries, "runs": runs}
        if "ours" in summaries and "torchft" in summaries:
            ours, torchft = summaries["ours"], summaries["torchft"]
            entry["ours_over_torchft"] = {
                row: round(ours[_ours_row(row)] / torchft[theirs], 2)
                if ours.get(_ours_row(row)) and torchft.get(theirs)
                else None
                for row, theirs in RATIO_ROWS.items()
            }
        sizes.append(entry)
    titan = (
        titan_row(args.titan, args.repeats, args.titan_ranks, args.titan_steps)
        if args.titan
        else None
    )
    ranks = rank_row(args.rank_faults, args.steady, rng, hangs) if args.rank_faults else None
    command = "python -m " + MODULE + " " + " ".join(sys.argv[1:])
    print(
        json.dumps(
            {
                "command": command.strip(),
                "machine": machine(),
                "setup": {
                    **_mlp.setup(),
                    "lighthouse": "in-process, the impl's own (torchft: its Rust one), "
                    f"min_replicas=1, heartbeat timeout {args.heartbeat_timeout_ms} ms, "
                    "other timeouts default",
                    "hang": f"SIGSTOP at a random moment of a step, SIGCONT {args.hang_hold_s} "
                    "s later",
                    "manager": "async quorum, timeout 30 s, HTTPTransport",
                    "kill": "SIGKILL at a random moment of a step after steady training",
                },
                "targets": TARGETS,
                "sizes": sizes,
                "titan": titan,
                "group_rank": ranks,
                "failed_runs": errors,
                "wall_s": round(time.time() - started, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
