"""Every RPC of every service in the proto, called without the job token on a real server
that has one, is refused with UNAUTHENTICATED; with the token it gets past the check. The
RPCs come from the proto's service descriptors, not from the servers' tables, so an RPC added
to the proto fails here until its server's table (``rpc_server.Rpc``) guards it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.rpc_server import Rpc, rpc_table
from torchtitan_ft.testing.servers import loopback_manager_server

TOKEN = "job-s3cret"
WITHOUT = [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]
"""No token, a wrong one, the right one without ``Bearer``."""


def _lighthouse() -> tuple[str, Callable[[], None]]:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token=TOKEN)
    return server.address(), server.shutdown


def _manager() -> tuple[str, Callable[[], None]]:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token=TOKEN)
    server = loopback_manager_server(lighthouse.address(), auth_token=TOKEN)

    def stop() -> None:
        server.shutdown()
        lighthouse.shutdown()

    return server.address(), stop


SERVERS = {"LighthouseService": _lighthouse, "ManagerService": _manager}
"""The server of each service of the proto."""


def _every_rpc() -> list[tuple[str, MethodDescriptor]]:
    return [
        (service.name, method)
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def test_every_service_of_the_proto_has_a_server_here() -> None:
    assert sorted(pb.DESCRIPTOR.services_by_name) == sorted(SERVERS)


@pytest.fixture(scope="module")
def channels() -> Iterator[dict[str, grpc.Channel]]:
    started = {name: start() for name, start in SERVERS.items()}
    opened = {
        name: grpc.insecure_channel(address.removeprefix("http://"))
        for name, (address, _) in started.items()
    }
    yield opened
    for channel in opened.values():
        channel.close()
    for _, stop in started.values():
        stop()


def _call(channel: grpc.Channel, method: MethodDescriptor, request: bytes, metadata) -> None:
    """One call of ``method`` carrying ``request`` bytes (one message on a stream)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming and method.server_streaming:
        for _ in channel.stream_stream(path)(iter([request]), timeout=5, metadata=metadata):
            pass
    elif method.client_streaming:
        channel.stream_unary(path)(iter([request]), timeout=5, metadata=metadata)
    elif method.server_streaming:
        for _ in channel.unary_stream(path)(request, timeout=5, metadata=metadata):
            pass
    else:
        channel.unary_unary(path)(request, timeout=5, metadata=metadata)


@pytest.mark.parametrize(
    ("service", "method"), _every_rpc(), ids=[f"{s}.{m.name}" for s, m in _every_rpc()]
)
def test_every_rpc_answers_only_with_the_token(channels, service, method) -> None:
    channel = channels[service]
    for metadata in WITHOUT:
        with pytest.raises(grpc.RpcError) as refused:
            _call(channel, method, b"", metadata)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, (metadata, refused.value)
        assert f"{service}/{method.name} refused" in refused.value.details()
    # With the token the call reaches the handler, given a malformed request (so that no
    # handler acts on it: Kill would end this process), which it refuses or skips.
    try:
        _call(channel, method, b"\xff", (("authorization", f"Bearer {TOKEN}"),))
    except grpc.RpcError as answered:
        assert answered.code() is not grpc.StatusCode.UNAUTHENTICATED, answered


def test_a_table_must_name_every_rpc_of_the_proto_once() -> None:
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    names = [m.name for m in pb.DESCRIPTOR.services_by_name["ManagerService"].methods]
    rows = [Rpc(name, handler, needs_token=True, needs_group_key=False) for name in names]
    last = Rpc(names[-1], handler, needs_token=False, needs_group_key=True)
    _, token, key = rpc_table("torchft.ManagerService", [*rows[:-1], last])
    assert token == [f"/torchft.ManagerService/{n}" for n in names[:-1]]
    assert key == [f"/torchft.ManagerService/{names[-1]}"]
    with pytest.raises(ValueError, match=re.escape(f"has {sorted(names[:-1])}")):
        rpc_table("torchft.ManagerService", rows[:-1])
    with pytest.raises(ValueError, match="give every RPC of the proto one row"):
        rpc_table("torchft.ManagerService", [*rows, Rpc("Extra", handler, True, False)])
    with pytest.raises(ValueError, match=r"'torchft.Nope' is not a service of torchft\.proto"):
        rpc_table("torchft.Nope", rows)
