"""TorchX components: one role per replica group, each a torchrun job that restarts its own
ranks, so a dead rank or group comes back alone and the other groups never restart.

* :func:`hsdp` is torchft's ``torchft.torchx:hsdp`` (same parameters and defaults): each group
  runs ``torchrun --master_port=29600+i --nnodes=1 --nproc_per_node=W --max_restarts=R SCRIPT
  ARGS`` with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set; the
  lighthouse runs apart. ``torchx run -s local_cwd torchtitan_ft.torchx:hsdp --script
  examples/train_ddp.py``.
* :func:`titan` runs the project's TorchTitan entry point (``run_train.sh`` with
  ``--fault_tolerance.*`` flags) per group and, unless given the address of one that runs apart,
  a lighthouse role of its own that ends when the job does (``--exit_when_idle_ms``).
  ``torchx run -s local_cwd torchtitan_ft.torchx:titan --replicas 2 -- --training.steps 20``.

Each group's role names itself to the lighthouse as ``torchx:<app id>/replica_<i>``
(``TORCHFT_LAUNCHER_JOB``), the launcher job on the status page.

Both pass the submitting environment's ``TORCHFT_*`` variables and ``GLOO_SOCKET_IFNAME`` to
every role, except the job token ``TORCHFT_AUTH_TOKEN`` and a group key ``TORCHFT_GROUP_KEY``:
they never enter an application definition (TorchX prints those, and schedulers record them);
the roles inherit them from the environment of the job's own processes (docs/launchers.md,
"The job token").

Not torchft's: no Rust logging variables (``RUST_BACKTRACE``, ``CLICOLOR_FORCE``: there is no
Rust here), a bad count raises ``ValueError`` where torchft asserts, and a lighthouse address
of the submitting machine where nothing listens raises ``ValueError`` before anything starts
(an address of another host is not probed).

This module imports ``torchx`` (``pip install torchx``); nothing else in the package does.
"""

# TorchX reads the components' annotations itself (its linter parses the source) and knows
# typing's Dict/List/Optional, not ``dict[...] | None``.
# ruff: noqa: UP006, UP035, UP045
import os
from typing import Dict, List, Optional

import torchx.specs as specs

from torchtitan_ft.addresses import absent_here
from torchtitan_ft.auth import AUTH_TOKEN_ENV, GROUP_KEY_ENV
from torchtitan_ft.launcher_job import LAUNCHER_JOB_ENV

LIGHTHOUSE_PORT = 29510
"""The lighthouse's default port, torchft's."""
MASTER_PORT_BASE = 29600
"""torchrun's ``--master_port`` of group ``i`` under :func:`hsdp` is this plus ``i``."""
PASSED_ENV_PREFIX = "TORCHFT_"
PASSED_ENV = ("GLOO_SOCKET_IFNAME",)
SECRET_ENV = (AUTH_TOKEN_ENV, GROUP_KEY_ENV)
"""Never put into an application definition: the job token, and a group's key (which is also
one group's own, not every role's)."""
LIGHTHOUSE_WAIT_S = 10.0
"""How long a component waits for a lighthouse of the submitting machine to listen (one started
with ``&`` just before ``torchx run``) before it refuses the submission."""
IDLE_EXIT_MS = 60_000
""":func:`titan`'s lighthouse role ends by default this long after the last group left: longer
than a group's restart, so that only a finished job, or one whose every group stays away for a
minute, ends it."""


def _check_counts(replicas: int, workers_per_replica: int, max_restarts: int) -> None:
    for name, value, least in (
        ("replicas", replicas, 1),
        ("workers_per_replica", workers_per_replica, 1),
        ("max_restarts", max_restarts, 0),
    ):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")


def passed_env(environ: Dict[str, str]) -> Dict[str, str]:
    """The variables of ``environ`` every role gets: ``TORCHFT_*`` and ``GLOO_SOCKET_IFNAME``,
    never :data:`SECRET_ENV`."""
    return {
        k: v
        for k, v in environ.items()
        if (k.startswith(PASSED_ENV_PREFIX) or k in PASSED_ENV) and k not in SECRET_ENV
    }


def _group_env(
    replica_id: int, replicas: int, lighthouse: str, env: Optional[Dict[str, str]]
) -> Dict[str, str]:
    for secret in SECRET_ENV:
        if env and secret in env:
            raise ValueError(
                f"env sets {secret}: a secret must not be part of an application definition "
                "(TorchX prints it, schedulers record it); export it in the environment the "
                "job is submitted from instead (docs/launchers.md)"
            )
    return {
        **passed_env(dict(os.environ)),
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "CUDA_VISIBLE_DEVICES": "",
        **(env or {}),
        "REPLICA_GROUP_ID": str(replica_id),
        "NUM_REPLICA_GROUPS": str(replicas),
        LAUNCHER_JOB_ENV: launcher_job(replica_id),
    }


def _check_lighthouse(address: str, given_as: str, instead: str) -> None:
    """A lighthouse address of this machine where nothing listens within
    :data:`LIGHTHOUSE_WAIT_S` stops the submission (:func:`~torchtitan_ft.addresses.absent_here`;
    one of another host is not probed)."""
    if absent_here(address, LIGHTHOUSE_WAIT_S):
        raise ValueError(
            f"{given_as} {address}: nobody listens there (expected a running "
            f"torchft_lighthouse on this machine: start it first, or {instead})"
        )


def launcher_job(replica_id: int) -> str:
    """Group ``replica_id``'s launcher job on the lighthouse's status page:
    ``torchx:<app id>/replica_<i>`` (TorchX fills in the app id when it submits)."""
    return f"torchx:{specs.macros.app_id}/replica_{replica_id}"


def hsdp(
    *script_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    script: str = "train_ddp.py",
    env: Optional[Dict[str, str]] = None,
    image: str = "",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
) -> specs.AppDef:
    """Replica groups of a torchft-style training script, one role each (torchft's ``hsdp``).

    Args:
        script_args: arguments to the script
        replicas: number of replica groups
        workers_per_replica: ranks per replica group (torchrun's --nproc_per_node)
        max_restarts: how often torchrun restarts a group's ranks after one fails
        script: the training script each rank runs
        env: environment variables for every role (not the job token)
        image: the image to run in (local_cwd: the current directory)
        h: a named resource of the scheduler
        cpu: CPUs per rank
        gpu: GPUs per rank
        memMB: memory per rank, in MB
    """
    _check_counts(replicas, workers_per_replica, max_restarts)
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE", f"http://localhost:{LIGHTHOUSE_PORT}")
    _check_lighthouse(
        lighthouse,
        "TORCHFT_LIGHTHOUSE" if "TORCHFT_LIGHTHOUSE" in os.environ else "the default lighthouse",
        "set TORCHFT_LIGHTHOUSE to where it runs",
    )
    roles = []
    for i in range(replicas):
        args = [
            f"--master_port={MASTER_PORT_BASE + i}",
            "--nnodes=1",
            f"--nproc_per_node={workers_per_replica}",
            f"--max_restarts={max_restarts}",
        ]
        args += [script] if script else []
        roles.append(
            specs.Role(
                name=f"replica_{i}",
                image=image,
                entrypoint="torchrun",
                args=[*args, *script_args],
                env=_group_env(i, replicas, lighthouse, env),
                num_replicas=1,
                max_retries=0,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
            )
        )
    return specs.AppDef(name="torchft", roles=roles)


def titan_group_args(replica_id: int, replicas: int, trainer_args: List[str]) -> List[str]:
    """``run_train.sh``'s arguments for group ``replica_id`` of ``replicas``."""
    return [
        "run_train.sh",
        "--fault_tolerance.enable",
        f"--fault_tolerance.replica_id={replica_id}",
        f"--fault_tolerance.group_size={replicas}",
        *trainer_args,
    ]


def titan(
    *trainer_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    lighthouse: str = "",
    lighthouse_port: int = LIGHTHOUSE_PORT,
    min_replicas: int = 1,
    lighthouse_idle_exit_ms: int = IDLE_EXIT_MS,
    env: Optional[Dict[str, str]] = None,
    image: str = "",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
) -> specs.AppDef:
    """Replica groups of TorchTitan with torchtitan_ft (``run_train.sh``), one role each, and a
    lighthouse role unless ``lighthouse`` names one.

    Args:
        trainer_args: flags for the trainer, after the fault_tolerance ones (a config: on
            TorchTitan 0.3.0 --module/--config, on 0.2.2 --job.config_file)
        replicas: number of replica groups (--fault_tolerance.group_size)
        workers_per_replica: ranks per replica group (run_train.sh's NGPU)
        max_restarts: how often torchrun restarts a group's ranks after one fails
        lighthouse: URL of a lighthouse that runs apart; empty: a lighthouse role in this
            application, which the groups reach at localhost (all roles on one host)
        lighthouse_port: the lighthouse role's port (its status page is on the next one)
        min_replicas: the lighthouse role's --min_replicas
        lighthouse_idle_exit_ms: the lighthouse role ends once no group has been healthy for
            this long after the job's first quorum (its --exit_when_idle_ms; > 0)
        env: environment variables for every role (not the job token)
        image: the image to run in (local_cwd: a checkout of torchtitan_ft)
        h: a named resource of the scheduler
        cpu: CPUs per rank
        gpu: GPUs per rank
        memMB: memory per rank, in MB
    """
    _check_counts(replicas, workers_per_replica, max_restarts)
    if not 1 <= min_replicas <= replicas:
        raise ValueError(
            f"min_replicas must be between 1 and replicas ({replicas}), got {min_replicas}"
        )
    if lighthouse_idle_exit_ms <= 0:
        raise ValueError(
            f"lighthouse_idle_exit_ms must be > 0 (the application ends when its lighthouse "
            f"does), got {lighthouse_idle_exit_ms}"
        )
    roles = []
    if lighthouse:
        _check_lighthouse(lighthouse, "lighthouse", "leave lighthouse empty to run one as a role")
    else:
        lighthouse = f"http://localhost:{lighthouse_port}"
        roles.append(
            specs.Role(
                name="lighthouse",
                image=image,
                entrypoint="torchft_lighthouse",
                args=[
                    f"--bind=127.0.0.1:{lighthouse_port}",
                    f"--min_replicas={min_replicas}",
                    f"--exit_when_idle_ms={lighthouse_idle_exit_ms}",
                ],
                env=passed_env(dict(os.environ)),
                num_replicas=1,
                max_retries=0,
                resource=specs.resource(cpu=1, gpu=0, memMB=512, h=h),
            )
        )
    for i in range(replicas):
        group_env = _group_env(i, replicas, lighthouse, env)
        group_env.setdefault("NGPU", str(workers_per_replica))
        group_env.setdefault("MAX_RESTARTS", str(max_restarts))
        roles.append(
            specs.Role(
                name=f"replica_{i}",
                image=image,
                entrypoint="bash",
                args=titan_group_args(i, replicas, list(trainer_args)),
                env=group_env,
                num_replicas=1,
                max_retries=0,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
            )
        )
    return specs.AppDef(name="torchtitan_ft", roles=roles)
