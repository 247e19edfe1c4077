"""``benchmarks.goodput``'s torchft method: TorchTitan's own FT trainer
(``torchtitan.experiments.ft.train``, TorchTitan 0.2.2) on the torchft 0.2.0 reference, with the
same per-step records as :mod:`torchtitan_ft.testing.goodput_worker`, and torchft's own
lighthouse.

    python -m benchmarks._goodput_torchft_worker lighthouse BIND MIN_REPLICAS JOIN_MS TICK_MS HB_MS
    TRAIN_FILE=benchmarks._goodput_torchft_worker ./run_train.sh ...   # the trainer

Nothing of TorchTitan or torchft is changed. A subclass of TorchTitan's ``FTTrainer`` reads what
they expose: torchft's ``Manager`` (its step, ``batches_committed``, ``is_participating``), the
result of its ``should_commit`` (wrapped on the instance), and the quorums its client receives
(a pass-through in front of the client: who a healing group heals from). The one thing it adds
is its ``drawn`` count, as one more entry of TorchTitan's FT data loader checkpoint. Records,
where they differ from :mod:`torchtitan_ft.testing.goodput_worker`'s:

* ``step``: torchft's committed step (``Manager.current_step``);
* ``consumed`` and ``participants``: null. torchft keeps no data ledger, and a group knows the
  number of participants, not which groups they were; ``benchmarks.goodput`` gathers the
  participants of a step from every group's ``participating``;
* ``batches_committed``: torchft's count (participants summed over committed steps, healed
  with the state): the job's committed samples are this x ranks x local batch;
* ``participating``: this group's batch was in the step (not healing, in the quorum);
* ``loss``: the job's loss as TorchTitan logs it (``logged_loss``: a sum over the participating
  groups of each one's mean, its ``dist_sum`` over torchft's process group) divided by the
  number of participants, so that it compares with this project's;
* ``drawn``: batches this group's loader has given out over the run, so batch ``drawn - 1`` of
  the group's slice is the one this step trained or lost. TorchTitan's loader reads on whatever
  the step does. A new process does not start its slice again: TorchTitan 0.2.2 saves each
  group's loader after every step (``checkpoint.enable_ft_dataloader_checkpoints``, on by
  default, even with checkpoints off: an asynchronous DCP save under
  ``<dump>/checkpoint/ft-replicat-<G>/step-<N>``) and a new process loads the latest before its
  first step. The count is saved and loaded with it (one more entry in the same DCP
  checkpoint), so it always names the position TorchTitan's loader resumed from (with that
  checkpoint switched off, neither is restored and both start again with the process);
* ``lr``: the learning rate the optimizer stepped with (read after ``should_commit``, where a
  healing group has just loaded the donor's optimizer state);
* ``param_sum``: the sum of this rank's model shards (float64): equal in groups whose rank 0
  holds the same bytes, so the records show the step at which groups part;

Rank 0 of a group also appends ``{"time", "source"}`` to ``heals_r<G>_p<PID>.jsonl`` when a quorum
tells the group to heal (``source``: the donor's replica group), before the heal.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan_ft.replica_ids import group_number


def serve_lighthouse(argv: list[str]) -> None:
    """torchft 0.2.0's lighthouse (its Rust server, in this process) until killed."""
    from benchmarks._reference import load_reference

    bind, min_replicas, join_ms, tick_ms, heartbeat_ms = argv
    reference = load_reference()
    if reference is None:
        raise SystemExit("goodput: the torchft 0.2.0 reference is not installed")
    server = reference.LighthouseServer(
        bind=bind,
        min_replicas=int(min_replicas),
        join_timeout_ms=int(join_ms),
        quorum_tick_ms=int(tick_ms),
        heartbeat_timeout_ms=int(heartbeat_ms),
    )
    print(f"torchft lighthouse at {server.address()}", flush=True)
    while True:
        time.sleep(3600)


class _QuorumTap:
    """Stands in front of torchft's ``ManagerClient``: passes every call on, and shows each
    quorum result to ``seen`` first."""

    def __init__(self, client: Any, seen: Any) -> None:
        self._client = client
        self._seen = seen

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self._seen(quorum)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def group_of(replica_id: str) -> int:
    """The replica group of TorchTitan's torchft replica id ``torchtitan_ft_<G>:<uuid>``."""
    return group_number(replica_id)


class _DrawnCount:
    """The trainer's ``drawn`` as a DCP stateful, one entry per rank (ranks of a group draw
    alike, but a per-rank key keeps DCP from choosing between them)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._key = f"drawn_rank{os.environ['RANK']}"

    def state_dict(self) -> dict[str, int]:
        return {self._key: self._trainer._drawn}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._trainer._drawn = int(state_dict[self._key])


def param_sum(model_parts: list[Any]) -> float:
    """Sum of this rank's local model shards in float64."""
    import torch

    with torch.no_grad():
        return sum(
            float(p.to_local().double().sum() if hasattr(p, "to_local") else p.double().sum())
            for part in model_parts
            for p in part.parameters()
        )


def _record_loss_and_commits(trainer: Any, manager: Any) -> None:
    """Makes ``trainer`` keep its step's logged loss in ``_loss``, and what ``should_commit``
    answered (with the participation it saw and the learning rate) in ``_step_result``."""
    log = trainer.metrics_processor.log

    def keep_loss(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
        trainer._loss = float(loss)
        log(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = keep_loss
    should_commit = manager.should_commit

    def recorded_should_commit(*args: Any, **kwargs: Any) -> bool:
        participating = manager.is_participating()
        participants = manager.num_participants()
        result = should_commit(*args, **kwargs)
        trainer._step_result = {
            "committed": result,
            "participating": participating,
            "participants": participants,
            "lr": trainer.optimizers.optimizers[0].param_groups[0]["lr"],
        }
        return result

    manager.should_commit = recorded_should_commit


def main() -> None:
    from torchtitan.experiments.ft.train import FTTrainer
    from torchtitan.train import main as titan_main

    from torchtitan_ft.testing.goodput_worker import announce, process_usage, run_tag, state_hash

    announce(Path(os.environ["GOODPUT_OUT"]), run_tag())

    class RecordingFTTrainer(FTTrainer):
        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            out = Path(os.environ["GOODPUT_OUT"])
            self._out = out
            self._rank = int(os.environ["RANK"])
            self._group = job_config.fault_tolerance.replica_id
            self._tag = f"r{self._group}"
            self._pid = os.getpid()
            self._loss: float | None = None
            self._drawn = 0
            self._step_result: dict[str, Any] = {}
            manager = self.ft_manager.manager
            self._manager = manager
            _record_loss_and_commits(self, manager)
            ft_states = getattr(self.checkpointer, "ft_states", None)
            if ft_states is not None:  # saved and loaded with TorchTitan's loader state
                ft_states["goodput_drawn"] = _DrawnCount(self)
            self._records = self._heals = None
            if self._rank == 0:
                self._records = open(out / f"steps_{self._tag}_p{self._pid}.jsonl", "a")  # noqa: SIM115
                self._heals = open(out / f"heals_{self._tag}_p{self._pid}.jsonl", "a")  # noqa: SIM115
                manager._client = _QuorumTap(manager._client, self._quorum_seen)

        def _quorum_seen(self, quorum: Any) -> None:
            if not quorum.heal or quorum.recover_src_replica_rank is None:
                return
            donor = group_of(quorum.replica_ids[quorum.recover_src_replica_rank])
            self._heals.write(json.dumps({"time": time.time(), "source": donor}) + "\n")
            self._heals.flush()

        def batch_generator(self, data_iterable: Any) -> Any:
            for batch in super().batch_generator(data_iterable):
                self._drawn += 1
                yield batch

        def train_step(self, data_iterator: Any) -> None:
            self._loss = None
            self._step_result = {}
            super().train_step(data_iterator)
            if self._records is None:
                return
            rss_mb, fds = process_usage()
            participants = self._step_result.get("participants") or 1
            record = {
                "time": time.time(),
                "step": self._manager.current_step(),
                "committed": bool(self._step_result.get("committed", False)),
                "consumed": None,
                "participants": None,
                "loss": self._loss / participants if self._loss is not None else None,
                "logged_loss": self._loss,
                "rss_mb": round(rss_mb, 1),
                "fds": fds,
                "batches_committed": self._manager.batches_committed(),
                "participating": bool(self._step_result.get("participating", False)),
                "drawn": self._drawn,
                "lr": self._step_result.get("lr"),
                "param_sum": param_sum(self.model_parts),
            }
            self._records.write(json.dumps(record) + "\n")
            self._records.flush()

        def should_continue_training(self) -> bool:
            stop = os.environ.get("GOODPUT_STOP_FILE")
            if stop and os.path.exists(stop):
                return self._manager.current_step() < int(Path(stop).read_text())
            return super().should_continue_training()

        def train(self) -> None:
            super().train()
            final = {
                "step": self._manager.current_step(),
                "hash": state_hash(self.model_parts, self.optimizers),
                "consumed": None,
                "position": None,
                "batches_committed": self._manager.batches_committed(),
            }
            path = self._out / f"final_{self._tag}_rank{self._rank}.json"
            path.write_text(json.dumps(final))

    titan_main(RecordingFTTrainer)


if __name__ == "__main__":
    if sys.argv[1:2] == ["lighthouse"]:
        serve_lighthouse(sys.argv[2:])
    else:
        main()
