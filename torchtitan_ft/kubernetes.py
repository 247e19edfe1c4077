"""Kubernetes manifests for a fault-tolerant TorchTitan job:
``python -m torchtitan_ft.kubernetes --name NAME --image IMAGE [...] > job.yaml``.

What it writes (docs/launchers.md, "Kubernetes"; no cluster has run them):

* the lighthouse: a Deployment of one pod and a Service in front of it (gRPC port and its
  status page on the next port), so that it has its own lifetime and placement and is
  restarted alone;
* the replica groups: a StatefulSet with one pod per group, created and replaced in parallel,
  each pod running ``run_train.sh`` with its group's ``W`` ranks (torchrun restarts them inside
  the pod); the group id is the pod's ordinal (the ``apps.kubernetes.io/pod-index`` label,
  Kubernetes >= 1.28), so a pod that dies comes back as the same group while the others keep
  training; a headless Service names the pods; each pod's name is its group's launcher job
  on the lighthouse's status page (``TORCHFT_LAUNCHER_JOB=pod:<name>``);
* the job token from a Secret the operator creates (``kubectl create secret generic
  NAME-token --from-literal=token=...``): the manifests name it, never hold it.

The manifests are built as plain data (:func:`manifests`) and written as YAML documents.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from torchtitan_ft.auth import AUTH_TOKEN_ENV
from torchtitan_ft.launcher_job import LAUNCHER_JOB_ENV

LIGHTHOUSE_PORT = 29510
TOKEN_KEY = "token"
"""The key of the job token in the Secret."""
GROUP_ID_LABEL = "apps.kubernetes.io/pod-index"
"""The label Kubernetes (>= 1.28) sets to a StatefulSet pod's ordinal."""


@dataclass(frozen=True)
class KubernetesJob:
    """One job's manifests' inputs.

    Args:
        name: the job's name: prefix of every object (a DNS label: lowercase letters, digits
            and '-', at most 40 characters so that the objects' names stay within 63).
        image: the container image, with torchtitan_ft and TorchTitan installed and this
            repository's ``run_train.sh`` in ``workdir``.
        replicas: replica groups (pods of the StatefulSet).
        workers_per_replica: ranks per group, in one pod (``run_train.sh``'s ``NGPU``).
        gpus_per_worker: GPUs each rank takes (0: a CPU job).
        min_replicas: the lighthouse's ``--min_replicas``.
        max_restarts: how often torchrun restarts a group's ranks inside its pod before the pod
            fails (and Kubernetes replaces it).
        namespace: the namespace of every object.
        workdir: the directory ``run_train.sh`` is in inside the image.
        token_secret: the Secret holding the job token under key ``token``; "" runs without a
            token (anyone who reaches the lighthouse's port may join).
        trainer_args: flags for the trainer after the ``fault_tolerance`` ones.
        env: more environment variables for the groups (e.g. ``GLOO_SOCKET_IFNAME``,
            ``TORCHFT_QUORUM_TIMEOUT_SEC``); never the token.
    """

    name: str
    image: str
    replicas: int = 2
    workers_per_replica: int = 1
    gpus_per_worker: int = 0
    min_replicas: int = 1
    max_restarts: int = 10
    namespace: str = "default"
    workdir: str = "/workspace/torchtitan_ft"
    token_secret: str = ""
    trainer_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not _is_dns_label(self.name) or len(self.name) > 40:
            raise ValueError(
                f"name {self.name!r} is not a DNS label of at most 40 characters "
                "(lowercase letters, digits and '-', starting and ending with a letter or digit)"
            )
        if not self.image:
            raise ValueError("image is empty; name the container image the groups run")
        for what, value, least in (
            ("replicas", self.replicas, 1),
            ("workers_per_replica", self.workers_per_replica, 1),
            ("gpus_per_worker", self.gpus_per_worker, 0),
            ("max_restarts", self.max_restarts, 0),
        ):
            if value < least:
                raise ValueError(f"{what} must be >= {least}, got {value}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(
                f"min_replicas must be between 1 and replicas ({self.replicas}), "
                f"got {self.min_replicas}"
            )
        if any(k == AUTH_TOKEN_ENV for k, _ in self.env):
            raise ValueError(
                f"env sets {AUTH_TOKEN_ENV}: the job token must not be written into manifests; "
                "put it in a Secret and pass its name as token_secret"
            )

    @property
    def lighthouse_name(self) -> str:
        return f"{self.name}-lighthouse"

    @property
    def groups_name(self) -> str:
        return f"{self.name}-groups"


def _is_dns_label(value: str) -> bool:
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-")
    return bool(value) and set(value) <= allowed and value[0] != "-" and value[-1] != "-"


def _token_env(job: KubernetesJob) -> list[dict[str, Any]]:
    if not job.token_secret:
        return []
    return [
        {
            "name": AUTH_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": job.token_secret, "key": TOKEN_KEY}},
        }
    ]


def _metadata(job: KubernetesJob, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": _labels(job, component)}


def _labels(job: KubernetesJob, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "torchtitan-ft", "torchtitan-ft/job": job.name,
            "torchtitan-ft/component": component}  # fmt: skip


def lighthouse_manifests(job: KubernetesJob) -> list[dict[str, Any]]:
    """The lighthouse's Deployment and Service."""
    labels = _labels(job, "lighthouse")
    ports = [
        {"name": "grpc", "containerPort": LIGHTHOUSE_PORT},
        {"name": "status", "containerPort": LIGHTHOUSE_PORT + 1},
    ]
    container = {
        "name": "lighthouse",
        "image": job.image,
        "command": ["torchft_lighthouse"],
        "args": [
            f"--bind=[::]:{LIGHTHOUSE_PORT}",
            f"--min_replicas={job.min_replicas}",
            f"--status_bind=[::]:{LIGHTHOUSE_PORT + 1}",
        ],
        "env": _token_env(job),
        "ports": ports,
        "readinessProbe": {"tcpSocket": {"port": LIGHTHOUSE_PORT}, "periodSeconds": 2},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(job, job.lighthouse_name, "lighthouse"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.lighthouse_name, "lighthouse"),
        "spec": {
            "selector": labels,
            "ports": [{"name": p["name"], "port": p["containerPort"]} for p in ports],
        },
    }
    return [deployment, service]


def group_manifests(job: KubernetesJob) -> list[dict[str, Any]]:
    """The replica groups' StatefulSet and its headless Service."""
    labels = _labels(job, "group")
    lighthouse = f"http://{job.lighthouse_name}.{job.namespace}.svc:{LIGHTHOUSE_PORT}"
    env: list[dict[str, Any]] = [
        {
            "name": "REPLICA_GROUP_ID",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{GROUP_ID_LABEL}']"}},
        },
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # The group's launcher job on the lighthouse's status page; $(POD_NAME) is expanded by
        # Kubernetes from the variable above.
        {"name": LAUNCHER_JOB_ENV, "value": "pod:$(POD_NAME)"},
        {"name": "NUM_REPLICA_GROUPS", "value": str(job.replicas)},
        {"name": "TORCHFT_LIGHTHOUSE", "value": lighthouse},
        {"name": "NGPU", "value": str(job.workers_per_replica)},
        {"name": "MAX_RESTARTS", "value": str(job.max_restarts)},
        *({"name": k, "value": v} for k, v in job.env),
        *_token_env(job),
    ]
    container: dict[str, Any] = {
        "name": "trainer",
        "image": job.image,
        "workingDir": job.workdir,
        "command": ["bash", "run_train.sh"],
        # $(VAR) is expanded by Kubernetes from the container's env.
        "args": [
            "--fault_tolerance.enable",
            "--fault_tolerance.replica_id=$(REPLICA_GROUP_ID)",
            f"--fault_tolerance.group_size={job.replicas}",
            "--fault_tolerance.hostname=$(POD_IP)",
            *job.trainer_args,
        ],
        "env": env,
    }
    gpus = job.gpus_per_worker * job.workers_per_replica
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(job, job.groups_name, "group"),
        "spec": {
            "replicas": job.replicas,
            "serviceName": job.groups_name,
            # Pods start and are replaced independently: a dead group is not waited for.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container], "restartPolicy": "Always"},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.groups_name, "group"),
        "spec": {"clusterIP": "None", "selector": labels},
    }
    return [statefulset, service]


def manifests(job: KubernetesJob) -> list[dict[str, Any]]:
    """Every object of the job, in the order to apply them."""
    return [*lighthouse_manifests(job), *group_manifests(job)]


class _NoAliases(yaml.SafeDumper):
    """Writes a mapping used twice (the labels, as selector and as template labels) twice,
    instead of as a YAML anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(objects: Sequence[dict[str, Any]]) -> str:
    """``objects`` as one YAML stream of documents."""
    return yaml.dump_all(objects, Dumper=_NoAliases, sort_keys=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_ft.kubernetes",
        description="Writes the Kubernetes manifests of a fault-tolerant TorchTitan job "
        "(lighthouse Deployment and Service, the replica groups' StatefulSet) to stdout. "
        "Trainer flags follow '--'.",
    )
    defaults = KubernetesJob("x", "x")
    p.add_argument("--name", required=True, help="the job's name, a DNS label")
    p.add_argument("--image", required=True, help="container image with torchtitan_ft")
    p.add_argument("--replicas", type=int, default=defaults.replicas)
    p.add_argument("--workers_per_replica", type=int, default=defaults.workers_per_replica)
    p.add_argument("--gpus_per_worker", type=int, default=defaults.gpus_per_worker)
    p.add_argument("--min_replicas", type=int, default=defaults.min_replicas)
    p.add_argument("--max_restarts", type=int, default=defaults.max_restarts)
    p.add_argument("--namespace", default=defaults.namespace)
    p.add_argument("--workdir", default=defaults.workdir)
    p.add_argument(
        "--token_secret",
        default="",
        help="Secret with the job token under key 'token' (default: no token)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of the groups (repeatable; never the token)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args = parser.parse_args(argv[:split])
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env {item!r} is not KEY=VALUE")
        env.append((key, value))
    try:
        job = KubernetesJob(
            name=args.name,
            image=args.image,
            replicas=args.replicas,
            workers_per_replica=args.workers_per_replica,
            gpus_per_worker=args.gpus_per_worker,
            min_replicas=args.min_replicas,
            max_restarts=args.max_restarts,
            namespace=args.namespace,
            workdir=args.workdir,
            token_secret=args.token_secret,
            trainer_args=tuple(argv[split + 1 :]),
            env=tuple(env),
        )
    except ValueError as e:
        parser.error(str(e))
    sys.stdout.write(to_yaml(manifests(job)))


if __name__ == "__main__":
    main()
