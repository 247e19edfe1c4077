"""Observability of one replica group: FT scalars beside TorchTitan's own, and log-line prefixes.

:func:`attach_ft_metrics` (called once at the end of ``FaultTolerantTrainer.__init__``) and
:func:`attach_log_prefix` (called before the replica axis and its Manager are built), both
no-ops when FT is off:

* wrap TorchTitan's metric logger (TensorBoard under ``<dump>/tb/<time>/replica_<id>``, and
  wandb) so that each of TorchTitan's log calls also writes the ``ft/*`` scalars of
  :meth:`FTMetrics.scalars` at the same step;
* prefix every log line of this process with ``[replica=<id> rank=<rank>
  train_step=<TorchTitan's step> committed_steps=<the Manager's>]`` (:class:`ReplicaLogPrefix`),
  instead of the Manager's own prefix on its lines.

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
``ft/commit_failures``     ``commit_failures``: consecutive failed commits now (0 after a commit)
``ft/steps_discarded``     ``steps_discarded``: steps that did not commit, cumulative
``ft/heal_count``          ``heal_count``: healed states this rank applied
``ft/heal_seconds``        ``heal_seconds``: transfer + load time of those heals (cumulative)
``ft/bytes_healed``        ``heal_bytes_received``: tensor bytes received from donors
``ft/bytes_served``        ``heal_bytes_sent``: tensor bytes served to healing peers
``ft/bytes_synced``        ``allreduce_bytes``: tensor bytes handed to the cross-group allreduce
``ft/relative_speed``      ``relative_speed``: compute speed vs the other groups' (lighthouse)
``ft/straggler``           ``straggler``: 1 while the lighthouse reports this group as one
``ft/syncs_committed``     semi-sync only: ``strategy.stats.syncs_committed``
``ft/syncs_failed``        semi-sync only: ``strategy.stats.syncs_failed``, cumulative
=========================  ======================================================================

Sizes are payload (tensor bytes of this rank's shards), not bytes on the wire; the counters are
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
            "ft/commit_failures": float(stats.commit_failures),
            "ft/steps_discarded": float(stats.steps_discarded),
            "ft/heal_count": float(stats.heal_count),
            "ft/heal_seconds": stats.heal_seconds,
            "ft/bytes_healed": float(stats.heal_bytes_received),
            "ft/bytes_served": float(stats.heal_bytes_sent),
            "ft/bytes_synced": float(stats.allreduce_bytes),
            "ft/relative_speed": stats.relative_speed,
            "ft/straggler": float(stats.straggler),
        }
        strategy_stats = getattr(self._strategy, "stats", None)
        if strategy_stats is not None:
            values["ft/syncs_committed"] = float(strategy_stats.syncs_committed)
            values["ft/syncs_failed"] = float(strategy_stats.syncs_failed)
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
    """Prefixes log records with ``[replica=<id> rank=<rank> train_step=<n>
    committed_steps=<m>]`` (once per record); a Manager record (``ft_message``) gets it instead
    of the Manager's own prefix, so every line has one."""

    def __init__(
        self,
        replica_id: int,
        rank: int,
        train_step: Callable[[], int],
        committed: Callable[[], int],
    ) -> None:
        super().__init__()
        self._head = f"[replica={replica_id} rank={rank} train_step="
        self._train_step = train_step
        self._committed = committed

    def filter(self, record: logging.LogRecord) -> bool:
        """Adds the prefix; never drops a record."""
        if not getattr(record, "ft_prefixed", False):
            message = getattr(record, "ft_message", None)
            if message is not None:
                record.msg, record.args = message, ()
            head = f"{self._head}{self._train_step()} committed_steps={self._committed()}]"
            record.msg = f"{head} {record.msg}"
            record.ft_prefixed = True
        return True


def install_log_prefix(
    replica_id: int,
    rank: int,
    train_step: Callable[[], int],
    committed: Callable[[], int],
    logger: logging.Logger | None = None,
) -> ReplicaLogPrefix:
    """Adds a :class:`ReplicaLogPrefix` to every handler of ``logger`` (default: the root
    logger, TorchTitan's); returns it (``handler.removeFilter`` undoes it)."""
    prefix = ReplicaLogPrefix(replica_id, rank, train_step, committed)
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
    return metrics


def attach_log_prefix(trainer: Any) -> ReplicaLogPrefix | None:
    """Prefixes this process's log lines for ``trainer`` (see the module docstring); None if FT
    is off. Called before the replica axis is built, so that the Manager's start-up lines get
    the prefix too (``committed_steps=0`` until the axis has a Manager)."""
    ft = trainer.job_config.fault_tolerance
    if not ft.enable:
        return None

    def committed() -> int:
        manager = getattr(getattr(trainer, "replica_axis", None), "manager", None)
        return manager.current_step() if manager is not None else 0

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return install_log_prefix(ft.replica_id, rank, lambda: getattr(trainer, "step", 0), committed)
