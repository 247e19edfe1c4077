"""A replica group slowed through its link's bandwidth, over real processes on test hosts
(``testing.netns``): what the straggler report can and cannot see.

Three per-step groups (``benchmarks._semi_sync_worker``: the real Manager, gloo, a 612k-parameter
LM, 2.45 MB of gradients a step) on hosts A, B and C, the lighthouse on host L; C's link is held
to ``LINK_MBIT`` each way (``tc tbf``). Every step's gradient allreduce then moves at C's pace,
and the allreduce holds every group in step: each group's compute, each group's step time and
each group's wait in the allreduce are the same. A link slowdown is the whole job's, not one
group's, and the report (which compares a group's compute time, or would compare its step time,
with the others') cannot name the group behind it. The test checks that: the link did slow
every group (its wait in the allreduce is at least what the link's rate allows), and the
lighthouse reported nobody. See docs/operations.md, "Stragglers" ("A slow link").
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks._semi_sync_worker import ReplicaJob, Setup, StrategySpec
from torchtitan_ft.testing import netns

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        netns.limit_unavailable_reason() is not None,
        reason=f"no test hosts here: {netns.limit_unavailable_reason()}",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
GROUPS = 3
LINK_MBIT = 10.0
STEPS = 15
PORT = 29510


def _read(host: netns.Host, url: str) -> str | None:
    """``url``'s body, fetched from inside ``host``; None when it does not answer (yet)."""
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    out = host.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout if out.returncode == 0 else None


def test_a_link_limited_group_slows_every_group_alike_and_nobody_is_reported(
    tmp_path: Path,
) -> None:
    setup = Setup(steps=STEPS)
    tokens = torch.randint(0, setup.vocab, (STEPS, GROUPS, setup.batch, setup.seq_len + 1))
    torch.save({"train": tokens, "validation": tokens[0, 0]}, tmp_path / "data.pt")
    with netns.HostNetwork(["L", "A", "B", "C"]) as net:
        lighthouse = net["L"]
        with (tmp_path / "lighthouse.log").open("w") as log:
            lighthouse.popen(
                [
                    *(sys.executable, "-m", "torchtitan_ft.lighthouse.cli"),
                    *("--bind", f"{lighthouse.address}:{PORT}", "--min_replicas", str(GROUPS)),
                    *("--status_bind", f"{lighthouse.address}:{PORT + 1}"),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        net["C"].limit(LINK_MBIT)
        procs = []
        for r, name in enumerate(["A", "B", "C"]):
            job = ReplicaJob(
                replica=r,
                replica_groups=GROUPS,
                lighthouse=f"http://{lighthouse.address}:{PORT}",
                setup=setup,
                strategy=StrategySpec("per_step"),
                data_path=str(tmp_path / "data.pt"),
                out_path=str(tmp_path / f"out_{r}.json"),
                threads=1,
                timeout_s=120,
                host=net[name].address,
            )
            (tmp_path / f"{r}.pickle").write_bytes(pickle.dumps(job))
            with (tmp_path / f"{r}.log").open("w") as log:
                command = [sys.executable, "-m", "benchmarks._semi_sync_worker"]
                procs.append(
                    net[name].popen(
                        [*command, str(tmp_path / f"{r}.pickle")],
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        # While they train: the lighthouse's judged speeds (a group appears once it has a
        # window of compute times, and is forgotten when it leaves).
        judged: dict[str, float] = {}
        deadline = time.monotonic() + 480
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            metrics = _read(lighthouse, f"http://{lighthouse.address}:{PORT + 1}/metrics")
            for line in (metrics or "").splitlines():
                if line.startswith("torchft_lighthouse_relative_speed{"):
                    judged[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
            time.sleep(5)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        logs = {r: (tmp_path / f"{r}.log").read_text()[-2000:] for r in range(GROUPS)}
        assert [p.returncode for p in procs] == [0] * GROUPS, logs
        metrics = _read(lighthouse, f"http://{lighthouse.address}:{PORT + 1}/metrics")
    assert metrics is not None, "the lighthouse's /metrics did not answer"
    assert len(judged) == GROUPS and all(v > 0 for v in judged.values()), judged
    reports = [
        line for line in metrics.splitlines() if line.startswith("torchft_lighthouse_straggler_")
    ]
    assert "torchft_lighthouse_straggler_reports_total 0" in reports, (reports, judged)
    results = [json.loads((tmp_path / f"out_{r}.json").read_text()) for r in range(GROUPS)]
    # Each step's allreduce moves 2 (N-1)/N of the gradients' bytes through C's link each way.
    gradient_bytes = 4 * results[0]["parameters"]
    floor_s = 2 * (GROUPS - 1) / GROUPS * gradient_bytes * 8 / (LINK_MBIT * 1e6)
    for r, result in enumerate(results):
        waited = result["phase_seconds"]["before_step"] / result["steady_steps"]
        assert waited >= 0.8 * floor_s, (r, waited, floor_s, logs[r])
