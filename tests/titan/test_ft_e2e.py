"""End to end on CPU: a replica group is SIGKILLed mid-run, restarts, heals from the live peer.

A lighthouse (in this process) and 2 replica groups of 1 or 2 ranks train the llama3 debugmodel
(small shape) with FT through ``run_train.sh`` / torchrun, per-step or with DiLoCo. Replica
group 1 is SIGKILLed (its torchrun agent *and* its workers) mid-run; group 0 keeps committing
alone; group 1 is started again, heals from group 0 and both finish the run. At exit each rank
dumps its healed state (model, optimizer, lr scheduler, train state, data ledger), the Manager's
state, its reader position and the sync strategy's state (the runs' ``TRAIN_FILE`` is
:mod:`torchtitan_ft.testing.titan_dump`, whose environment variables are set here); the test
checks that both groups hold the same state, rank by rank, and that the healed job steps as
fast as before the kill.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_dump import dump_path, ready_path
from torchtitan_ft.testing.titan_jobs import (
    TrainRun,
    assert_identical,
    finish_all,
    ft_env,
    lighthouse,
    logged_scalars,
    median_ratio,
    step_durations,
)

STEPS = 30
KILL_AT_STEP = 8
"""Group 1 is killed once it has logged this trainer step (later if it started late: see
:func:`kill_and_restart_group_1`)."""
STEPS_BEFORE_KILL = 5
"""Step times of group 1 before the kill that the recovery-speed check compares against."""
MAX_ALONE = 6
RECOVERY_SLOWDOWN_LIMIT = 2.5
"""The healed job's median step time may be at most this times its median before the kill. What
it catches is a group that never gets its speed back (a heal or a thread every step); beside a
busy process on 2 cores, with the suite's other worker running, the median moved by up to 1.64x
(stop 28) and 2.005x in both groups alike (stop 30) between the two windows with nothing wrong,
and 3 runs of the test alone beside a busy process then passed at 2.0. A slowdown of under 2.5x
that stays after a heal goes unseen here."""
E2E_TIMEOUT_S = 420


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
    from torchtitan_ft.titan.training_data import CommittedBatches

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
    from torchtitan_ft.titan.training_data import CommittedBatches

    g = CommittedBatches(_SliceLoader(0), 0, 1)
    assert [next(g), next(g)] == [0, 1]  # two microbatches
    g.end_step(False, [0])
    assert [next(g), next(g)] == [0, 1]
    g.end_step(True, [0])
    assert next(g) == 2
    assert g.dataloader.reads == [0, 1, 2]


def test_skip_left_out_drops_the_batches_and_the_ledger_counts_them_as_skipped() -> None:
    """fault_tolerance.numerics = "torchtitan_ft_trainer": a group left out of a committed step
    (healing) skips its batch as TorchTitan's FT trainer does; it reports the skip in its next
    participating step (not in a discarded one), and every group's ledger then counts it as
    consumed and skipped. A restart heals the ledger and skips again; each sample is trained
    or skipped exactly once."""
    from torchtitan_ft.titan.training_data import CommittedBatches

    def step(groups: dict, participants: list[int], committed: bool) -> dict[int, int]:
        batches = {r: next(g) for r, g in groups.items()}
        reported = [0, 0]
        for r in participants:
            reported[r] = groups[r].skips_to_report()
        skipped = {r: g.end_step(committed, participants, reported) for r, g in groups.items()}
        for r in groups:
            if committed and r in participants:
                trained.append(batches[r])
            elif skipped[r]:
                dropped.append(batches[r])
        return skipped

    trained: list[int] = []
    dropped: list[int] = []
    g0 = CommittedBatches(_SliceLoader(0), 0, 2, skip_left_out=True)
    g1 = CommittedBatches(_SliceLoader(1), 1, 2, skip_left_out=True)
    assert step({0: g0, 1: g1}, [0], True) == {0: 0, 1: 1}  # group 1 heals in step 1
    assert g1.skips_to_report() == 1 and g0.consumed == g1.consumed == [1, 0]
    step({0: g0, 1: g1}, [0, 1], False)  # discarded: the report does not count
    assert g1.skips_to_report() == 1 and g0.consumed == [1, 0]
    step({0: g0, 1: g1}, [0, 1], True)
    assert g0.consumed == g1.consumed == [2, 2]
    assert g0.skipped == g1.skipped == [0, 1] and g1.skips_to_report() == 0
    # Group 1 restarts and heals from group 0's ledger in the step it rejoins: skips again.
    g1 = CommittedBatches(_SliceLoader(1), 1, 2, skip_left_out=True)
    ledger = g0.state_dict()
    batches = {0: next(g0), 1: next(g1)}
    g1.load_state_dict(ledger)
    assert g0.end_step(True, [0], [0, 0]) == 0 and g1.end_step(True, [0], [0, 0]) == 1
    trained.append(batches[0])
    dropped.append(batches[1])
    step({0: g0, 1: g1}, [0, 1], True)
    assert g0.consumed == g1.consumed == [4, 4] and g0.skipped == g1.skipped == [0, 2]
    assert step({0: g0, 1: g1}, [0, 1], True) == {0: 0, 1: 0}
    # Group 1's slice: 1000 and 1002 skipped (the restart read 1000 before its heal; the
    # ledger counts it as its next batch, 1002), the others trained once, in order.
    assert [s for s in trained if s >= 1000] == [1001, 1003, 1004]
    assert [s for s in trained if s < 1000] == [0, 1, 2, 3, 4] and g1.position == 5
    assert g0.consumed == [5, 5] and g0.skipped == [0, 2]


def test_without_skip_left_out_a_left_out_group_retries_its_batch() -> None:
    from torchtitan_ft.titan.training_data import CommittedBatches

    g = CommittedBatches(_SliceLoader(1), 1, 2)
    first = next(g)
    assert g.end_step(True, [0], [0, 0]) == 0 and g.skips_to_report() == 0
    assert next(g) == first and g.skipped == [0, 0]


def test_reader_state_resumes_at_the_consumed_batch() -> None:
    """A disk checkpoint taken after a discarded step restarts at the retried batch."""
    from torchtitan_ft.titan.training_data import CommittedBatches

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


class KilledAndHealed:
    """The runs of :func:`kill_and_restart_group_1`: group 0, group 1 as it was killed, and
    group 1 restarted; all runs but the killed one exited 0."""

    def __init__(
        self, survivor: TrainRun, killed: TrainRun, restarted: TrainRun, before: range
    ) -> None:
        self.survivor, self.killed, self.restarted = survivor, killed, restarted
        self.before = before
        """Trainer steps both groups trained together before the kill (their step times are
        the baseline of :meth:`recovery_slowdown`)."""
        self.outputs = [survivor.output, restarted.output]

    @property
    def healed_to(self) -> int:
        """The Manager step group 1 healed to (for DiLoCo: syncs committed)."""
        heals = self.restarted.events(EventKind.HEAL_START)
        assert heals, "the restarted group never healed"
        return int(heals[0]["to_step"])

    def assert_healed_and_survived(self) -> None:
        """The restarted group applied a healed state; the survivor committed steps."""
        outcomes = [e["outcome"] for e in self.restarted.events(EventKind.HEAL_END)]
        assert "applied" in outcomes, f"the restarted group's heals ended {outcomes}"
        assert self.survivor.events(EventKind.COMMIT), "the survivor committed no step"

    def recovery_slowdown(self) -> dict[str, float]:
        """Per group, its median step time once both groups train again after the heal ÷ its
        median before the kill. Before: :attr:`before` (from two steps past group 1's first
        step: that step heals, with init_sync, and sleeps, and the next one's time includes
        that sleep). After: from two steps past the restarted group's first step (with an async
        quorum that step heals and contributes zeros, so the survivor trains alone in it and
        sleeps)."""
        restarted_steps = self.restarted.step_lines()
        assert restarted_steps, "the restarted group logged no step"
        first_after = restarted_steps[0][0] + 2
        first, last = self.before[0], self.before[-1]
        before = {
            "group 0": step_durations(self.survivor, first, last),
            "group 1": step_durations(self.killed, first, last),
        }
        after = {
            "group 0": step_durations(self.survivor, first_after, STEPS),
            "group 1": step_durations(self.restarted, first_after, STEPS),
        }
        return {group: median_ratio(after[group], before[group]) for group in before}

    def assert_recovers_its_speed(self) -> None:
        slowdown = self.recovery_slowdown()
        assert max(slowdown.values()) <= RECOVERY_SLOWDOWN_LIMIT, (
            f"median step time after the heal / before the kill: {slowdown} (limit "
            f"{RECOVERY_SLOWDOWN_LIMIT}); step lines survivor {self.survivor.step_lines()}, "
            f"killed {self.killed.step_lines()}, restarted {self.restarted.step_lines()}"
        )


def kill_and_restart_group_1(
    tmp_path: Path,
    ranks: int,
    *args: str,
    config: str = "debug_ft_cpu.toml",
    config_env: dict[str, str] | None = None,
) -> KilledAndHealed:
    """Two replica groups of ``ranks`` ranks train ``STEPS`` steps of ``config`` against a fresh
    lighthouse; group 1 is SIGKILLed once it logged ``KILL_AT_STEP`` (and ``STEPS_BEFORE_KILL``
    steps past the later of the two groups' first steps) and started again. ``config_env``
    names the config instead of ``config`` (TorchTitan 0.3.0: ``MODULE`` and ``CONFIG``, the FT
    fields in ``args``)."""

    def group(replica: int, address: str) -> TrainRun:
        return TrainRun(
            f"replica group {replica}",
            STEPS,
            tmp_path / f"outputs{replica}",
            f"--fault_tolerance.replica_id={replica}",
            *args,
            ngpu=ranks,
            env=ft_env(
                config,
                address,
                TRAIN_FILE="torchtitan_ft.testing.titan_dump",
                FT_E2E_OUT=str(tmp_path),
                FT_E2E_ALONE_SLEEP_S="0.7",
                FT_E2E_MAX_ALONE=str(MAX_ALONE),
            )
            if config_env is None
            else {
                **config_env,
                "TORCHFT_LIGHTHOUSE": address,
                "TRAIN_FILE": "torchtitan_ft.testing.titan_dump",
                "FT_E2E_OUT": str(tmp_path),
                "FT_E2E_ALONE_SLEEP_S": "0.7",
                "FT_E2E_MAX_ALONE": str(MAX_ALONE),
            },
        )

    with lighthouse(min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=2000) as address:
        survivor, killed = group(0, address), group(1, address)
        killed.wait_for(rf"step:\s*{KILL_AT_STEP}\s+loss")
        survivor.wait_for(r"\[rank0\]:.*step:\s*\d+\s+loss")
        # On a busy machine either group may start late and heal into a later step (with
        # DiLoCo, to the last sync): both then train STEPS_BEFORE_KILL steps together before
        # the kill (the steps before the kill are the baseline of recovery_slowdown).
        first = max(killed.step_lines()[0][0], survivor.step_lines()[0][0]) + 2
        kill_at = max(KILL_AT_STEP, first + STEPS_BEFORE_KILL)
        killed.wait_for(rf"step:\s*{kill_at}\s+loss")
        killed.sigkill()
        killed.name = "replica group 1 (killed)"
        for rank in range(ranks):
            ready_path(tmp_path, 1, rank).unlink(missing_ok=True)
        restarted = group(1, address)
        restarted.name = "replica group 1 (restarted)"
        finish_all([survivor, restarted])
    return KilledAndHealed(survivor, killed, restarted, range(first, kill_at))


def _load_states(tmp_path: Path, rank: int) -> list[dict]:
    import torch

    return [torch.load(dump_path(tmp_path, r, rank), weights_only=False) for r in range(2)]


def assert_groups_identical(tmp_path: Path, ranks: int) -> None:
    """Both groups end at ``STEPS`` with bitwise-identical healed state and model state dict
    (what a checkpoint saves: a parameter the heal left out differs there), rank by rank, each
    group's reader at its ledger entry, the ledger adding up to the Manager's count."""
    for rank in range(ranks):  # every rank holds its own shards: compare rank by rank
        states = _load_states(tmp_path, rank)
        for state in states:
            assert state["manager"]["step"] == state["healed"]["train_state"]["step"] == STEPS
        assert_identical(states[0]["healed"], states[1]["healed"], f"rank{rank}")
        assert_identical(states[0]["model"], states[1]["model"], f"rank{rank} model")
        # Every committed step consumed one batch of each participant's slice; each group's
        # reader stands exactly at its ledger entry (the restarted group read forward to it).
        # With fault_tolerance.numerics = "torchtitan_ft_trainer", the ledger also counts the
        # batches skipped by request (``skipped``, zeros otherwise).
        ledger = states[0]["healed"]["data"]
        consumed, skipped = ledger["consumed"], ledger["skipped"]
        assert [s["position"] for s in states] == consumed
        trained = sum(consumed) - sum(skipped)
        assert trained == states[0]["manager"]["batches_committed"]
        # Group 1 missed the steps it was down. Group 0 may have missed as many at the start:
        # with min_replicas 1 the group that starts first trains alone until the other joins.
        assert 0 < consumed[1] < STEPS and 0 < consumed[0] <= STEPS, consumed


@pytest.mark.slow  # the default tier: tests/titan/test_pg_heal.py (2 ranks), titan030's 1 rank
@pytest.mark.multiprocess
@pytest.mark.step_timing
@pytest.mark.timeout(E2E_TIMEOUT_S)
@pytest.mark.parametrize("ranks", [1, 2], ids=["1rank", "2ranks"])
def test_killed_replica_group_heals_to_identical_state(tmp_path: Path, ranks: int) -> None:
    job = kill_and_restart_group_1(tmp_path, ranks, "--metrics.enable_tensorboard")
    job.assert_healed_and_survived()
    assert job.healed_to > KILL_AT_STEP
    assert_groups_identical(tmp_path, ranks)
    assert_job_loss_logged_per_commit(tmp_path, job)
    job.assert_recovers_its_speed()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_kill_and_heal_with_torchtitan_ft_trainer_numerics(tmp_path: Path) -> None:
    """fault_tolerance.numerics = "torchtitan_ft_trainer" through a kill and a heal: the
    restarted group skips the batch of the step it heals in (the ledger of both groups counts
    it as skipped), both groups end identical, and every committed step is logged once."""
    job = kill_and_restart_group_1(
        tmp_path,
        1,
        "--metrics.enable_tensorboard",
        "--fault_tolerance.numerics=torchtitan_ft_trainer",
    )
    job.assert_healed_and_survived()
    assert_groups_identical(tmp_path, 1)
    ledger = _load_states(tmp_path, 0)[0]["healed"]["data"]
    assert ledger["skipped"][0] == 0 and ledger["skipped"][1] >= 1, ledger
    assert_job_loss_logged_per_commit(tmp_path, job)


def assert_job_loss_logged_per_commit(tmp_path: Path, job: KilledAndHealed) -> None:
    """Through the kill and the heal, each group logged the job-level loss once for every
    step it committed and for no other; where both groups logged a step, the same value."""
    assert_loss_logged_per_commit(
        (tmp_path / "outputs0", tmp_path / "outputs1"),
        [e.step for e in job.survivor.events(EventKind.COMMIT)],
        {e.step for e in job.killed.events(EventKind.COMMIT)},
        {e.step for e in job.restarted.events(EventKind.COMMIT)},
    )


def assert_loss_logged_per_commit(
    dump_folders: tuple[Path, Path], survivor: list[int], killed: set[int], restarted: set[int]
) -> None:
    """What :func:`assert_job_loss_logged_per_commit` checks, from the two groups' dump
    folders (one folder for both where they share it) and the steps each run committed:
    group 0's ``survivor`` run, group 1's ``killed`` and ``restarted`` runs."""
    tag = "loss_metrics/global_avg_loss"
    logged = dict(logged_scalars(dump_folders[0], 0, tag))
    assert sorted(logged) == survivor
    # From its first commit on, every step (a group that started late healed into the job
    # and committed from the step after).
    assert survivor == list(range(survivor[0], STEPS + 1)) and survivor[0] <= KILL_AT_STEP
    # Group 1: the restarted run logged all its commits; the killed run at most its own (a
    # SIGKILL may lose TensorBoard's unflushed tail).
    group1 = logged_scalars(dump_folders[1], 1, tag)
    steps = [step for step, _ in group1]
    assert len(steps) == len(set(steps)) and restarted <= set(steps) <= restarted | killed
    both = [(step, value) for step, value in group1 if step in logged]
    assert len(both) >= len(restarted)  # not just the steps before one of them started
    for step, value in both:
        assert value == pytest.approx(logged[step], rel=1e-6), step


DILOCO = (
    "--fault_tolerance.num_fragments=1",
    "--fault_tolerance.fragment_sync_delay=0",
    "--fault_tolerance.sync_steps=3",
)


@pytest.mark.slow  # the default tier: test_pg_heal.py + test_diloco_multiprocess.py
@pytest.mark.multiprocess
@pytest.mark.step_timing
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_killed_diloco_group_heals_to_the_global_model(tmp_path: Path) -> None:
    """DiLoCo (sync every 3 steps, one fragment): the restarted group heals at a sync point
    from the survivor, with the strategy's global parameters and outer-optimizer state, and
    after the last sync (step 30) both groups hold the same model and strategy state. Each
    group's inner optimizer trained on its own data, so it is not compared."""
    job = kill_and_restart_group_1(tmp_path, 1, *DILOCO, config="debug_ft_diloco_cpu.toml")
    job.assert_healed_and_survived()
    assert job.healed_to > 0
    states = _load_states(tmp_path, 0)
    for state in states:
        assert state["healed"]["train_state"]["step"] == STEPS
    assert_identical(states[0]["healed"]["model"], states[1]["healed"]["model"], "model")
    assert_identical(states[0]["strategy"], states[1]["strategy"], "strategy")
    assert states[0]["manager"] == states[1]["manager"]
    job.assert_recovers_its_speed()
