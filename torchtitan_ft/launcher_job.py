"""A replica group's launcher job: the name its launcher gives the job the group's process runs
in (a Slurm job id, a TorchX app id and role, a pod name), which the group sends the
lighthouse (``GroupProgress.launcher_job``) and the status page, ``/status.json`` and
``torchft_lighthouse status`` show per group (docs/launchers.md). Pure and cheap to import (the
launchers use it); the Manager's settings resolve it (``manager.settings``).

The launchers set ``TORCHFT_LAUNCHER_JOB``: the TorchX components ``torchx:<app id>/replica_<i>``,
the Kubernetes manifests ``pod:<pod name>``. Under Slurm, whose every job has ``SLURM_JOB_ID``,
it is ``slurm:<job id>`` without anyone setting it.
"""

from __future__ import annotations

from collections.abc import Mapping

LAUNCHER_JOB_ENV = "TORCHFT_LAUNCHER_JOB"
SLURM_JOB_ID_ENV = "SLURM_JOB_ID"
LAUNCHER_JOB_MAX = 128
"""The longest launcher job name, in characters (a Slurm job id, a TorchX app id and role, a
pod name: all far shorter)."""


def from_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(name, variable it came from)``: ``TORCHFT_LAUNCHER_JOB``, else ``slurm:`` +
    ``SLURM_JOB_ID``, else None; an empty value is unset.

    Raises:
        ValueError: a name that is not printable ASCII without spaces of at most
            ``LAUNCHER_JOB_MAX`` characters, naming the variable and its value.
    """
    if env.get(LAUNCHER_JOB_ENV):
        var, name = LAUNCHER_JOB_ENV, env[LAUNCHER_JOB_ENV]
    elif env.get(SLURM_JOB_ID_ENV):
        var, name = SLURM_JOB_ID_ENV, f"slurm:{env[SLURM_JOB_ID_ENV]}"
    else:
        return None
    if len(name) > LAUNCHER_JOB_MAX or not (name.isascii() and name.isprintable()) or " " in name:
        raise ValueError(
            f"env var {var} must give a job name of printable ASCII without spaces, at most "
            f"{LAUNCHER_JOB_MAX} characters, got {env[var]!r}"
        )
    return name, var
