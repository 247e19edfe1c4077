"""FT observability: ``ft/*`` scalars in TensorBoard per replica group, and log-line prefixes."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torchtitan_ft.titan.metrics import (
    HEAL_PROBE_KEY,
    FTMetricLogger,
    FTMetrics,
    ObservedOptimizers,
    install_log_prefix,
    tree_nbytes,
)


class FakeManager:
    """The public Manager API FTMetrics reads, with hand-set values."""

    def __init__(self) -> None:
        self.fns: dict[str, Any] = {}
        self.step = 0
        self.participants = 2
        self.participating = True

    def register_state_dict_fn(self, key: str, load: Any, state: Any) -> None:
        self.fns[key] = (load, state)

    def heal(self) -> None:
        load, _ = self.fns[HEAL_PROBE_KEY]
        load({})

    def num_participants(self) -> int:
        return self.participants

    def current_step(self) -> int:
        return self.step

    def batches_committed(self) -> int:
        return 2 * self.step

    def is_participating(self) -> bool:
        return self.participating


class FakeOptimizers:
    def __init__(self, results: list[bool]) -> None:
        self.results = results

    def zero_grad(self) -> None:
        pass

    def step(self) -> bool:
        return self.results.pop(0)


def test_tree_nbytes_counts_nested_tensors() -> None:
    tree = {"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.float64), 3], "c": "x"}
    assert tree_nbytes(tree) == 4 * 4 + 2 * 8


def test_per_step_scalars_count_failures_heals_and_gradient_bytes() -> None:
    manager = FakeManager()
    healed = SimpleNamespace(state_dict=lambda: {"w": torch.zeros(10)})
    metrics = FTMetrics(manager, healed_state=healed, grad_bytes=100)
    optimizers = ObservedOptimizers(FakeOptimizers([True, False, True]), metrics, manager)
    for _ in range(3):
        optimizers.zero_grad()
        optimizers.step()
    manager.heal()
    manager.step = 2
    scalars = metrics.scalars()
    assert scalars["ft/participants"] == 2
    assert scalars["ft/committed_step"] == 2
    assert scalars["ft/batches_committed"] == 4
    assert scalars["ft/commit_failures"] == 1
    assert scalars["ft/bytes_synced"] == 300
    assert scalars["ft/heal_count"] == 1
    assert scalars["ft/bytes_healed"] == 40
    assert "ft/quorum_size" not in scalars  # the Manager does not expose it


def test_heal_seconds_are_the_step_calls_that_healed() -> None:
    manager = FakeManager()
    metrics = FTMetrics(manager)

    class HealingOptimizers(FakeOptimizers):
        def zero_grad(self) -> None:
            manager.heal()

    optimizers = ObservedOptimizers(HealingOptimizers([True]), metrics, manager)
    optimizers.zero_grad()
    optimizers.step()
    assert metrics.heal_count == 1
    assert metrics.heal_seconds > 0


def test_semi_sync_scalars_come_from_strategy_stats() -> None:
    from torchtitan_ft.semi_sync import CommStats

    manager = FakeManager()
    strategy = SimpleNamespace(
        stats=CommStats(allreduce_calls=3, payload_bytes=1234, syncs_committed=2, syncs_failed=1),
        state_dict=lambda: {"global": {"w": torch.zeros(3)}},
    )
    metrics = FTMetrics(manager, strategy=strategy)
    optimizers = ObservedOptimizers(FakeOptimizers([True]), metrics, manager)
    optimizers.step()
    manager.heal()
    scalars = metrics.scalars()
    assert scalars["ft/bytes_synced"] == 1234
    assert scalars["ft/commit_failures"] == 1
    assert scalars["ft/syncs_committed"] == 2
    assert scalars["ft/bytes_healed"] == 12


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
        install_log_prefix(1, 0, lambda: step[0], logger)
        logger.warning("hello %s", "world")
    finally:
        logger.removeHandler(handler)
    assert records == ["[replica 1 rank 0 step 3] hello world"]


@pytest.mark.multiprocess
def test_ft_job_writes_ft_scalars_per_replica_group(tmp_path: Path) -> None:
    """2 replica groups x 1 rank, per-step FT, 3 steps, TensorBoard on: each group's event
    file has TorchTitan's loss and the ft/* scalars; the group that healed at step 0
    (init_sync) reports one heal and the bytes it received."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.titan.test_train_run import ROOT, run_ft_groups

    steps = 3
    outputs = run_ft_groups(
        tmp_path, 1, steps, ROOT / "configs" / "debug_ft_cpu.toml", "--metrics.enable_tensorboard"
    )
    scalars = []
    for r, output in enumerate(outputs):
        assert f"[replica {r} rank 0 step {steps}]" in output, output[-4000:]
        (run_dir,) = (tmp_path / f"replica{r}" / "outputs" / "tb").glob(f"*/replica_{r}")
        events = EventAccumulator(str(run_dir))
        events.Reload()
        tags = events.Tags()["scalars"]
        for tag in (
            "loss_metrics/global_avg_loss",
            "ft/participants",
            "ft/committed_step",
            "ft/commit_failures",
            "ft/heal_count",
            "ft/heal_seconds",
            "ft/bytes_healed",
            "ft/bytes_synced",
        ):
            assert tag in tags, (tag, tags)
        scalars.append({tag: [e.value for e in events.Scalars(tag)] for tag in tags})
    for values in scalars:
        # A group healing at step 0 with an async quorum sits that step out.
        assert values["ft/participants"][-1] == 2.0
        assert values["ft/committed_step"] == [1.0, 2.0, 3.0]
        assert values["ft/commit_failures"] == [0.0] * steps
        synced = values["ft/bytes_synced"]
        assert synced == sorted(synced) and synced[-1] > 6e6 * 4  # fp32 gradients, >= 1 step
    heals = sorted(values["ft/heal_count"][-1] for values in scalars)
    assert heals == [0.0, 1.0]
    healed = next(v for v in scalars if v["ft/heal_count"][-1] == 1.0)
    assert healed["ft/bytes_healed"][-1] > 6e6 * 4  # 6.2 M fp32 weights at least
    assert healed["ft/heal_seconds"][-1] > 0
