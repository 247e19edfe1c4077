"""The lighthouse's mutable state and its bookkeeping, without any networking.

``LighthouseState`` is driven by the server's event loop (one thread, no locks): requests,
heartbeats, stream ends and ticks come in; it calls the pure ``decide`` when a quorum might be
ready and hands the issued quorum, serialized once, to every waiting member.

Cost per round is linear in the number of replicas: an arrival does O(1) work and only calls
``decide`` (O(N log N)) when it completes the previous quorum or brings every known replica in;
other rounds (join timeout, stragglers) are decided by the periodic tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from torchtitan_ft.lighthouse.decision import (
    HOLDER_WAIT_HEARTBEATS,
    Decision,
    DecisionOptions,
    Pending,
    RoundKind,
    decide,
    gone_members,
    group_last_seen,
    healthy_replicas,
    newcomer_ahead,
    next_gone_check,
    next_quorum_id,
)
from torchtitan_ft.lighthouse.exclusion import (
    Action,
    Exclusion,
    ExclusionOptions,
    StragglerPolicy,
    decide_exclusion,
    group_of,
)
from torchtitan_ft.lighthouse.groups import GroupBook, GroupsFile
from torchtitan_ft.lighthouse.history import (
    DEFAULT_CAPACITY,
    History,
    HistoryKind,
    LeftBecause,
    heartbeat_events,
    membership_events,
    why_left,
)
from torchtitan_ft.lighthouse.last_quorum import (
    LastQuorum,
    LastQuorumFile,
    heard_since_restart,
    restored_line,
    write_due,
)
from torchtitan_ft.lighthouse.recoveries import Departure
from torchtitan_ft.lighthouse.stragglers import Change, SpeedBook, StragglerOptions
from torchtitan_ft.lighthouse.types import Quorum, QuorumMember, StateLoss
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.recoveries import Noticed

logger = logging.getLogger(__name__)

DECISION_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5)
"""Upper bounds (seconds) of the decision-latency histogram."""

_DECLARED_GONE_KEEP_S = 3600.0
"""How long a replica named gone is remembered without a quorum that has it again: longer
than any SIGSTOP a job survives; bounds the memory of ids that never come back."""


@dataclass
class Metrics:
    quorums_issued: int = 0
    quorum_id_changes: int = 0
    heartbeats: int = 0
    stream_deaths: int = 0
    bad_requests: int = 0
    unauthenticated_requests: int = 0
    decision_seconds_sum: float = 0.0
    decision_buckets: list[int] = field(default_factory=lambda: [0] * len(DECISION_BUCKETS))
    decision_count: int = 0
    exclusions: int = 0
    """Times the straggler policy left a group out of the quorum."""
    readmissions: int = 0
    """Times it took a left-out group back."""
    link_probe_bytes: int = 0
    """Payload bytes of the groups' link probes, both ways (their cost to the lighthouse)."""
    state_losses: int = 0
    """Times the state guard declared the job's state lost (``decision.state_guard``)."""

    def observe_decision(self, seconds: float) -> None:
        self.decision_count += 1
        self.decision_seconds_sum += seconds
        for i, bound in enumerate(DECISION_BUCKETS):
            if seconds <= bound:
                self.decision_buckets[i] += 1


class LighthouseState:
    """Pending requests, heartbeats and the last quorum; decides and issues quorums.

    Args:
        opts: the decision's thresholds.
        clock: monotonic seconds, used for heartbeats and join times.
        wall_us: wall-clock microseconds since the epoch; the floor of every new quorum_id, so
            that a restarted lighthouse never reissues an id (see ``next_quorum_id``).
        stragglers: the straggler report's thresholds (``lighthouse.stragglers``).
        exclusion: the straggler policy (``lighthouse.exclusion``); default: off.
        history: the job's event log (``lighthouse.history``); default: in memory only,
            ``DEFAULT_CAPACITY`` events, on the wall clock.
        last_quorum: where the last issued quorum is kept across restarts
            (``lighthouse.last_quorum``, under ``--state_dir``); one there is restored.
            Default None: a restarted lighthouse knows no previous quorum.
        groups_file: where the groups' figures are saved and restored from
            (``lighthouse.groups.GroupsFile``, under ``--state_dir``); default None: in memory
            only.
    """

    def __init__(
        self,
        opts: DecisionOptions,
        clock: Callable[[], float] = time.monotonic,
        wall_us: Callable[[], int] = lambda: time.time_ns() // 1000,
        stragglers: StragglerOptions | None = None,
        exclusion: ExclusionOptions | None = None,
        history: History | None = None,
        last_quorum: LastQuorumFile | None = None,
        groups_file: GroupsFile | None = None,
    ) -> None:
        self.opts = opts
        self.exclusion_opts = exclusion or ExclusionOptions()
        self._clock = clock
        self._wall_us = wall_us
        self.pending: dict[str, Pending] = {}
        self._wire: dict[str, pb.QuorumMember] = {}
        self._waiters: dict[str, list[asyncio.Future[bytes]]] = {}
        self.heartbeats: dict[str, float] = {}
        self._streams: dict[str, int] = {}
        self.rank_heartbeats: dict[str, dict[int, float]] = {}
        """replica_id -> group rank (> 0) -> last heartbeat on that rank's own stream (our
        clients' group ranks other than 0; see ``decision.group_last_seen``)."""
        self._rank_streams: dict[tuple[str, int], int] = {}
        self.previous: tuple[QuorumMember, ...] | None = None
        self._previous_ids: frozenset[str] = frozenset()
        self._previous_max_step: int | None = None
        self._previous_pending = 0
        self.quorum_id = 0
        self.quorum: Quorum | None = None
        self.quorum_issued_at: float | None = None
        self.reason = "waiting: no replica has asked yet"
        """Why the last decision was what it was; logged when it changes (a countdown in it
        aside, see ``Decision.log_key``)."""
        self._logged_as = self.reason
        self.metrics = Metrics()
        self.declared_gone: dict[str, float] = {}
        """Replicas a ``gone`` answer named, and when: until a quorum with them is issued,
        they must not commit the step their peers aborted."""
        self.speeds = SpeedBook(stragglers or StragglerOptions())
        """Each group's recent compute times and judged speed (the straggler report)."""
        self.exclusions: dict[str, Exclusion] = {}
        """Each group's state under the straggler policy (only groups it ever left out)."""
        self._exclusion_history: dict[str, tuple[float, ...]] = {}
        """When each replica group (``group_of``) was left out, within the policy's window:
        kept when its process is gone, so that a restarted group goes on with its count."""
        self.history = history or History(DEFAULT_CAPACITY, None, time.time)
        """The job's events: who joined and left the quorum and why (``lighthouse.history``)."""
        self.asked: set[str] = set()
        """Groups that ever asked for a quorum: replica groups, unlike a readiness probe that
        only heartbeats (forgotten with their heartbeat)."""
        self._stream_ended: set[str] = set()
        """Groups whose stream ended since their last quorum request (why they left)."""
        self._was_healthy: set[str] = set()
        self._lost: set[str] = set()
        self._groups_file = groups_file
        self.groups = groups_file.load(self._wall()) if groups_file else GroupBook()
        """What the groups report (steps/s, committed samples, heals) and the job's figures;
        restored after a restart when ``groups_file`` is given."""
        self._last_quorum = last_quorum
        self._written: LastQuorum | None = None
        self._written_at = 0.0
        self._ended: set[str] = set()
        """Members of the previous quorum whose heartbeat stream ended since it was issued."""
        self._ended_at: dict[str, float] = {}
        self._finished: set[str] = set()
        """Members of the previous quorum whose process ended its stream itself (the state
        guard's ``finished``)."""
        """When each of them ended in this run: the state guard waits for it from there."""
        self.state_loss: StateLoss | None = None
        """The job's state loss, from its declaration until a quorum reaches the lost step
        again; sent with every quorum meanwhile (docs/lighthouse.md, "State loss")."""
        self.state_loss_at: float | None = None
        """When it was declared (wall seconds)."""
        self._restored_at: float | None = None
        """When a quorum of an earlier run was restored, until this run issues its own."""
        if last_quorum is not None and (record := last_quorum.load()) is not None:
            self._restore(record)

    # -- inputs ---------------------------------------------------------------------------

    def heartbeat(self, replica_id: str) -> None:
        self.heartbeats[replica_id] = self._clock()
        self.metrics.heartbeats += 1

    def stream_opened(self, replica_id: str) -> None:
        self._streams[replica_id] = self._streams.get(replica_id, 0) + 1
        self.heartbeat(replica_id)

    def rank_heartbeat(self, replica_id: str, group_rank: int) -> None:
        """A heartbeat of group rank ``group_rank`` (> 0) of a group, on its own stream."""
        self.rank_heartbeats.setdefault(replica_id, {})[group_rank] = self._clock()
        self.metrics.heartbeats += 1

    def rank_stream_opened(self, replica_id: str, group_rank: int) -> None:
        key = (replica_id, group_rank)
        self._rank_streams[key] = self._rank_streams.get(key, 0) + 1
        self.rank_heartbeat(replica_id, group_rank)

    def rank_stream_closed(self, replica_id: str, group_rank: int) -> None:
        """A group rank's heartbeat stream ended: the rank exited or died (its peers'
        collectives fail on their own); the group is judged by its other heartbeats."""
        key = (replica_id, group_rank)
        left = self._rank_streams.get(key, 0) - 1
        if left > 0:
            self._rank_streams[key] = left
            return
        self._rank_streams.pop(key, None)
        ranks = self.rank_heartbeats.get(replica_id, {})
        ranks.pop(group_rank, None)
        if not ranks:
            self.rank_heartbeats.pop(replica_id, None)

    def last_seen(self) -> Mapping[str, float]:
        """When each group was last heard from, its silent ranks counted
        (``decision.group_last_seen``)."""
        return group_last_seen(self.heartbeats, self.rank_heartbeats)

    def stream_closed(self, replica_id: str, finished: bool = False) -> None:
        """The replica's heartbeat stream ended: its process is gone, or (``finished``) it
        ended the stream itself, shutting down."""
        left = self._streams.get(replica_id, 0) - 1
        if left > 0:
            self._streams[replica_id] = left
            return
        self._streams.pop(replica_id, None)
        self.heartbeats.pop(replica_id, None)
        self.speeds.forget(replica_id)
        self.exclusions.pop(replica_id, None)
        self.metrics.stream_deaths += 1
        self._was_healthy.discard(replica_id)
        self._lost.discard(replica_id)
        if replica_id in self._previous_ids:
            self._ended.add(replica_id)
            self._ended_at[replica_id] = self._clock()
            if finished:
                self._finished.add(replica_id)
        if replica_id in self.asked:
            self._stream_ended.add(replica_id)
            if not finished:
                wall = self._wall()
                self.groups.departed(Departure(replica_id, wall, wall, Noticed.STREAM_END))
            self.history.record(
                HistoryKind.STREAM_ENDED, replica_id, "heartbeat stream ended: the process died"
            )
        if replica_id in self.pending:
            self._drop_pending(replica_id)
        logger.info("replica %s is gone (heartbeat stream ended)", replica_id)
        self.evaluate()

    def request(
        self,
        member: QuorumMember,
        wire: pb.QuorumMember,
        progress: pb.GroupProgress | None = None,
    ) -> asyncio.Future[bytes]:
        """Registers a quorum request (with the group's step timings, if it sent any); the
        future gets the serialized response."""
        rid = member.replica_id
        now = self._clock()
        self.heartbeats[rid] = now
        self.asked.add(rid)
        self._stream_ended.discard(rid)
        if progress is not None:
            changes = self.speeds.report(rid, progress.steps, now)
            changes += self.speeds.report_link(rid, progress.link_probes, member.step, now)
            for change, line in changes:
                logger.info("lighthouse: %s", line)
                kind = (
                    HistoryKind.STRAGGLER
                    if change is Change.STARTED
                    else HistoryKind.STRAGGLER_ENDED
                )
                self.history.record(kind, rid, line)
            self.history.record_all(self.groups.report(rid, progress, self._wall()))
        if self._excluded_now(rid, now):
            return self._answer_excluded(rid, wire)
        previous = self.pending.get(rid)
        joined = previous.joined if previous is not None else now
        if previous is None and rid in self._previous_ids:
            self._previous_pending += 1
        if previous is None and (
            warning := newcomer_ahead(member, self._previous_ids, self._previous_max_step)
        ):
            logger.warning("lighthouse: %s", warning)
        self.pending[rid] = Pending(member, joined)
        self._wire[rid] = wire
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(rid, []).append(fut)
        if self._might_be_ready():
            self.evaluate()
        return fut

    def excluded(self) -> frozenset[str]:
        """The groups the straggler policy leaves out of the quorum now."""
        return frozenset(rid for rid, e in self.exclusions.items() if e.excluded)

    def _excluded_now(self, rid: str, now: float) -> bool:
        """Decides (``decide_exclusion``) whether the asking group is out of the quorum."""
        prior = self.exclusions.get(rid) or Exclusion(
            history=self._exclusion_history.get(group_of(rid), ())
        )
        straggler = self.speeds.straggler(rid)
        if not prior.excluded and (
            not straggler or self.exclusion_opts.policy is StragglerPolicy.OFF
        ):
            return False  # the common case, without the O(replicas) count below
        others = len(self.healthy() - self.excluded() - {rid})
        after, action, reason = decide_exclusion(
            prior,
            straggler,
            others,
            self.opts.min_replicas,
            now,
            self.exclusion_opts,
        )
        self.exclusions[rid] = after
        self._exclusion_history[group_of(rid)] = after.history
        if action is Action.EXCLUDED:
            self.metrics.exclusions += 1
            self.history.record(HistoryKind.EXCLUDED, rid, reason)
            logger.warning(
                "lighthouse: straggler policy: replica group %r is left out of the quorum "
                "(%s); it trains alone without committing until it is fast again",
                rid,
                reason,
            )
        elif action is Action.READMITTED:
            self.metrics.readmissions += 1
            self.history.record(HistoryKind.READMITTED, rid, reason)
            logger.info(
                "lighthouse: straggler policy: replica group %r is taken back into the quorum "
                "(%s); it heals from the others",
                rid,
                reason,
            )
        return after.excluded

    def _answer_excluded(self, rid: str, wire: pb.QuorumMember) -> asyncio.Future[bytes]:
        """Answers a left-out group at once: a quorum of itself alone, its speed marked
        ``excluded`` (its Manager then runs the step without committing it). The others' round
        no longer waits for it."""
        msg = pb.LighthouseQuorumResponse()
        msg.quorum.quorum_id = self.quorum_id
        msg.quorum.participants.append(wire)
        msg.quorum.created.FromDatetime(datetime.now(UTC))
        msg.speeds.extend(speed.to_proto() for speed in self.speeds.views(self.excluded()))
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        fut.set_result(msg.SerializeToString())
        if rid in self.pending:
            self._drop_pending(rid)
        if self.pending:
            self.evaluate()
        return fut

    def cancel(self, replica_id: str, fut: asyncio.Future[bytes]) -> None:
        """The request behind ``fut`` ended before a quorum (deadline or disconnect)."""
        waiters = self._waiters.get(replica_id)
        if waiters is None or fut not in waiters:
            return
        waiters.remove(fut)
        if not waiters:
            self._drop_pending(replica_id)

    def tick(self) -> None:
        """Periodic: forget long-expired heartbeats, decide rounds that wait on time."""
        now = self._clock()
        horizon = 10 * self.opts.heartbeat_timeout
        for rid in [r for r, seen in self.heartbeats.items() if now - seen > horizon]:
            if rid not in self._streams:
                del self.heartbeats[rid]
                self.speeds.forget(rid)
                self.exclusions.pop(rid, None)
                self.asked.discard(rid)
                self._lost.discard(rid)
        for rid in [r for r, at in self.declared_gone.items() if now - at > _DECLARED_GONE_KEEP_S]:
            del self.declared_gone[rid]
        window = self.exclusion_opts.window_s
        for group in [
            g for g, h in self._exclusion_history.items() if not h or now - h[-1] >= window
        ]:
            del self._exclusion_history[group]
        self._heartbeat_changes()
        self._persist()
        if self.pending:
            self.evaluate()
        if self._groups_file is not None:
            self._groups_file.save_due(self.groups, self._wall())

    def close(self) -> None:
        """Saves the groups' figures (under ``--state_dir``) and closes the history."""
        if self._groups_file is not None and self.groups.groups:
            self._groups_file.save(self.groups, self._wall())
        self.history.close()

    def _heartbeat_changes(self) -> None:
        """Records heartbeats lost and regained since the last tick (groups that asked for a
        quorum only)."""
        healthy = self.healthy() & self.asked
        if healthy == self._was_healthy:
            return
        events = heartbeat_events(
            self._was_healthy, healthy, self._lost, self.opts.heartbeat_timeout
        )
        self.history.record_all(events)
        last_seen = self.last_seen()
        for kind, rid, _ in events:
            if kind is HistoryKind.HEARTBEAT_LOST:
                self._lost.add(rid)
                seen = self._wall_of(last_seen.get(rid, self._clock()))
                noticed = min(self._wall(), seen + self.opts.heartbeat_timeout)
                self.groups.departed(Departure(rid, seen, noticed, Noticed.HEARTBEAT_TIMEOUT))
            else:
                self._lost.discard(rid)
        self._was_healthy = healthy

    def gone(
        self, asker: str, watched: list[str], asker_runs: bool
    ) -> tuple[tuple[str, ...], bool]:
        """``GoneMembers``: the watched replicas that are gone (``gone_members``), and whether
        ``asker`` itself was named gone by an earlier answer. ``asker_runs``: the request was
        just sent (not a long poll that may have outlived a SIGSTOP of the asker); the asker
        then counts as heard from now unless named gone, so that no later answer names it gone
        for a silence that has already ended."""
        now = self._clock()
        gone = gone_members(watched, self.last_seen(), now, self.opts.heartbeat_timeout)
        for rid in gone:
            self.declared_gone.setdefault(rid, now)
        asker_gone = asker in self.declared_gone
        if asker_runs and not asker_gone and asker in self.heartbeats:
            self.heartbeats[asker] = now
        return gone, asker_gone

    def next_gone_check(self, watched: list[str]) -> float | None:
        """Seconds until one of ``watched`` may be gone (``decision.next_gone_check``)."""
        return next_gone_check(
            watched, self.last_seen(), self._clock(), self.opts.heartbeat_timeout
        )

    # -- decision -------------------------------------------------------------------------

    def _might_be_ready(self) -> bool:
        """O(1) test: could this arrival complete a round? ``decide`` has the final word."""
        if self.previous is not None and self._previous_pending == len(self._previous_ids):
            return True
        # Every known replica asked, and enough of them: otherwise the tick decides.
        known = len(self.heartbeats) - len(self.excluded())
        return len(self.pending) >= max(self.opts.min_replicas, known)

    def evaluate(self) -> Decision:
        start = time.perf_counter()
        heartbeats, previous = self.last_seen(), self.previous
        excluded = self.excluded()
        if excluded:
            # Left-out groups are neither waited for nor counted by the split-brain guard: they
            # cannot commit, so they are no competing quorum.
            heartbeats = {rid: t for rid, t in heartbeats.items() if rid not in excluded}
            if previous is not None:
                previous = tuple(m for m in previous if m.replica_id not in excluded) or None
        # The state guard counts a member whose stream ended as heard from at its end.
        heard = {**self._ended_at, **heartbeats}
        if self._restored_at is not None and self.previous is not None:
            heard = self._ended_at | heard_since_restart(
                (m.replica_id for m in self.previous), self._ended, heartbeats, self._restored_at
            )
        decision = decide(
            self.pending,
            heartbeats,
            previous,
            self._clock(),
            self.opts,
            heard,
            frozenset(self._finished),
        )
        self.metrics.observe_decision(time.perf_counter() - start)
        if decision.state_loss is not None:
            self._declare_state_loss(decision.state_loss)
        if decision.members is not None:
            self._issue(decision.members, decision.round_kind or RoundKind.FULL)
        self._set_reason(decision)
        return decision

    def _issue(self, members: tuple[QuorumMember, ...], round_kind: RoundKind) -> None:
        # The first quorum after a restart gets a new id, as without ``last_quorum``.
        previous = None if self._restored_at is not None else self.previous
        new_id = next_quorum_id(self.quorum_id, previous, members, self._wall_us())
        if new_id != self.quorum_id:
            self.metrics.quorum_id_changes += 1
            self._record_quorum(members, new_id, round_kind)
        self.quorum_id = new_id
        created = datetime.now(UTC)
        self.quorum = Quorum(new_id, members, created)
        msg = pb.LighthouseQuorumResponse()
        msg.quorum.quorum_id = new_id
        msg.quorum.participants.extend(self._wire[m.replica_id] for m in members)
        msg.quorum.created.FromDatetime(created)
        msg.speeds.extend(speed.to_proto() for speed in self.speeds.views(self.excluded()))
        if self.state_loss is not None:
            if max(m.step for m in members) < self.state_loss.lost_step:
                msg.state_loss.CopyFrom(self.state_loss.to_proto())
            else:
                logger.info(
                    "lighthouse: quorum %d is at step %d, the lost step %d or past it: the "
                    "state loss is over",
                    new_id,
                    max(m.step for m in members),
                    self.state_loss.lost_step,
                )
                self.state_loss = self.state_loss_at = None
        payload = msg.SerializeToString()
        for m in members:
            rid = m.replica_id
            del self.pending[rid]
            del self._wire[rid]
            for fut in self._waiters.pop(rid, ()):
                if not fut.done():
                    fut.set_result(payload)
        self.previous = members
        self._previous_ids = frozenset(m.replica_id for m in members)
        for rid in self._previous_ids & self.declared_gone.keys():
            del self.declared_gone[rid]
        self._previous_max_step = max((m.step for m in members), default=None)
        self._previous_pending = sum(1 for rid in self.pending if rid in self._previous_ids)
        self.quorum_issued_at = self._clock()
        self.metrics.quorums_issued += 1
        self._ended.clear()
        self._ended_at.clear()
        self._finished.clear()
        self._restored_at = None
        self._persist()

    def _declare_state_loss(self, loss: StateLoss) -> None:
        """Records the job's state loss (history, counter, one ERROR line); the quorums issued
        from now on carry it until one reaches the lost step again."""
        self.state_loss, self.state_loss_at = loss, self._wall()
        self.metrics.state_losses += 1
        holders = ", ".join(loss.holders) or "unknown"
        reason = (
            f"the job's state at step {loss.lost_step} is lost: every member that held it "
            f"({holders}) is gone and none came back within {HOLDER_WAIT_HEARTBEATS} heartbeat "
            "timeouts; the next quorum's groups are behind it (each stops or trains on as its "
            "fault_tolerance.on_state_loss says)"
        )
        self.history.record(HistoryKind.STATE_LOST, "", reason)
        logger.error("lighthouse: %s", reason)

    def _restore(self, record: LastQuorum) -> None:
        """Takes an earlier run's last quorum as the previous one (``last_quorum``)."""
        self.previous = tuple(
            QuorumMember(replica_id=rid, step=step) for rid, step in sorted(record.steps.items())
        )
        self._previous_ids = frozenset(record.steps)
        self._previous_max_step = max(record.steps.values())
        self._ended = set(record.ended)
        self._restored_at = self._clock()
        self._written, self._written_at = record, self._clock()
        if self._last_quorum is not None:
            logger.info("lighthouse: %s", restored_line(record, self._last_quorum.path))

    def _persist(self) -> None:
        """Writes the last quorum when due (``last_quorum.write_due``)."""
        if self._last_quorum is None or self.previous is None:
            return
        current = LastQuorum(
            {m.replica_id: m.step for m in self.previous},
            frozenset(self._ended),
        )
        now = self._clock()
        if write_due(self._written, current, now - self._written_at):
            self._last_quorum.save(current)
            self._written, self._written_at = current, now

    def _record_quorum(
        self, members: tuple[QuorumMember, ...], quorum_id: int, round_kind: RoundKind
    ) -> None:
        """The history of a quorum with a new id: who joined, who left and why, commit
        failures reported, healthy groups left out by the join timeout."""
        ids = [m.replica_id for m in members]
        left = self._previous_ids - set(ids)
        healthy, excluded = self.healthy(), self.excluded()
        because = {
            rid: why_left(rid, self._stream_ended, healthy, excluded, round_kind) for rid in left
        }
        self.history.record_all(
            membership_events(
                self._previous_ids,
                ids,
                quorum_id,
                round_kind,
                because,
                self.groups.were_members(ids),
            )
        )
        self._departed(because)
        self.groups.quorum(ids, self._wall())
        for m in members:
            if m.commit_failures > 0:
                self.history.record(
                    HistoryKind.COMMIT_FAILURES,
                    m.replica_id,
                    f"{m.commit_failures} failed commit(s) in a row at step {m.step}",
                )
        if round_kind is RoundKind.JOIN_TIMEOUT:
            waited = round(self.opts.join_timeout, 3)
            for rid in sorted((healthy & self.asked) - set(ids) - excluded - left):
                self.history.record(
                    HistoryKind.JOIN_TIMEOUT, rid, f"healthy but did not ask within {waited:g} s"
                )

    def _departed(self, because: Mapping[str, LeftBecause]) -> None:
        """The departures of members a new quorum left out (``lighthouse.recoveries``): their
        heartbeats timed out, or they did not ask (a quorum without them came first). An ended
        stream was one already; a group the straggler policy left out did not go."""
        last_seen, now = self.last_seen(), self._wall()
        for rid, why in because.items():
            if why in (LeftBecause.STREAM_ENDED, LeftBecause.EXCLUDED):
                continue
            seen = self._wall_of(last_seen.get(rid, self._clock()))
            if why is LeftBecause.HEARTBEAT_LOST:
                noticed = min(now, seen + self.opts.heartbeat_timeout)
                self.groups.departed(Departure(rid, seen, noticed, Noticed.HEARTBEAT_TIMEOUT))
            else:
                self.groups.departed(Departure(rid, seen, now, Noticed.QUORUM))

    def _drop_pending(self, replica_id: str) -> None:
        del self.pending[replica_id]
        self._wire.pop(replica_id, None)
        for fut in self._waiters.pop(replica_id, ()):
            fut.cancel()
        if replica_id in self._previous_ids:
            self._previous_pending -= 1

    def _set_reason(self, decision: Decision) -> None:
        if decision.log_as != self._logged_as:
            logger.info("lighthouse: %s", decision.reason)
            self._logged_as = decision.log_as
        self.reason = decision.reason

    # -- views ----------------------------------------------------------------------------

    def _wall(self) -> float:
        return self._wall_us() / 1e6

    def _wall_of(self, at: float) -> float:
        """The wall time of ``at``, a reading of the state's clock."""
        return self._wall() - (self._clock() - at)

    def healthy(self) -> set[str]:
        return healthy_replicas(self.last_seen(), self._clock(), self.opts.heartbeat_timeout)

    def status(self) -> dict:
        """A JSON-able snapshot for the status page."""
        now = self._clock()
        healthy = self.healthy()
        quorum = None
        if self.quorum is not None:
            quorum = {
                "quorum_id": self.quorum.quorum_id,
                "created": self.quorum.created.isoformat(),
                "age_s": round(now - (self.quorum_issued_at or now), 3),
                "members": [
                    {
                        "replica_id": m.replica_id,
                        "address": m.address,
                        "store_address": m.store_address,
                        "step": m.step,
                        "world_size": m.world_size,
                        "commit_failures": m.commit_failures,
                    }
                    for m in self.quorum.participants
                ],
            }
        excluded = self.excluded()
        state_loss = None
        if self.state_loss is not None:
            state_loss = {
                "lost_step": self.state_loss.lost_step,
                "holders": list(self.state_loss.holders),
                "declared_at": self.state_loss_at,
            }
        return {
            "reason": self.reason,
            "state_loss": state_loss,
            "state_losses": self.metrics.state_losses,
            "min_replicas": self.opts.min_replicas,
            "straggler_policy": self.exclusion_opts.policy.value,
            "quorum": quorum,
            "pending": sorted(self.pending),
            "heartbeats": [
                {
                    "replica_id": rid,
                    "age_s": round(now - seen, 3),
                    "healthy": rid in healthy,
                    "stream": rid in self._streams,
                }
                for rid, seen in sorted(self.last_seen().items())
                if rid in self.asked
            ],
            "other_callers": sorted(rid for rid in self.heartbeats if rid not in self.asked),
            "now": round(self._wall(), 3),
            "job": self.groups.job(self._wall()),
            "groups": self.groups.views(self._wall()),
            "last_event_seq": self.history.last_seq,
            "speeds": [
                {
                    "replica_id": speed.replica_id,
                    "relative_speed": round(speed.relative_speed, 3),
                    "straggler": speed.straggler,
                    "straggler_since_step": speed.straggler_since_step,
                    "excluded": speed.excluded,
                    "link_relative_speed": round(speed.link_relative_speed, 3),
                    "cause": speed.cause,
                }
                for speed in self.speeds.views(excluded)
            ],
        }
