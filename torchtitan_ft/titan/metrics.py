"""Observability of one replica group: FT scalars beside TorchTitan's own, and log-line prefixes.

:func:`attach_ft_metrics` (called once at the end of ``FaultTolerantTrainer.__init__``; a no-op
when FT is off) does two things:

* wraps TorchTitan's metric logger (TensorBoard under ``<dump>/tb/<time>/replica_<id>``, and
  wandb) so that each of TorchTitan's log calls also writes the ``ft/*`` scalars of
  :meth:`FTMetrics.scalars` at the same step;
* prefixes every log line of this process with ``[replica <id> rank <rank> step <step>]``
  (:class:`ReplicaLogPrefix`).

Every scalar is read from ``Manager.stats()`` (a snapshot that never waits for the quorum), or
for a semi-sync strategy from its ``stats``:

=========================  ======================================================================
scalar                     source
=========================  ======================================================================
``ft/participants``        ``num_participants``: groups whose gradients the last step averaged
``ft/quorum_size``         ``replica_world_size``: groups in the last quorum (incl. healing, spares)
``ft/quorum_id``           ``quorum_id``
``ft/committed_step``      ``step``
``ft/batches_committed``   ``Manager.batches_committed()``
``ft/commit_failures``     per-step: ``steps_discarded``; semi-sync: ``strategy.stats.syncs_failed``
``ft/heal_count``          ``heal_count``: healed states this rank applied
``ft/heal_seconds``        ``heal_seconds``: transfer + load time of those heals (cumulative)
``ft/bytes_healed``        ``heal_bytes_received``: tensor bytes received from donors
``ft/bytes_served``        ``heal_bytes_sent``: tensor bytes served to healing peers
``ft/bytes_synced``        ``allreduce_bytes``: tensor bytes handed to the cross-group allreduce
``ft/syncs_committed``     semi-sync only: ``strategy.stats.syncs_committed``
=========================  ======================================================================

Sizes are payload (tensor bytes of this rank's shards), not bytes on the wire; all counters are
cumulative since the process started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch


class FTMetrics:
    """The ``ft/*`` scalars of one replica-group rank; see the module docstring for sources.

    Args:
        manager: the replica group's Manager (anything with ``stats()`` and
            ``batches_committed()``).
        strategy: the semi-sync strategy (with ``stats``), or None for per-step FT.
    """

    def __init__(self, manager: Any, strategy: Any = None) -> None:
        self._manager = manager
        self._strategy = strategy

    def scalars(self) -> dict[str, float]:
        """The ``ft/*`` scalars now (cumulative counters and current gauges)."""
        stats = self._manager.stats()
        values: dict[str, float] = {
            "ft/participants": float(stats.num_participants),
            "ft/quorum_size": float(stats.replica_world_size),
            "ft/quorum_id": float(stats.quorum_id),
            "ft/committed_step": float(stats.step),
            "ft/batches_committed": float(self._manager.batches_committed()),
            "ft/commit_failures": float(stats.steps_discarded),
            "ft/heal_count": float(stats.heal_count),
            "ft/heal_seconds": stats.heal_seconds,
            "ft/bytes_healed": float(stats.heal_bytes_received),
            "ft/bytes_served": float(stats.heal_bytes_sent),
            "ft/bytes_synced": float(stats.allreduce_bytes),
        }
        strategy_stats = getattr(self._strategy, "stats", None)
        if strategy_stats is not None:
            values["ft/commit_failures"] = float(strategy_stats.syncs_failed)
            values["ft/syncs_committed"] = float(strategy_stats.syncs_committed)
        return values


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


def attach_ft_metrics(trainer: Any) -> FTMetrics | None:
    """Wires :class:`FTMetrics` into ``trainer`` (see the module docstring); None if FT is off."""
    axis = trainer.replica_axis
    manager = getattr(axis, "manager", None)
    if not axis.enabled or manager is None:
        return None
    metrics = FTMetrics(manager, strategy=getattr(axis, "strategy", None))
    processor = trainer.metrics_processor
    processor.logger = FTMetricLogger(processor.logger, metrics.scalars)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    install_log_prefix(axis.replica_id, rank, lambda: trainer.step)
    return metrics
