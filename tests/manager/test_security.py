"""Strangers against a real ManagerServer (with a real lighthouse): refused with a clear error,
and the job unharmed.

The attacks of issue 15 that concern the ManagerServer: a forged ``ShouldCommit`` vote in a
group rank's name (attack 1), a forged ``Quorum`` call rewriting where healers fetch a rank's
state (attack 2, and issue 20's N1: between two rounds), calls without the job token, and
malformed requests; and the ways back that a rank's own process keeps (a reconnect, a
restart). The group's ranks are ``ManagerClient``s, one per rank as in a job (each holds its
own connection); the stranger is one more client, or raw bytes on a channel of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import timedelta

import grpc
import pytest

from tests._sockets import idle_connections
from torchtitan_ft.auth import GROUP_KEY_METADATA, group_key
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager import ManagerClient, ManagerServer, QuorumResult
from torchtitan_ft.manager.server import connection_cap
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.testing.flood import FLOOD_BOUND, Flood
from torchtitan_ft.testing.servers import loopback_manager_server

TOKEN = "s3cret-job-token"
T = timedelta(seconds=10)
"""Deadline of every call that should succeed: far beyond what one costs on a busy machine."""
SERVICE = "/torchft.ManagerService"
EVIL = "http://stranger.example:1/checkpoint"


class Group:
    """One replica group's ManagerServer and one ``ManagerClient`` per group rank."""

    def __init__(
        self,
        lighthouse: LighthouseServer,
        world_size: int,
        token: str | None,
        group_key: str | None = None,
    ) -> None:
        self.token = token
        self.server = loopback_manager_server(
            lighthouse.address(),
            world_size=world_size,
            connect_timeout=T,
            auth_token=token,
            group_key=group_key,
        )
        self.ranks = [self.client(token, group_key) for _ in range(world_size)]

    def client(self, token: str | None, group_key: str | None = None) -> ManagerClient:
        return ManagerClient(
            self.server.address(), connect_timeout=T, auth_token=token, group_key=group_key
        )

    def quorum(self, step: int) -> list[QuorumResult]:
        """Every rank joins the quorum of ``step`` with metadata ``real-<rank>-<step>``."""
        return _in_parallel(
            *[
                lambda rank=rank, client=client: _ask(client, rank, step, f"real-{rank}-{step}")
                for rank, client in enumerate(self.ranks)
            ]
        )

    def commit(self, step: int, *votes: bool) -> list[object]:
        return _in_parallel(
            *[
                lambda rank=rank, vote=vote: self.ranks[rank].should_commit(rank, step, vote, T)
                for rank, vote in enumerate(votes)
            ]
        )

    def close(self) -> None:
        for client in self.ranks:
            client.close()
        self.server.shutdown()


def _ask(
    client: ManagerClient, rank: int, step: int, metadata: str, timeout: timedelta = T
) -> QuorumResult:
    return client._quorum(
        group_rank=rank,
        step=step,
        checkpoint_metadata=metadata,
        shrink_only=False,
        timeout=timeout,
    )


def _waiting_ranks(server: ManagerServer) -> list[int]:
    """The group ranks waiting in the server's current quorum round (read on its loop)."""

    async def read() -> list[int]:
        return server._rounds.joining()

    return asyncio.run_coroutine_threadsafe(read(), server._loop).result(timeout=5)


def _held_ranks(server: ManagerServer) -> list[int]:
    """The group ranks the server's current quorum round holds calls for (read on its loop)."""

    async def read() -> list[int]:
        return server._rounds.holding()

    return asyncio.run_coroutine_threadsafe(read(), server._loop).result(timeout=5)


def _wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        time.sleep(0.01)


def _in_parallel(*calls: Callable[[], object]) -> list[object]:
    with futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(call) for call in calls]]


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    yield server
    server.shutdown()


@pytest.fixture
def group(lighthouse) -> Iterator[Callable[..., Group]]:
    groups: list[Group] = []

    def make(world_size: int = 2, token: str | None = None, group_key: str | None = None) -> Group:
        groups.append(Group(lighthouse, world_size, token, group_key))
        return groups[-1]

    yield make
    for g in groups:
        g.close()


def _raw(server: ManagerServer, method: str, request: bytes, metadata=()) -> grpc.RpcError:
    """One call of ``method`` with ``request`` bytes on a channel of its own; its error."""
    target = server.address().removeprefix("http://")
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(f"{SERVICE}/{method}")(request, timeout=5, metadata=metadata)
    return info.value


_REQUESTS = {
    "Quorum": pb.ManagerQuorumRequest(group_rank=1, step=10**12, checkpoint_metadata=EVIL),
    "ShouldCommit": pb.ShouldCommitRequest(group_rank=1, step=1, should_commit=True),
    "CheckpointMetadata": pb.CheckpointMetadataRequest(rank=0),
    "Kill": pb.KillRequest(msg="stranger"),
}


# ------------------------------------------------------------------------------- job token


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)])
def test_every_manager_call_needs_the_token(group, metadata) -> None:
    g = group(token=TOKEN)
    g.quorum(step=1)
    for method, request in _REQUESTS.items():
        error = _raw(g.server, method, request.SerializeToString(), metadata)
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED, (method, error.details())
        assert f"ManagerService/{method} refused" in error.details()
        assert "auth_token" in error.details()
    # Nothing the stranger sent reached the group: the real ranks carry on.
    assert [r.max_step for r in g.quorum(step=2)] == [2, 2]
    assert g.commit(2, True, True) == [True, True]
    assert g.ranks[0]._checkpoint_metadata(1, T) == "real-1-2"


@pytest.mark.parametrize("client_token", [None, "wrong"])
def test_our_client_without_the_token_gets_a_clear_error(group, client_token) -> None:
    g = group(world_size=1, token=TOKEN)
    stranger = g.client(client_token)
    try:
        with pytest.raises(RuntimeError, match=r"UNAUTHENTICATED: .*job token.*auth_token"):
            _ask(stranger, 0, 1, EVIL)
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            stranger.should_commit(0, 1, True, T)
    finally:
        stranger.close()
    assert g.quorum(step=1)[0].max_step == 1


def test_a_kill_with_the_token_reaches_the_handler(group) -> None:
    """The token is checked once, by the interceptor: a caller with it reaches Kill (refused
    here only for a malformed request, so that the test process survives)."""
    g = group(world_size=1, token=TOKEN)
    error = _raw(g.server, "Kill", b"\xff", (("authorization", f"Bearer {TOKEN}"),))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()


# ------------------------------------------------------------------------------- group key

KEY_A, KEY_B = group_key("launcher-secret", "A"), group_key("launcher-secret", "B")


@pytest.mark.parametrize("caller_key", [None, KEY_B, KEY_A[:-1]], ids=["none", "B", "truncated"])
def test_with_a_group_key_a_token_holder_of_another_group_cannot_act_for_it(
    group, caller_key
) -> None:
    """Group A's ranks got KEY_A at launch; a process of group B holds the job token and
    KEY_B. Its Quorum and ShouldCommit calls for A's ranks are refused before they reach the
    rounds (so it cannot even be held for a rank); it still reads A's checkpoint metadata,
    as a healer of group B must."""
    g = group(token=TOKEN, group_key=KEY_A)
    g.quorum(step=1)
    other = g.client(TOKEN, caller_key)
    try:
        for call in (
            lambda: _ask(other, 1, 10**6, EVIL),
            lambda: other.should_commit(1, 1, True, T),
        ):
            with pytest.raises(RuntimeError, match=r"UNAUTHENTICATED: .*group key") as refused:
                call()
            assert "TORCHFT_GROUP_KEY" in str(refused.value)
        assert _held_ranks(g.server) == [] and _waiting_ranks(g.server) == []
        assert other._checkpoint_metadata(1, T) == "real-1-1"
    finally:
        other.close()
    assert g.commit(1, True, True) == [True, True]
    assert [r.max_step for r in g.quorum(step=2)] == [2, 2]
    assert g.ranks[0]._checkpoint_metadata(1, T) == "real-1-2"


def test_our_client_sends_the_group_key_only_on_calls_acting_for_a_rank() -> None:
    """A healer's CheckpointMetadata and the lighthouse's Kill go to other groups' servers:
    they must not carry this group's key (a server recording every call's metadata)."""
    seen: dict[str, dict[str, str]] = {}

    class Recorder(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            seen[details.method.rpartition("/")[2]] = dict(details.invocation_metadata)
            return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Recorder()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = ManagerClient(f"http://127.0.0.1:{port}", T, auth_token=TOKEN, group_key=KEY_A)
    try:
        with contextlib.suppress(Exception):  # an empty answer is no quorum
            _ask(client, 0, 1, "m")
        client.should_commit(0, 1, True, T)
        client._checkpoint_metadata(0, T)
        client.kill("test")
    finally:
        client.close()
        server.stop(None)
    has_key = {method: GROUP_KEY_METADATA in md for method, md in seen.items()}
    assert has_key == {
        "Quorum": True,
        "ShouldCommit": True,
        "CheckpointMetadata": False,
        "Kill": False,
    }
    assert all(md["authorization"] == f"Bearer {TOKEN}" for md in seen.values())


# ----------------------------------------------------------------- attack 1: a forged vote


@pytest.mark.parametrize("token", [None, TOKEN])
def test_forged_vote_is_refused_and_the_real_vote_counts(group, token) -> None:
    """The stranger votes "yes" as rank 1 while rank 0 waits at the commit barrier; with the
    job token too (a misconfigured process of the job), its vote is not rank 1's."""
    g = group(token=token)
    g.quorum(step=1)
    stranger = g.client(token)
    with futures.ThreadPoolExecutor(1) as pool:
        rank0 = pool.submit(g.ranks[0].should_commit, 0, 1, True, T)
        try:
            with pytest.raises(RuntimeError, match="PERMISSION_DENIED") as refused:
                stranger.should_commit(1, 1, True, T)
            message = str(refused.value)
            assert "vote as group rank 1 of replica 'group' refused" in message
            assert "bound to the connection ipv4:127.0.0.1:" in message
            # Rank 0 still waits for the real rank 1, whose "no" decides the step.
            with pytest.raises(futures.TimeoutError):
                rank0.result(timeout=0.3)
            assert g.ranks[1].should_commit(1, 1, False, T) is False
            assert rank0.result(timeout=30) is False
        finally:
            stranger.close()
    # The job carries on: the next step commits.
    g.quorum(step=1)
    assert g.commit(1, True, True) == [True, True]


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_restarted_rank_takes_its_rank_over_once_its_old_connection_closed(group, token) -> None:
    """A restarted process (a new client: a new connection and no session) cannot vote for
    its rank at once; its Quorum call is held while the old client's connection is open, and
    takes the rank over, with its own checkpoint metadata, once it has closed (as a dead
    process's does); the old client's session is dead."""
    g = group(token=token)
    g.quorum(step=1)
    old, g.ranks[1] = g.ranks[1], g.client(token)
    try:
        with pytest.raises(RuntimeError, match=r"PERMISSION_DENIED.*process restarted"):
            g.ranks[1].should_commit(1, 1, True, timedelta(seconds=1))
        with futures.ThreadPoolExecutor(1) as pool:
            rounds = pool.submit(g.quorum, 2)
            _wait_until(lambda: _held_ranks(g.server) == [1])
            time.sleep(1.0)  # the connection guard looks 4 times: the old connection is open
            assert _held_ranks(g.server) == [1] and not rounds.done()
            sessions = dict(old._sessions)
            old.close()
            assert [r.max_step for r in rounds.result(timeout=30)] == [2, 2]
        assert g.ranks[0]._checkpoint_metadata(1, T) == "real-1-2"
        stale = g.client(token)
        stale._sessions = sessions  # the old client's session, on a connection of its own
        try:
            with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
                stale.should_commit(1, 2, True, timedelta(seconds=1))
        finally:
            stale.close()
        assert g.commit(2, True, True) == [True, True]
        # The new client holds the rank now: its next quorum waits for nothing.
        assert [r.max_step for r in g.quorum(step=3)] == [3, 3]
        assert g.commit(3, True, True) == [True, True]
    finally:
        old.close()


def test_two_ranks_restarted_at_once_take_their_ranks_over(group) -> None:
    """Two of three ranks restart at once: neither waits for the other."""
    g = group(world_size=3)
    g.quorum(step=1)
    for client in g.ranks[1:]:
        client.close()
    g.ranks[1:] = [g.client(None), g.client(None)]
    assert [r.max_step for r in g.quorum(step=2)] == [2, 2, 2]
    assert [g.ranks[0]._checkpoint_metadata(r, T) for r in (1, 2)] == ["real-1-2", "real-2-2"]
    assert g.commit(2, True, True, True) == [True, True, True]


def test_a_client_that_reconnects_keeps_its_rank_by_its_session(group) -> None:
    """The rank's client on a new connection (here a new client given the old one's sessions,
    as a channel that reconnects keeps them) votes at once and joins the next quorum."""
    g = group()
    g.quorum(step=1)
    reconnected = g.client(None)
    reconnected._sessions = dict(g.ranks[1]._sessions)
    g.ranks[1].close()
    g.ranks[1] = reconnected
    assert g.commit(1, True, True) == [True, True]
    assert [r.max_step for r in g.quorum(step=2)] == [2, 2]
    assert g.ranks[0]._checkpoint_metadata(1, T) == "real-1-2"


@pytest.mark.parametrize("step_s", [1.0, pytest.param(10.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_caller_who_claims_every_rank_at_once_takes_none_over(group, token, step_s) -> None:
    """Issue 40: after the real ranks voted, a caller opens two new connections and asks for
    the quorum as rank 0 and as rank 1 at once, with its own checkpoint metadata, while the
    real ranks compute a step of ``step_s``. Both calls are held and then refused when the real
    ranks join; the real ranks keep their records and votes."""
    g = group(token=token)
    g.quorum(step=1)
    assert g.commit(1, True, True) == [True, True]
    callers = [g.client(token), g.client(token)]
    with futures.ThreadPoolExecutor(2) as pool:
        try:
            forged = [pool.submit(_ask, c, r, 10**6, EVIL) for r, c in enumerate(callers)]
            _wait_until(lambda: _held_ranks(g.server) == [0, 1])
            time.sleep(step_s)
            assert _held_ranks(g.server) == [0, 1] and _waiting_ranks(g.server) == []
            assert [r.max_step for r in g.quorum(step=2)] == [2, 2]
            for call in forged:
                with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
                    call.result(timeout=30)
        finally:
            for c in callers:
                c.close()
    assert [g.ranks[0]._checkpoint_metadata(r, T) for r in (0, 1)] == ["real-0-2", "real-1-2"]
    assert g.commit(2, True, True) == [True, True]


# -------------------------------------------------------------- attack 2: a forged quorum


@pytest.mark.parametrize("token", [None, TOKEN])
def test_failed_forged_quorum_leaves_the_metadata(group, token) -> None:
    """A stranger's Quorum call as rank 1 that fails (here: its round never completes) does not
    change where healers fetch rank 1's state from."""
    g = group(token=token)
    g.quorum(step=1)
    stranger = g.client(token)
    try:
        with pytest.raises(TimeoutError):
            _ask(stranger, 1, 10**12, EVIL, timeout=timedelta(milliseconds=300))
    finally:
        stranger.close()
    assert [g.ranks[0]._checkpoint_metadata(r, T) for r in (0, 1)] == ["real-0-1", "real-1-1"]
    # The stranger's call gave up and left the round: the real ranks' next quorum completes.
    assert [r.max_step for r in g.quorum(step=2)] == [2, 2]
    assert g.commit(2, True, True) == [True, True]


@pytest.mark.parametrize("token", [None, TOKEN])
def test_forged_quorum_beside_the_real_rank_is_refused(group, token) -> None:
    """While the real rank 1 waits in a round, a stranger joining that round as rank 1 is
    refused, and the round completes with the real ranks' metadata."""
    g = group(token=token)
    g.quorum(step=1)
    stranger = g.client(token)
    with futures.ThreadPoolExecutor(1) as pool:
        rank1 = pool.submit(_ask, g.ranks[1], 1, 2, "real-1-2")
        try:
            _wait_until(lambda: _waiting_ranks(g.server) == [1])
            with pytest.raises(RuntimeError, match="PERMISSION_DENIED") as refused:
                _ask(stranger, 1, 2, EVIL)
            assert "join the quorum as group rank 1 of replica 'group' refused" in str(
                refused.value
            )
            assert _ask(g.ranks[0], 0, 2, "real-0-2").max_step == 2
            assert rank1.result(timeout=30).max_step == 2
        finally:
            stranger.close()
    assert g.ranks[0]._checkpoint_metadata(1, T) == "real-1-2"
    assert g.commit(2, True, True) == [True, True]


@pytest.mark.parametrize("token", [None, TOKEN])
def test_forged_quorum_between_rounds_is_held_and_refused(group, token) -> None:
    """Issue 20's N1: after a round, a stranger on a new connection joins as rank 1, with its
    own checkpoint metadata, before the real rank 1 asks for the next round. It is held, not
    counted: the round waits for the real rank 1 and completes with it, the stranger is
    refused, healers still fetch from the real rank, and the stranger's vote does not count."""
    g = group(token=token)
    g.quorum(step=1)
    stranger = g.client(token)
    with futures.ThreadPoolExecutor(3) as pool:
        try:
            forged = pool.submit(_ask, stranger, 1, 2, EVIL)
            _wait_until(lambda: 1 in _waiting_ranks(g.server) + _held_ranks(g.server))
            rank0 = pool.submit(_ask, g.ranks[0], 0, 2, "real-0-2")
            with pytest.raises(futures.TimeoutError):  # the round waits for the real rank 1
                rank0.result(timeout=0.5)
            rank1 = pool.submit(_ask, g.ranks[1], 1, 2, "real-1-2")
            assert [rank0.result(timeout=30).max_step, rank1.result(timeout=30).max_step] == [2, 2]
            with pytest.raises(RuntimeError, match="PERMISSION_DENIED") as refused:
                forged.result(timeout=30)
            assert "join the quorum as group rank 1 of replica 'group' refused" in str(
                refused.value
            )
            assert g.ranks[0]._checkpoint_metadata(1, T) == "real-1-2"
            with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
                stranger.should_commit(1, 2, True, T)
        finally:
            stranger.close()
    assert g.commit(2, True, True) == [True, True]


# ------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize("method", list(_REQUESTS))
def test_malformed_request_is_invalid_argument_and_the_server_stays_up(group, method) -> None:
    g = group(world_size=1, token=TOKEN)
    error = _raw(g.server, method, b"\xff\xff\xff", (("authorization", f"Bearer {TOKEN}"),))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    request_type = type(_REQUESTS[method]).__name__
    assert error.details().startswith(f"malformed {request_type}: "), error.details()
    assert g.quorum(step=1)[0].max_step == 1


def test_without_a_token_malformed_requests_are_invalid_argument_too(group) -> None:
    g = group(world_size=1)
    error = _raw(g.server, "ShouldCommit", b"\x0a")
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert g.commit(1, True) == [True]


@pytest.mark.parametrize(
    ("fd_limit", "expected"),
    [(64, 16), (256, 64), (1024, 256), (1 << 20, 1024), (resource.RLIM_INFINITY, 1024)],
)
def test_connection_cap_fits_the_descriptor_limit(fd_limit, expected) -> None:
    assert connection_cap(fd_limit) == expected


_FD_LIMIT = 256
"""The flood test's ManagerServer process runs with this many descriptors: a cap of 64."""
_SERVER = """
import resource, sys, time
from datetime import timedelta
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
from torchtitan_ft.manager import ManagerServer
server = ManagerServer(
    "group", sys.argv[1], hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="127.0.0.1:1",
    world_size=2, heartbeat_interval=timedelta(milliseconds=100),
    connect_timeout=timedelta(seconds=5),
)
print(server.address(), flush=True)
time.sleep(120)
"""


@pytest.mark.multiprocess
def test_a_flood_of_idle_connections_starves_neither_ranks_nor_healers(lighthouse) -> None:
    """300 idle connections to a ManagerServer with 256 descriptors: the ranks' connections
    keep working (they vote at once), and a healer gets in once the flood's connections miss
    their HTTP/2 handshake (5 s)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, lighthouse.address(), str(_FD_LIMIT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    flood: list[socket.socket] = []
    ranks: list[ManagerClient] = []
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("http://127.0.0.1:"), proc.stderr.read()
        ranks += [ManagerClient(address, connect_timeout=T) for _ in range(2)]
        _in_parallel(*[lambda r=r: _ask(ranks[r], r, 1, f"real-{r}-1") for r in range(2)])

        flood += idle_connections(int(address.rpartition(":")[2]), 300)
        time.sleep(1.0)  # let the server accept (and refuse) them
        assert _in_parallel(*[lambda r=r: ranks[r].should_commit(r, 1, True, T) for r in (0, 1)])
        healer = ManagerClient(address, connect_timeout=T)
        try:
            assert healer._checkpoint_metadata(1, T) == "real-1-1"
        finally:
            healer.close()
        assert proc.poll() is None
    finally:
        for s in flood:
            s.close()
        for client in ranks:
            client.close()
        proc.kill()
        _, stderr = proc.communicate()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(stderr) < 10_000, stderr[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_flood_at_the_cap_starves_neither_ranks_nor_healers(lighthouse) -> None:
    """Issue 20, N3: with 256 descriptors (a cap of 64), 72 connections that finished the
    HTTP/2 handshake and call a method the server does not have every 2 s (UNIMPLEMENTED; the
    server has no token), reopened whenever closed, used to hold every slot for the hour of
    the idle timeout: a healing rank's ``ManagerClient`` could not connect. The guard closes
    them (3 s without a call to one of the server's methods, or at once beyond 48): the ranks
    vote and form the next quorum on their own connections, and a new healer gets the
    checkpoint metadata within ``FLOOD_BOUND``, at 1 s and again at 6 s of the flood."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, lighthouse.address(), str(_FD_LIMIT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks: list[ManagerClient] = []
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("http://127.0.0.1:"), proc.stderr.read()
        ranks += [ManagerClient(address, connect_timeout=T) for _ in range(2)]
        _in_parallel(*[lambda r=r: _ask(ranks[r], r, 1, f"real-{r}-1") for r in range(2)])
        cap = connection_cap(_FD_LIMIT)
        port = int(address.rpartition(":")[2])
        with Flood(port, cap + 8, f"{SERVICE}/Flood") as flood:
            for step, at in ((1, 1.0), (2, 6.0)):
                time.sleep(max(0.0, at - (time.monotonic() - flood.started)))
                assert _in_parallel(*_votes(ranks, step)) == [True, True]
                healer = ManagerClient(address, connect_timeout=FLOOD_BOUND)
                try:
                    assert healer._checkpoint_metadata(1, FLOOD_BOUND) == f"real-1-{step}"
                finally:
                    healer.close()
                _in_parallel(*_asks(ranks, step + 1))
            assert flood.opened > cap + 8, "the server closed none of the flood's connections"
        assert proc.poll() is None
    finally:
        for client in ranks:
            client.close()
        proc.kill()
        _, stderr = proc.communicate()
    assert "Traceback" not in stderr, stderr[-3000:]


def _votes(ranks: list[ManagerClient], step: int) -> list[Callable[[], object]]:
    return [lambda r=r: ranks[r].should_commit(r, step, True, T) for r in range(len(ranks))]


def _asks(ranks: list[ManagerClient], step: int) -> list[Callable[[], object]]:
    return [lambda r=r: _ask(ranks[r], r, step, f"real-{r}-{step}") for r in range(len(ranks))]
