"""Single-writer disk checkpoints on TorchTitan 0.3.0 (torchtitan_ft/titan/checkpointing.py,
attached by releases/v0_3/trainer.py): the same job and checks as tests/titan/
test_checkpointing.py's full-job resume on 0.2.2, configured the way a 0.2.2 user would on
0.3.0, with the repository's TOML over the registry config (``--job.config_file``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.titan.test_checkpointing import CHECKPOINT_ARGS, _losses
from tests.titan030._groups import ft_groups, toml
from torchtitan_ft.testing.titan_jobs import TrainRun, finish_all, lighthouse
from torchtitan_ft.titan.checkpointing import reader_dir, reader_files


def run_groups_sharing(
    dump: Path, address: str, steps: int, wait: bool = True
) -> list[str] | list[TrainRun]:
    """Two replica groups (1 rank each) of configs/debug_ft_cpu.toml sharing the dump folder
    ``dump``, checkpointing every 2 steps; their outputs (each exited 0), or the runs."""
    runs = ft_groups([dump, dump], address, steps, *toml("debug_ft_cpu.toml"), *CHECKPOINT_ARGS)
    return finish_all(runs) if wait else runs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_single_writer_and_full_job_resume(tmp_path: Path) -> None:
    """Only group 0 writes the full checkpoint, both keep their reader files (retention 2);
    a job whose every process is SIGKILLed mid-run and started again continues after its
    latest full checkpoint with the losses of the uninterrupted run, in both groups."""
    with lighthouse(min_replicas=2) as address:
        whole = run_groups_sharing(tmp_path / "whole", address, 6)
    folder = tmp_path / "whole" / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4", "step-6"]
    for replica in (0, 1):
        assert sorted(reader_files(reader_dir(folder, replica, 0))) == [4, 6]
    assert whole[1].count("leaves step") == 3  # steps 2, 4, 6: group 0 writes them
    assert "registry config llama3/llama3_debugmodel, overridden by" in whole[0]

    dump = tmp_path / "stopped"
    with lighthouse(min_replicas=2) as address:
        groups = run_groups_sharing(dump, address, 6, wait=False)
        try:
            groups[0].wait_for(r"step:\s*3\s+loss")
        finally:
            for group in groups:
                group.sigkill()
    saved = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*"))
    assert saved and saved[-1] < 6, saved
    last = saved[-1]

    with lighthouse(min_replicas=2) as address:
        resumed = run_groups_sharing(dump, address, 6)
    for replica in (0, 1):
        assert f"Training starts at step {last + 1}" in resumed[replica], resumed[replica][-4000:]
        expected = _losses(whole[replica])
        assert _losses(resumed[replica]) == {s: expected[s] for s in range(last + 1, 7)}
