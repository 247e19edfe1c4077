"""scripts/gpu_check.py's long parts on CPU (--full): the TorchTitan kill-and-heal run beside
the same processes without FT, and the NCCL part's sequence rehearsed on gloo (the part itself
is skipped without CUDA). Reads ``report.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(720)
def test_titan_and_nccl_parts_on_cpu(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)]
    command += ["--device", "cpu", "--parts", "nccl", "titan"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=690)
    report = json.loads((tmp_path / "report.json").read_text())
    parts = report["parts"]
    assert done.returncode == 0, (done.stdout, {p: r["reason"] for p, r in parts.items()})

    nccl = parts["nccl"]
    assert nccl["status"] == "skipped" and "needs CUDA" in nccl["reason"]
    assert set(nccl["figures"]["gloo_rehearsal"]) == {"ProcessGroupGloo", "ProcessGroupBabyGloo"}
    assert nccl["checks"] and all(nccl["checks"].values()), nccl["checks"]

    titan = parts["titan"]
    assert titan["status"] == "passed", titan["reason"]
    assert all(titan["checks"].values()), titan["checks"]
    figures = titan["figures"]
    assert figures["heal_outcomes"][0] == "applied"
    assert figures["final_steps"] == [figures["steps"]] * 2
    assert figures["ft_over_no_ft"] > 0
    assert not list((tmp_path / "titan").glob("state_*.pt"))  # the big dumps are removed
