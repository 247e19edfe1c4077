"""Finishing a step whose allreduce failed with the surviving groups instead of discarding it
(``ManagerOptions.retry_inflight_allreduce``; docs/architecture.md, "Finishing a step a peer
died in"), on the training thread inside ``Manager.should_commit``.

Whether a step is retried is ``decisions.inflight_retry_decision`` (pure); ``InflightRetry``
gathers its inputs and carries it out: it waits until the process group is done with the
failed collectives, gets a new quorum at the same step and re-runs the step's allreduces from
their kept inputs (``step_collectives.StepCollectives.replay``) over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torchtitan_ft.manager.decisions import RetryDecision, inflight_retry_decision
from torchtitan_ft.manager.healing import Healing
from torchtitan_ft.manager.hung import HungPeerGuard
from torchtitan_ft.manager.quorum import QuorumRequest, QuorumThread
from torchtitan_ft.manager.settings import ManagerSettings
from torchtitan_ft.manager.stats import Counters
from torchtitan_ft.manager.step_collectives import StepCollectives
from torchtitan_ft.process_group.base import ProcessGroup


def check_retry_arguments(enabled: bool, use_async_quorum: bool) -> None:
    """Raises ValueError for a retry asked of a Manager with a sync quorum."""
    if enabled and not use_async_quorum:
        raise ValueError(
            "retry_inflight_allreduce=True needs use_async_quorum=True (with a sync quorum "
            "a group healed by the retry's quorum would count as a participant)"
        )


class InflightRetry:
    """One Manager's in-flight retry (training thread).

    Args:
        enabled: ``retry_inflight_allreduce``.
        settings: this rank's settings: the group's world size, ``timeout`` and
            ``quorum_timeout``.
        pg: the cross-replica-group process group.
        quorum, healing, collectives, hung: the Manager's parts that a retry restarts.
        counters: counts ``steps_retried``.
        log: the Manager's logger (level, message).
    """

    def __init__(
        self,
        enabled: bool,
        settings: ManagerSettings,
        *,
        pg: Any,
        quorum: QuorumThread,
        healing: Healing,
        collectives: StepCollectives,
        hung: HungPeerGuard,
        counters: Counters,
        log: Callable[[int, str], None],
    ) -> None:
        self._enabled = enabled
        self._group_world_size = settings.group_world_size.value
        self._timeout = settings.timeout.value
        self._quorum_timeout = settings.quorum_timeout.value
        self._pg = pg
        self._can_wait_abandoned = isinstance(pg, ProcessGroup) and pg.can_wait_abandoned()
        self._quorum = quorum
        self._healing = healing
        self._collectives = collectives
        self._hung = hung
        self._counters = counters
        self._log = log
        self._retries_this_step = 0
        self.participated = False
        """This group contributed its own tensors to the step's allreduces (training thread:
        set at each attempt's collectives)."""

    def warning(self) -> str | None:
        """Why an enabled retry can never run here (the Manager logs it at construction), or
        None."""
        if not self._enabled or self._can_wait_abandoned:
            return None
        return (
            f"retry_inflight_allreduce=True has no effect with this process group ({self._pg!r}): "
            "it cannot wait for the collectives it abandoned (can_wait_abandoned() is "
            "False), so a step whose allreduce fails is discarded, not retried. "
            "ProcessGroupGloo, ProcessGroupNCCL and wrappers of them can."
        )

    def new_step(self) -> None:
        """A step starts: no retry and no contribution yet."""
        self._retries_this_step = 0
        self.participated = False

    def decision(self) -> RetryDecision:
        """Whether this step, if it failed in an allreduce, is retried (see the module doc)."""
        error = self._collectives.error
        return inflight_retry_decision(
            enabled=self._enabled,
            first_error=error.original_exception if error is not None else None,
            first_error_is_collective=self._collectives.first_error_is_collective,
            participated=self.participated,
            inputs_kept=self._collectives.inputs_kept,
            retries_done=self._retries_this_step,
            group_world_size=self._group_world_size,
            can_wait_abandoned=self._can_wait_abandoned,
        )

    def run(
        self,
        manager_state: dict[str, int],
        commit_failures: int,
        *,
        wait_quorum: Callable[[], None],
        is_participating: Callable[[], bool],
        settle: Callable[[], None],
    ) -> None:
        """Retries the step at ``manager_state`` (the Manager's ``state_dict()``): waits until
        gloo is done with the failed collectives' tensors, gets a new quorum at the same step,
        and re-runs the step's allreduces from their kept inputs over it. Its participants (a
        group now behind heals and sends zeros) are the step's: the average and
        ``batches_committed`` count exactly them. A failure is recorded (the step is then
        discarded as usual); ``settle`` (the Manager's) waits for the re-run collectives.

        Raises:
            RuntimeError: gloo did not finish the failed collectives within its timeout (the
                tensors they write into can no longer be trusted).
        """
        self._log(logging.WARNING, self.decision().reason)
        self._retries_this_step += 1
        started = time.perf_counter()
        limit = self._timeout + self._pg_timeout()
        if not self._pg.wait_abandoned(limit):
            raise RuntimeError(
                f"the failed collectives did not end within {limit}; their tensors (the "
                "gradients) may still be written: cannot continue"
            )
        self._collectives.begin_retry()
        self._healing.new_step()
        self._quorum.start(
            QuorumRequest(
                step=manager_state["step"],
                # As a group that discarded the step would ask: the quorum id changes.
                commit_failures=commit_failures + 1,
                allow_heal=True,
                shrink_only=False,
                timeout=self._quorum_timeout,
                manager_state=manager_state,
            )
        )
        try:
            self._quorum.wait_ready()
            self.participated = is_participating()
            self._hung.arm(self._quorum.result)
            self._collectives.replay(
                participants=self._quorum.participation.world_size,
                participating=self.participated,
            )
            wait_quorum()
        except Exception as e:  # recorded: the step is discarded
            self._collectives.report_error(e)
        settle()
        self._counters.add(steps_retried=1)
        result = self._quorum.result
        self._log(
            logging.INFO,
            f"retried the step over quorum {result.quorum_id if result is not None else -1} "
            f"with {self._quorum.participation.world_size} participants in "
            f"{time.perf_counter() - started:.3f} s (error: {self._collectives.error})",
        )

    def _pg_timeout(self) -> timedelta:
        timeout = self._pg.get_timeout() if isinstance(self._pg, ProcessGroup) else None
        return timeout if timeout is not None else self._timeout
