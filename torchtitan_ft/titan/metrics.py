"""Observability of one replica group: FT scalars beside TorchTitan's own, and log-line prefixes.

:func:`attach_ft_metrics` (called once at the end of ``FaultTolerantTrainer.__init__``; a no-op
when FT is off) does three things:

* wraps the trainer's optimizers in :class:`ObservedOptimizers`, which times each step call
  and counts commit failures (``step()`` returning False);
* wraps TorchTitan's metric logger (TensorBoard under ``<dump>/tb/<time>/replica_<id>``, and
  wandb) so that each of TorchTitan's log calls also writes the ``ft/*`` scalars of
  :meth:`FTMetrics.scalars` at the same step;
* prefixes every log line of this process with ``[replica <id> rank <rank> step <step>]``
  (:class:`ReplicaLogPrefix`).

Where each scalar comes from (only the Manager's public API and the strategy's ``stats``):

=========================  ======================================================================
scalar                     source
=========================  ======================================================================
``ft/participants``        ``Manager.num_participants()`` (groups taking part in the last quorum)
``ft/committed_step``      ``Manager.current_step()``
``ft/batches_committed``   ``Manager.batches_committed()``
``ft/commit_failures``     per-step: optimizer steps that did not commit; semi-sync:
                           ``strategy.stats.syncs_failed`` (cumulative)
``ft/heal_count``          calls of a no-op state registered with ``Manager.register_state_dict_fn``
                           (the Manager loads every registered state when this replica heals)
``ft/heal_seconds``        wall time of the step calls (``zero_grad``/``step``) in which a heal
                           happened: quorum + transfer + apply (cumulative)
``ft/bytes_healed``        size of this replica's own healed state (trainer state + strategy
                           state) at each heal: the payload received, not the bytes on the wire
``ft/bytes_synced``        semi-sync: ``strategy.stats.payload_bytes``; per-step: the local
                           gradient shards handed to ``Manager.allreduce`` per committed-or-not
                           step in which this group participated (cumulative)
=========================  ======================================================================

Not exposed by the Manager, hence not logged: the quorum size (members including healing
replicas and spares: ``QuorumResult.replica_world_size``), the quorum id, the Manager's own
commit-failure counter, and per-heal transfer time and wire bytes (see the report in
``docs/`` / the session notes for the accessors the Manager should add).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

HEAL_PROBE_KEY = "ft_metrics"
"""Key of the no-op state registered with the Manager to observe heals."""


def tree_nbytes(value: Any) -> int:
    """Total bytes of the tensors in a nested dict/list/tuple (DTensors: the local shard)."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(tree_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tree_nbytes(v) for v in value)
    return 0


class FTMetrics:
    """Counters and gauges of one replica-group rank; see the module docstring for sources.

    Args:
        manager: the replica group's Manager (``torchtitan_ft.manager.Manager`` or alike).
        strategy: the semi-sync strategy (with ``stats``), or None for per-step FT.
        healed_state: the trainer state healed from peers (for ``bytes_healed``), or None.
        grad_bytes: bytes of this rank's gradient shards, reduced once per per-step step.
    """

    def __init__(
        self,
        manager: Any,
        strategy: Any = None,
        healed_state: Any = None,
        grad_bytes: int = 0,
    ) -> None:
        self._manager = manager
        self._strategy = strategy
        self._healed_state = healed_state
        self._grad_bytes = grad_bytes
        self.heal_count = 0
        self.heal_seconds = 0.0
        self.bytes_healed = 0
        self.step_failures = 0
        self.per_step_bytes = 0
        manager.register_state_dict_fn(HEAL_PROBE_KEY, self._on_heal, dict)

    def _on_heal(self, _state: Any) -> None:
        """Called by the Manager, with the other healed states, when this replica heals."""
        self.heal_count += 1
        if self._healed_state is not None:
            self.bytes_healed += tree_nbytes(self._healed_state.state_dict())
        if self._strategy is not None:
            self.bytes_healed += tree_nbytes(self._strategy.state_dict())

    def observe_step_call(self, seconds: float, heals_before: int) -> None:
        """Adds ``seconds`` to the heal time if a heal happened during the call."""
        if self.heal_count > heals_before:
            self.heal_seconds += seconds

    def observe_step_result(self, committed: bool, participated: bool) -> None:
        """Counts a per-step commit failure and the gradient bytes sent."""
        if self._strategy is not None:
            return
        if not committed:
            self.step_failures += 1
        if participated:
            self.per_step_bytes += self._grad_bytes

    def scalars(self) -> dict[str, float]:
        """The ``ft/*`` scalars now (cumulative counters and current gauges)."""
        manager = self._manager
        stats = getattr(self._strategy, "stats", None)
        values: dict[str, float] = {
            "ft/participants": float(_participants(manager)),
            "ft/committed_step": float(manager.current_step()),
            "ft/batches_committed": float(manager.batches_committed()),
            "ft/heal_count": float(self.heal_count),
            "ft/heal_seconds": self.heal_seconds,
            "ft/bytes_healed": float(self.bytes_healed),
        }
        if stats is not None:
            values["ft/commit_failures"] = float(stats.syncs_failed)
            values["ft/bytes_synced"] = float(stats.payload_bytes)
            values["ft/syncs_committed"] = float(stats.syncs_committed)
        else:
            values["ft/commit_failures"] = float(self.step_failures)
            values["ft/bytes_synced"] = float(self.per_step_bytes)
        quorum_size = getattr(manager, "quorum_size", None)
        if callable(quorum_size):  # not in the Manager yet; logged once it exposes one
            values["ft/quorum_size"] = float(quorum_size())
        return values


def _participants(manager: Any) -> int:
    """``manager.num_participants()``, 0 when the last quorum failed (its error is the step's)."""
    try:
        return int(manager.num_participants())
    except (RuntimeError, TimeoutError, OSError):
        return 0


class ObservedOptimizers:
    """The trainer's optimizers (already FT-wrapped), timed and counted for :class:`FTMetrics`."""

    def __init__(self, optimizers: Any, metrics: FTMetrics, manager: Any) -> None:
        self._optimizers = optimizers
        self._metrics = metrics
        self._manager = manager

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Delegates; a heal during the call (sync quorum) is timed."""
        heals, start = self._metrics.heal_count, time.perf_counter()
        self._optimizers.zero_grad(*args, **kwargs)
        self._metrics.observe_step_call(time.perf_counter() - start, heals)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Delegates; counts a step that did not commit and times a heal during the call."""
        heals, start = self._metrics.heal_count, time.perf_counter()
        result = self._optimizers.step(*args, **kwargs)
        self._metrics.observe_step_call(time.perf_counter() - start, heals)
        committed = result is not False
        self._metrics.observe_step_result(committed, self._manager.is_participating())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizers, name)


class FTMetricLogger:
    """TorchTitan's metric logger (``BaseLogger`` protocol) plus the ``ft/*`` scalars."""

    def __init__(self, inner: Any, scalars: Callable[[], dict[str, float]]) -> None:
        self._inner = inner
        self._scalars = scalars

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Logs ``metrics`` and the FT scalars at ``step``."""
        self._inner.log({**metrics, **self._scalars()}, step)

    def close(self) -> None:
        """Closes the wrapped logger."""
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ReplicaLogPrefix(logging.Filter):
    """Prefixes log records with ``[replica <id> rank <rank> step <step>]`` (once per record)."""

    def __init__(self, replica_id: int, rank: int, step: Callable[[], int]) -> None:
        super().__init__()
        self._head = f"[replica {replica_id} rank {rank} step "
        self._step = step

    def filter(self, record: logging.LogRecord) -> bool:
        """Adds the prefix; never drops a record."""
        if not getattr(record, "ft_prefixed", False):
            record.msg = f"{self._head}{self._step()}] {record.msg}"
            record.ft_prefixed = True
        return True


def install_log_prefix(
    replica_id: int, rank: int, step: Callable[[], int], logger: logging.Logger | None = None
) -> ReplicaLogPrefix:
    """Adds a :class:`ReplicaLogPrefix` to every handler of ``logger`` (default: the root
    logger, TorchTitan's); returns it (``handler.removeFilter`` undoes it)."""
    prefix = ReplicaLogPrefix(replica_id, rank, step)
    for handler in (logger or logging.getLogger()).handlers:
        handler.addFilter(prefix)
    return prefix


def local_grad_bytes(model_parts: Any) -> int:
    """Bytes of this rank's gradient shards (fp32, like TorchTitan's default reduce dtype)."""
    total = 0
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad:
                total += tree_nbytes(p.detach()) // p.element_size() * 4
    return total


def attach_ft_metrics(trainer: Any) -> FTMetrics | None:
    """Wires :class:`FTMetrics` into ``trainer`` (see the module docstring); None if FT is off."""
    axis = trainer.replica_axis
    manager = getattr(axis, "manager", None)
    if not axis.enabled or manager is None:
        return None
    strategy = getattr(axis, "strategy", None)
    metrics = FTMetrics(
        manager,
        strategy=strategy,
        healed_state=getattr(trainer, "healed_state", None),
        grad_bytes=0 if strategy is not None else local_grad_bytes(trainer.model_parts),
    )
    trainer.optimizers = ObservedOptimizers(trainer.optimizers, metrics, manager)
    processor = trainer.metrics_processor
    processor.logger = FTMetricLogger(processor.logger, metrics.scalars)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    install_log_prefix(axis.replica_id, rank, lambda: trainer.step)
    return metrics
