"""What a Manager drives, built and wired to each other once its arguments are checked and its
settings resolved (``Manager.__init__``): the replica group it joined (``rendezvous``), its event
stream, and the parts each step runs through: the progress report (``progress``), the step's
collectives (``step_collectives``), healing (``healing``), the quorum thread (``quorum``), the
hung-peer guard (``hung``) and the in-flight retry (``retry``); on group rank 0, the watch of
its own recoveries (``recovery``), fed by the event stream; and the step account
(``ledger``) whose committed step every event carries.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchtitan_ft.checkpoint import CheckpointTransport
from torchtitan_ft.events import EventKind, EventWriter, open_event_writer, this_process_started
from torchtitan_ft.manager.decisions import WorldSizeMode, check_step_arguments
from torchtitan_ft.manager.healing import Healing
from torchtitan_ft.manager.hung import HungPeerGuard
from torchtitan_ft.manager.ledger import StepLedger
from torchtitan_ft.manager.options import ManagerOptions
from torchtitan_ft.manager.progress import ProgressReport
from torchtitan_ft.manager.quorum import QuorumThread
from torchtitan_ft.manager.recovery import RecoveryWatch
from torchtitan_ft.manager.rendezvous import GroupRendezvous, join_replica_group
from torchtitan_ft.manager.retry import InflightRetry, check_retry_arguments
from torchtitan_ft.manager.settings import ManagerSettings
from torchtitan_ft.manager.stats import Counters
from torchtitan_ft.manager.step_collectives import StepCollectives


@dataclass(frozen=True)
class StepRules:
    """torchft's Manager arguments that shape every step (the ``Manager``'s of these names).

    Raises:
        ValueError, TypeError: ``decisions.check_step_arguments``.
    """

    min_replica_size: int
    world_size_mode: WorldSizeMode
    max_retries: int | None
    init_sync: bool
    use_async_quorum: bool

    def __post_init__(self) -> None:
        check_step_arguments(self.min_replica_size, self.world_size_mode, self.max_retries)


@dataclass(frozen=True)
class ManagerParts:
    """The parts of one Manager (see the module doc)."""

    group: GroupRendezvous
    events: EventWriter
    counters: Counters
    ledger: StepLedger
    progress: ProgressReport
    collectives: StepCollectives
    healing: Healing
    quorum: QuorumThread
    hung: HungPeerGuard
    retry: InflightRetry


def open_parts(
    settings: ManagerSettings,
    options: ManagerOptions,
    rules: StepRules,
    *,
    pg: Any,
    pg_timeout: timedelta | None,
    hostname: str,
    heartbeat_interval: timedelta,
    checkpoint_transport: CheckpointTransport[Any] | None,
    log: Callable[[int, str], None],
) -> ManagerParts:
    """Joins the replica group (``rendezvous.join_replica_group``: on group rank 0 the
    ManagerServer starts), builds the parts over it and records the ``START`` event.

    Args:
        settings, options, rules: the Manager's.
        pg: the cross-replica-group process group; ``pg_timeout`` its own timeout (None: it
            has none).
        hostname, heartbeat_interval, checkpoint_transport: the Manager's arguments.
        log: the Manager's logger (level, message); called only once this returned.

    Raises:
        ValueError: ``retry.check_retry_arguments``, before anything starts.
    """
    check_retry_arguments(options.retry_inflight_allreduce, rules.use_async_quorum)
    group = join_replica_group(
        settings,
        env=os.environ,
        hostname=hostname,
        heartbeat_interval=heartbeat_interval,
        transport=checkpoint_transport,
    )
    events, counters, ledger, recovery = _account(settings, group.replica_id, rules)
    collectives = StepCollectives(
        pg,
        timeout=settings.timeout.value,
        counters=counters,
        log=log,
        keep_inputs=options.retry_inflight_allreduce,
        events=events,
    )
    healing = Healing(
        group.transport,
        group_rank=settings.group_rank.value,
        timeout=settings.timeout.value,
        connect_timeout=settings.connect_timeout.value,
        auth_token=settings.auth_token.value,
        counters=counters,
        events=events,
        log=log,
    )
    quorum = QuorumThread(
        group,
        settings,
        pg=pg,
        healing=healing,
        collectives=collectives,
        init_sync=rules.init_sync,
        use_async_quorum=rules.use_async_quorum,
        world_size_mode=rules.world_size_mode,
        min_replica_size=rules.min_replica_size,
        events=events,
        log=log,
    )
    hung = HungPeerGuard(
        settings,
        group.replica_id,
        collectives=collectives,
        pg=pg,
        heartbeat_interval=heartbeat_interval,
        log=log,
    )
    retry = InflightRetry(
        options.retry_inflight_allreduce,
        settings,
        pg=pg,
        quorum=quorum,
        healing=healing,
        collectives=collectives,
        hung=hung,
        counters=counters,
        log=log,
    )
    _record_start(events, settings)
    return ManagerParts(
        group=group,
        events=events,
        counters=counters,
        ledger=ledger,
        progress=ProgressReport(
            settings,
            pg_timeout,
            ledger=ledger,
            healing=healing,
            recovery=recovery,
            events=events,
            log=log,
        ),
        collectives=collectives,
        healing=healing,
        quorum=quorum,
        hung=hung,
        retry=retry,
    )


def _account(
    settings: ManagerSettings, replica_id: str, rules: StepRules
) -> tuple[EventWriter, Counters, StepLedger, RecoveryWatch | None]:
    """The event stream, the counters and the step account whose committed step every event
    carries; on group rank 0 also the watch of its own recoveries, fed by the stream."""
    recovery = RecoveryWatch() if settings.group_rank.value == 0 else None
    events = open_event_writer(
        settings.events_dir.value,
        replica_id,
        settings.group_rank.value,
        lambda: ledger.step,
        listener=recovery.observe if recovery is not None else None,
    )
    counters = Counters()
    ledger = StepLedger(rules.max_retries, counters, events)
    return events, counters, ledger, recovery


def _record_start(events: EventWriter, settings: ManagerSettings) -> None:
    """The ``START`` event: this process, its group's size and its resolved settings."""
    events.emit(
        EventKind.START,
        pid=os.getpid(),
        process_started=this_process_started(),
        group_world_size=settings.group_world_size.value,
        settings=settings.record(),
        overridden=list(settings.overridden),
    )
