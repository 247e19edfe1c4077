"""The Kubernetes manifests (``python -m torchtitan_ft.kubernetes``), checked offline: valid
against Kubernetes' own schemas (``kubernetes-validate``), the group id from the pod ordinal,
the lighthouse apart, the token only as a reference to a Secret. No cluster runs them here."""

from __future__ import annotations

import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from torchtitan_ft.auth import AUTH_TOKEN_ENV
from torchtitan_ft.kubernetes import GROUP_ID_LABEL, KubernetesJob, manifests, to_yaml

TOKEN = "s3cr3t-token-value"
JOB = KubernetesJob(
    "llama", "registry.example/tft:1", replicas=3, workers_per_replica=2, gpus_per_worker=1,
    min_replicas=2, token_secret="llama-token", env=(("GLOO_SOCKET_IFNAME", "eth0"),),
    trainer_args=("--module", "llama3", "--config", "llama3_8b"),
)  # fmt: skip


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.kubernetes", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.parametrize("version", ["1.28", "1.31", kubernetes_validate.latest_version()])
def test_manifests_are_valid_kubernetes_objects(version: str) -> None:
    documents = list(yaml.safe_load_all(to_yaml(manifests(JOB))))
    assert [d["kind"] for d in documents] == ["Deployment", "Service", "StatefulSet", "Service"]
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


def test_each_pod_is_one_group_whose_id_is_its_ordinal() -> None:
    _, lighthouse_service, groups, _ = manifests(JOB)
    spec = groups["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["REPLICA_GROUP_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{GROUP_ID_LABEL}']"
    )
    assert "--fault_tolerance.replica_id=$(REPLICA_GROUP_ID)" in container["args"]
    assert "--fault_tolerance.group_size=3" in container["args"]
    assert container["args"][-4:] == ["--module", "llama3", "--config", "llama3_8b"]
    assert env["NGPU"]["value"] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert env["GLOO_SOCKET_IFNAME"]["value"] == "eth0"
    service = lighthouse_service["metadata"]["name"]
    assert env["TORCHFT_LIGHTHOUSE"]["value"] == f"http://{service}.default.svc:29510"
    # The pod's name is the group's launcher job; Kubernetes expands $(POD_NAME) only from a
    # variable defined before it.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["TORCHFT_LAUNCHER_JOB"]["value"] == "pod:$(POD_NAME)"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_NAME") < names.index("TORCHFT_LAUNCHER_JOB")


def test_the_token_comes_from_the_secret_and_is_never_written() -> None:
    result = cli("--name", "llama", "--image", "img", "--token_secret", "llama-token",
                 env={AUTH_TOKEN_ENV: TOKEN})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr
    for document in yaml.safe_load_all(result.stdout):
        if document["kind"] in ("Deployment", "StatefulSet"):
            (container,) = document["spec"]["template"]["spec"]["containers"]
            (token,) = [e for e in container["env"] if e["name"] == AUTH_TOKEN_ENV]
            assert token["valueFrom"]["secretKeyRef"] == {"name": "llama-token", "key": "token"}


@pytest.mark.parametrize(
    "args, named",
    [
        (["--name", "Llama_1", "--image", "i"], "name 'Llama_1' is not a DNS label"),
        (["--name", "a", "--image", "i", "--replicas", "2", "--min_replicas", "3"],
         "min_replicas must be between 1 and replicas (2), got 3"),
        (["--name", "a", "--image", "i", "--env", f"{AUTH_TOKEN_ENV}={TOKEN}"],
         f"env sets {AUTH_TOKEN_ENV}"),
        (["--name", "a", "--image", "i", "--env", "NOEQUALS"], "--env 'NOEQUALS' is not KEY=VALUE"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(args: list[str], named: str) -> None:
    result = cli(*args)
    assert result.returncode == 2
    assert named in result.stderr
    assert TOKEN not in result.stderr
