"""A TorchTitan ``TRAIN_FILE`` for tests and ``scripts/gpu_check.py``:
``TRAIN_FILE=torchtitan_ft.testing.titan_dump ./run_train.sh ...`` trains as
``torchtitan_ft.titan.train`` does, with test hooks. Once built, each rank writes
``ready_r<replica>_rank<rank>``; after the last step it dumps its healed state (model,
optimizer, lr scheduler, train state, data ledger), its model's own ``state_dict()`` (what a
checkpoint saves, whatever the heal chose to send; local shards), the Manager's state, its
reader position and the sync strategy's state to ``state_r<replica>_rank<rank>.pt``
(:func:`dump_path`), so that a test can check that replica groups end identical.
Environment of a run:

* ``FT_E2E_OUT``: directory of the ``ready`` and ``state`` files;
* ``FT_E2E_ALONE_SLEEP_S``: seconds to sleep after a step with fewer participants than
  ``FT_E2E_TOGETHER`` (default ``group_size``; a job with a hot spare group has fewer
  participants than groups), so the survivor is still training when the restarted group is
  back;
* ``FT_E2E_MAX_ALONE``: after this many such steps the survivor waits (at most
  :data:`ALONE_WAIT_S`) for the other groups' ``ready`` files, so that a restart slowed down by
  a busy machine still leaves steps to train together after the heal;
* ``FT_E2E_STOP_FILE``: once this file exists, training ends after the step it names (the
  test decides when every group has done what it watches for; ``--training.steps`` is then
  only an upper bound).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from torchtitan_ft.titan import releases
from torchtitan_ft.titan.healing import to_local_tree

ALONE_WAIT_S = 150.0
"""How long a survivor waits for the other groups' ``ready`` files (``FT_E2E_MAX_ALONE``)."""


def dump_path(out: Path, replica: int, rank: int) -> Path:
    """Where group rank ``rank`` of replica group ``replica`` dumps its state after training."""
    return out / f"state_r{replica}_rank{rank}.pt"


def ready_path(out: Path, replica: int, rank: int) -> Path:
    """The file group rank ``rank`` of replica group ``replica`` writes once it is built."""
    return out / f"ready_r{replica}_rank{rank}"


def main() -> None:
    """The trainer's entry point with :class:`DumpingTrainer`'s hooks (run under torchrun)."""
    import torchtitan_ft.titan.train as entry  # load order: the CPU fixes before TorchTitan

    FaultTolerantTrainer = releases.installed().module.trainer_class()

    class DumpingTrainer(FaultTolerantTrainer):
        """Announces itself once built, paces the survivor, dumps its state after training."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self._out = Path(os.environ["FT_E2E_OUT"])
            self._replica = job_config.fault_tolerance.replica_id
            self._rank = int(os.environ["RANK"])
            self._tag = f"r{self._replica}_rank{self._rank}"
            self._alone_steps = 0
            ready_path(self._out, self._replica, self._rank).write_text(str(os.getpid()))

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            together = int(os.environ.get("FT_E2E_TOGETHER", self.replica_axis.group_size))
            if self.replica_axis.manager.num_participants() < together:
                time.sleep(float(os.environ.get("FT_E2E_ALONE_SLEEP_S", "0")))
                self._alone_steps += 1
                if self._alone_steps >= int(os.environ.get("FT_E2E_MAX_ALONE", "1000000")):
                    self._wait_for_the_others()

        def should_continue_training(self) -> bool:
            stop = os.environ.get("FT_E2E_STOP_FILE")
            if stop and os.path.exists(stop):
                return self.step < int(Path(stop).read_text())
            return super().should_continue_training()

        def _wait_for_the_others(self) -> None:
            others = [
                ready_path(self._out, r, self._rank)
                for r in range(self.replica_axis.group_size)
                if r != self._replica
            ]
            deadline = time.monotonic() + ALONE_WAIT_S
            while not all(p.exists() for p in others) and time.monotonic() < deadline:
                time.sleep(0.2)

        def train(self) -> None:
            super().train()
            strategy = getattr(self.replica_axis, "strategy", None)
            state = {
                "healed": self.healed_state.state_dict(),
                "model": [to_local_tree(part.state_dict()) for part in self.model_parts],
                "manager": self.replica_axis.manager.state_dict(),
                "position": getattr(self.batches, "position", None),  # per-step FT only
                "strategy": strategy.state_dict() if strategy is not None else None,
            }
            torch.save(state, self._out / f"state_{self._tag}.pt")

    entry.main(trainer_class=DumpingTrainer)


if __name__ == "__main__":
    main()
