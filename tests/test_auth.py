"""The job token's checks (torchtitan_ft.auth): which tokens a server accepts at start, and
which ``authorization`` values present a token."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from torchtitan_ft.auth import (
    AUTH_TOKEN_ENV,
    GROUP_KEY_ENV,
    bearer,
    check_token,
    group_key,
    presents,
    presents_key,
    resolve_group_key,
)
from torchtitan_ft.checkpoint import HTTPTransport
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer
from torchtitan_ft.manager.server import ManagerServer


@pytest.mark.parametrize(
    ("value", "token", "expected"),
    [
        (bearer("s3cret"), "s3cret", True),
        (bearer("s3cret").encode(), "s3cret", True),
        (bearer("s3cret "), "s3cret", False),
        ("s3cret", "s3cret", False),
        (None, "s3cret", False),
        # Every non-Latin-1 character used to compare equal to '?' (issue 20, N4).
        ("Bearer ab\u043a", "ab?", False),
        ("Bearer ab\udcff", "ab?", False),  # a lone surrogate is bytes of its own
        (b"Bearer ab\xd0\xba", "ab?", False),
    ],
)
def test_presents_compares_the_exact_bytes(value, token, expected) -> None:
    assert presents(value, token) is expected


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("", "non-empty string"),
        ("\u043a\u043b\u044e\u0447-\u0441\u0435\u043a\u0440\u0435\u0442", "visible ASCII"),
        ("s3cret\n", r"'\\n'"),  # a token read from a file, newline kept (N5)
        ("two words", "' '"),
        ("tab\t", r"'\\t'"),
    ],
)
def test_tokens_no_client_can_present_are_refused(token, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_token(token, "auth_token")


@pytest.mark.parametrize("token", ["s3cret", "A-z_0.9~+/=!", None])
def test_visible_ascii_tokens_are_accepted(token) -> None:
    check_token(token, "auth_token")


@pytest.mark.parametrize(
    "make",
    [
        lambda token: LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token=token),
        lambda token: ManagerServer(
            replica_id="r",
            lighthouse_addr="http://127.0.0.1:9",
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="127.0.0.1:9",
            world_size=1,
            heartbeat_interval=timedelta(seconds=1),
            connect_timeout=timedelta(seconds=1),
            auth_token=token,
        ),
    ],
    ids=["lighthouse", "manager_server"],
)
def test_servers_refuse_a_non_ascii_token_at_start(make) -> None:
    with pytest.raises(ValueError, match="visible ASCII"):
        make("\u043a\u043b\u044e\u0447-\u0441\u0435\u043a\u0440\u0435\u0442")


def test_torchft_style_clients_take_the_token_from_the_env(monkeypatch) -> None:
    """torchft's API has no token argument: a program written for it joins a job with a
    token through TORCHFT_AUTH_TOKEN (real lighthouse, real HTTP checkpoint server)."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token="job-s3cret")
    donor = HTTPTransport(timedelta(seconds=10), 0, "127.0.0.1", auth_token="job-s3cret")
    try:
        donor.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, timedelta(seconds=10))
        monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
        with pytest.raises(PermissionError):
            LighthouseClient(lighthouse.address()).quorum("r", timedelta(seconds=10))
        monkeypatch.setenv(AUTH_TOKEN_ENV, "job-s3cret")
        quorum = LighthouseClient(lighthouse.address()).quorum("r", timedelta(seconds=10))
        assert [m.replica_id for m in quorum.participants] == ["r"]
        receiver = HTTPTransport(timedelta(seconds=10), 0, "127.0.0.1")
        try:
            got = receiver.recv_checkpoint(0, donor.metadata(), 3, timedelta(seconds=10))
        finally:
            receiver.shutdown()
        assert torch.equal(got["w"], torch.arange(4.0))
    finally:
        donor.shutdown(wait=False)
        lighthouse.shutdown()


# ------------------------------------------------------------------------------ group keys


def test_a_group_key_is_derived_per_group_and_secret_and_can_be_presented() -> None:
    keys = {group_key(secret, group) for secret in ("s1", "s2") for group in ("A", "B")}
    assert len(keys) == 4
    assert group_key("s1", "A") == group_key("s1", "A")
    for key in keys:
        check_token(key, "group_key")  # visible ASCII: gRPC metadata carries it as it is
        assert len(key) == 43
        assert presents_key(key, key) and presents_key(key.encode(), key)
        assert not presents_key(key[:-1], key) and not presents_key(None, key)


def test_the_group_key_comes_from_the_argument_else_the_environment() -> None:
    assert resolve_group_key("given", {GROUP_KEY_ENV: "env"}) == "given"
    assert resolve_group_key(None, {GROUP_KEY_ENV: "env"}) == "env"
    assert resolve_group_key(None, {GROUP_KEY_ENV: ""}) is None
    assert resolve_group_key(None, {}) is None
    with pytest.raises(ValueError, match=r"\$TORCHFT_GROUP_KEY may hold only visible ASCII"):
        resolve_group_key(None, {GROUP_KEY_ENV: "key\n"})
