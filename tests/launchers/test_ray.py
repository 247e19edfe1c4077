"""Ray Train's own torchft backend (Ray 2.60's ``TorchftConfig``) over the torchft compatibility
package: a one-node Ray cluster on 127.0.0.1, two replica groups (Ray workers), one SIGKILLed
and replaced alone by Ray, the other training on meanwhile, both ending with the same
parameters (``tests/launchers/_ray_job.py``). Runs in Ray's venv (scripts/install_ray.sh, which
``./run_tests.sh --full`` runs), as a child process: the suite's venvs have no Ray."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from torchtitan_ft.testing.processes import ROOT

RAY_PYTHON = ROOT / ".cache" / "ray" / "venv" / "bin" / "python"


def _ray_missing() -> str | None:
    if not RAY_PYTHON.exists():
        return "Ray's venv is missing: run scripts/install_ray.sh (./run_tests.sh --full runs it)"
    found = subprocess.run(
        [str(RAY_PYTHON), "-c", "import ray.train.v2.torch.torchft_config"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        return f"Ray's venv has no Ray Train torchft backend: {found.stderr.strip()[-300:]}"
    return None


@pytest.mark.slow  # Ray's cluster, workers and replacement: 5-10 min on a loaded 2-core machine
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_ray_replaces_a_killed_replica_group_alone_and_the_groups_end_identical(
    tmp_path: Path,
) -> None:
    missing = _ray_missing()
    if missing:
        pytest.skip(missing)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "compat")]),
        "GLOO_SOCKET_IFNAME": "lo",
        # Ray on loopback only, no usage stats, no token file under ~/.ray.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    run = subprocess.run(
        [str(RAY_PYTHON), "-m", "tests.launchers._ray_job", f"--out={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,  # then SIGKILL: the Ray cluster ends with it (_ray_job._end_with_parent)
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["error"] is None, result
    groups = {int(g): records for g, records in result["groups"].items()}
    starts = {g: [r["pid"] for r in rs if r["event"] == "start"] for g, rs in groups.items()}
    killed = result["killed"]
    # Group 1's process was SIGKILLed and Ray started a new one; group 0's never restarted.
    assert starts[1][0] == killed["pid"] and len(starts[1]) == 2, starts
    assert len(starts[0]) == 1, starts
    # Group 0 trained on alone while group 1 was away.
    alone = [
        r
        for r in groups[0]
        if r["event"] == "step" and r["time"] > killed["time"] and r["participants"] == 1
    ]
    assert alone, groups[0]
    # The new group 1 healed from group 0 (its first step is far past 0), and both ended at the
    # same step with the same parameters.
    second_start = [i for i, r in enumerate(groups[1]) if r["event"] == "start"][1]
    first_step = next(r for r in groups[1][second_start:] if r["event"] == "step")
    assert first_step["step"] > killed["step"], groups[1]
    ends = {g: records[-1] for g, records in groups.items()}
    assert all(e["event"] == "end" for e in ends.values()), ends
    assert ends[0]["step"] == ends[1]["step"] >= 30
    assert ends[0]["params"] == ends[1]["params"]
