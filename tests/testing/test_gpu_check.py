"""scripts/gpu_check.py: its decisions as pure functions, and a run of its cheap parts on CPU
(the TorchTitan and process-group parts run in ``tests/titan/test_gpu_check_titan.py``, --full).
The run's test reads ``report.json``, not the logs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from torchtitan_ft.testing.gpu_check import (
    PARTS,
    Part,
    PartResult,
    Status,
    overall,
    plan,
    run_part,
    settle,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def test_plan_keeps_the_parts_order_and_rejects_bad_requests() -> None:
    assert plan(["titan", "environment"], "cpu", cuda_available=False) == ["environment", "titan"]
    assert plan(list(PARTS), "cuda", cuda_available=True) == list(PARTS)
    with pytest.raises(ValueError, match=r"unknown parts \['gpu'\]"):
        plan(["gpu"], "cpu", cuda_available=False)
    with pytest.raises(ValueError, match="no CUDA device"):
        plan(["environment"], "cuda", cuda_available=False)


def test_cuda_limits_fit_a_run_in_eight_minutes() -> None:
    assert sum(p.limit_s["cuda"] for p in PARTS.values()) <= 450


PASSED = PartResult(Status.PASSED, figures={"x": 1}, checks={"c": True})
SKIPPED = PartResult(Status.SKIPPED, "needs CUDA")
FAILED = PartResult(Status.FAILED, "c: it broke", checks={"c": False})


@pytest.mark.parametrize(
    ("result", "returncode", "status", "reason"),
    [
        (PASSED, 0, Status.PASSED, ""),
        (SKIPPED, 0, Status.SKIPPED, "needs CUDA"),
        (FAILED, 0, Status.FAILED, "c: it broke"),
        (PASSED, 3, Status.FAILED, "its process exited with 3"),
        (FAILED, -11, Status.FAILED, "its process exited with -11"),
        (None, -9, Status.FAILED, "its process exited with -9 without a result (see its log)"),
        (None, None, Status.FAILED, "did not finish within its limit of 60 s"),
        (PASSED, None, Status.FAILED, "did not finish within its limit of 60 s"),
    ],
)
def test_settle(result, returncode, status, reason) -> None:
    settled = settle(result, returncode, limit_s=60, wall_s=12.345)
    assert (settled.status, settled.reason, settled.wall_s) == (status, reason, 12.3)
    if result is not None:
        assert settled.figures == result.figures  # what a part measured is kept


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([Status.PASSED, Status.SKIPPED], Status.PASSED),
        ([Status.PASSED, Status.FAILED, Status.SKIPPED], Status.FAILED),
        ([Status.SKIPPED], Status.SKIPPED),
        ([], Status.SKIPPED),
    ],
)
def test_overall(statuses, expected) -> None:
    assert overall({str(i): PartResult(s) for i, s in enumerate(statuses)}) == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_cheap_parts_pass_on_cpu(tmp_path: Path) -> None:
    """The environment, the Manager on the device and DiLoCo with quantized pseudo-gradients,
    each in its own process as on a GPU; every named check holds."""
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path)]
    command += ["--device", "cpu", "--parts", "environment", "manager", "semi_sync"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=200)
    report = json.loads((tmp_path / "report.json").read_text())
    parts = report["parts"]
    assert done.returncode == 0, (done.stdout, {p: r["reason"] for p, r in parts.items()})
    assert report["status"] == "passed" and list(parts) == ["environment", "manager", "semi_sync"]
    for name, part in parts.items():
        assert part["status"] == "passed" and part["checks"], name
        assert all(part["checks"].values()), (name, part["checks"])
        assert part["wall_s"] <= report["limits_s"][name]
    assert parts["environment"]["figures"]["packages"]["torchtitan"] == "0.2.2"
    manager = parts["manager"]["figures"]
    assert [g["step_after_discard"] for g in manager["groups"]] == [
        g["step_after_commit"] for g in manager["groups"]
    ]
    assert {d for _, d in manager["configured_on"]} == {"cpu"}
    assert parts["semi_sync"]["figures"]["group0"]["syncs_failed"] == 0


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_part_past_its_limit_is_stopped_and_fails(tmp_path: Path, monkeypatch) -> None:
    script = _script()
    monkeypatch.setitem(script.PARTS, "environment", Part("environment", {"cpu": 0.5}))
    started = time.monotonic()
    result = script.run_one("environment", "cpu", tmp_path, dict(os.environ))
    assert time.monotonic() - started < script.STOP_GRACE_S + 10
    assert (result.status, result.reason) == (
        Status.FAILED,
        "did not finish within its limit of 0 s",
    )
    assert (tmp_path / "environment.log").exists()


def test_the_native_nccl2_part_is_skipped_on_cpu_with_its_reason(tmp_path: Path) -> None:
    # The part imports torch in this process; the module's other tests run without it.
    import torch

    from torchtitan_ft.process_group.base import native_reconfigure_available

    result = run_part("native_nccl2", "cpu", tmp_path)
    assert result.status is Status.SKIPPED, result
    expected = "needs CUDA" if native_reconfigure_available() else torch.__version__
    assert expected in result.reason
    assert json.loads((tmp_path / "native_nccl2.json").read_text())["status"] == "skipped"
