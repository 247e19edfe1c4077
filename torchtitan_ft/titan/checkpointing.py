"""Disk checkpoints of an FT job: one writer for the full checkpoint, a reader file per group.

TorchTitan's ``CheckpointManager`` knows one job; an FT job is several replica groups that
hold the same weights but read different slices of the data. :class:`ReplicaCheckpointer`
wraps the trainer's ``CheckpointManager`` (TorchTitan unchanged) so that, on the steps where
TorchTitan saves (``checkpoint.interval``, the last step):

* **Full checkpoint** (DCP, ``<dump_folder>/<checkpoint.folder>/step-N``): model, optimizer,
  lr schedulers, train state and the replica axis state (the data ledger of every group and
  the Manager's step, :class:`ReplicaAxisState`). Written by exactly one replica group: the
  lowest participating one (``Manager.participating_rank() == 0``), after a committed step.
  The groups hold identical state, so one copy is enough, and one writer cannot race another
  in a shared folder. TorchTitan's retention (``keep_latest_k``) runs in the writer, also
  after the last step (TorchTitan skips it there). The
  dataloader is *not* in it (each group has its own position).
* **Reader state** (``<folder>/ft-replica-<id>/rank<r>/step-N.pt``, plain ``torch.save``, one
  small file per rank, written atomically and synchronously, so the last one is complete when
  the process exits): this rank's dataloader state at its consumed position and that position.
  Every group writes its own, with the same ``keep_latest_k`` retention per directory.

Loading (``Trainer.train`` calls ``load`` first): the latest full checkpoint gives the weights,
the step and the ledger; each group then restarts its reader from its own file with the
largest position not beyond the ledger's entry for it, and reads forward to that entry (a
group that was down when the checkpoint was written, or whose last reader file is newer than
the full checkpoint, still lands on the exact batch).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torchtitan.tools.logging import logger

DATALOADER_KEY = "dataloader"
"""The key of the dataloader in TorchTitan's checkpoint states (removed from the full one)."""
REPLICA_AXIS_KEY = "ft_replica_axis"
"""The key of :class:`ReplicaAxisState` in the full checkpoint."""
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


class ReplicaAxisState:
    """Stateful (DCP-friendly: int64 tensors) view of the data ledger and the Manager's step."""

    def __init__(self, batches: Any, manager: Any) -> None:
        self._batches = batches
        self._manager = manager

    def state_dict(self) -> dict[str, torch.Tensor]:
        manager = self._manager.state_dict()
        return {
            "consumed": torch.tensor(self._batches.consumed, dtype=torch.int64),
            "step": torch.tensor(manager["step"], dtype=torch.int64),
            "batches_committed": torch.tensor(manager["batches_committed"], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._batches.load_state_dict({"consumed": state["consumed"].tolist()})
        self._manager.load_state_dict(
            {
                "step": int(state["step"]),
                "batches_committed": int(state["batches_committed"]),
            }
        )


def reader_dir(folder: str | Path, replica_id: int, rank: int) -> Path:
    """Where replica group ``replica_id``'s rank ``rank`` keeps its reader files."""
    return Path(folder) / f"ft-replica-{replica_id}" / f"rank{rank}"


def reader_files(directory: Path) -> dict[int, Path]:
    """{step: path} of the reader files in ``directory`` (empty if it does not exist)."""
    if not directory.is_dir():
        return {}
    found = {}
    for path in directory.iterdir():
        match = _STEP_FILE.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def stale_reader_files(files: dict[int, Path], keep_latest_k: int) -> list[Path]:
    """The files retention deletes: all but the ``keep_latest_k`` newest (0 keeps all)."""
    if keep_latest_k <= 0:
        return []
    return [files[step] for step in sorted(files)[:-keep_latest_k]]


def best_reader_state(states: list[dict[str, Any]], target: int) -> dict[str, Any] | None:
    """The reader state with the largest ``position`` not beyond ``target`` (None: start over)."""
    usable = [s for s in states if int(s["position"]) <= target]
    return max(usable, key=lambda s: int(s["position"]), default=None)


class ReplicaCheckpointer:
    """TorchTitan's ``CheckpointManager`` for one replica group of an FT job (see module doc).

    Args:
        inner: the trainer's ``CheckpointManager`` (its dataloader entry is removed).
        replica_axis: the group's ``ManagedReplicaAxis`` (Manager, commit gate).
        batches: the group's ``CommittedBatches``.
        rank: this process's rank inside the replica group.
        keep_latest_k: retention of reader files (``checkpoint.keep_latest_k``; 0 keeps all).
    """

    def __init__(
        self, inner: Any, replica_axis: Any, batches: Any, rank: int, keep_latest_k: int
    ) -> None:
        self._inner = inner
        self._axis = replica_axis
        self._batches = batches
        self._keep_latest_k = keep_latest_k
        self._last_saved: int | None = None
        inner.states.pop(DATALOADER_KEY, None)
        inner.states[REPLICA_AXIS_KEY] = ReplicaAxisState(batches, replica_axis.manager)
        self._reader_dir = (
            reader_dir(inner.folder, replica_axis.replica_id, rank) if inner.enable else None
        )

    @property
    def enable(self) -> bool:
        return self._inner.enable

    def is_writer(self) -> bool:
        """Whether this group writes the full checkpoint: the lowest participating group."""
        return self._axis.manager.participating_rank() == 0

    @torch.no_grad()
    def save(self, curr_step: int, last_step: bool = False) -> None:
        """After a committed step, at TorchTitan's save steps: this rank's reader file, and the
        full checkpoint if this group is the writer."""
        if not self._inner._should_save(curr_step, last_step):
            return
        if not self._axis.step_committed() or curr_step == self._last_saved:
            return  # a discarded step is retried under the same number
        self._last_saved = curr_step
        self._save_reader(curr_step)
        if self.is_writer():
            self._inner.save(curr_step, last_step)
            if last_step:  # TorchTitan applies keep_latest_k only to interval saves
                self._inner._purge_stale_checkpoints()
        else:
            logger.info(
                f"FT: replica group {self._axis.replica_id} leaves step {curr_step}'s full "
                "checkpoint to the lowest participating replica group"
            )

    def _save_reader(self, step: int) -> None:
        if self._reader_dir is None:
            return
        self._reader_dir.mkdir(parents=True, exist_ok=True)
        path = self._reader_dir / f"step-{step}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(self._batches.reader_state(), tmp)
        os.replace(tmp, path)
        for stale in stale_reader_files(reader_files(self._reader_dir), self._keep_latest_k):
            stale.unlink(missing_ok=True)

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """TorchTitan's load of the full checkpoint, then this group's reader position."""
        loaded = self._inner.load(step)
        if loaded and self._reader_dir is not None:
            target = self._batches.consumed[self._batches.replica_id]
            states = [
                torch.load(path, weights_only=False)
                for path in reader_files(self._reader_dir).values()
            ]
            best = best_reader_state(states, target)
            if best is not None:
                self._batches.load_reader_state(best)
            logger.info(
                f"FT: replica group {self._axis.replica_id} resumes its data slice at batch "
                f"{target} (reader file at {best['position'] if best else 0}); manager step "
                f"{self._axis.manager.current_step()}"
            )
            self._last_saved = self._axis.manager.current_step()
        return loaded

    def close(self) -> None:
        """Wait for an async full save, then TorchTitan's close."""
        if self._inner.enable and getattr(self._inner, "save_future", None) is not None:
            self._inner._async_wait()
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
