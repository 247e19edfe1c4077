"""The Manager's phases show in a torch profiler trace under torchft's span names, so a
TorchTitan profile shows the time fault tolerance takes (quorum, reconfigure, heal send and
receive, allreduce, should_commit).

The quorum, reconfigure and heal transfer run on the quorum thread: torch's profiler records
them only with ``_ExperimentalConfig(profile_all_threads=True)`` (as for torchft, whose quorum
also runs on a worker thread). The training thread's spans show in any profile.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from tests.manager.test_manager import UserState, _manager, lighthouse2  # noqa: F401
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager.step_collectives import profiled

# torchft 0.2.0's names (its manager.py), minus the CUDA stream synchronizations.
TRAINING_THREAD_SPANS = {
    "torchft::manager::wait_quorum",
    "torchft::manager::allreduce",
    "torchft::manager::should_commit",
}
SPANS = TRAINING_THREAD_SPANS | {
    "torchft::manager::_async_quorum",
    "torchft::manager::_client::_quorum",
    "torchft::manager::_pg::configure",
    "torchft::manager::_checkpoint_transport::send_checkpoint",
    "torchft::manager::_checkpoint_transport::recv_checkpoint",
    "torchft::manager::allreduce::callback",
}


def _span_names(trace: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") == "X" and name.startswith("torchft::"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def _profiled_heal_step(
    lighthouse: LighthouseServer, trace: Path, all_threads: bool
) -> dict[str, int]:
    """Two managers, one healing from the other, through one step under the profiler."""
    donor = _manager(lighthouse, "a_donor", user=UserState(7.0), init_sync=False)
    healer = _manager(lighthouse, "b_healer", user=UserState(-1.0), init_sync=False)
    config = _ExperimentalConfig(profile_all_threads=all_threads)
    try:
        donor.load_state_dict({"step": 3, "batches_committed": 6})
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            for m in (donor, healer):
                m.start_quorum()
            for m in (donor, healer):
                m.allreduce(torch.ones(2)).wait()
            assert donor.should_commit() and healer.should_commit()
        prof.export_chrome_trace(str(trace))
    finally:
        donor.shutdown()
        healer.shutdown()
    return _span_names(trace)


def test_trace_shows_training_thread_spans_by_default(
    lighthouse2: LighthouseServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    counts = _profiled_heal_step(lighthouse2, tmp_path / "trace.json", all_threads=False)
    assert counts.keys() >= TRAINING_THREAD_SPANS, counts
    assert counts["torchft::manager::should_commit"] == 2, counts


def test_trace_of_all_threads_shows_torchft_spans_for_every_phase(
    lighthouse2: LighthouseServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    counts = _profiled_heal_step(lighthouse2, tmp_path / "trace.json", all_threads=True)
    assert counts.keys() >= SPANS, f"missing spans: {sorted(SPANS - counts.keys())}"
    # One per manager for the phases both ran; the transfer only on its two ends.
    for name in ("_async_quorum", "_client::_quorum", "_pg::configure", "should_commit"):
        assert counts[f"torchft::manager::{name}"] == 2, counts
    assert counts["torchft::manager::_checkpoint_transport::send_checkpoint"] == 1
    assert counts["torchft::manager::_checkpoint_transport::recv_checkpoint"] == 1


def test_spans_cost_nothing_without_a_profiler() -> None:
    """``profiled`` enters ``record_function`` only while a profiler runs (two dispatcher
    calls per span otherwise, on every collective)."""
    assert isinstance(profiled("torchft::manager::allreduce"), contextlib.nullcontext)
    with profile(activities=[ProfilerActivity.CPU]):
        assert isinstance(profiled("torchft::manager::allreduce"), record_function)
    assert isinstance(profiled("torchft::manager::allreduce"), contextlib.nullcontext)
