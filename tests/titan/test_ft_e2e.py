"""End to end on CPU: a replica group is SIGKILLed mid-run, restarts, heals from the live peer.

A lighthouse (in this process) and 2 replica groups of 1 or 2 ranks train the llama3 debugmodel
(small shape) with FT through ``run_train.sh`` / torchrun. Replica group 1 is SIGKILLed (its
torchrun agent *and* its workers, which torchrun starts in their own sessions) mid-run; group 0
keeps committing alone; group 1 is started again, heals from group 0 and both finish the run.
At exit each rank dumps its model, optimizer, lr scheduler, train state, data ledger and reader
position (``DumpingTrainer`` in ``_worker_main``), and the test checks that both groups hold
bitwise-identical state, rank by rank, at the same step.

This module is also the ``TRAIN_FILE`` of the runs (``python -m tests.titan.test_ft_e2e``):
the test-only hooks live here, not in the product. Environment of a run:

* ``FT_E2E_OUT``: directory for ``pid_r<replica>_rank<rank>`` (written at start) and
  ``state_r<replica>_rank<rank>.pt`` (written after the last step);
* ``FT_E2E_ALONE_SLEEP_S``: seconds to sleep after a step with fewer participants than
  ``group_size``, so the survivor is still training when the restarted group is back (a
  restart takes 10-20 s of imports on 2 loaded cores).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
KILL_AT_STEP = 5
"""Group 1 is killed once it has logged this trainer step."""


def _dump_path(out: Path, replica: int, rank: int) -> Path:
    return out / f"state_r{replica}_rank{rank}.pt"


# --- the worker (runs under torchrun) ----------------------------------------------------------


def _worker_main() -> None:
    import torchtitan_ft.train as entry  # applies the CPU fixes before TorchTitan is imported
    from torchtitan_ft.titan.trainer import FaultTolerantTrainer

    class DumpingTrainer(FaultTolerantTrainer):
        """Writes its pid at start, its whole healed state after training."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self._out = Path(os.environ["FT_E2E_OUT"])
            self._tag = f"r{job_config.fault_tolerance.replica_id}_rank{os.environ['RANK']}"
            (self._out / f"pid_{self._tag}").write_text(str(os.getpid()))

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            manager = self.replica_axis.manager
            if manager.num_participants() < self.replica_axis.group_size:
                time.sleep(float(os.environ.get("FT_E2E_ALONE_SLEEP_S", "0")))

        def train(self) -> None:
            import torch

            super().train()
            state = {
                "healed": self.healed_state.state_dict(),
                "manager": self.replica_axis.manager.state_dict(),
                "position": self.batches.position,
            }
            torch.save(state, self._out / f"state_{self._tag}.pt")

    entry.main(trainer_class=DumpingTrainer)


# --- data semantics, without processes ----------------------------------------------------------


class _SliceLoader:
    """A deterministic stateful dataloader over one replica group's slice: sample ids."""

    def __init__(self, replica: int, size: int = 100) -> None:
        self.samples = [1000 * replica + i for i in range(size)]
        self.next_index = 0
        self.reads: list[int] = []

    def __iter__(self) -> _SliceLoader:
        return self

    def __next__(self) -> int:
        sample = self.samples[self.next_index]
        self.next_index += 1
        self.reads.append(sample)
        return sample

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_index = state["next_index"]


def _step(groups: dict[int, Any], participants: list[int], committed: bool, trained: dict) -> None:
    """One step of every live group: read a batch, settle it; record what the model got."""
    batches = {r: next(g) for r, g in groups.items()}
    for r, g in groups.items():
        g.end_step(committed, participants)
        if committed and r in participants:
            trained.setdefault(r, []).append(batches[r])


def test_failure_and_heal_neither_replay_nor_skip_a_groups_samples() -> None:
    """Group 1 dies mid-step 3 (the step is discarded), group 0 trains alone, group 1 restarts
    from scratch and heals from group 0's ledger: each group's samples reach the model exactly
    once, in slice order, across the restart."""
    from torchtitan_ft.titan.data import CommittedBatches

    g0 = CommittedBatches(_SliceLoader(0), 0, 2)
    g1 = CommittedBatches(_SliceLoader(1), 1, 2)
    trained: dict[int, list[int]] = {}
    for _ in range(3):
        _step({0: g0, 1: g1}, [0, 1], True, trained)
    _step({0: g0, 1: g1}, [0, 1], False, trained)  # group 1 killed during the all-reduce
    for _ in range(3):
        _step({0: g0}, [0], True, trained)
    # Group 1 restarts with a fresh reader, receives the ledger with the weights (taken by the
    # donor at the start of the step), contributes zeros this step and trains afterwards.
    g1 = CommittedBatches(_SliceLoader(1), 1, 2)
    ledger = g0.state_dict()
    first = next(g1)
    g1.load_state_dict(ledger)
    second_of_g0 = next(g0)
    g0.end_step(True, [0])
    g1.end_step(True, [0])
    trained[0].append(second_of_g0)
    for _ in range(2):
        _step({0: g0, 1: g1}, [0, 1], True, trained)

    assert trained[0] == list(range(9))  # the discarded step's sample 3 was retried
    assert trained[1] == [1000, 1001, 1002, 1003, 1004]  # no replay of 1000-1002, no gap
    assert first == 1000  # read before the heal, then dropped: the weights already have it
    assert g0.consumed == g1.consumed == [9, 5]
    assert g1.position == 5


def test_discarded_step_retries_its_batches_in_order() -> None:
    from torchtitan_ft.titan.data import CommittedBatches

    g = CommittedBatches(_SliceLoader(0), 0, 1)
    assert [next(g), next(g)] == [0, 1]  # two microbatches
    g.end_step(False, [0])
    assert [next(g), next(g)] == [0, 1]
    g.end_step(True, [0])
    assert next(g) == 2
    assert g.dataloader.reads == [0, 1, 2]


def test_reader_state_resumes_at_the_consumed_batch() -> None:
    """A disk checkpoint taken after a discarded step restarts at the retried batch."""
    from torchtitan_ft.titan.data import CommittedBatches

    g = CommittedBatches(_SliceLoader(0), 0, 1)
    next(g)
    g.end_step(True, [0])
    next(g)
    g.end_step(False, [0])  # batch 1 pending a retry
    state = g.reader_state()
    assert state["position"] == 1

    resumed = CommittedBatches(_SliceLoader(0), 0, 1)
    resumed.load_reader_state(state)
    resumed.load_state_dict({"consumed": [1]})
    assert next(resumed) == 1
    # An older reader file is read forward to the ledger's position.
    older = CommittedBatches(_SliceLoader(0), 0, 1)
    older.load_state_dict({"consumed": [3]})
    assert next(older) == 3


# --- the test ----------------------------------------------------------------------------------


class _Group:
    """One replica group's ``run_train.sh`` (1 rank, this module as TRAIN_FILE), its output
    collected by a thread; ``args`` are passed to the trainer."""

    def __init__(
        self,
        replica: int,
        out: Path,
        lighthouse: str,
        steps: int,
        *args: str,
        dump_folder: Path | None = None,
        ranks: int = 1,
    ) -> None:
        env = {
            **os.environ,
            "NGPU": str(ranks),
            "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            "CONFIG_FILE": str(ROOT / "configs" / "debug_ft_cpu.toml"),
            "TRAIN_FILE": "tests.titan.test_ft_e2e",
            "TORCHFT_LIGHTHOUSE": lighthouse,
            "FT_E2E_OUT": str(out),
            "FT_E2E_ALONE_SLEEP_S": "0.7",
        }
        self.replica, self.out = replica, out
        self.proc = subprocess.Popen(
            [
                str(ROOT / "run_train.sh"),
                "--training.steps",
                str(steps),
                "--job.dump_folder",
                str(dump_folder or out / f"outputs{replica}"),
                f"--fault_tolerance.replica_id={replica}",
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {pattern!r}:\n{self.output[-4000:]}")
            time.sleep(0.1)

    def sigkill(self) -> None:
        """SIGKILL the torchrun agent and its workers (their pids come from the pid files)."""
        workers = [int(p.read_text()) for p in self.out.glob(f"pid_r{self.replica}_rank*")]
        for pid in [self.proc.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        for path in self.out.glob(f"pid_r{self.replica}_rank*"):
            path.unlink()

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.sigkill()
            raise AssertionError(
                f"replica group {self.replica} did not finish:\n{self.output}"
            ) from None
        self._reader.join(timeout=10)
        return self.output


def _assert_identical(a: Any, b: Any, where: str = "") -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def kill_and_restart_group_1(tmp_path: Path, ranks: int, *args: str) -> tuple[list[str], str]:
    """Two replica groups of ``ranks`` ranks train ``STEPS`` steps against a fresh lighthouse;
    group 1 is SIGKILLed once it logged ``KILL_AT_STEP`` and started again. Returns both
    groups' outputs (each run exited 0) and the killed run's output."""
    from torchtitan_ft.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=2000
    )
    groups: list[_Group] = []
    try:
        address = lighthouse.address()
        groups = [_Group(r, tmp_path, address, STEPS, *args, ranks=ranks) for r in range(2)]
        groups[1].wait_for(rf"step:\s*{KILL_AT_STEP}\s+loss", timeout=200)
        groups[1].sigkill()
        killed_output = groups[1].output
        groups[1] = _Group(1, tmp_path, address, STEPS, *args, ranks=ranks)
        outputs = [g.finish(timeout=300) for g in groups]
    finally:
        for group in groups:
            if group.proc.poll() is None:
                group.sigkill()
        lighthouse.shutdown()
    for group, output in zip(groups, outputs, strict=True):
        assert group.proc.returncode == 0, output[-6000:]
    return outputs, killed_output


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", [1, 2], ids=["1rank", "2ranks"])
def test_killed_replica_group_heals_to_identical_state(tmp_path: Path, ranks: int) -> None:
    import torch

    outputs, killed_output = kill_and_restart_group_1(tmp_path, ranks)
    assert "should_commit=False" in outputs[0] or "participants" in outputs[0]
    assert "applied healed state" in outputs[1], outputs[1][-6000:]
    assert re.search(rf"step:\s*{KILL_AT_STEP}\s+loss", killed_output)

    heal = re.search(r"healing to step (\d+)", outputs[1])
    assert heal and int(heal.group(1)) > KILL_AT_STEP, outputs[1][-6000:]

    for rank in range(1, ranks):  # every rank holds its own shards: compare rank by rank
        shards = [torch.load(_dump_path(tmp_path, r, rank), weights_only=False) for r in range(2)]
        _assert_identical(shards[0]["healed"], shards[1]["healed"], f"rank{rank}")
        consumed = shards[0]["healed"]["data"]["consumed"]
        assert [s["position"] for s in shards] == consumed
    states = [torch.load(_dump_path(tmp_path, r, 0), weights_only=False) for r in range(2)]
    for state in states:
        assert state["manager"]["step"] == state["healed"]["train_state"]["step"] == STEPS
    _assert_identical(states[0]["healed"], states[1]["healed"], "state")
    # Data: every committed step consumed one batch of each participant's slice; each group's
    # reader stands exactly at its ledger entry (the restarted group read forward to it).
    consumed = states[0]["healed"]["data"]["consumed"]
    assert [s["position"] for s in states] == consumed
    # One batch per participant per committed step: the ledger adds up to the Manager's count.
    assert sum(consumed) == states[0]["manager"]["batches_committed"]
    assert 0 < consumed[1] < consumed[0] <= STEPS  # group 1 missed the steps it was down


if __name__ == "__main__":
    _worker_main()
