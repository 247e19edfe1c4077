"""Injecting for ``benchmarks.goodput``: the seeded schedule's faults, each when it is due and
``testing.faults.fault_victims`` lets it fire (a holder of the job's state survives it, except
the correlated kind), on the processes of a :class:`~benchmarks._goodput_launch.Launcher`; the
SIGCONTs, reconnects and lighthouse restarts that end them, and the donor kill's watch."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from benchmarks._goodput_accounts import Record
from benchmarks._goodput_job import Injected, Method, Options, launched_groups
from benchmarks._goodput_launch import Launcher, signal_pids
from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.replica_ids import group_number
from torchtitan_ft.testing.faults import Fault, FaultKind, donor_may_die, fault_victims

TORCHFT_NO_LINK = (
    "not injected: torchft's Manager advertises socket.gethostname() and TorchTitan's FTManager "
    "gives it no host name, so torchft's groups cannot live in network-namespace hosts (the name "
    "resolves to a loopback address there); they run on this machine's loopback, where no "
    "group's link can be pulled"
)
"""Why a ``link_down`` fault does not apply to the ``torchft`` method."""
DONOR_WATCH_S = 300.0
"""A donor kill's watch gives up when the victim has not started healing within this."""
KILLS = (FaultKind.SIGKILL, FaultKind.TWO_GROUPS, FaultKind.DONOR_KILL, FaultKind.CORRELATED)


def spare_schedule(schedule: Sequence[Fault], seed: int, groups: int) -> list[Fault]:
    """torchtitan_ft_spare's faults: ``schedule``'s times, kinds and ranks, with each fault's
    victim groups drawn again (seeded by ``seed``) uniformly over its ``groups`` launched
    groups, the hot spare included (the correlated kind: all of them). The schedule's own
    victims are among ``--groups``, which in the spare's job are the groups that hold the slots
    while all is well (the lowest replica ids participate): the spare would never be hit,
    whereas on a real job its hardware fails as often as any group's, and its death costs the
    step in flight as a participant's does."""
    rng = random.Random(seed)
    out = []
    for fault in schedule:
        if fault.kind is FaultKind.CORRELATED:
            victims = tuple(range(groups))
        else:
            victims = tuple(rng.sample(range(groups), len(fault.groups)))
        out.append(replace(fault, groups=victims))
    return out


def state_holders(
    records: Sequence[Record],
    running: Sequence[int],
    struck: Mapping[int, float],
    *,
    spare: bool,
) -> list[int]:
    """The groups that hold the job's newest committed state: running (``running``: every rank
    runs), in step, and not struck since (``struck``: group -> Unix time a fault last hit it)
    without being in step again. In step: a participant of the job's latest commit (a
    record's ``participants``; a group one of whose ranks was just killed still has all its
    workers until torchrun notices); with a hot spare (``spare``), also a group whose own newest
    record is a commit it did not heal in, of the job's latest step or the one before (the
    groups write their records of a step at slightly different times): the spare takes every
    step's update without a slot, so it holds the state though no step names it."""
    latest = next((r for r in reversed(records) if r.committed and r.participants), None)
    if latest is None:
        return []

    def in_step(r: Record, g: int) -> bool:
        if r.participants and g in r.participants:
            return True
        return spare and r.group == g and r.committed and not r.healed

    members = set(latest.participants or ())
    if spare:
        newest: dict[int, Record] = {}
        for r in records:
            if r.group is not None:
                newest[r.group] = r
        members |= {g for g, r in newest.items() if in_step(r, g) and r.step >= latest.step - 1}
    return [
        g
        for g in sorted(members)
        if g in running
        and not (g in struck and not any(r.time > struck[g] and in_step(r, g) for r in records))
    ]


class Injector:
    """Injects ``schedule`` (times after the job trained, :meth:`tick`'s ``t0``) into the
    processes of ``launcher``, started at ``started`` (Unix time); keeps what it did in
    :attr:`injected`."""

    def __init__(
        self, launcher: Launcher, opts: Options, schedule: list[Fault], started: float
    ) -> None:
        self.launcher, self.opts, self.started = launcher, opts, started
        self.method = launcher.method
        self.groups = launched_groups(self.method, opts)
        self.faults = list(schedule) if self.method is not Method.IDEAL else []
        if self.method is Method.TORCHTITAN_FT_SPARE:
            self.faults = spare_schedule(schedule, opts.seed, self.groups)
        self.injected: list[Injected] = []
        self.pending: list[tuple[float, Callable[[], None]]] = []
        self.watch: Callable[[list[Record]], bool] | None = None
        self.struck: dict[int, float] = {}
        """Group -> when a fault last hit it (Unix time)."""

    def now(self) -> float:
        return time.time() - self.started

    def tick(self, t0: float, records: list[Record]) -> None:
        """Injects the faults due (each once :meth:`victims` lets it), ends the faults whose
        time is up, and runs the donor watch."""
        now = self.now()
        while self.faults and t0 + self.faults[0].at_s <= now:
            victims = self.victims(self.faults[0], records)
            if victims is None:
                break  # deferred: no group holding the state would survive it
            fault = self.faults.pop(0)
            self._inject(fault, victims, t0 + fault.at_s)
        self.end_due(now)
        if self.watch is not None and self.watch(records):
            self.watch = None

    def end_due(self, now: float) -> None:
        """Runs the pending actions (SIGCONT, reconnect, lighthouse start) due by ``now``."""
        for due, action in list(self.pending):
            if due <= now:
                self.pending.remove((due, action))
                action()

    def end_all(self) -> None:
        for _, action in self.pending:
            action()
        self.pending = []

    def holders(self, records: list[Record]) -> list[int]:
        """The groups holding the job's state now (:func:`state_holders`)."""
        return state_holders(
            records,
            self.launcher.running_groups(),
            self.struck,
            spare=self.method is Method.TORCHTITAN_FT_SPARE,
        )

    def victims(self, fault: Fault, records: list[Record]) -> list[int] | None:
        """The fault's victim groups (``faults.fault_victims`` over the holders), or None while
        it must wait. The native job (one job, no per-group state) takes them as scheduled."""
        if not self.launcher.ft:
            return list(fault.groups)
        victims = fault_victims(fault.kind, fault.groups, self.holders(records), self.groups)
        return None if victims is None else list(victims)

    def _inject(self, fault: Fault, victims: list[int], due: float) -> None:
        inj = Injected(fault, self.now(), victims, deferred_s=round(self.now() - due, 2))
        self.injected.append(inj)
        kind = fault.kind
        if not self.launcher.ft:
            if kind is FaultKind.LIGHTHOUSE:
                inj.effect = "none: no lighthouse"
                return
            inj.effect = "job restarted from the last checkpoint"
            self.launcher.restart_job()
            return
        if kind in KILLS:
            for g in victims:
                self._kill_rank(g, fault.rank)
            inj.effect = f"SIGKILL rank {fault.rank} of group(s) {victims}"
            if kind is FaultKind.DONOR_KILL:
                self.watch = self._donor_watch(inj)
        elif kind is FaultKind.SIGSTOP:
            self._hang(inj, victims[0])
        elif kind is FaultKind.LINK_DOWN:
            self._link_down(inj, victims[0])
        elif kind in (FaultKind.LIGHTHOUSE, FaultKind.LIGHTHOUSE_GROUP_AWAY):
            lighthouse = self.launcher.lighthouse
            lighthouse.kill()
            for g in victims:
                self._kill_rank(g, fault.rank)
            inj.effect = f"lighthouse SIGKILLed, back after {self.opts.lighthouse_down_s}s" + (
                f"; SIGKILL rank {fault.rank} of group {victims[0]} with it" if victims else ""
            )
            self.pending.append((self.now() + self.opts.lighthouse_down_s, lighthouse.start))
        else:  # a new FaultKind needs its injector here (docs/development.md)
            raise ValueError(f"the goodput benchmark cannot inject {kind!r}: no injector")

    def _hang(self, inj: Injected, group: int) -> None:
        rank = inj.fault.rank
        pid = self.launcher.worker(group, rank)
        if pid is None:
            inj.effect = "not injected: rank gone"
            return
        os.kill(pid, signal.SIGSTOP)
        self.struck[group] = time.time()
        inj.effect = f"SIGSTOP rank {rank} of group {group} for {self.opts.hang_s}s"
        self.pending.append(
            (self.now() + self.opts.hang_s, lambda: signal_pids([pid], signal.SIGCONT))
        )

    def _link_down(self, inj: Injected, group: int) -> None:
        if self.method is Method.TORCHFT:
            inj.effect = TORCHFT_NO_LINK
            return
        if self.launcher.net is None:
            inj.effect = "not injected: no network namespaces here"
            return
        host = self.launcher.net[f"G{group}"]
        host.disconnect()
        self.struck[group] = time.time()
        inj.effect = f"link of group {group} down for {self.opts.link_down_s}s"
        self.pending.append((self.now() + self.opts.link_down_s, host.reconnect))

    def _kill_rank(self, group: int, rank: int) -> None:
        self.struck[group] = time.time()
        self.launcher.kill_rank(group, rank)

    def _donor_watch(self, inj: Injected) -> Callable[[list[Record]], bool]:
        """Kills the donor of the victim's first heal after the kill, if another group holds
        the state when that heal starts (``faults.donor_may_die``); gives up after
        :data:`DONOR_WATCH_S`. True once it is done."""
        victim = inj.groups[0]
        folder = self.launcher.folder / "events" / f"g{victim}"
        since = self.started + inj.time

        def check(records: list[Record]) -> bool:
            if self.now() - inj.time > DONOR_WATCH_S:
                inj.effect += f"; no heal seen within {DONOR_WATCH_S:g} s, donor not killed"
                return True
            if self.method is Method.TORCHFT:
                donor = self._torchft_donor(victim, since)
                why = "when the victim's quorum said heal"
            else:
                donor, why = self._donor(folder, since)
            if donor is None:
                return False
            inj.donor = donor
            if not donor_may_die(donor, self.holders(records)):
                inj.effect += f"; donor group {donor} not killed: it was the last holder"
                return True
            self._kill_rank(donor, inj.fault.rank)
            inj.effect += f"; donor group {donor} SIGKILLed {why}"
            return True

        return check

    def _donor(self, folder: Path, since: float) -> tuple[int | None, str]:
        """The group the victim's first heal after ``since`` is from (its quorum's replica id
        at the heal's source rank), with whether that heal had ended; None before it starts."""
        events = [e for e in read_events(folder) if e.time > since and e.group_rank == 0]
        heals = [e for e in events if e.kind is EventKind.HEAL_START]
        if not heals:
            return None, ""
        quorums = [e for e in events if e.kind is EventKind.QUORUM and e.time <= heals[0].time]
        donor_id = quorums[-1]["replica_ids"][heals[0]["source_replica_rank"]]
        done = any(e.kind is EventKind.HEAL_END for e in events)
        why = "after the heal had ended" if done else "while the victim healed"
        return group_number(donor_id), why

    def _torchft_donor(self, victim: int, since: float) -> int | None:
        """The torchft method's donor: the source of the victim's first heal after ``since``,
        as its quorum named it (``heals_*.jsonl`` of the torchft worker)."""
        heals = []
        for path in self.launcher.folder.glob(f"heals_r{victim}_p*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    heals.append(json.loads(line))
        heals = sorted((h for h in heals if h["time"] > since), key=lambda h: h["time"])
        return heals[0]["source"] if heals else None
