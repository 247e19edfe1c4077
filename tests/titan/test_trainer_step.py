"""``FaultTolerantTrainer.train_step`` without a model: TorchTitan's step is replaced by a fake
that sets the step the way a commit, a discard or a heal leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import torchtitan_ft.titan.train  # noqa: F401  (CPU fixes before TorchTitan is imported)
from torchtitan_ft.titan.trainer import FaultTolerantTrainer


class _Axis:
    def __init__(self) -> None:
        self.committed = True

    def step_committed(self) -> bool:
        return self.committed


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch):
    """A trainer whose TorchTitan step only applies ``trainer.heal_to`` (if set), and whose
    ``set_pg_timeouts`` calls are recorded in ``trainer.lowered``."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import Trainer

    def titan_step(self, data_iterator) -> None:
        self.ntokens_seen += 512  # what TorchTitan's batch generator adds per batch read
        if self.heal_to is not None:
            self.step, self.heal_to = self.heal_to, None

    trainer = FaultTolerantTrainer.__new__(FaultTolerantTrainer)
    trainer.step = 0
    trainer.ntokens_seen = 0
    trainer.heal_to = None
    trainer.replica_axis = _Axis()
    trainer.job_config = SimpleNamespace(comm=SimpleNamespace(train_timeout_seconds=100))
    trainer.parallel_dims = object()
    trainer.lowered = []
    monkeypatch.setattr(Trainer, "train_step", titan_step)
    monkeypatch.setattr(
        dist_utils,
        "set_pg_timeouts",
        lambda timeout, parallel_dims: trainer.lowered.append(
            (timeout.total_seconds(), trainer.step)
        ),
    )
    return trainer


def _run(trainer, committed: bool = True) -> None:
    """One iteration of TorchTitan's loop as far as the step number goes."""
    trainer.step += 1
    trainer.replica_axis.committed = committed
    trainer.train_step(iter(()))


def test_fresh_run_leaves_the_lowering_to_torchtitan(trainer) -> None:
    _run(trainer, committed=False)  # the first attempt is discarded: step back to 0
    _run(trainer)  # step 1 commits: TorchTitan's loop lowers the timeouts (step == 1)
    _run(trainer)
    assert trainer.step == 2
    assert trainer.lowered == []


def test_group_healed_to_a_later_step_lowers_after_its_first_step(trainer) -> None:
    trainer.heal_to = 40  # the replacement group receives step 40 during its first step
    _run(trainer)
    assert trainer.lowered == [(100.0, 40)]
    _run(trainer)
    _run(trainer, committed=False)
    assert trainer.lowered == [(100.0, 40)]  # once per process


def test_resumed_run_lowers_after_its_first_step_even_if_discarded(trainer) -> None:
    trainer.step = 7  # loaded from a checkpoint
    _run(trainer, committed=False)
    assert trainer.step == 7
    assert trainer.lowered == [(100.0, 7)]


def test_discarded_step_does_not_count_its_tokens(trainer) -> None:
    _run(trainer)
    _run(trainer, committed=False)  # the retry reads the same batch again
    _run(trainer)
    assert (trainer.step, trainer.ntokens_seen) == (2, 1024)


def test_init_optimizer_state_is_torchtitans_zero_lr_adam_step() -> None:
    """fault_tolerance.numerics = "torchtitan_ft_trainer": Adam's state exists before the first
    step, its counter at 1, the weights and the learning rate untouched."""
    import torch
    from torchtitan.components.optimizer import OptimizersContainer

    from torchtitan_ft.titan.trainer_hooks import init_optimizer_state

    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1})
    init_optimizer_state([model], optimizers)
    (adam,) = optimizers.optimizers
    assert all(float(adam.state[p]["step"]) == 1.0 for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert adam.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("numerics", ["torchtitan", "torchtitan_ft_trainer"])
@pytest.mark.parametrize("semi_sync", [False, True])
def test_the_start_line_names_the_difference_from_torchtitans_ft_trainer(
    numerics: str, semi_sync: bool
) -> None:
    from torchtitan_ft.titan.trainer_hooks import numerics_line

    line = numerics_line(numerics, semi_sync)
    assert "\n" not in line and f"'{numerics}'" in line and "TorchTitan's FT trainer" in line
    assert ("batches" in line) is not semi_sync  # semi-sync has no ledger to retry or skip


@pytest.mark.parametrize(
    ("step", "titan_lowers_at", "here"),
    [
        (0, 1, None),  # a fresh run's discarded first step: wait for TorchTitan's step
        (1, 1, False),  # TorchTitan's loop lowers them after this step
        (40, 1, True),  # healed to step 40 in its first step: TorchTitan's never comes
        (7, 1, True),  # 0.2.2, resumed at 7, first step discarded: its loop waits for step 1
        (7, 8, None),  # 0.3.0, resumed at 7, first step discarded: its loop waits for step 8
        (8, 8, False),
        (40, 8, True),
    ],
)
def test_who_lowers_the_pg_timeouts_after_a_step(
    step: int, titan_lowers_at: int, here: bool | None
) -> None:
    """Both releases' trainers ask the same question; each says where its loop lowers them
    (0.2.2: after step 1; 0.3.0: one step past the loaded one)."""
    from torchtitan_ft.titan.trainer_hooks import lowers_pg_timeouts_here

    assert lowers_pg_timeouts_here(step, titan_lowers_at) is here
