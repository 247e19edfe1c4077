"""The examples in examples/ as a user runs them: one command each, a local lighthouse and two
replica groups, read back from the JSON summary each group prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    ("script", "progress"),
    [
        ("train_ddp.py", ("step", 50)),
        # The DiLoCo example in --full: tests/semi_sync/test_diloco_multiprocess.py trains DiLoCo
        # across processes (a joining group heals, a group killed during a sync) by default.
        pytest.param("train_diloco.py", ("outer_syncs_committed", 6), marks=pytest.mark.slow),
    ],
)
def test_example_trains_two_groups_to_identical_state(tmp_path, script, progress) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=tmp_path,  # as a user would, from anywhere
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["replica_group"] for s in summaries) == [0, 1], result.stdout
    key, expected = progress
    assert all(s[key] == expected for s in summaries), summaries
    assert len({s["state_sha1"] for s in summaries}) == 1, summaries
