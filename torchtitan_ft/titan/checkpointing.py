"""Disk checkpoints of an FT job, in every trainer rank: one replica group writes the full
checkpoint, every group its reader files (docs/titan.md, "Checkpoints").

:class:`ReplicaCheckpointer` wraps TorchTitan's ``CheckpointManager`` (unchanged); what the
full checkpoint adds and how a group finds its data position on load is a :class:`Resume`
policy: :class:`LedgerResume` for per-step FT, :class:`SemiSyncResume` for LocalSGD / DiLoCo.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

import torch
from torchtitan.tools.logging import logger

from torchtitan_ft.titan import releases
from torchtitan_ft.titan.semi_sync_axis import SemiSyncReplicaAxis, in_flight_note
from torchtitan_ft.titan.training_data import CommittedBatches

DATALOADER_KEY = "dataloader"
"""The key of the dataloader in TorchTitan's checkpoint states (removed from the full one)."""
REPLICA_AXIS_KEY = "ft_replica_axis"
"""The key of :class:`ReplicaAxisState` (or semi-sync's :class:`ManagerState`) in the full
checkpoint."""
STRATEGY_KEY = "ft_strategy"
"""The key of the semi-sync strategy's state (``titan.semi_sync_axis.StrategyState``)."""
TRAIN_STATE_KEY = "train_state"
"""TorchTitan's key of the trainer (step, tokens seen) in the checkpoint states."""
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
_CHECKPOINT_DIR = re.compile(r"^step-(\d+)$")


class ReplicaAxisState:
    """Stateful (DCP-friendly: int64 tensors) view of the data ledger and the Manager's step."""

    def __init__(self, batches: Any, manager: Any) -> None:
        self._batches = batches
        self._manager = manager

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "consumed": torch.tensor(self._batches.consumed, dtype=torch.int64),
            **_manager_tensors(self._manager),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._batches.load_state_dict({"consumed": state["consumed"].tolist()})
        _load_manager_tensors(self._manager, state)


def _manager_tensors(manager: Any) -> dict[str, torch.Tensor]:
    """The Manager's ``state_dict`` (step, batches committed) as int64 tensors, for DCP."""
    return {k: torch.tensor(v, dtype=torch.int64) for k, v in manager.state_dict().items()}


def _load_manager_tensors(manager: Any, state: dict[str, torch.Tensor]) -> None:
    """Loads what :func:`_manager_tensors` saved (other keys of ``state`` are ignored)."""
    manager.load_state_dict({k: int(state[k]) for k in ("step", "batches_committed")})


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


def newest_complete_checkpoint(folder: str | Path) -> int | None:
    """The step of the newest complete full checkpoint in ``folder``: a ``step-N`` directory
    holding DCP's ``.metadata``, which DCP writes last (None: none). What TorchTitan's load
    without a ``load_step`` picks, so a process that starts has loaded this one."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = [
        int(match.group(1))
        for path in folder.iterdir()
        if (match := _CHECKPOINT_DIR.match(path.name)) and (path / ".metadata").is_file()
    ]
    return max(steps, default=None)


def best_reader_state(states: list[dict[str, Any]], target: int) -> dict[str, Any] | None:
    """The reader state with the largest ``position`` not beyond ``target`` (None: start over)."""
    usable = [s for s in states if int(s["position"]) <= target]
    return max(usable, key=lambda s: int(s["position"]), default=None)


class Resume(Protocol):
    """What a kind of FT job adds to the full checkpoint and where a group's reader resumes."""

    def states(self) -> dict[str, Any]:
        """Statefuls added to the full checkpoint, by key."""
        ...

    def reader_state(self, step: int) -> dict[str, Any]:
        """This rank's reader file after step ``step``: ``position`` and the loader state."""
        ...

    def target(self, loaded_step: int) -> int:
        """The largest reader-file ``position`` usable after loading ``loaded_step``."""
        ...

    def load_reader_state(self, state: dict[str, Any]) -> None:
        """Restarts the reader from a reader file."""
        ...

    def after_load(self) -> None:
        """Called once the full checkpoint is loaded, before the reader is positioned."""
        ...

    def note_save(self, step: int) -> None:
        """Called by the writer right before it saves the full checkpoint of ``step``."""
        ...


class LedgerResume:
    """Per-step FT: the data position is the ledger's (:class:`CommittedBatches`).

    The full checkpoint carries the ledger and the Manager's step (:class:`ReplicaAxisState`);
    a group's reader resumes at the ledger's entry for it.
    """

    def __init__(self, batches: Any, manager: Any) -> None:
        self._batches = batches
        self._manager = manager

    def states(self) -> dict[str, Any]:
        """What this adds to the full checkpoint."""
        return {REPLICA_AXIS_KEY: ReplicaAxisState(self._batches, self._manager)}

    def reader_state(self, step: int) -> dict[str, Any]:
        """The reader at its consumed position (not past batches awaiting a retry)."""
        return self._batches.reader_state()

    def target(self, loaded_step: int) -> int:
        """The ledger's entry for this group: the batch its reader must reach (reading
        forward from the best reader file)."""
        return self._batches.consumed[self._batches.replica_id]

    def load_reader_state(self, state: dict[str, Any]) -> None:
        self._batches.load_reader_state(state)

    def after_load(self) -> None:
        """Nothing: every group holds the weights the ledger describes."""

    def note_save(self, step: int) -> None:
        """Nothing: a per-step checkpoint holds no collective in flight."""


class ManagerState:
    """Stateful (int64 tensors) of the Manager's step and batches committed, and the replica
    group that wrote the checkpoint (semi-sync, where groups differ between syncs)."""

    def __init__(self, manager: Any, replica_id: int) -> None:
        self._manager = manager
        self._replica_id = replica_id
        self.writer: int | None = None
        """The replica id of the group that wrote the loaded checkpoint (after a load)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            **_manager_tensors(self._manager),
            "writer": torch.tensor(self._replica_id, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _load_manager_tensors(self._manager, state)
        self.writer = int(state["writer"])


class SemiSyncResume:
    """LocalSGD / DiLoCo: every inner step consumes the batches it read (there is no commit
    per step, hence no ledger), so a group's position is simply its dataloader after the
    save step's batches.

    The full checkpoint carries the strategy's state (``ft_strategy``: global parameters,
    outer-optimizer state, schedule position) and the Manager's step with the writer's id
    (:class:`ManagerState`); a group's reader resumes from its own reader file of the loaded
    step (or the newest before it). After loading, a group other than the writer resets its
    model to the global parameters: the checkpoint's model is the writer's *local* one, whose
    progress since each fragment's last sync is the writer's, not this group's.

    Args:
        dataloader: the group's (stateful) dataloader.
        replica_axis: the group's ``SemiSyncReplicaAxis`` (after ``gate_step``).
    """

    def __init__(self, dataloader: Any, replica_axis: Any) -> None:
        self._dataloader = dataloader
        self._axis = replica_axis
        self._manager_state = ManagerState(replica_axis.manager, replica_axis.replica_id)

    def states(self) -> dict[str, Any]:
        """What this adds to the full checkpoint."""
        return {
            REPLICA_AXIS_KEY: self._manager_state,
            STRATEGY_KEY: self._axis.strategy_state(),
        }

    def reader_state(self, step: int) -> dict[str, Any]:
        """The dataloader after step ``step``'s batches; the position is the step."""
        return {"position": step, "loader": self._dataloader.state_dict()}

    def target(self, loaded_step: int) -> int:
        """The loaded step: the reader file written at that step, or the newest before it."""
        return loaded_step

    def load_reader_state(self, state: dict[str, Any]) -> None:
        self._dataloader.load_state_dict(state["loader"])

    def note_save(self, step: int) -> None:
        """One line when an outer round is in flight (an outer overlap): it is not in the
        checkpoint (``titan.semi_sync_axis.in_flight_note``)."""
        note = in_flight_note(self._axis.strategy, step)
        if note is not None:
            logger.info(note)

    def after_load(self) -> None:
        """A group other than the writer drops the writer's local progress (see above)."""
        writer = self._manager_state.writer
        if writer is not None and writer != self._axis.replica_id:
            self._axis.strategy.restore_global()
            logger.info(
                f"FT: replica group {self._axis.replica_id} resumes from the global parameters "
                f"(the checkpoint's model is replica group {writer}'s local one)"
            )


class ReplicaCheckpointer:
    """TorchTitan's ``CheckpointManager`` for one replica group of an FT job (see module doc).

    Args:
        inner: the trainer's ``CheckpointManager`` (its dataloader entry is removed).
        replica_axis: the group's replica axis (Manager, commit gate).
        resume: what the full checkpoint adds and where this group's reader resumes:
            :class:`LedgerResume` (per-step FT) or :class:`SemiSyncResume`.
        rank: this process's rank inside the replica group.
        keep_latest_k: retention of reader files (``checkpoint.keep_latest_k``; 0 keeps all).
    """

    def __init__(
        self, inner: Any, replica_axis: Any, resume: Resume, rank: int, keep_latest_k: int
    ) -> None:
        self._inner = inner
        self._axis = replica_axis
        self._resume = resume
        self._keep_latest_k = keep_latest_k
        self._last_saved: int | None = None
        if inner.enable:  # TorchTitan 0.3.0's manager has no states when disabled
            inner.states.pop(DATALOADER_KEY, None)
            inner.states.update(resume.states())
        self._reader_dir = (
            reader_dir(inner.folder, replica_axis.replica_id, rank) if inner.enable else None
        )

    @classmethod
    def for_replica_axis(
        cls, inner: Any, replica_axis: Any, batches: Any, rank: int, keep_latest_k: int
    ) -> ReplicaCheckpointer:
        """The checkpointer of a replica axis with a Manager: :class:`SemiSyncResume` for
        LocalSGD / DiLoCo, :class:`LedgerResume` over ``batches`` (the trainer's
        ``CommittedBatches``) for per-step FT, whose Manager then finds the newest complete
        checkpoint when the job's state is lost (``Manager.set_checkpoint_step``,
        ``on_state_loss="checkpoint"``).

        Raises:
            TypeError: a per-step axis whose ``batches`` are not a ``CommittedBatches``.
        """
        if isinstance(replica_axis, SemiSyncReplicaAxis):
            resume: Resume = SemiSyncResume(batches, replica_axis)
        elif isinstance(batches, CommittedBatches):
            resume = LedgerResume(batches, replica_axis.manager)
            if inner.enable:  # its steps are the Manager's: a state loss can resume from it
                folder = inner.folder
                replica_axis.manager.set_checkpoint_step(lambda: newest_complete_checkpoint(folder))
        else:
            raise TypeError(
                "per-step FT checkpoints need the trainer's batches read through "
                f"CommittedBatches, got {type(batches).__name__}"
            )
        return cls(inner, replica_axis, resume, rank, keep_latest_k)

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
            self._resume.note_save(curr_step)
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
        torch.save(self._resume.reader_state(step), tmp)
        os.replace(tmp, path)
        for stale in stale_reader_files(reader_files(self._reader_dir), self._keep_latest_k):
            stale.unlink(missing_ok=True)

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """TorchTitan's load of the full checkpoint, then this group's reader position."""
        loaded = self._inner.load(step)
        if not loaded:
            return False
        loaded_step = int(self._inner.states[TRAIN_STATE_KEY].step)
        self._resume.after_load()
        if self._reader_dir is not None:
            target = self._resume.target(loaded_step)
            states = [
                torch.load(path, weights_only=False)
                for path in reader_files(self._reader_dir).values()
            ]
            best = best_reader_state(states, target)
            if best is not None:
                self._resume.load_reader_state(best)
            logger.info(
                f"FT: replica group {self._axis.replica_id} resumes its data slice from its "
                f"reader file at position {best['position'] if best else 0} (target {target}); "
                f"manager step {self._axis.manager.current_step()}"
            )
        self._last_saved = loaded_step
        return True

    def close(self) -> None:
        """Wait for an async full save (as the installed release spells it), then
        TorchTitan's close."""
        releases.installed().module.wait_for_checkpoint_save(self._inner)
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
