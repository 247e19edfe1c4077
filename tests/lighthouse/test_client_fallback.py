"""The lighthouse client's stream-or-unary fallback, on both faces (``LighthouseClient`` and
``AsyncLighthouseClient``) over one rule (``client.stream_failure``): a stream the lighthouse
ends with INTERNAL is asked again as a unary call at once (and the stream tried again on the
next request); UNIMPLEMENTED (torchft's lighthouse) means unary calls from then on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from tests.lighthouse._helpers import T
from torchtitan_ft.lighthouse.client import (
    AsyncLighthouseClient,
    LighthouseClient,
    StreamFailure,
    stream_failure,
)
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc


@pytest.mark.parametrize(
    ("code", "failure"),
    [
        (grpc.StatusCode.UNIMPLEMENTED, StreamFailure.UNARY_FROM_NOW_ON),
        (grpc.StatusCode.INTERNAL, StreamFailure.UNARY_THIS_TIME),
        (grpc.StatusCode.UNAVAILABLE, StreamFailure.RAISE),
        (grpc.StatusCode.UNAUTHENTICATED, StreamFailure.RAISE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, StreamFailure.RAISE),
    ],
)
def test_stream_failure(code: grpc.StatusCode, failure: StreamFailure) -> None:
    assert stream_failure(code) is failure


class StreamFailingLighthouse(pb_grpc.LighthouseServiceServicer):
    """A lighthouse whose ``QuorumStream`` ends with ``code`` and whose unary ``Quorum``
    answers each request alone; counts both."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.streams = 0
        self.unary = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_LighthouseServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def QuorumStream(self, request_iterator, context):
        self.streams += 1
        next(request_iterator)
        context.abort(self.code, "stream refused by the test")

    def Quorum(self, request, context):
        self.unary += 1
        quorum = pb.Quorum(quorum_id=self.unary, participants=[request.requester])
        return pb.LighthouseQuorumResponse(quorum=quorum)

    def stop(self) -> None:
        self._server.stop(None)


@pytest.fixture(params=[grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED])
def lighthouse(request) -> Iterator[StreamFailingLighthouse]:
    server = StreamFailingLighthouse(request.param)
    yield server
    server.stop()


def _expected_streams(lighthouse: StreamFailingLighthouse) -> int:
    """Two requests: INTERNAL tries the stream each time, UNIMPLEMENTED only the first."""
    return 2 if lighthouse.code is grpc.StatusCode.INTERNAL else 1


def test_the_blocking_client_falls_back_to_unary(lighthouse) -> None:
    client = LighthouseClient(lighthouse.address())
    try:
        quorums = [client.quorum("r", T, step=step) for step in (1, 2)]
    finally:
        client.close()
    assert [q.participants[0].step for q in quorums] == [1, 2]
    assert lighthouse.unary == 2
    assert lighthouse.streams == _expected_streams(lighthouse)


def test_the_async_client_falls_back_to_unary(lighthouse) -> None:
    async def two_quorums() -> list:
        client = AsyncLighthouseClient(lighthouse.address())
        try:
            return [(await client.quorum_with_speeds("r", T, step=s))[0] for s in (1, 2)]
        finally:
            await client.close()

    quorums = asyncio.run(two_quorums())
    assert [q.participants[0].step for q in quorums] == [1, 2]
    assert lighthouse.unary == 2
    assert lighthouse.streams == _expected_streams(lighthouse)
