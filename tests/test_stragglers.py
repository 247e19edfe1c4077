"""The straggler report with real replica groups (the MLP harness, a real lighthouse, real
gloo), one group slowed for real by a CPU limit on its process (``testing.cpulimit``).

A group limited to a tenth of a core (its compute several times slower) is reported within
``DETECTION_STEPS`` of its steps, in its own event stream and on the lighthouse; the report
ends once the limit is lifted; the other groups are never reported. A clean run of the same
kind reports nobody (default tier, 2 s beside the other multi-process tests); the slowed run
is in the full tier (``--full``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.lighthouse.exclusion import ExclusionOptions, StragglerPolicy
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank, write_stop_step

pytestmark = pytest.mark.multiprocess

GROUPS = 3
WORK = 60
"""Matrix products per step (``WorkerConfig.work``): some 20 to 60 ms of compute, long enough
that the scheduler's noise on a busy machine does not look like a straggler."""
OPTS = StragglerOptions()  # the defaults: factor 2, 5 steps, a window of 5
DETECTION_STEPS = OPTS.steps + OPTS.window // 2 + 3
"""Steps of the slow group from the limit to its report: ``steps + window // 2`` slow samples
(``lighthouse.stragglers``), plus the step the limit lands in, the step whose request carries
the last sample's timing and the one whose answer brings the report back."""


class Job:
    def __init__(
        self, tmp_path: Path, min_replicas: int = GROUPS, exclusion: ExclusionOptions | None = None
    ) -> None:
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=min_replicas,
            join_timeout_ms=60000,
            stragglers=OPTS,
            exclusion=exclusion,
        )
        self.events = tmp_path / "events"
        self.stop_file = tmp_path / "stop_step"
        self.procs = [
            spawn_rank(
                WorkerConfig(
                    lighthouse_addr=self.lighthouse.address(),
                    replica=i,
                    out_path=str(tmp_path / f"out_{i}.pt"),
                    stop_participants=GROUPS,
                    stop_step_file=str(self.stop_file),
                    max_iterations=1000,
                    events_dir=str(self.events),
                    work=WORK,
                    shared_batches=True,
                )
            )
            for i in range(GROUPS)
        ]

    def step(self, replica: int) -> int:
        commits = [
            e.step
            for e in read_events(self.events)
            if e.kind is EventKind.COMMIT and e.replica_name == f"replica_{replica}"
        ]
        return max(commits, default=0)

    def wait_step(self, replica: int, step: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while self.step(replica) < step:
            assert time.monotonic() < deadline, f"replica_{replica} did not reach step {step}"
            self.check_alive()
            time.sleep(0.1)

    def reports(self) -> list[Any]:
        return [e for e in read_events(self.events) if e.kind is EventKind.STRAGGLER]

    def wait_report(self, straggler: bool, timeout: float = 90.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.reports() if e["straggler"] is straggler]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no straggler={straggler} report in time"
            self.check_alive()
            time.sleep(0.1)

    def wait_event(
        self, kind: EventKind, replica: str, after: Any = None, timeout: float = 90.0
    ) -> Any:
        """The first ``kind`` event of ``replica`` (after the event ``after``, if given)."""
        deadline = time.monotonic() + timeout
        while True:
            events = [e for e in read_events(self.events) if e.replica_name == replica]
            if after is not None:
                events = events[events.index(after) + 1 :]
            found = [e for e in events if e.kind is kind]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no {kind} event of {replica} in time"
            self.check_alive()
            time.sleep(0.1)

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            assert proc.exitcode in (None, 0), f"replica_{i} exited with {proc.exitcode}"

    def stop(self) -> None:
        """Stops every group a few steps on, together."""
        write_stop_step(self.stop_file, max(self.step(i) for i in range(GROUPS)) + 3)
        for i, proc in enumerate(self.procs):
            proc.join(90)
            assert proc.exitcode == 0, f"replica_{i} exit code {proc.exitcode}"

    def reports_started(self) -> int:
        return self.lighthouse.run_in_loop(lambda: self.lighthouse.state.speeds.reports_started)

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.lighthouse.shutdown()


@pytest.mark.slow  # 15 to 25 s; the default tier has the report's logic (lighthouse tests)
@pytest.mark.timeout(300)
def test_a_group_under_a_cpu_limit_is_reported_and_the_report_ends_when_lifted(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path)
    try:
        # Every group's history holds a full window of unlimited steps (the first steps are
        # slow for all: warm-up), so the detection is timed from a steady state.
        job.wait_step(2, OPTS.window + 3)
        limited_at = job.step(2)
        with CpuLimit("straggler_test", [job.procs[2].pid], cpus=0.1):
            started = job.wait_report(straggler=True)
            assert started.replica_name == "replica_2"
            assert started.step - limited_at <= DETECTION_STEPS, (limited_at, started)
            assert started["relative_speed"] < 1 / OPTS.factor
            assert started["since_step"] >= limited_at - 1
        lifted_at = job.step(2)
        ended = job.wait_report(straggler=False)
        assert ended.replica_name == "replica_2"
        assert ended.step - lifted_at <= DETECTION_STEPS, (lifted_at, ended)
        job.stop()
        assert {e.replica_name for e in job.reports()} == {"replica_2"}
        assert job.reports_started() == 1
    finally:
        job.close()


@pytest.mark.timeout(300)
def test_a_clean_run_reports_nobody(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        job.wait_step(0, 30)
        job.stop()
        assert job.reports() == []
        assert job.reports_started() == 0
    finally:
        job.close()


POLICY = ExclusionOptions(StragglerPolicy.EXCLUDE, min_excluded_s=2.0)


@pytest.mark.slow  # 20 to 40 s
@pytest.mark.timeout(300)
def test_under_the_policy_a_limited_group_is_left_out_and_rejoins_healed(
    tmp_path: Path,
) -> None:
    """Under ``--straggler_policy exclude`` (min_replicas 2 of 3 groups): the group under a
    CPU limit is left out, commits nothing while out and the others keep committing; once the
    limit is lifted it is taken back, heals, and every group ends bitwise identical."""
    job = Job(tmp_path, min_replicas=2, exclusion=POLICY)
    try:
        job.wait_step(2, OPTS.window + 3)
        with CpuLimit("straggler_policy_test", [job.procs[2].pid], cpus=0.1):
            job.wait_event(EventKind.EXCLUDED, "replica_2")
            out_at = job.step(0)
            job.wait_step(0, out_at + 10)  # the others keep committing without it
        readmitted = job.wait_event(EventKind.READMITTED, "replica_2")
        events = read_events(job.events)
        excluded = next(e for e in events if e.kind is EventKind.EXCLUDED)
        assert excluded["relative_speed"] < 1 / OPTS.factor
        mine = [e for e in events if e.replica_name == "replica_2"]
        out = mine[mine.index(excluded) : mine.index(readmitted)]
        assert not [e for e in out if e.kind is EventKind.COMMIT]
        assert [e for e in out if e.kind is EventKind.DISCARD]
        heal = job.wait_event(EventKind.HEAL_END, "replica_2", after=readmitted)
        assert heal["outcome"] == "applied"
        job.stop()
        outs = [torch.load(tmp_path / f"out_{i}.pt", weights_only=False) for i in range(GROUPS)]
        for other in outs[1:]:
            assert other["step"] == outs[0]["step"]
            for key, value in outs[0]["model"].items():
                assert torch.equal(value, other["model"][key]), key
        exclusions = job.lighthouse.run_in_loop(lambda: job.lighthouse.state.metrics.exclusions)
        assert exclusions == 1
    finally:
        job.close()
