"""A TorchTitan job as this project's own tools launch it (the failure demo, the benchmarks,
``./run_local.sh``'s job, the tests' runs): one :class:`TitanJob` says what to train, and
:func:`command` spells it as ``run_train.sh``'s command line and environment on the installed
release or a named one. What differs between the releases' command lines is here and nowhere
else in the tools:

* the dump folder: ``--job.dump_folder`` on 0.2.2, ``--dump_folder`` on 0.3.0 (top-level);
* the config: on 0.3.0 a registry config (``MODULE``/``CONFIG``, which ``run_train.sh`` passes
  as ``--module``/``--config``) that a TOML file overrides (``CONFIG_FILE``, passed as
  ``--job.config_file``); on 0.2.2 the TOML file is the whole config (its ``[model]`` names
  the model) and ``MODULE``/``CONFIG`` name one of ``configs/`` only without a TOML file
  (``torchtitan_ft.titan.named_configs``).

Every other flag (``--training.*``, this project's ``--fault_tolerance.*``) is spelled alike
on both. Imports neither torch nor TorchTitan: a tool in one release's Python builds another
release's command (``benchmarks.titan_step --releases``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_ft.events import EVENTS_DIR_ENV
from torchtitan_ft.titan.releases import Release, installed

ROOT = Path(__file__).resolve().parents[3]
RUN_TRAIN = ROOT / "run_train.sh"
"""The launcher every job runs (a checkout's; a tool that launches needs one)."""

DUMP_FOLDER_FLAG = {Release.V0_2: "--job.dump_folder", Release.V0_3: "--dump_folder"}
"""Each release's dump-folder flag (0.3.0 moved it out of ``[job]``)."""


@dataclass(frozen=True)
class FtGroup:
    """The replica group's place in a fault-tolerant job: ``--fault_tolerance.enable`` and
    the fields below (None: the config's value; docs/configuration.md has each field)."""

    replica_id: int
    """``--fault_tolerance.replica_id``: this group's id, distinct per group."""
    group_size: int | None = None
    """``--fault_tolerance.group_size``: the number of replica groups."""
    lighthouse: str | None = None
    """The lighthouse's address (``TORCHFT_LIGHTHOUSE``; None: the caller's environment's,
    else ``run_train.sh``'s default ``http://localhost:29510``)."""
    min_replica_size: int | None = None
    """``--fault_tolerance.min_replica_size``: groups a step needs."""
    hostname: str | None = None
    """``--fault_tolerance.hostname``: the address this group's servers listen on."""
    quorum_timeout_ms: int | None = None
    """``--fault_tolerance.quorum_timeout_ms``: how long a group waits for a quorum."""
    process_group_timeout_ms: int | None = None
    """``--fault_tolerance.process_group_timeout_ms``: a collective's timeout."""

    def flags(self) -> list[str]:
        """The command-line flags (the same on both releases)."""
        values = {
            "replica_id": self.replica_id,
            "group_size": self.group_size,
            "min_replica_size": self.min_replica_size,
            "hostname": self.hostname,
            "quorum_timeout_ms": self.quorum_timeout_ms,
            "process_group_timeout_ms": self.process_group_timeout_ms,
        }
        set_ = [f"--fault_tolerance.{k}={v}" for k, v in values.items() if v is not None]
        return ["--fault_tolerance.enable", *set_]


@dataclass(frozen=True)
class TitanJob:
    """One ``run_train.sh`` run (a torchrun job: one replica group when fault tolerance is on).

    Every field but the first is optional; None leaves the value to the config (or to
    ``run_train.sh``'s default)."""

    dump_folder: Path | None = None
    """Where TorchTitan writes (checkpoints, TensorBoard, profiles): the release's flag."""
    steps: int | None = None
    """``--training.steps``."""
    config_file: Path | None = None
    """A TOML config file (``CONFIG_FILE``): 0.2.2's whole config, 0.3.0's override of the
    registry config (the one its ``[model]`` names when ``module``/``config`` are None)."""
    module: str | None = None
    """The config's module (``MODULE``): 0.3.0's registry module; on 0.2.2 with ``config`` a
    config file of ``configs/`` by name, not passed when ``config_file`` is set."""
    config: str | None = None
    """The config's name (``CONFIG``), as ``module``."""
    ngpu: int = 1
    """Processes of the job on this machine (``NGPU``; on a CPU, gloo processes)."""
    ft: FtGroup | None = None
    """The replica group's fault-tolerance fields; None: none passed (the config's)."""
    events_dir: Path | None = None
    """Where the group's Managers write their event streams (``TORCHFT_EVENTS_DIR``)."""
    train_file: str | None = None
    """The trainer module (``TRAIN_FILE``; None: ``torchtitan_ft.titan.train``)."""
    python: str | None = None
    """The Python ``run_train.sh`` trains with (``PYTHON``; None: this one). It must have the
    release :func:`command` is asked for."""
    flags: tuple[str, ...] = ()
    """Further trainer flags, after the ones above (a later flag wins)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Further environment variables; they win over the ones the fields above set."""
    prefix: tuple[str, ...] = ()
    """Words before ``run_train.sh`` (e.g. ``Host.command([])`` of
    ``torchtitan_ft.testing.netns`` runs the job on that host)."""


@dataclass(frozen=True)
class TitanCommand:
    """A :class:`TitanJob` spelled for one release."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    """The variables set over the caller's environment (:meth:`environ`)."""
    release: Release

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The job's whole environment: ``base`` (default: this process's) with :attr:`env`."""
        return {**(os.environ if base is None else base), **self.env}

    def popen(self, **kwargs: Any) -> subprocess.Popen:
        """Start it in the repository root (``kwargs`` go to ``subprocess.Popen``: output,
        ``start_new_session``, ...)."""
        return subprocess.Popen(list(self.argv), cwd=ROOT, env=self.environ(), **kwargs)


def command(job: TitanJob, release: Release | None = None) -> TitanCommand:
    """``job`` as ``release``'s (default: the installed one's) ``run_train.sh`` command.

    The environment has one OpenMP thread per process (``OMP_NUM_THREADS=1``: torchrun sets
    it for NGPU > 1; on a shared CPU a 2-thread process spin-waits behind other jobs) unless
    ``job.env`` says otherwise. Raises ``ValueError`` for a release other than this Python's
    without ``job.python``."""
    if release is None:
        release = installed()
    elif job.python is None and release is not installed():
        raise ValueError(
            f"a TorchTitan {release.value} job from a Python with TorchTitan "
            f"{installed().value}: set TitanJob.python to a Python that has {release.value}"
        )
    env = {
        "NGPU": str(job.ngpu),
        "PYTHON": job.python or sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    if job.config_file is not None:
        env["CONFIG_FILE"] = str(job.config_file)
    if release is Release.V0_3 or job.config_file is None:
        env.update({k: v for k, v in (("MODULE", job.module), ("CONFIG", job.config)) if v})
    if job.ft is not None and job.ft.lighthouse is not None:
        env["TORCHFT_LIGHTHOUSE"] = job.ft.lighthouse
    if job.events_dir is not None:
        env[EVENTS_DIR_ENV] = str(job.events_dir)
    if job.train_file is not None:
        env["TRAIN_FILE"] = job.train_file
    env.update(job.env)
    argv = [*job.prefix, str(RUN_TRAIN)]
    if job.steps is not None:
        argv += ["--training.steps", str(job.steps)]
    if job.dump_folder is not None:
        argv += [DUMP_FOLDER_FLAG[release], str(job.dump_folder)]
    if job.ft is not None:
        argv += job.ft.flags()
    argv += job.flags
    return TitanCommand(tuple(argv), env, release)
