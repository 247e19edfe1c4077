"""Observability of one replica group: FT scalars beside TorchTitan's own, and log-line prefixes.

:func:`attach_ft_metrics` (called once at the end of ``FaultTolerantTrainer.__init__``) and
:func:`attach_log_prefix` (called before the replica axis and its Manager are built), both
no-ops when FT is off:

* tell the Manager how many samples one step of this replica group trains (per-step FT,
  :func:`group_batch_samples`), so that the lighthouse's status page shows the job's committed
  samples per second;

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
``ft/link_relative_speed`` ``link_relative_speed``: link rate vs the other groups' (link probes)
``ft/straggler``           ``straggler``: 1 while the lighthouse reports this group as one
``ft/excluded``            ``excluded``: 1 while the straggler policy leaves it out of the quorum
``ft/syncs_committed``     semi-sync only: ``strategy.stats.syncs_committed``
``ft/syncs_failed``        semi-sync only: ``strategy.stats.syncs_failed``, cumulative
=========================  ======================================================================

Sizes are payload (tensor bytes of this rank's shards), not bytes on the wire; the counters are
cumulative since the process started.

Job-level loss (per-step FT, :class:`JobLevelLoss`): like TorchTitan's FT trainer
(``torchtitan.experiments.ft.train``, whose ``dist_sum``/``dist_max`` take the FT process
group), the loss and token count TorchTitan logs for a committed step are those of the job:

=================================  =============================================================
logged as                          value
=================================  =============================================================
``loss_metrics/global_avg_loss``   sum over the participating groups of each group's mean loss
                                   (TorchTitan's reduction: with 2 groups, twice a mean loss)
``loss_metrics/global_max_loss``   max over the participating groups
``n_tokens_seen``                  sum over the participating groups
``ft/group_avg_loss`` etc.         this group's own values (``group_max_loss``,
                                   ``group_n_tokens_seen``)
=================================  =============================================================

A group that heals in the step contributes zeros and logs the participants' values. A
discarded step logs no loss line and no scalars (its retry logs the step); a step whose
reduction failed logs NaN as the job's loss, beside the group's own values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

_log = logging.getLogger(__name__)


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
            "ft/link_relative_speed": stats.link_relative_speed,
            "ft/straggler": float(stats.straggler),
            "ft/excluded": float(stats.excluded),
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


@dataclass(frozen=True)
class StepLoss:
    """The loss values TorchTitan logs for one step (of one group, or of the job)."""

    avg_loss: float
    """``global_avg_loss``: the mean loss over the valid tokens."""
    max_loss: float
    """``global_max_loss``: the largest per-rank mean loss."""
    ntokens_seen: int
    """``n_tokens_seen``: tokens trained on since the start (committed steps only)."""

    def scalars(self, prefix: str) -> dict[str, float]:
        """The three values as ``<prefix>avg_loss``, ``<prefix>max_loss``,
        ``<prefix>n_tokens_seen``."""
        return {
            f"{prefix}avg_loss": self.avg_loss,
            f"{prefix}max_loss": self.max_loss,
            f"{prefix}n_tokens_seen": float(self.ntokens_seen),
        }


FAILED_REDUCTION = StepLoss(math.nan, math.nan, 0)
"""What :func:`reduce_across_groups` returns when the cross-group reduction failed."""


def reduce_across_groups(manager: Any, own: StepLoss) -> StepLoss:
    """The job's :class:`StepLoss` from this group's: TorchTitan's FT reduction (sum of the
    mean losses and of the token counts, max of the max losses) over the Manager's
    participating groups; :data:`FAILED_REDUCTION` if the Manager recorded an error."""
    sums = torch.tensor([own.avg_loss, float(own.ntokens_seen)], dtype=torch.float64)
    maxes = torch.tensor([own.max_loss], dtype=torch.float64)
    manager.allreduce(sums, reduce_op=ReduceOp.SUM).wait()
    manager.allreduce(maxes, reduce_op=ReduceOp.MAX).wait()
    if manager.errored() is not None:
        return FAILED_REDUCTION
    return StepLoss(float(sums[0]), float(maxes[0]), round(float(sums[1])))


class JobLevelLoss:
    """Stands in for TorchTitan's ``MetricsProcessor.log``: a committed step is logged with
    the job's loss and tokens (``reduce``) and this group's own beside them (``ft/group_*``);
    a discarded step is not logged (see the module docstring).

    Args:
        log: the wrapped ``MetricsProcessor.log``.
        reduce: this group's :class:`StepLoss` -> the job's (:func:`reduce_across_groups`).
        committed: whether the step being logged committed.
    """

    def __init__(
        self,
        log: Callable[..., None],
        reduce: Callable[[StepLoss], StepLoss],
        committed: Callable[[], bool],
    ) -> None:
        self._log = log
        self._reduce = reduce
        self._committed = committed

    def __call__(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = dict(extra_metrics or {})
        own = StepLoss(global_avg_loss, global_max_loss, int(extra.get("n_tokens_seen", 0)))
        if not self._committed():
            _log.info(
                f"FT: step {step} discarded (not committed; retried): this group's loss "
                f"{own.avg_loss:.5f} is not logged"
            )
            return
        job = self._reduce(own)
        if job is FAILED_REDUCTION:
            _log.warning(f"FT: step {step}: the job-level loss could not be reduced; logged NaN")
        extra["n_tokens_seen"] = job.ntokens_seen
        extra.update(own.scalars("ft/group_"))
        self._log(step, job.avg_loss, job.max_loss, grad_norm, extra_metrics=extra)


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
    """Wires :class:`FTMetrics` into ``trainer`` and, for per-step FT, :class:`JobLevelLoss`
    (see the module docstring); None if FT is off."""
    axis = trainer.replica_axis
    manager = getattr(axis, "manager", None)
    if not axis.enabled or manager is None:
        return None
    strategy = getattr(axis, "strategy", None)
    if strategy is None:
        # A semi-sync commit covers many steps (and fragments): the page shows its batches.
        manager.set_samples_per_batch(group_batch_samples(trainer))
    metrics = FTMetrics(manager, strategy=strategy)
    processor = trainer.metrics_processor
    processor.logger = FTMetricLogger(processor.logger, metrics.scalars)
    if strategy is None:
        processor.log = JobLevelLoss(
            processor.log, lambda own: reduce_across_groups(manager, own), axis.step_committed
        )
        if not trainer.parallel_dims.dp_cp_enabled:
            _log.info(
                "FT: the logged loss and n_tokens_seen are the job's, summed over the replica "
                "groups (TorchTitan's FT trainer sums them only when a group has data "
                "parallelism; with one rank per group it logs the group's own, logged here as "
                "ft/group_*)"
            )
    return metrics


def group_batch_samples(trainer: Any) -> int:
    """The samples (sequences) one replica group trains per step: TorchTitan's global batch of
    the group, gradient accumulation steps x ``training.local_batch_size`` x the group's
    data-parallel degree, as TorchTitan's Trainer (0.2.2 and 0.3.0) derives them. With FT,
    ``training.global_batch_size`` covers all groups and each takes its share
    (``preflight.per_group_batch``)."""
    dims = trainer.parallel_dims
    degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    local = trainer.job_config.training.local_batch_size
    return trainer.gradient_accumulation_steps * local * degree


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
