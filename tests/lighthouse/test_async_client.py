"""``AsyncLighthouseClient`` (the ManagerServer's quorum requests, on its event loop) against a
real lighthouse: the held-open stream, a request that times out, a lighthouse that restarts."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from tests.lighthouse._helpers import T
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.lighthouse.client import AsyncLighthouseClient


def _run(coro_fn):
    """Runs ``coro_fn(client)`` on a fresh loop with a client made (and closed) on it."""

    async def main(addr: str):
        client = AsyncLighthouseClient(addr)
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return main


def test_requests_share_one_stream(servers) -> None:
    server = servers(min_replicas=1)

    async def two_quorums(client: AsyncLighthouseClient):
        first, _ = await client.quorum_with_speeds("r", T, step=3, data={"k": 1})
        stream = client._stream
        second, _ = await client.quorum_with_speeds("r", T, step=4)
        return first, second, stream is not None and client._stream is stream

    first, second, same_stream = asyncio.run(_run(two_quorums)(server.address()))
    assert [(m.replica_id, m.step, m.data) for m in first.participants] == [("r", 3, {"k": 1})]
    assert second.participants[0].step == 4
    assert same_stream


def test_a_timed_out_request_leaves_the_client_usable(servers) -> None:
    """Nobody else asks: the request times out (its stream is cancelled); once a second
    member asks too, the next request gets the quorum on a new stream."""
    server = servers(min_replicas=2)

    async def timeout_then_quorum(client: AsyncLighthouseClient):
        with pytest.raises(TimeoutError, match="no quorum from the lighthouse"):
            await client.quorum_with_speeds("a", timedelta(seconds=0.3))
        other = AsyncLighthouseClient(server.address())
        try:
            got = await asyncio.gather(
                client.quorum_with_speeds("a", T), other.quorum_with_speeds("b", T)
            )
        finally:
            await other.close()
        return [m.replica_id for m in got[0][0].participants]

    assert asyncio.run(_run(timeout_then_quorum)(server.address())) == ["a", "b"]


def test_a_lighthouse_restart_is_retried_within_the_timeout() -> None:
    """The stream breaks when the lighthouse goes away; requests are retried (UNAVAILABLE)
    until a lighthouse on the same port answers."""
    first = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    addr = first.address()
    port = addr.rsplit(":", 1)[1]

    async def across_restart(client: AsyncLighthouseClient):
        await client.quorum_with_speeds("r", T, step=1)
        first.shutdown()
        loop = asyncio.get_running_loop()
        restarted = loop.run_in_executor(
            None, lambda: LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1)
        )
        try:
            quorum, _ = await client.quorum_with_speeds("r", T, step=2)
        finally:
            (await restarted).shutdown()
        return quorum

    quorum = asyncio.run(_run(across_restart)(addr))
    assert quorum.participants[0].step == 2


def test_wait_unreachable_returns_once_a_connection_attempt_fails(servers) -> None:
    """A live lighthouse never counts as unreachable; one that is gone does once a request
    tries to connect (what lets a round go on without it: ``manager.outage``)."""
    server = servers(min_replicas=1)
    gone = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    gone_addr = gone.address()
    gone.shutdown()

    async def live(client: AsyncLighthouseClient) -> bool:
        await client.quorum_with_speeds("r", T, step=1)
        try:
            await asyncio.wait_for(client.wait_unreachable(), 0.5)
        except TimeoutError:
            return False
        return True

    async def dead(client: AsyncLighthouseClient) -> float:
        loop = asyncio.get_running_loop()
        asked = asyncio.ensure_future(client.quorum_with_speeds("r", T, step=1))
        started = loop.time()
        try:
            await asyncio.wait_for(client.wait_unreachable(), 10.0)
        finally:
            asked.cancel()
        return loop.time() - started

    assert asyncio.run(_run(live)(server.address())) is False
    assert asyncio.run(_run(dead)(gone_addr)) < 10.0
