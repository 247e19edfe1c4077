"""Step timings: what a rank measures, and how its group's ranks' timings merge."""

from __future__ import annotations

from torchtitan_ft.manager.steptimes import (
    StepTimer,
    group_progress,
    slowest_per_step,
    with_link_probes,
)
from torchtitan_ft.proto import torchft_pb2 as pb


def test_step_and_compute_times_from_quorum_to_first_collective() -> None:
    timer = StepTimer()
    assert timer.start(step=0, now=10.0) is None  # nothing to report before the first step
    timer.collective(now=10.5)
    timer.collective(now=10.9)  # only the first collective of a step counts
    progress = timer.start(step=1, now=11.0)
    assert list(progress.steps) == [pb.StepTiming(step=0, step_seconds=1.0, compute_seconds=0.5)]
    # A step without a collective (a spare): step time only.
    progress = timer.start(step=1, now=13.0)
    assert list(progress.steps) == [pb.StepTiming(step=1, step_seconds=2.0, compute_seconds=0.0)]


def test_group_is_as_slow_as_its_slowest_rank() -> None:
    def rank(*timings: tuple[int, float, float]) -> pb.GroupProgress:
        return pb.GroupProgress(
            steps=[pb.StepTiming(step=s, step_seconds=w, compute_seconds=c) for s, w, c in timings]
        )

    merged = slowest_per_step([rank((4, 1.0, 0.2)), None, rank((3, 0.5, 0.1), (4, 0.9, 0.6))])
    assert [(t.step, t.step_seconds, t.compute_seconds) for t in merged.steps] == [
        (3, 0.5, 0.1),
        (4, 1.0, 0.6),
    ]
    assert slowest_per_step([None, None]) is None


def test_group_progress_merges_counts_and_heals_of_the_ranks() -> None:
    def heal(to_step: int, nbytes: int, seconds: float, outcome: str) -> pb.HealReport:
        return pb.HealReport(
            to_step=to_step, source_address="http://d:1", bytes=nbytes, seconds=seconds,
            outcome=outcome,
        )  # fmt: skip

    rank0 = pb.GroupProgress(
        batches_committed=10, discarded_steps=1, heals=[heal(7, 100, 0.5, "applied")]
    )
    rank1 = pb.GroupProgress(
        batches_committed=12, discarded_steps=2, heals=[heal(7, 50, 0.8, "not_applied")]
    )
    merged = group_progress([rank0, None, rank1])
    assert (merged.batches_committed, merged.discarded_steps) == (12, 2)
    assert list(merged.heals) == [heal(7, 150, 0.8, "not_applied")]
    assert group_progress([None]) is None


def test_link_probes_join_the_ranks_progress_or_make_one_of_their_own() -> None:
    probe = pb.LinkProbeResult(seq=1, bytes=2048, seconds=0.01)
    timed = pb.GroupProgress(steps=[pb.StepTiming(step=3, step_seconds=1.0)])
    assert with_link_probes(timed, []) is timed
    assert list(with_link_probes(timed, [probe]).link_probes) == [probe]
    assert with_link_probes(None, []) is None
    assert with_link_probes(None, [probe]) == pb.GroupProgress(link_probes=[probe])


def test_group_progress_sends_samples_only_when_a_rank_has_them() -> None:
    with_samples = pb.GroupProgress(batches_committed=4, samples_committed=32)
    merged = group_progress([pb.GroupProgress(batches_committed=4), with_samples])
    assert merged.HasField("samples_committed") and merged.samples_committed == 32
    merged = group_progress([pb.GroupProgress(batches_committed=4)])
    assert not merged.HasField("samples_committed")  # the page then shows batches


def test_a_groups_heal_started_when_its_first_rank_started() -> None:
    def rank(started: float) -> pb.GroupProgress:
        return pb.GroupProgress(heals=[pb.HealReport(to_step=7, bytes=10, started=started)])

    for ranks in ([0.0, 105.0, 100.0], [105.0, 0.0, 100.0]):  # 0: a rank that sent none
        merged = group_progress([rank(started) for started in ranks])
        assert (merged.heals[0].started, merged.heals[0].bytes) == (100.0, 30)


def test_group_progress_carries_the_launcher_job_a_rank_sent() -> None:
    said = pb.GroupProgress(launcher_job="slurm:17")
    assert group_progress([pb.GroupProgress(), None, said]).launcher_job == "slurm:17"
    assert group_progress([pb.GroupProgress()]).launcher_job == ""  # none said
