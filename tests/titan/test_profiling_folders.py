"""Profiler traces and memory snapshots of replica groups that share a ``dump_folder`` go to a
folder per group (``iteration_<n>/replica_<id>/``), as in TorchTitan's FT trainer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import torchtitan_ft.titan.train  # noqa: F401  (CPU fixes before TorchTitan is imported)
from torchtitan_ft.titan.trainer import profiling_leaf_folder, titan_train
from torchtitan_ft.titan.trainer_hooks import replica_leaf_folder


def _profiling(**values: object) -> object:
    from torchtitan.config import Profiling

    return Profiling(**values)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A 1-rank default process group (TorchTitan's profilers read the rank)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_leaf_folder_is_the_replica_group_with_ft_only() -> None:
    assert replica_leaf_folder(SimpleNamespace(enabled=True, replica_id=3)) == "replica_3"
    assert replica_leaf_folder(SimpleNamespace(enabled=False, replica_id=0)) == ""


@pytest.mark.usefixtures("one_rank")
def test_traces_of_two_groups_do_not_overwrite_each_other(tmp_path: Path) -> None:
    """TorchTitan's own profiler on a CPU-only torch (cpu_compat's fix 5: TorchTitan 0.2.2
    asks it for a None activity when there is no GPU, which torch refuses)."""
    config = _profiling(enable_profiling=True, profile_freq=2, profiler_warmup=0, profiler_active=1)
    for replica in (0, 1):
        with (
            profiling_leaf_folder(f"replica_{replica}"),
            titan_train.maybe_enable_profiling(config, base_folder=str(tmp_path)) as profiler,
        ):
            for _ in range(2):
                torch.ones(4).add_(1)
                profiler.step()
    folder = tmp_path / config.save_traces_folder / "iteration_2"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.json")) == [
        "replica_0/rank0_trace.json",
        "replica_1/rank0_trace.json",
    ]


@pytest.mark.usefixtures("one_rank")
def test_memory_snapshots_go_to_the_groups_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchtitan.tools.profiling as profiling

    # CPU has no allocator history: a stand-in records nothing and snapshots an empty state.
    memory = SimpleNamespace(_record_memory_history=lambda **_: None, _snapshot=lambda: {})
    monkeypatch.setattr(profiling, "device_module", SimpleNamespace(memory=memory))
    config = _profiling(enable_memory_snapshot=True, profile_freq=1)
    with (
        profiling_leaf_folder("replica_1"),
        titan_train.maybe_enable_memory_snapshot(config, base_folder=str(tmp_path)) as snapshots,
    ):
        snapshots.step()
    folder = tmp_path / config.save_memory_snapshot_folder
    assert [p.relative_to(folder).as_posix() for p in folder.rglob("*.pickle")] == [
        "iteration_1/replica_1/rank0_memory_snapshot.pickle"
    ]


def test_torchtitan_gets_its_functions_back() -> None:
    before = titan_train.maybe_enable_profiling, titan_train.maybe_enable_memory_snapshot
    with profiling_leaf_folder("replica_0"):
        assert titan_train.maybe_enable_profiling is not before[0]
    assert (titan_train.maybe_enable_profiling, titan_train.maybe_enable_memory_snapshot) == before
