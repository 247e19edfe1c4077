"""The trainer of ``benchmarks.goodput`` (its ``TRAIN_FILE``): this project's TorchTitan trainer,
plus one JSON line per step about what the step committed, for the benchmark to read. In the
package (not ``benchmarks/``) so that ``run_train.sh`` starts it as it starts this project's own
trainer, through the zygote with ``fault_tolerance.replacement = "zygote"``.

Environment:

* ``GOODPUT_OUT``: folder of the records. Rank 0 of each replica group (of the whole job when
  fault tolerance is off) appends to ``steps_<tag>.jsonl`` one object per iteration:
  ``time``, ``step`` (committed steps after it), ``committed``, ``consumed`` (the data ledger:
  batches of each group's slice in committed steps; null without fault tolerance),
  ``participants`` (groups whose batches the step committed; empty in a step this group healed
  in, where the ledger before it was this process's and after it the donor's), ``healed``,
  ``loss`` (TorchTitan's logged
  job loss), ``rss_mb`` and ``fds`` (this process's resident memory and open descriptors).
  Every rank writes ``final_<tag>_rank<k>.json`` after its last step: ``step``, ``hash``
  (SHA-256 of its model and optimizer tensors, local shards), ``consumed`` and ``position``
  (its reader's place in its slice).
* ``GOODPUT_STOP_FILE``: once this file exists, training ends after the step it names.

Every rank first creates ``worker_<tag>_l<LOCAL_RANK>_p<PID>`` there: which process is which
rank (a worker forked by the zygote shows the zygote's command line and environment in
``/proc``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan_ft.titan import releases


def process_usage() -> tuple[float, int]:
    """This process's resident memory (MiB) and open file descriptors."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, len(os.listdir("/proc/self/fd"))


def state_hash(model_parts: list[Any], optimizers: Any) -> str:
    """SHA-256 over this rank's local model shards and optimizer state tensors, in name order."""
    import torch  # load order: the module announces its rank before torch is imported

    digest = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        if hasattr(value, "to_local"):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            digest.update(name.encode())
            digest.update(
                value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            )

    for part in model_parts:
        for name, tensor in sorted(part.state_dict().items()):
            add(name, tensor)
    for i, optimizer in enumerate(getattr(optimizers, "optimizers", [optimizers])):
        for key, state in sorted(optimizer.state_dict()["state"].items()):
            for name, value in sorted(state.items()):
                add(f"opt{i}.{key}.{name}", value)
    return digest.hexdigest()


def announce(out: Path, tag: str) -> None:
    """Creates this rank's ``worker_<tag>_l<LOCAL_RANK>_p<PID>`` file in ``out``."""
    (out / f"worker_{tag}_l{os.environ['LOCAL_RANK']}_p{os.getpid()}").touch()


def run_tag() -> str:
    """``r<G>`` for replica group G (from the command line's replica id), ``job`` without
    fault tolerance: read before the config is parsed, to announce the rank at once."""
    if "--fault_tolerance.no-enable" in sys.argv:
        return "job"
    for arg in sys.argv:
        if arg.startswith("--fault_tolerance.replica_id="):
            return f"r{arg.split('=', 1)[1]}"
    return "job"


def main() -> None:
    announce(Path(os.environ["GOODPUT_OUT"]), run_tag())
    # load order: the rank is announced first; the entry point applies the CPU fixes before
    # TorchTitan is imported, and the installed release's trainer is the base (0.2.2 or 0.3.0)
    import torchtitan_ft.titan.train as entry

    FaultTolerantTrainer = releases.installed().module.trainer_class()

    class RecordingTrainer(FaultTolerantTrainer):
        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self._out = Path(os.environ["GOODPUT_OUT"])
            self._rank = int(os.environ["RANK"])
            ft = job_config.fault_tolerance
            self._tag = f"r{ft.replica_id}" if self.replica_axis.enabled else "job"
            self._pid = os.getpid()
            self._loss: float | None = None
            log = self.metrics_processor.log

            def keep_loss(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
                self._loss = float(loss)
                log(step, loss, *args, **kwargs)

            self.metrics_processor.log = keep_loss
            self._records = (
                open(self._out / f"steps_{self._tag}_p{self._pid}.jsonl", "a")  # noqa: SIM115
                if self._rank == 0
                else None
            )

        def _ledger(self) -> list[int] | None:
            consumed = getattr(self.batches, "consumed", None)
            return list(consumed) if consumed is not None else None

        def train_step(self, data_iterator: Any) -> None:
            before = self._ledger()
            step_before = self.step
            self._loss = None
            super().train_step(data_iterator)
            if self._records is None:
                return
            after = self._ledger()
            committed = self.replica_axis.step_committed()
            # healed in this step: the ledger before is this process's own, after the donor's
            healed = self.step > step_before + 1
            participants = (
                [g for g, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
                if before is not None and after is not None and not healed
                else ([] if healed else None)
            )
            rss_mb, fds = process_usage()
            record = {
                "time": time.time(),
                "step": self.step,
                "committed": committed,
                "consumed": after,
                "participants": participants,
                "healed": healed,
                "loss": self._loss,
                "rss_mb": round(rss_mb, 1),
                "fds": fds,
            }
            self._records.write(json.dumps(record) + "\n")
            self._records.flush()

        def should_continue_training(self) -> bool:
            stop = os.environ.get("GOODPUT_STOP_FILE")
            if stop and os.path.exists(stop):
                return self.step < int(Path(stop).read_text())
            return super().should_continue_training()

        def train(self) -> None:
            super().train()
            final = {
                "step": self.step,
                "hash": state_hash(self.model_parts, self.optimizers),
                "consumed": self._ledger(),
                "position": getattr(self.batches, "position", None),
            }
            path = self._out / f"final_{self._tag}_rank{self._rank}.json"
            path.write_text(json.dumps(final))

    entry.main(trainer_class=RecordingTrainer)


if __name__ == "__main__":
    main()
