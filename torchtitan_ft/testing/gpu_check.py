"""The parts of ``scripts/gpu_check.py``: what it checks on a device, one part per process.

``scripts/gpu_check.py`` runs each part as ``python -m torchtitan_ft.testing.gpu_check PART
--device D --out DIR`` under a time limit, with its output in ``DIR/<part>.log``; the part writes
``DIR/<part>.json`` (a :class:`PartResult`), and the script gathers those into
``DIR/report.json``. A part in a process of its own: a CUDA or NCCL crash, or a hang, costs that
part, not the report.

The parts (:data:`PARTS`):

- ``environment``: Python, torch, CUDA and driver versions, the GPU, the versions of the
  packages the check uses (and the wheels it installed);
- ``manager``: two replica groups (a Manager each, threads of one process, gloo across them)
  on the device: the thread that configures the process group sees the caller's CUDA device;
  the managed all-reduce of device tensors averages them; after ``should_commit`` the result is
  readable from another CUDA stream (``should_commit`` waited for the work); a step discarded
  after an error leaves the parameters untouched;
- ``nccl``: ``ProcessGroupNCCL`` and ``ProcessGroupBabyNCCL`` with one rank (configure,
  all-reduce, abort, configure again), and an all-reduce stuck on a peer that never joins it,
  failed past its timeout, after which the group reconfigures. Needs CUDA; on CPU the same
  sequence runs on the gloo groups (figures ``gloo_rehearsal``), and the part is skipped;
- ``native_nccl2``: torch's native reconfigurable group over ``nccl2`` (torch >= 2.14's
  ``enable_reconfigure=True``) in ``NativeProcessGroup``, one rank: reconfigure, all-reduce a
  device tensor, abort, three times. Skipped on CPU (the native gloo group has its tests) and
  where torch has no native reconfigure, with the reason;
- ``semi_sync``: DiLoCo with int8-quantized pseudo-gradients, two groups, a few outer steps:
  every sync commits, the groups end with bitwise-identical models;
- ``titan``: TorchTitan's llama3 debug model through ``./run_train.sh``, 2 replica groups of 1
  process sharing the device (bf16 on CUDA, fp32 on CPU), per-step FT across groups over gloo;
  group 1 is SIGKILLed partway, restarted, heals over HTTP from group 0, and both end bitwise
  identical (the end-to-end test's dumping trainer, ``torchtitan_ft.testing.titan_dump``).
  Beside it, the same two processes without FT, one after the other on the same device: the FT
  step time over theirs.

The pure parts (:func:`plan`, :func:`settle`, :func:`overall`) decide what runs and what a part's
end means; unit-tested in ``tests/testing/test_gpu_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torchtitan_ft

Device = Literal["cuda", "cpu"]


class Status(enum.StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: dict[str, float]
    """Time limit per device, in seconds: the part's process is stopped past it (and fails).
    The CUDA limits add up to 450 s, so that a whole run on one GPU, with the wheels' install,
    fits in 8 minutes; the CPU ones allow for a loaded 2-core machine."""


PARTS = {
    p.name: p
    for p in (
        Part("environment", {"cuda": 30, "cpu": 60}),
        Part("manager", {"cuda": 60, "cpu": 90}),
        Part("nccl", {"cuda": 100, "cpu": 120}),
        Part("native_nccl2", {"cuda": 20, "cpu": 60}),
        Part("semi_sync", {"cuda": 60, "cpu": 90}),
        Part("titan", {"cuda": 180, "cpu": 420}),
    )
}


@dataclass
class PartResult:
    """What a part reports (``DIR/<part>.json``, one entry of ``report.json``'s ``parts``)."""

    status: Status
    reason: str = ""
    """Why it failed or was skipped (the first failed check, the error, the time limit)."""
    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    """Each named check of the part and whether it held."""
    error: str | None = None
    """The traceback of an exception that ended the part."""
    wall_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}


def plan(names: list[str], device: Device, cuda_available: bool) -> list[str]:
    """The parts to run, in :data:`PARTS`' order. Raises ValueError for an unknown part or a
    CUDA run without CUDA."""
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; expected some of {list(PARTS)}")
    if device == "cuda" and not cuda_available:
        raise ValueError("--device cuda, but torch sees no CUDA device; use --device cpu")
    return [n for n in PARTS if n in names]


def settle(
    result: PartResult | None, returncode: int | None, limit_s: float, wall_s: float
) -> PartResult:
    """A part's outcome from what its process left: its result file (``None`` if it wrote
    none; a part saves its progress while it runs), its exit status (``None`` when it was
    stopped at ``limit_s``; a part that ran to its end exits 0, whatever it found) and its wall
    time. What the part measured is kept in every case."""
    if returncode is None:
        reason = f"did not finish within its limit of {limit_s:.0f} s"
    elif returncode != 0:
        reason = f"its process exited with {returncode}"
        if result is None:
            reason += " without a result (see its log)"
    else:
        reason = None
    if reason is None and result is not None:
        settled = result
    else:
        settled = PartResult(Status.FAILED, reason or "it wrote no result (see its log)")
        if result is not None:
            settled.figures, settled.checks, settled.error = (
                result.figures,
                result.checks,
                result.error,
            )
    settled.wall_s = round(wall_s, 1)
    return settled


def overall(results: dict[str, PartResult]) -> Status:
    """Failed if a part failed; passed if one passed and none failed; else skipped."""
    statuses = {r.status for r in results.values()}
    if Status.FAILED in statuses:
        return Status.FAILED
    return Status.PASSED if Status.PASSED in statuses else Status.SKIPPED


# ---------------------------------------------------------------------- running a part


class Checks:
    """The named checks of a part: :meth:`expect` records each; the first that fails is the
    part's reason."""

    def __init__(self) -> None:
        self.results: dict[str, bool] = {}
        self.failures: list[str] = []

    def expect(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results[name] = bool(ok)
        if not ok:
            self.failures.append(f"{name}: {detail}" if detail else name)
        return bool(ok)


SAVE_EVERY_S = 2.0
"""How often a running part saves what it has measured so far (kept if it is stopped)."""


def run_part(name: str, device: Device, out: Path) -> PartResult:
    """Runs part ``name`` in this process, saving its progress to ``out/<name>.json`` while it
    runs; exceptions end it as a failure with the traceback. Its result, also saved."""
    checks, figures = Checks(), {}
    started = time.monotonic()
    done = threading.Event()

    def save_progress() -> None:
        while not done.wait(SAVE_EVERY_S):
            unfinished = PartResult(Status.FAILED, "unfinished", figures, checks.results)
            with contextlib.suppress(RuntimeError, TypeError, ValueError):  # changed mid-dump
                _save(out, name, unfinished)

    threading.Thread(target=save_progress, daemon=True).start()
    try:
        skipped = _part_function(name)(device, out, checks, figures)
    except Exception as e:  # the part failed; the report says how
        result = PartResult(Status.FAILED, f"{type(e).__name__}: {e}"[:500], figures)
        result.error = traceback.format_exc()
    else:
        if checks.failures:
            result = PartResult(Status.FAILED, checks.failures[0], figures)
        elif skipped:
            result = PartResult(Status.SKIPPED, skipped, figures)
        else:
            result = PartResult(Status.PASSED, "", figures)
    done.set()
    result.checks = checks.results
    result.wall_s = round(time.monotonic() - started, 1)
    _save(out, name, result)
    return result


def _save(out: Path, name: str, result: PartResult) -> None:
    text = json.dumps(result.to_json(), indent=2)
    tmp = out / f".{name}.json.tmp"
    tmp.write_text(text)
    tmp.replace(out / f"{name}.json")  # a reader never sees half a file


# ---------------------------------------------------------------------- environment

PACKAGES = ("torch", "torchtitan", "tyro", "grpcio", "protobuf", "torchdata", "tokenizers")


def environment(device: Device, out: Path, checks: Checks, figures: dict) -> str | None:
    import torch  # load order: scripts/gpu_check.py imports this module without torch

    figures["python"] = platform.python_version()
    figures["torch"] = torch.__version__
    figures["cuda_runtime"] = torch.version.cuda
    figures["cuda_available"] = torch.cuda.is_available()
    figures["packages"] = {}
    for name in PACKAGES:
        try:
            figures["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            figures["packages"][name] = None
    figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        figures["gpu"] = props.name
        figures["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        figures["bf16_supported"] = torch.cuda.is_bf16_supported()
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            figures["driver"] = subprocess.run(
                query, capture_output=True, text=True, timeout=20, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            figures["driver"] = f"unknown ({type(e).__name__})"
    missing = [n for n, v in figures["packages"].items() if v is None]
    checks.expect("packages importable", not missing, f"not installed: {missing}")
    figures["torchtitan_ft_from"] = str(Path(torchtitan_ft.__file__).parent)
    return None


def _part_function(name: str) -> Callable[[Device, Path, Checks, dict], str | None]:
    """Part ``name``'s function: :func:`environment` here, the others in
    :mod:`torchtitan_ft.testing.gpu_parts`."""
    if name == "environment":
        return environment
    # load order: the parts import torch and the FT stack, which scripts/gpu_check.py (which
    # imports this module) may not have until its wheels are installed
    from torchtitan_ft.testing import gpu_parts

    return getattr(gpu_parts, name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Runs one part of scripts/gpu_check.py.")
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = run_part(args.part, args.device, args.out)
    print(f"gpu_check part {args.part}: {result.status.value} {result.reason}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # a Manager's or NCCL's leftover threads must not hold the exit


if __name__ == "__main__":
    main()
