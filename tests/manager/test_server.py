"""ManagerServer / ManagerClient over real gRPC on 127.0.0.1.

Most tests use the real lighthouse; a small recording lighthouse checks exactly what the
manager server sends and makes it fail on purpose.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import timedelta

import grpc
import pytest

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager import (
    AddressInUseError,
    ManagerClient,
    ManagerServer,
    QuorumResult,
    ReplicaGroupMismatchError,
)
from torchtitan_ft.manager.identity import GroupIdentity
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc

SHORT = timedelta(seconds=5)
TOKEN = "s3cret-job-token"


def _server(lighthouse_addr: str, replica_id: str = "rep", world_size: int = 1, **kw):
    return ManagerServer(
        replica_id,
        lighthouse_addr,
        hostname="127.0.0.1",
        bind=kw.pop("bind", "127.0.0.1:0"),
        store_addr=kw.pop("store_addr", f"127.0.0.1:{hash(replica_id) % 1000 + 20000}"),
        world_size=world_size,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=SHORT,
        **kw,
    )


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    yield server
    server.shutdown()


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], None]]]:
    """Callbacks run at teardown, last registered first."""
    callbacks: list[Callable[[], None]] = []
    yield callbacks
    for callback in reversed(callbacks):
        callback()


def _start(cleanup, lighthouse_addr: str, **kw) -> tuple[ManagerServer, ManagerClient]:
    server = _server(lighthouse_addr, **kw)
    cleanup.append(server.shutdown)
    client = ManagerClient(server.address(), connect_timeout=SHORT)
    cleanup.append(client.close)
    return server, client


def _quorum(client: ManagerClient, group_rank: int, step: int = 0, **kw) -> QuorumResult:
    args = dict(
        group_rank=group_rank,
        step=step,
        checkpoint_metadata=f"metadata-{group_rank}",
        shrink_only=False,
        timeout=SHORT,
        commit_failures=0,
        init_sync=True,
    )
    args.update(kw)
    return client._quorum(**args)


def _in_parallel(*calls: Callable[[], object]) -> list[object]:
    with futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(call) for call in calls]]


class RecordingLighthouse(pb_grpc.LighthouseServiceServicer):
    """A lighthouse that records requests and answers each alone, or fails on demand."""

    def __init__(self, failures: int = 0) -> None:
        self.requests: list[pb.QuorumMember] = []
        self.failures = failures
        self._server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_LighthouseServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Quorum(self, request, context):
        self.requests.append(request.requester)
        if self.failures > 0:
            self.failures -= 1
            context.abort(grpc.StatusCode.INTERNAL, "injected lighthouse failure")
        quorum = pb.Quorum(quorum_id=len(self.requests), participants=[request.requester])
        return pb.LighthouseQuorumResponse(quorum=quorum)

    def Heartbeat(self, request, context):
        return pb.LighthouseHeartbeatResponse()

    def HeartbeatStream(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return pb.LighthouseHeartbeatResponse()

    def stop(self) -> None:
        self._server.stop(None)


@pytest.fixture
def recording() -> Iterator[RecordingLighthouse]:
    server = RecordingLighthouse()
    yield server
    server.stop()


def _closed_port_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------------- quorum


def test_ranks_are_aggregated_into_one_lighthouse_request(recording, cleanup) -> None:
    server, client = _start(cleanup, recording.address(), replica_id="grp", world_size=3)
    results = _in_parallel(
        lambda: _quorum(client, 0, step=3, commit_failures=0),
        lambda: _quorum(client, 1, step=7, commit_failures=2, shrink_only=True),
        lambda: _quorum(client, 2, step=5, commit_failures=1),
    )
    assert len(recording.requests) == 1
    requester = recording.requests[0]
    assert requester.replica_id == "grp"
    assert requester.address == server.address()
    assert requester.step == 7
    assert requester.world_size == 3
    assert requester.shrink_only
    assert requester.commit_failures == 2
    assert requester.data == ""
    assert all(r.max_step == 7 and r.commit_failures == 2 for r in results)
    assert {r.quorum_id for r in results} == {1}

    # The next round is a fresh one: again exactly one request.
    _in_parallel(*[lambda g=g: _quorum(client, g, step=8) for g in range(3)])
    assert len(recording.requests) == 2
    assert not recording.requests[1].shrink_only
    assert recording.requests[1].commit_failures == 0


def test_two_replica_groups_get_a_consistent_quorum(cleanup) -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    cleanup.append(lighthouse.shutdown)
    a, client_a = _start(
        cleanup, lighthouse.address(), replica_id="a", world_size=2, store_addr="127.0.0.1:1001"
    )
    _, client_b = _start(
        cleanup, lighthouse.address(), replica_id="b", world_size=2, store_addr="127.0.0.1:1002"
    )
    ra0, ra1, rb0, rb1 = _in_parallel(
        lambda: _quorum(client_a, 0, step=5),
        lambda: _quorum(client_a, 1, step=5),
        lambda: _quorum(client_b, 0, step=2),
        lambda: _quorum(client_b, 1, step=2),
    )
    assert len({r.quorum_id for r in (ra0, ra1, rb0, rb1)}) == 1
    assert all(r.replica_ids == ["a", "b"] and r.max_step == 5 for r in (ra0, ra1, rb0, rb1))
    # a is the only group at max_step: it is primary (store) and donor for every group rank.
    assert {r.store_address for r in (ra0, ra1, rb0, rb1)} == {"127.0.0.1:1001"}
    for r in (ra0, ra1):
        assert (r.replica_rank, r.heal, r.recover_dst_replica_ranks) == (0, False, [1])
        assert r.max_replica_rank == 0
    for r in (rb0, rb1):
        assert (r.replica_rank, r.heal, r.recover_src_replica_rank) == (1, True, 0)
        assert r.recover_src_manager_address == a.address()
        assert r.max_replica_rank is None


def test_step_zero_init_sync_heals_all_but_the_primary(cleanup) -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    cleanup.append(lighthouse.shutdown)
    _, client_a = _start(cleanup, lighthouse.address(), replica_id="a")
    _, client_b = _start(cleanup, lighthouse.address(), replica_id="b")
    ra, rb = _in_parallel(lambda: _quorum(client_a, 0), lambda: _quorum(client_b, 0))
    assert (ra.heal, rb.heal) == (False, True)
    ra, rb = _in_parallel(
        lambda: _quorum(client_a, 0, init_sync=False),
        lambda: _quorum(client_b, 0, init_sync=False),
    )
    assert (ra.heal, rb.heal) == (False, False)


def test_lighthouse_down_gives_a_timeout(cleanup) -> None:
    _, client = _start(cleanup, _closed_port_addr())
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="lighthouse"):
        _quorum(client, 0, timeout=timedelta(seconds=1))
    # Bounded by the call's 1 s, not by the 5 s connect timeout (SHORT) or retries.
    assert time.monotonic() - started < SHORT.total_seconds()
    # The server is still up and answers other calls; the failed call recorded nothing.
    with pytest.raises(RuntimeError, match=r"NOT_FOUND.*not completed a Quorum call"):
        client._checkpoint_metadata(0, SHORT)


def test_lighthouse_error_reaches_every_rank_and_server_recovers(recording, cleanup) -> None:
    recording.failures = 1
    _, client = _start(cleanup, recording.address(), world_size=2)

    def failing_quorum(group_rank: int) -> str:
        with pytest.raises(RuntimeError) as excinfo:
            _quorum(client, group_rank)
        return str(excinfo.value)

    for error in _in_parallel(*[lambda g=g: failing_quorum(g) for g in range(2)]):
        assert "UNAVAILABLE" in error
        assert "injected lighthouse failure" in error
    results = _in_parallel(*[lambda g=g: _quorum(client, g, step=1) for g in range(2)])
    assert [r.max_step for r in results] == [1, 1]


def test_quorum_retries(recording, cleanup) -> None:
    recording.failures = 2
    _, client = _start(cleanup, recording.address(), quorum_retries=2)
    result = _quorum(client, 0, step=4)
    assert result.max_step == 4
    assert len(recording.requests) == 3


def test_rank_that_gave_up_does_not_count(recording, cleanup) -> None:
    _, client = _start(cleanup, recording.address(), world_size=2)
    with pytest.raises(TimeoutError):
        _quorum(client, 0, timeout=timedelta(milliseconds=200))
    time.sleep(0.2)
    # Rank 0 withdrew: rank 1 alone must not complete the round.
    with pytest.raises(TimeoutError):
        _quorum(client, 1, timeout=timedelta(milliseconds=300))
    assert recording.requests == []


# ------------------------------------------------------------------- metadata / should_commit


def test_checkpoint_metadata(lighthouse, cleanup) -> None:
    _, client = _start(cleanup, lighthouse.address())
    with pytest.raises(RuntimeError, match=r"NOT_FOUND.*group rank 0"):
        client._checkpoint_metadata(0, SHORT)
    _quorum(client, 0, checkpoint_metadata="http://127.0.0.1:9/ckpt")
    assert client._checkpoint_metadata(0, SHORT) == "http://127.0.0.1:9/ckpt"
    _quorum(client, 0, step=1, checkpoint_metadata="second")
    assert client._checkpoint_metadata(0, SHORT) == "second"


def test_metadata_asked_while_the_ranks_first_quorum_is_with_the_lighthouse_waits_for_it(
    cleanup,
) -> None:
    """A healer's group can get the quorum before the donor's server does, and ask the donor
    for its rank's metadata then: the answer waits for the donor's round (issue 27: it was
    NOT_FOUND, and the replacement's first heal failed)."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000)
    cleanup.append(lighthouse.shutdown)
    _, donor = _start(cleanup, lighthouse.address(), replica_id="donor")
    _, other = _start(cleanup, lighthouse.address(), replica_id="other")
    long = timedelta(seconds=20)

    def pending() -> set[str]:
        return lighthouse.run_in_loop(lambda: set(lighthouse.state.pending))

    with futures.ThreadPoolExecutor(2) as pool:
        donor_quorum = pool.submit(_quorum, donor, 0, checkpoint_metadata="ckpt", timeout=long)
        # The donor's round is with the lighthouse, which waits for a second group.
        assert _wait_until(lambda: "donor" in pending())
        metadata = pool.submit(donor._checkpoint_metadata, 0, long)
        assert not _wait_until(metadata.done, timeout=1.0), metadata.exception()
        _quorum(other, 0, timeout=long)
        assert metadata.result(timeout=20) == "ckpt"
        assert donor_quorum.result(timeout=20).replica_ids == ["donor", "other"]


def test_metadata_of_a_round_that_fails_is_not_found(recording, cleanup) -> None:
    recording.failures = 1
    _, client = _start(cleanup, recording.address())
    with pytest.raises(RuntimeError, match="injected lighthouse failure"):
        _quorum(client, 0)
    with pytest.raises(RuntimeError, match=r"NOT_FOUND.*not completed a Quorum call"):
        client._checkpoint_metadata(0, SHORT)


def test_close_without_waiting_still_closes_the_channel(lighthouse, cleanup) -> None:
    server = _server(lighthouse.address())
    cleanup.append(server.shutdown)
    client = ManagerClient(server.address(), connect_timeout=SHORT)
    closer_threads = {t for t in threading.enumerate() if t.name == "close-manager-client"}
    client.close(wait=False)

    def closed() -> bool:
        try:
            client._checkpoint_metadata(0, SHORT)
        except RuntimeError as e:  # NOT_FOUND from the server while the channel is open
            assert "NOT_FOUND" in str(e)
            return False
        except (TimeoutError, ValueError):  # grpcio: the channel is closed
            return True
        raise AssertionError("no rank has sent metadata: the call cannot succeed")

    assert _wait_until(closed)
    # the close ran on its own thread, which has finished
    assert _wait_until(
        lambda: (
            {t for t in threading.enumerate() if t.name == "close-manager-client"} <= closer_threads
        )
    )


def test_should_commit_is_an_and_over_ranks(lighthouse, cleanup) -> None:
    _, client = _start(cleanup, lighthouse.address(), world_size=3)

    def vote(*votes: bool, step: int) -> list[object]:
        return _in_parallel(
            *[lambda g=g, v=v: client.should_commit(g, step, v, SHORT) for g, v in enumerate(votes)]
        )

    assert vote(True, True, True, step=1) == [True, True, True]
    assert vote(True, False, True, step=2) == [False, False, False]
    assert vote(True, True, True, step=3) == [True, True, True]


def test_should_commit_waits_for_every_rank_of_the_step(lighthouse, cleanup) -> None:
    _, client = _start(cleanup, lighthouse.address(), world_size=2)
    with pytest.raises(TimeoutError):
        client.should_commit(0, 1, True, timedelta(milliseconds=200))
    # A vote for another step does not complete step 1's barrier.
    with pytest.raises(TimeoutError):
        _in_parallel(
            lambda: client.should_commit(0, 1, True, timedelta(milliseconds=300)),
            lambda: client.should_commit(1, 2, True, timedelta(milliseconds=300)),
        )


# -------------------------------------------------------------------------------------- kill


def test_kill_refused_without_token(lighthouse, cleanup) -> None:
    _, client = _start(cleanup, lighthouse.address())
    with pytest.raises(RuntimeError, match=r"PERMISSION_DENIED.*no auth_token"):
        client.kill("go away", auth_token="anything")
    server, stranger = _start(cleanup, lighthouse.address(), replica_id="guarded", auth_token=TOKEN)
    for token in (None, "wrong"):
        with pytest.raises(RuntimeError, match=r"UNAUTHENTICATED.*ManagerService/Kill refused"):
            stranger.kill("go away", auth_token=token)
    member = ManagerClient(server.address(), connect_timeout=SHORT, auth_token=TOKEN)
    cleanup.append(member.close)
    assert member.should_commit(0, 1, True, SHORT)  # still serving


_VICTIM = """
import sys, time
from datetime import timedelta
from torchtitan_ft.manager import ManagerServer
server = ManagerServer(
    "victim", sys.argv[1], hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="127.0.0.1:1",
    world_size=1, heartbeat_interval=timedelta(milliseconds=100),
    connect_timeout=timedelta(seconds=5), auth_token=sys.argv[2],
)
print(server.address(), flush=True)
time.sleep(60)
"""


def _heartbeating(lighthouse: LighthouseServer) -> set[str]:
    return lighthouse.run_in_loop(lambda: set(lighthouse.state.heartbeats))


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.multiprocess
def test_kill_with_token_exits_the_process(lighthouse) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, lighthouse.address(), TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("http://127.0.0.1:"), proc.stderr.read()
        client = ManagerClient(address, connect_timeout=SHORT)
        assert _wait_until(lambda: "victim" in _heartbeating(lighthouse))
        client.kill("replaced by the operator", auth_token=TOKEN)
        client.close()
        assert proc.wait(timeout=10) == 1
        assert "replaced by the operator" in proc.stderr.read()
        # The heartbeat stream ended with the process: the lighthouse forgot it at once.
        assert _wait_until(lambda: "victim" not in _heartbeating(lighthouse), timeout=1.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------ bad requests


@pytest.mark.parametrize("group_rank", [-1, 2])
def test_bad_group_rank_is_rejected(lighthouse, cleanup, group_rank: int) -> None:
    _, client = _start(cleanup, lighthouse.address(), world_size=2)
    with pytest.raises(RuntimeError, match=f"INVALID_ARGUMENT.*group_rank {group_rank}"):
        _quorum(client, group_rank)
    with pytest.raises(RuntimeError, match=f"INVALID_ARGUMENT.*group_rank {group_rank}"):
        client.should_commit(group_rank, 1, True, SHORT)
    assert _in_parallel(*[lambda g=g: client.should_commit(g, 1, True, SHORT) for g in (0, 1)])


def test_quorum_without_deadline_is_rejected(lighthouse, cleanup) -> None:
    server, _ = _start(cleanup, lighthouse.address())
    with grpc.insecure_channel(server.address().removeprefix("http://")) as channel:
        stub = pb_grpc.ManagerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.Quorum(pb.ManagerQuorumRequest(group_rank=0))
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deadline" in excinfo.value.details()


def test_constructor_validation(lighthouse) -> None:
    with pytest.raises(ValueError, match="world_size"):
        _server(lighthouse.address(), world_size=0)
    with pytest.raises(ValueError, match="quorum_retries"):
        _server(lighthouse.address(), quorum_retries=-1)
    with pytest.raises(RuntimeError, match="cannot listen"):
        ManagerServer(
            "r",
            lighthouse.address(),
            bind="256.0.0.1:0",
            store_addr="x:1",
            world_size=1,
            heartbeat_interval=SHORT,
            connect_timeout=SHORT,
        )


def test_client_times_out_when_no_server() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not reachable"):
        ManagerClient(_closed_port_addr(), connect_timeout=timedelta(milliseconds=300))
    assert time.monotonic() - started < 2


def test_shutdown_is_prompt_with_a_quorum_in_flight(cleanup) -> None:
    server = _server(_closed_port_addr())
    client = ManagerClient(server.address(), connect_timeout=SHORT)
    cleanup.append(client.close)
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            _quorum(client, 0, timeout=timedelta(seconds=30))
        except (TimeoutError, RuntimeError) as e:
            errors.append(e)

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    server.shutdown()
    server.shutdown()  # idempotent
    assert time.monotonic() - started < 3
    thread.join(timeout=5)
    assert len(errors) == 1


def test_quorum_survives_a_lighthouse_restart(cleanup) -> None:
    port = int(_closed_port_addr().rsplit(":", 1)[1])
    bind = f"127.0.0.1:{port}"
    first = LighthouseServer(bind=bind, min_replicas=2, join_timeout_ms=100)
    _, client = _start(cleanup, f"http://127.0.0.1:{port}")
    with futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_quorum, client, 0, step=2, timeout=timedelta(seconds=10))
        time.sleep(0.3)  # the request is long-polling: min_replicas=2 is not met
        first.shutdown()
        second = LighthouseServer(bind=bind, min_replicas=1, join_timeout_ms=100)
        cleanup.append(second.shutdown)
        assert pending.result(timeout=10).max_step == 2
    assert _quorum(client, 0, step=3).max_step == 3


# ------------------------------------------------------------------------- group identity


def test_identity_goes_to_the_lighthouse_in_member_data(recording, cleanup) -> None:
    server, client = _start(cleanup, recording.address(), replica_id="grp:uuid")
    server.set_identity(GroupIdentity(replica="grp", model="ab12: 1 params / 4 elements"))
    _quorum(client, 0)
    assert json.loads(recording.requests[0].data) == {
        "replica": "grp",
        "model": "ab12: 1 params / 4 elements",
        "group_size": None,
    }


def _two_groups(cleanup, a: GroupIdentity, b: GroupIdentity):
    """Group a trains alone first; then group b (a newcomer) joins a's next quorum."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10000)
    cleanup.append(lighthouse.shutdown)
    server_a, client_a = _start(cleanup, lighthouse.address(), replica_id=f"{a.replica}:u1")
    server_a.set_identity(a)
    assert _quorum(client_a, 0, step=3).replica_world_size == 1
    server_b, client_b = _start(cleanup, lighthouse.address(), replica_id=f"{b.replica}:u2")
    server_b.set_identity(b)

    def newcomer() -> BaseException | QuorumResult:
        try:
            return _quorum(client_b, 0)
        except ReplicaGroupMismatchError as e:
            return e

    def running() -> QuorumResult:
        time.sleep(0.3)  # b asks first; the lighthouse waits for a, the previous member
        return _quorum(client_a, 0, step=3)

    return _in_parallel(newcomer, running)


def test_newcomer_with_another_model_fails_and_running_group_carries_on(
    cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="torchtitan_ft.manager.server")
    b_error, a_result = _two_groups(
        cleanup, GroupIdentity("ft_0", model="aaaa: 2 params / 10 elements"),
        GroupIdentity("ft_1", model="bbbb: 2 params / 12 elements"),
    )  # fmt: skip
    assert isinstance(b_error, ReplicaGroupMismatchError)
    assert str(b_error) == (
        "replica group 'ft_1' runs a different model than 'ft_0' (fingerprint bbbb: 2 params "
        "/ 12 elements vs aaaa: 2 params / 10 elements); start every group with the same model "
        "config"
    )
    assert isinstance(a_result, QuorumResult) and a_result.replica_world_size == 2
    a_lines = [r.getMessage() for r in caplog.records if "ft_0:u1" in r.getMessage()]
    assert len(a_lines) == 1 and "different model" in a_lines[0] and "carries on" in a_lines[0]


def test_second_group_with_a_used_replica_id_fails(cleanup) -> None:
    b_error, a_result = _two_groups(cleanup, GroupIdentity("ft_0"), GroupIdentity("ft_0"))
    assert isinstance(b_error, ReplicaGroupMismatchError)
    assert "replica_id 'ft_0' is already used by a live replica group" in str(b_error)
    assert isinstance(a_result, QuorumResult)


class ScriptedLighthouse(RecordingLighthouse):
    """A lighthouse whose n-th quorum holds the requester and the n-th list of ``others``."""

    def __init__(self, others: list[list[pb.QuorumMember]]) -> None:
        super().__init__()
        self.others = others

    def Quorum(self, request, context):
        self.requests.append(request.requester)
        others = self.others[len(self.requests) - 1]
        quorum = pb.Quorum(quorum_id=len(self.requests), participants=[request.requester, *others])
        return pb.LighthouseQuorumResponse(quorum=quorum)


def _member(replica_id: str, host: str, step: int) -> pb.QuorumMember:
    return pb.QuorumMember(
        replica_id=replica_id,
        address=f"http://{host}:1234",
        store_address=f"{host}:5678",
        step=step,
        world_size=1,
    )


def test_loopback_group_that_trained_before_a_remote_peer_came_stops_at_that_quorum(
    cleanup,
) -> None:
    """The start order of the multi-host test that kept failing reconfigurations: this group
    (advertising 127.0.0.1) trains alone, then beside a group of its own host (advertising
    ``localhost``); the first quorum with a group on another host (192.0.2.1, not an address
    of this machine) must stop it with the address to set, though it is no newcomer."""
    local = _member("local:u2", "localhost", step=1)
    remote = _member("remote:u3", "192.0.2.1", step=0)
    scripted = ScriptedLighthouse([[], [local], [local, remote]])
    cleanup.append(scripted.stop)
    _, client = _start(cleanup, scripted.address(), replica_id="loopback:u1")
    assert _quorum(client, 0, step=1).replica_world_size == 1
    assert _quorum(client, 0, step=1).replica_world_size == 2
    with pytest.raises(ReplicaGroupMismatchError) as refused:
        _quorum(client, 0, step=1)
    assert "replica group 'loopback:u1' advertises loopback (127.0.0.1" in str(refused.value)
    assert "replica group 'remote:u3' runs on another host (192.0.2.1)" in str(refused.value)
    assert "set fault_tolerance.hostname to" in str(refused.value)


def test_port_in_use_is_named(lighthouse) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUseError, match=f"127.0.0.1:{port}.*in use") as excinfo:
            _server(lighthouse.address(), bind=f"127.0.0.1:{port}")
    assert excinfo.value.bind == f"127.0.0.1:{port}"
