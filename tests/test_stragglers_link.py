"""A replica group held back by its own slow link, over real processes on test hosts
(``testing.netns``): reported for its link, left out under the policy, taken back once the
link is fast again.

Three MLP groups (``testing.mlp``, a hidden layer of ``HIDDEN``: 344 kB of gradients a step)
on hosts A, B and C, the lighthouse on host L. C's link is held to ``LINK_MBIT`` each way
(``tc tbf``) from a steady state on. The all-reduce then moves at C's pace and holds every
group to it, so the groups' step and compute times are all alike and cannot name C; C's link
probes (``manager.linkprobe``: ``PROBE_BYTES`` each way to the lighthouse, at every quorum) can.
Under ``--straggler_policy exclude`` (min_replicas 2) C is left out and A and B go on without
it; when the limit is lifted its probes are fast again, it is taken back, heals, and all three
end bitwise identical. A clean run of the same kind reports and leaves out nobody.
Everything is read from the groups' event streams and the lighthouse's ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.events import EventKind, read_events
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.testing import netns
from torchtitan_ft.testing.mlp import WorkerConfig

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        netns.limit_unavailable_reason() is not None,
        reason=f"no test hosts here: {netns.limit_unavailable_reason()}",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
GROUPS = 3
HOSTS = ["A", "B", "C"]
LINK_MBIT = 10.0
HIDDEN = 4096
WORK = 60
"""Matrix products per step (``WorkerConfig.work``), as in ``tests/test_stragglers.py``: some
20 to 60 ms of compute, so that the scheduler's noise does not make a compute straggler (with
none, a step's compute is a millisecond, and one busy moment is a 3x slowdown)."""
COMPUTE_STEPS = 50
"""The compute report's ``--straggler_steps``: this test is about links, and at tens of
milliseconds a step the busy machine starves one group for 5 steps now and then: at the
default of 5, a healthy group was reported for its compute in 3 of the first 9 runs (the one
kept: 0.20x for 5 steps, at load 20); see performance.md, "Stragglers"."""
PROBE_BYTES = 128 * 1024
PORT = 29510
OPTS = StragglerOptions()  # the link thresholds at their defaults: 4x, 3 probes, window 5
DETECTION_STEPS = 2 * (OPTS.link_probes + OPTS.link_window // 2) + 3
"""Steps of the slow group from the limit to its report: ``link_probes + link_window // 2``
slow probes (``lighthouse.stragglers``), at most one per quorum but up to two steps apart (a
probe of the limited link takes about as long as a limited step, and the next starts only at
the quorum after it ends), plus the step the limit lands in, the step whose request carries the
last probe and the one whose answer brings the report back."""


class Job:
    """The lighthouse on L and one MLP group on each of A, B and C."""

    def __init__(self, net: netns.HostNetwork, tmp_path: Path) -> None:
        self.net, self.tmp_path = net, tmp_path
        self.events = tmp_path / "events"
        self.stop_file = tmp_path / "stop_step"
        lighthouse = net["L"]
        self.status = f"http://{lighthouse.address}:{PORT + 1}"
        with (tmp_path / "lighthouse.log").open("w") as log:
            lighthouse.popen(
                [
                    *(sys.executable, "-m", "torchtitan_ft.lighthouse.cli"),
                    *("--bind", f"{lighthouse.address}:{PORT}", "--min_replicas", "2"),
                    *("--status_bind", f"{lighthouse.address}:{PORT + 1}"),
                    *("--straggler_policy", "exclude", "--straggler_min_excluded_ms", "2000"),
                    *("--straggler_steps", str(COMPUTE_STEPS)),
                    *("--straggler_link_probe_bytes", str(PROBE_BYTES)),
                    *("--straggler_link_probe_interval_ms", "0"),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs = []
        for i, name in enumerate(HOSTS):
            cfg = WorkerConfig(
                lighthouse_addr=f"http://{lighthouse.address}:{PORT}",
                replica=i,
                out_path=str(tmp_path / f"out_{i}.pt"),
                stop_participants=GROUPS,
                stop_step_file=str(self.stop_file),
                max_iterations=100_000,
                events_dir=str(self.events),
                shared_batches=True,
                timeout_s=30.0,
                host=net[name].address,
                hidden=HIDDEN,
                work=WORK,
            )
            with (tmp_path / f"{i}.log").open("w") as log:
                self.procs.append(
                    net[name].popen(
                        [
                            *(sys.executable, "-m", "torchtitan_ft.testing.mlp_rank"),
                            json.dumps(dataclasses.asdict(cfg)),
                        ],
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}:\n{f.read_text()[-1500:]}" for f in sorted(self.tmp_path.glob("*.log"))
        )

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            assert proc.poll() in (None, 0), f"replica_{i} exited with {proc.poll()}\n{self.logs()}"

    def step(self, replica: int) -> int:
        commits = [
            e.step
            for e in read_events(self.events)
            if e.kind is EventKind.COMMIT and e.replica_name == f"replica_{replica}"
        ]
        return max(commits, default=0)

    def wait_step(self, replica: int, step: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.step(replica) < step:
            assert time.monotonic() < deadline, (
                f"replica_{replica} did not reach step {step}\n{self.logs()}"
            )
            self.check_alive()
            time.sleep(0.2)

    def wait_event(self, kind: EventKind, replica: str, timeout: float = 120.0, **fields) -> Any:
        """The first ``kind`` event of ``replica`` whose fields have the values given."""
        deadline = time.monotonic() + timeout
        while True:
            for e in read_events(self.events):
                mine = e.kind is kind and e.replica_name == replica
                if mine and all(e[k] == v for k, v in fields.items()):
                    return e
            assert time.monotonic() < deadline, f"no {kind} {fields} of {replica}\n{self.logs()}"
            self.check_alive()
            time.sleep(0.2)

    def metrics(self) -> dict[str, str]:
        """The lighthouse's /metrics, by series (a group's ids without their ``:uuid``)."""
        url = self.status + "/metrics"
        code = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
        out = self.net["L"].run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        values = {}
        for line in out.stdout.splitlines():
            if line and line[0] != "#":
                series, value = line.rsplit(" ", 1)
                values[re.sub(r':[^"]*"', '"', series)] = value
        return values

    def stop(self) -> list[dict]:
        """Stops every group a few steps on, together; their final states."""
        # Whole or not at all: the groups read it every step.
        written = self.stop_file.with_suffix(".tmp")
        written.write_text(str(max(self.step(i) for i in range(GROUPS)) + 3))
        written.replace(self.stop_file)
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"replica_{i} did not stop\n{self.logs()}") from None
            assert proc.returncode == 0, f"replica_{i} exit code {proc.returncode}\n{self.logs()}"
        return [
            torch.load(self.tmp_path / f"out_{i}.pt", weights_only=False) for i in range(GROUPS)
        ]


def _assert_identical(outs: list[dict]) -> None:
    for other in outs[1:]:
        assert other["step"] == outs[0]["step"]
        for key, value in outs[0]["model"].items():
            assert torch.equal(value, other["model"][key]), key


def test_a_group_behind_a_slow_link_is_reported_left_out_and_taken_back(tmp_path: Path) -> None:
    with netns.HostNetwork(["L", *HOSTS]) as net:
        job = Job(net, tmp_path)
        # Steady state first: every group has a full window of probes of its fast link.
        job.wait_step(2, 2 * OPTS.link_window + 3)
        limited_at = job.step(2)
        net["C"].limit(LINK_MBIT)
        started = job.wait_event(EventKind.STRAGGLER, "replica_2", straggler=True)
        assert started["cause"] == "link", started
        assert started.step - limited_at <= DETECTION_STEPS, (limited_at, started.step)
        assert 0 < started["link_relative_speed"] < 1 / OPTS.link_factor
        job.wait_event(EventKind.EXCLUDED, "replica_2")
        out_at = job.step(0)
        job.wait_step(0, out_at + 10)  # the others go on without it
        values = job.metrics()
        assert values['torchft_lighthouse_excluded{replica_id="replica_2"}'] == "1"
        assert values['torchft_lighthouse_link_straggler{replica_id="replica_2"}'] == "1"
        lifted_at = job.step(2)
        net["C"].limit(None)
        readmitted = job.wait_event(EventKind.READMITTED, "replica_2")
        ended = job.wait_event(EventKind.STRAGGLER, "replica_2", straggler=False)
        print(
            json.dumps(
                {
                    "limited_at": limited_at,
                    "detected_at": started.step,
                    "out_at": out_at,
                    "lifted_at": lifted_at,
                    "ended_at": ended.step,
                    "readmitted_at": readmitted.step,
                }
            )
        )
        job.wait_event(EventKind.HEAL_END, "replica_2", outcome="applied")
        outs = job.stop()
        _assert_identical(outs)
        reports = [e for e in read_events(job.events) if e.kind is EventKind.STRAGGLER]
        assert {e.replica_name for e in reports} == {"replica_2"}
        values = job.metrics()
        assert values["torchft_lighthouse_straggler_exclusions_total"] == "1"
        assert values["torchft_lighthouse_straggler_reports_total"] == "1"


def test_a_clean_run_on_test_hosts_reports_and_leaves_out_nobody(tmp_path: Path) -> None:
    with netns.HostNetwork(["L", *HOSTS]) as net:
        job = Job(net, tmp_path)
        job.wait_step(2, 2 * OPTS.link_window + 3)
        job.wait_step(0, job.step(0) + 40)
        values = job.metrics()
        outs = job.stop()
        _assert_identical(outs)
        assert [e for e in read_events(job.events) if e.kind is EventKind.STRAGGLER] == []
        assert values["torchft_lighthouse_straggler_reports_total"] == "0"
        assert values["torchft_lighthouse_straggler_exclusions_total"] == "0"
        judged = [k for k in values if k.startswith("torchft_lighthouse_link_relative_speed{")]
        assert len(judged) == GROUPS and all(float(values[k]) > 0 for k in judged), values
