"""Replica groups of a TorchTitan 0.3.0 job for the tests of this folder, configured with one
of the repository's TOML files over the registry config (``--job.config_file``; run_train.sh's
``CONFIG_FILE`` is 0.2.2's form)."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ft.testing.titan_jobs import CONFIGS, TrainRun


def toml(name: str) -> tuple[str, str]:
    """The flag that reads ``configs/<name>``."""
    return ("--job.config_file", str(CONFIGS / name))


def ft_groups(
    dumps: list[Path], address: str, steps: int, *args: str, ngpu: int = 1, **env: str
) -> list[TrainRun]:
    """One replica group per dump folder in ``dumps`` (group ``r`` in ``dumps[r]``), each
    ``steps`` steps with ``args`` against the lighthouse ``address``, ``env`` added."""
    return [
        TrainRun(
            f"replica group {replica}",
            steps,
            dump,
            *args,
            f"--fault_tolerance.replica_id={replica}",
            ngpu=ngpu,
            env={"TORCHFT_LIGHTHOUSE": address, **env},
        )
        for replica, dump in enumerate(dumps)
    ]
