"""FT observability: ``ft/*`` scalars in TensorBoard per replica group, and log-line prefixes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from torchtitan_ft.lighthouse.groups import GROUPS_FILE
from torchtitan_ft.manager import ManagerStats
from torchtitan_ft.titan.metrics import (
    FTMetricLogger,
    FTMetrics,
    group_batch_samples,
    install_log_prefix,
)


def _stats(**overrides: Any) -> ManagerStats:
    values: dict[str, Any] = dict(
        step=2, quorum_id=5, replica_world_size=3, num_participants=2, participating=True,
        commit_failures=0, steps_discarded=1, heal_count=1, last_heal_seconds=0.25,
        heal_seconds=0.75, heal_bytes_received=40, heal_bytes_sent=80, allreduce_bytes=300,
        relative_speed=0.25, link_relative_speed=0.5, straggler=True,
    )  # fmt: skip
    values.update(overrides)
    return ManagerStats(**values)


class FakeManager:
    """What FTMetrics reads from the Manager: its stats and batches committed."""

    def __init__(self, stats: ManagerStats) -> None:
        self.current = stats

    def stats(self) -> ManagerStats:
        return self.current

    def batches_committed(self) -> int:
        return 4


def test_per_step_scalars_come_from_manager_stats() -> None:
    assert FTMetrics(FakeManager(_stats())).scalars() == {
        "ft/participants": 2.0,
        "ft/quorum_size": 3.0,
        "ft/quorum_id": 5.0,
        "ft/committed_step": 2.0,
        "ft/batches_committed": 4.0,
        "ft/commit_failures": 0.0,
        "ft/steps_discarded": 1.0,
        "ft/heal_count": 1.0,
        "ft/heal_seconds": 0.75,
        "ft/bytes_healed": 40.0,
        "ft/bytes_served": 80.0,
        "ft/bytes_synced": 300.0,
        "ft/relative_speed": 0.25,
        "ft/link_relative_speed": 0.5,
        "ft/straggler": 1.0,
        "ft/excluded": 0.0,
    }


def test_semi_sync_commit_scalars_come_from_strategy_stats() -> None:
    from torchtitan_ft.semi_sync import CommStats

    strategy = SimpleNamespace(
        stats=CommStats(allreduce_calls=3, payload_bytes=1234, syncs_committed=2, syncs_failed=1)
    )
    scalars = FTMetrics(FakeManager(_stats(commit_failures=2)), strategy=strategy).scalars()
    assert scalars["ft/commit_failures"] == 2  # the Manager's, consecutive
    assert scalars["ft/steps_discarded"] == 1  # the Manager's, cumulative
    assert (scalars["ft/syncs_committed"], scalars["ft/syncs_failed"]) == (2, 1)
    assert scalars["ft/bytes_synced"] == 300  # what the Manager's allreduce was handed


@pytest.mark.parametrize(
    ("accumulation", "local", "dp_degree", "expected"),
    [
        (1, 8, None, 8),  # one rank: no data parallelism in the group
        (2, 4, 2, 16),  # 2 accumulation steps x local batch 4 x 2 data-parallel ranks
    ],
)
def test_a_groups_samples_per_step_are_torchtitans_global_batch_of_the_group(
    accumulation, local, dp_degree, expected
) -> None:
    mesh = SimpleNamespace(size=lambda: dp_degree)
    trainer = SimpleNamespace(
        gradient_accumulation_steps=accumulation,
        job_config=SimpleNamespace(training=SimpleNamespace(local_batch_size=local)),
        parallel_dims=SimpleNamespace(
            dp_enabled=dp_degree is not None, get_mesh=lambda name: {"batch": mesh}[name]
        ),
    )
    assert group_batch_samples(trainer) == expected


def test_logger_adds_ft_scalars_at_the_same_step() -> None:
    logged: list[tuple[dict, int]] = []
    inner = SimpleNamespace(log=lambda m, s: logged.append((m, s)), close=lambda: None)
    FTMetricLogger(inner, lambda: {"ft/participants": 2.0}).log({"loss": 1.0}, 7)
    assert logged == [({"loss": 1.0, "ft/participants": 2.0}, 7)]


def test_log_prefix_names_replica_rank_and_step(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test_metrics_prefix")
    handler = logging.Handler()
    records: list[str] = []
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    step = [3]
    try:
        install_log_prefix(1, 0, lambda: step[0], lambda: 2, logger)
        logger.warning("hello %s", "world")
        # A Manager record: the process prefix replaces the Manager's own.
        logger.warning(
            "[r:uuid group_rank=0 committed_steps=2] %s",
            "vote 50%",
            extra={"ft_message": "vote 50%"},
        )
    finally:
        logger.removeHandler(handler)
    assert records == [
        "[replica=1 rank=0 train_step=3 committed_steps=2] hello world",
        "[replica=1 rank=0 train_step=3 committed_steps=2] vote 50%",
    ]


@pytest.mark.multiprocess
def test_ft_job_writes_ft_scalars_per_replica_group(tmp_path: Path) -> None:
    """2 replica groups x 1 rank, per-step FT, 3 steps, TensorBoard on: each group's event
    file has TorchTitan's loss and the ft/* scalars; the loss and tokens logged are the job's;
    a TORCHFT_* variable applies unless the config sets its field;
    the group that healed at step 0 (init_sync) reports one heal and received exactly the
    bytes its donor served; the lighthouse counted the job's committed samples with the groups'
    batch (``training.local_batch_size`` 2, one rank)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtitan_ft.events import EventKind
    from torchtitan_ft.testing.titan_jobs import group_events, run_ft_groups

    steps = 3
    # The config sets step_timeout_ms (30 s), not quorum_retries: one variable loses, one applies.
    env = {"TORCHFT_TIMEOUT_SEC": "45", "TORCHFT_QUORUM_RETRIES": "2"}
    outputs = run_ft_groups(
        tmp_path, 1, steps, "debug_ft_cpu.toml", "--metrics.enable_tensorboard", env=env,
        lighthouse_state_dir=tmp_path / "lighthouse",
    )  # fmt: skip
    # What the lighthouse kept (groups.json): each group's last report, before its last step.
    saved = json.loads((tmp_path / "lighthouse" / GROUPS_FILE).read_text())
    counts = [(g["batches_committed"], g["samples_committed"]) for g in saved["groups"].values()]
    assert counts == [(3, 6)] * 2, saved  # 1 + 2 batches before step 3, 2 samples each
    for r in range(2):
        (start,) = group_events(tmp_path, r, EventKind.START)
        assert start["settings"]["timeout"] == {"value": 30.0, "source": "argument"}
        assert start["settings"]["quorum_retries"]["value"] == 2
        assert start["settings"]["quorum_retries"]["source"] == "env"
        assert start["overridden"] == ["TORCHFT_TIMEOUT_SEC"]
    scalars = []
    for r, output in enumerate(outputs):
        # The last step's vote: TorchTitan's step 3, the Manager's 2 committed steps before it.
        prefix = f"[replica={r} rank=0 train_step={steps} committed_steps={steps - 1}]"
        assert f"{prefix} should_commit=True" in output, output[-4000:]
        assert "group_rank=0 committed_steps=" not in output  # the Manager's own prefix
        (run_dir,) = (tmp_path / f"replica{r}" / "outputs" / "tb").glob(f"*/replica_{r}")
        events = EventAccumulator(str(run_dir))
        events.Reload()
        tags = events.Tags()["scalars"]
        for tag in (
            "loss_metrics/global_avg_loss",
            "ft/group_avg_loss",
            "ft/participants",
            "ft/quorum_size",
            "ft/committed_step",
            "ft/commit_failures",
            "ft/steps_discarded",
            "ft/heal_count",
            "ft/heal_seconds",
            "ft/bytes_healed",
            "ft/bytes_served",
            "ft/bytes_synced",
        ):
            assert tag in tags, (tag, tags)
        scalars.append({tag: [e.value for e in events.Scalars(tag)] for tag in tags})
    for values in scalars:
        # Step 0 (init_sync): only the primary's gradient is averaged.
        assert values["ft/participants"] == [1.0, 2.0, 2.0]
        assert values["ft/quorum_size"] == [2.0] * steps
        assert values["ft/committed_step"] == [1.0, 2.0, 3.0]
        assert values["ft/commit_failures"] == [0.0] * steps
        assert values["ft/steps_discarded"] == [0.0] * steps
        synced = values["ft/bytes_synced"]
        # every step hands the same gradient shards (fp32, >= 6.2 M) to the allreduce
        # (TensorBoard keeps float32: compare approximately)
        assert synced[0] > 6e6 * 4
        assert synced == pytest.approx([synced[0] * (i + 1) for i in range(steps)], rel=1e-6)
    # The job-level loss and tokens (TorchTitan's FT reduction): the same in both groups, the
    # sum of the participating groups' own values (the group healing at step 0 contributes
    # none), each group's own beside them.
    donor = next(v for v in scalars if v["ft/heal_count"][-1] == 0.0)
    for step in range(steps):
        participants = [donor] if donor["ft/participants"][step] == 1.0 else scalars
        for name, own in (
            ("loss_metrics/global_avg_loss", "ft/group_avg_loss"),
            ("n_tokens_seen", "ft/group_n_tokens_seen"),
        ):
            job = sum(v[own][step] for v in participants)
            assert [v[name][step] for v in scalars] == pytest.approx([job, job], rel=1e-6)
        job_max = max(v["ft/group_max_loss"][step] for v in participants)
        assert [v["loss_metrics/global_max_loss"][step] for v in scalars] == [job_max] * 2
    heals = sorted(values["ft/heal_count"][-1] for values in scalars)
    assert heals == [0.0, 1.0]
    healed = next(v for v in scalars if v["ft/heal_count"][-1] == 1.0)
    assert healed["ft/bytes_healed"][-1] == donor["ft/bytes_served"][-1] > 6e6 * 4
    assert healed["ft/bytes_served"][-1] == donor["ft/bytes_healed"][-1] == 0
    assert healed["ft/heal_seconds"][-1] > 0


class ReducingManager:
    """A Manager's allreduce over fixed other groups' values (``others``: SUM / MAX applied
    elementwise), or a recorded error."""

    def __init__(self, others: list[list[float]], error: Exception | None = None) -> None:
        self.others = others
        self.error = error
        self.ops: list[Any] = []

    def allreduce(self, tensor: Any, reduce_op: Any) -> Any:
        import torch
        from torch.distributed import ReduceOp

        self.ops.append(reduce_op)
        for other in self.others:
            values = torch.tensor(other[: tensor.numel()], dtype=tensor.dtype)
            if reduce_op == ReduceOp.SUM:
                tensor += values
            else:
                torch.maximum(tensor, values, out=tensor)
        future: Any = torch.futures.Future()
        future.set_result(tensor)
        return future

    def errored(self) -> Exception | None:
        return self.error


def test_job_loss_sums_means_and_tokens_and_takes_the_max_like_torchtitan() -> None:
    from torchtitan_ft.titan.metrics import StepLoss, reduce_across_groups

    # the other group: mean loss 2.5 and 300 tokens summed, max loss 4.0
    manager = ReducingManager([[2.5, 300.0]])
    manager_max = ReducingManager([[4.0]])
    sums = reduce_across_groups(manager, StepLoss(1.25, 3.0, 200))
    assert (sums.avg_loss, sums.ntokens_seen) == (3.75, 500)
    assert reduce_across_groups(manager_max, StepLoss(1.25, 3.0, 200)).max_loss == 4.0


def test_a_failed_reduction_is_not_a_job_loss() -> None:
    from torchtitan_ft.titan.metrics import FAILED_REDUCTION, StepLoss, reduce_across_groups

    manager = ReducingManager([[2.5, 300.0]], error=RuntimeError("peer gone"))
    assert reduce_across_groups(manager, StepLoss(1.25, 3.0, 200)) is FAILED_REDUCTION


def _job_logger(committed: bool) -> tuple[Any, list[tuple]]:
    from torchtitan_ft.titan.metrics import JobLevelLoss, StepLoss

    calls: list[tuple] = []

    def log(step: int, avg: float, mx: float, grad_norm: float, extra_metrics: dict) -> None:
        calls.append((step, avg, mx, grad_norm, extra_metrics))

    def reduce(own: StepLoss) -> StepLoss:
        return StepLoss(own.avg_loss * 2, own.max_loss + 1, own.ntokens_seen * 2)

    return JobLevelLoss(log, reduce, lambda: committed), calls


def test_a_committed_step_logs_the_job_loss_beside_the_groups_own() -> None:
    job_log, calls = _job_logger(committed=True)
    job_log(4, 1.5, 2.0, 0.3, extra_metrics={"n_tokens_seen": 512, "lr": 0.1})
    assert calls == [
        (
            4,
            3.0,
            3.0,
            0.3,
            {
                "n_tokens_seen": 1024,
                "lr": 0.1,
                "ft/group_avg_loss": 1.5,
                "ft/group_max_loss": 2.0,
                "ft/group_n_tokens_seen": 512.0,
            },
        )
    ]


def test_a_discarded_step_logs_no_loss() -> None:
    job_log, calls = _job_logger(committed=False)
    job_log(4, 1.5, 2.0, 0.3, extra_metrics={"n_tokens_seen": 512})
    assert calls == []
