"""What a rank tells the lighthouse with each quorum request (``pb.GroupProgress``): the
previous step's timing (``steptimes``), the committed batches and, once the trainer said its
``samples_per_batch``, samples, the discarded steps, the launcher's job name (settings'
``launcher_job``), the heals that ended since and, on group
rank 0, its recoveries that ended since; group rank 0's ManagerServer merges its ranks'
(``steptimes.group_progress``). The same step timings judge the timeouts once
(``timeouts.OversizeWatch``): a warning and an ``oversized_timeout`` event per timeout far
above the measured step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from torchtitan_ft import timeouts
from torchtitan_ft.events import EventKind, EventWriter
from torchtitan_ft.manager.healing import Healing
from torchtitan_ft.manager.ledger import StepLedger
from torchtitan_ft.manager.recovery import RecoveryWatch
from torchtitan_ft.manager.settings import ManagerSettings
from torchtitan_ft.manager.steptimes import StepTimer
from torchtitan_ft.proto import torchft_pb2 as pb


class ProgressReport:
    """One rank's progress report (training thread).

    Args:
        settings: this rank's settings: the timeouts to judge, ``samples_per_batch`` and
            ``launcher_job``.
        pg_timeout: the process group's own timeout, judged too (None: it has none).
        ledger: the Manager's step account (committed step, batches, discarded steps).
        healing: gives the reports of the heals that ended.
        recovery: on group rank 0, gives the reports of its recoveries that ended
            (``manager.recovery``); None on the other ranks.
        events: the event stream (``OVERSIZED_TIMEOUT``).
        log: the Manager's logger (level, message).
    """

    def __init__(
        self,
        settings: ManagerSettings,
        pg_timeout: timedelta | None,
        *,
        ledger: StepLedger,
        healing: Healing,
        recovery: RecoveryWatch | None,
        events: EventWriter,
        log: Callable[[int, str], None],
    ) -> None:
        self.samples_per_batch: int | None = settings.samples_per_batch.value
        """Samples one replica group trains per step (None: not said)."""
        self._launcher_job = settings.launcher_job.value
        self.timer = StepTimer()
        """Times each step and its compute part for the lighthouse's straggler report."""
        self._oversize = timeouts.OversizeWatch(
            {
                timeouts.Key.STEP: settings.timeout.value.total_seconds(),
                timeouts.Key.QUORUM: settings.quorum_timeout.value.total_seconds(),
                timeouts.Key.CONNECT: settings.connect_timeout.value.total_seconds(),
                **({timeouts.Key.PROCESS_GROUP: pg_timeout.total_seconds()} if pg_timeout else {}),
            }
        )
        """Warns once when a timeout is far above the measured step."""
        self._ledger = ledger
        self._healing = healing
        self._recovery = recovery
        self._events = events
        self._log = log

    def set_samples_per_batch(self, samples_per_batch: int) -> None:
        """Sets ``samples_per_batch`` from the next report on.

        Raises:
            ValueError: not a positive integer.
        """
        if isinstance(samples_per_batch, bool) or not isinstance(samples_per_batch, int):
            raise ValueError(f"samples_per_batch must be a positive int, got {samples_per_batch!r}")
        if samples_per_batch < 1:
            raise ValueError(f"samples_per_batch must be >= 1, got {samples_per_batch}")
        self.samples_per_batch = samples_per_batch

    def start_step(self) -> pb.GroupProgress:
        """A step starts (``start_quorum``): the report for its quorum request."""
        ledger = self._ledger
        progress = self.timer.start(ledger.step, time.monotonic()) or pb.GroupProgress()
        for timing in progress.steps:
            self._judge_timeouts(timing.step_seconds)
        progress.batches_committed = ledger.batches_committed
        if self.samples_per_batch is not None:
            progress.samples_committed = ledger.batches_committed * self.samples_per_batch
        progress.discarded_steps = ledger.discarded_steps
        if self._launcher_job is not None:
            progress.launcher_job = self._launcher_job
        progress.heals.extend(self._healing.take_reports())
        if self._recovery is not None:
            progress.recoveries.extend(self._recovery.take_reports())
        return progress

    def _judge_timeouts(self, step_seconds: float) -> None:
        for found in self._oversize.step(step_seconds) or ():
            self._log(logging.WARNING, found.message())
            self._events.emit(
                EventKind.OVERSIZED_TIMEOUT,
                timeout=timeouts.BY_KEY[found.key].title.strip("`"),
                seconds=found.seconds,
                step_seconds=round(found.step_s, 6),
            )
