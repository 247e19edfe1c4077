"""The TorchX components as application definitions (no scheduler): one role per replica group
with torchft's ports, ids and restarts; the TorchTitan component's lighthouse role; the
environment passed through, the job token never; a lighthouse of this machine that nobody runs
refused."""

from __future__ import annotations

import socket

import pytest
from torchx.specs import macros

from torchtitan_ft import torchx as components
from torchtitan_ft.auth import AUTH_TOKEN_ENV, GROUP_KEY_ENV

TOKEN = "s3cr3t-token-value"


@pytest.fixture(autouse=True)
def _lighthouse_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hsdp``'s lighthouse on a host that is not probed (the default, localhost:29510, would
    be: a test that means to probe sets its own)."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh.example:29510")
    monkeypatch.setattr(components, "LIGHTHOUSE_WAIT_S", 0.3)


@pytest.mark.parametrize("how", ["hsdp", "titan"])
def test_a_lighthouse_of_this_machine_that_nobody_runs_is_refused(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"http://127.0.0.1:{server.getsockname()[1]}"

        def submit() -> object:
            if how == "hsdp":
                monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
                return components.hsdp()
            return components.titan(lighthouse=address)

        app = submit()  # something listens: accepted
        assert {r.env["TORCHFT_LIGHTHOUSE"] for r in app.roles} == {address}
    named = "TORCHFT_LIGHTHOUSE" if how == "hsdp" else "lighthouse"
    with pytest.raises(ValueError, match=f"{named} {address}: nobody listens there") as e:
        submit()  # closed: nobody listens
    assert "\n" not in str(e.value)


def test_hsdp_has_torchfts_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    app = components.hsdp("--lr", "0.1", replicas=3, workers_per_replica=2, script="train.py")
    assert [r.name for r in app.roles] == ["replica_0", "replica_1", "replica_2"]
    for i, role in enumerate(app.roles):
        assert role.entrypoint == "torchrun"
        assert role.args == [
            f"--master_port={29600 + i}",
            "--nnodes=1",
            "--nproc_per_node=2",
            "--max_restarts=10",
            "train.py",
            "--lr",
            "0.1",
        ]
        assert role.env["REPLICA_GROUP_ID"] == str(i)
        assert role.env["NUM_REPLICA_GROUPS"] == "3"
        assert role.env["TORCHFT_LIGHTHOUSE"] == "http://lh:29510"
        assert role.max_retries == 0


def test_titan_has_a_lighthouse_role_that_ends_with_the_job() -> None:
    app = components.titan(
        "--training.steps=5", replicas=2, workers_per_replica=2, lighthouse_port=29700,
        min_replicas=2, lighthouse_idle_exit_ms=5000,
    )  # fmt: skip
    lighthouse, *groups = app.roles
    assert lighthouse.entrypoint == "torchft_lighthouse"
    assert "--min_replicas=2" in lighthouse.args
    assert "--exit_when_idle_ms=5000" in lighthouse.args
    for i, role in enumerate(groups):
        assert role.args == components.titan_group_args(i, 2, ["--training.steps=5"])
        assert role.env["TORCHFT_LIGHTHOUSE"] == "http://localhost:29700"
        assert (role.env["NGPU"], role.env["MAX_RESTARTS"]) == ("2", "10")


def test_titan_with_a_lighthouse_apart_has_no_lighthouse_role() -> None:
    app = components.titan(lighthouse="http://lh.example:29510")
    assert [r.name for r in app.roles] == ["replica_0", "replica_1"]
    assert {r.env["TORCHFT_LIGHTHOUSE"] for r in app.roles} == {"http://lh.example:29510"}


def test_environment_passes_through_but_never_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)
    monkeypatch.setenv(GROUP_KEY_ENV, TOKEN + "-key")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "90")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    for app in (components.hsdp(), components.titan()):
        assert TOKEN not in repr(app)
        for role in app.roles:
            assert role.env["TORCHFT_QUORUM_TIMEOUT_SEC"] == "90"
            assert role.env["GLOO_SOCKET_IFNAME"] == "ib0"
            assert AUTH_TOKEN_ENV not in role.env and GROUP_KEY_ENV not in role.env


@pytest.mark.parametrize("component", [components.hsdp, components.titan])
@pytest.mark.parametrize("secret", [AUTH_TOKEN_ENV, GROUP_KEY_ENV])
def test_a_secret_in_env_is_refused(component, secret: str) -> None:
    with pytest.raises(ValueError, match=secret):
        component(env={secret: TOKEN})


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"replicas": 0}, "replicas must be >= 1, got 0"),
        ({"workers_per_replica": 0}, "workers_per_replica must be >= 1, got 0"),
        ({"max_restarts": -1}, "max_restarts must be >= 0, got -1"),
    ],
)
def test_bad_counts_are_named(kwargs: dict, named: str) -> None:
    for component in (components.hsdp, components.titan):
        with pytest.raises(ValueError, match=named):
            component(**kwargs)


def test_titan_min_replicas_above_the_group_count_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"min_replicas must be between 1 and replicas \(2\), got 3"
    ):
        components.titan(replicas=2, min_replicas=3)


@pytest.mark.parametrize("component", [components.hsdp, components.titan])
def test_each_group_names_its_torchx_app_and_role_as_its_launcher_job(
    component, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHFT_LAUNCHER_JOB", "from-the-submitter")  # the role's own wins
    app = component(replicas=2)
    submitted = macros.Values(img_root="", app_id="app-7", replica_id="0", rank0_env="")
    jobs = {
        r.name: submitted.apply(r).env["TORCHFT_LAUNCHER_JOB"]
        for r in app.roles
        if r.name != "lighthouse"
    }
    assert jobs == {"replica_0": "torchx:app-7/replica_0", "replica_1": "torchx:app-7/replica_1"}
