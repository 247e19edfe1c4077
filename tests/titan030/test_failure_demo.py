"""The README's failure demo (``python scripts/failure_demo.py``, TorchTitan by default) on
TorchTitan 0.3.0, the release a fresh install has: a short schedule must inject its fault and
the job survive it, as on 0.2.2 (tests/test_failure_demo.py). Once every group exited 2 at
start here (a 0.2.2 flag) and the demo injected nothing, while the 0.2.2 run stayed green."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_failure_demo import _check, _run


@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # 12 steps took 7 min at load average 40 (other sessions)
def test_titan_demo_survives_a_kill_on_0_3_0(tmp_path: Path) -> None:
    """2 groups, 10 steps, one SIGKILL and restart (at step 3): the restarted group heals
    from the survivor, which waits for it (min_replicas 2)."""
    args = ["--groups", "2", "--min_replicas", "2", "--faults", "sigkill", "--steps", "10"]
    result = _run(tmp_path, *args, timeout=560)
    _check(result, tmp_path, ["SIGKILL"])
    assert json.loads((tmp_path / "summary.json").read_text())["torchtitan"] == "0.3.0"
