"""The lighthouse end to end: real gRPC server, real clients, real processes and signals."""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import grpc
import pytest

from tests.lighthouse._helpers import T, ask_all, free_port, get, wait_serving, wait_until
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer, Quorum
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc


def ids(quorum: Quorum) -> list[str]:
    return [m.replica_id for m in quorum.participants]


def test_several_clients_get_one_consistent_quorum(servers) -> None:
    server = servers(min_replicas=3)
    got = ask_all(server.address(), ["c", "a", "b"], step=7, world_size=2)
    assert {q.quorum_id for q in got.values()} == {got["a"].quorum_id}
    assert ids(got["a"]) == ["a", "b", "c"]
    assert all(m.step == 7 and m.world_size == 2 for m in got["b"].participants)


def test_member_fields_round_trip(servers) -> None:
    server = servers(min_replicas=1)
    client = LighthouseClient(server.address())
    q = client.quorum(
        "r0",
        T,
        address="http://127.0.0.1:1234",
        store_address="127.0.0.1:29500",
        step=12,
        world_size=4,
        data={"k": [1, 2]},
        commit_failures=0,
    )
    (m,) = q.participants
    assert (m.address, m.store_address, m.step, m.world_size, m.data) == (
        "http://127.0.0.1:1234",
        "127.0.0.1:29500",
        12,
        4,
        {"k": [1, 2]},
    )


def test_quorum_id_kept_for_same_members_and_bumped_on_change(servers) -> None:
    server = servers(min_replicas=2)
    first = ask_all(server.address(), ["a", "b"])["a"]
    same = ask_all(server.address(), ["a", "b"])["a"]
    assert same.quorum_id == first.quorum_id
    # A newcomer joins a fast quorum only if it is already waiting when the members return.
    newcomer: dict[str, Quorum] = {}
    t = threading.Thread(target=lambda: newcomer.update(ask_all(server.address(), ["c"])))
    t.start()
    wait_until(lambda: "c" in server.run_in_loop(lambda: set(server.state.pending)))
    bigger = ask_all(server.address(), ["a", "b"])["a"]
    t.join()
    assert ids(bigger) == ids(newcomer["c"]) == ["a", "b", "c"]
    assert bigger.quorum_id > first.quorum_id
    failures = ask_all(server.address(), ["a", "b", "c"], commit_failures=1)["a"]
    assert failures.quorum_id > bigger.quorum_id


def test_unary_heartbeat_counts_a_replica_as_healthy(servers) -> None:
    """A replica that only heartbeats counts as healthy: alone, the asker is no majority."""
    server = servers(min_replicas=1, join_timeout_ms=60_000)
    client = LighthouseClient(server.address())
    client.heartbeat("idle")
    with pytest.raises(TimeoutError):
        client.quorum("busy", timedelta(milliseconds=500))
    status = server.run_in_loop(server.state.status)
    assert "1 of 2 healthy replicas asked" in status["reason"]


_DYING_REPLICA = """
import sys, time
from datetime import timedelta
from torchtitan_ft.lighthouse import LighthouseClient
client = LighthouseClient(sys.argv[1])
stream = client.heartbeat_stream("doomed", timedelta(milliseconds=100))
client.quorum("doomed", timedelta(seconds=30))
print("in quorum", flush=True)
time.sleep(600)
"""


def survivor_and_doomed(server: LighthouseServer) -> tuple[LighthouseClient, subprocess.Popen]:
    """An in-test replica "alive" and a replica process "doomed", both known to the
    lighthouse (heartbeat streams) before either asks, so their first quorum has both."""
    survivor = LighthouseClient(server.address())
    survivor.heartbeat_stream("alive", timedelta(milliseconds=100))
    known = lambda: set(server.run_in_loop(lambda: set(server.state.heartbeats)))  # noqa: E731
    wait_until(lambda: "alive" in known())
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_REPLICA, server.address()], stdout=subprocess.PIPE, text=True
    )
    wait_until(lambda: "doomed" in known(), 30)
    return survivor, proc


@pytest.mark.multiprocess
def test_sigkilled_replica_is_dropped_from_the_next_quorum(servers) -> None:
    """With a 60 s heartbeat timeout, only the ended stream can explain a quick drop."""
    server = servers(min_replicas=1, heartbeat_timeout_ms=60_000, join_timeout_ms=60_000)
    survivor, proc = survivor_and_doomed(server)
    try:
        first = survivor.quorum("alive", T)
        assert ids(first) == ["alive", "doomed"]
        assert proc.stdout.readline().strip() == "in quorum"

        proc.send_signal(signal.SIGKILL)
        proc.wait()
        start = time.monotonic()
        second = survivor.quorum("alive", T)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert ids(second) == ["alive"]
    assert second.quorum_id > first.quorum_id
    assert elapsed < 5.0, f"dropped after {elapsed:.2f}s; the stream end was not noticed"
    assert server.run_in_loop(lambda: server.state.metrics.stream_deaths) == 1


@pytest.mark.multiprocess
def test_hung_replica_is_evicted_by_the_heartbeat_timeout(servers) -> None:
    """A SIGSTOPped process keeps its stream open but stops heartbeating."""
    server = servers(min_replicas=1, heartbeat_timeout_ms=1_000, join_timeout_ms=60_000)
    survivor, proc = survivor_and_doomed(server)
    try:
        assert ids(survivor.quorum("alive", T)) == ["alive", "doomed"]
        assert proc.stdout.readline().strip() == "in quorum"
        os.kill(proc.pid, signal.SIGSTOP)
        second = survivor.quorum("alive", T)
        status = server.run_in_loop(server.state.status)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert ids(second) == ["alive"]
    doomed = next(h for h in status["heartbeats"] if h["replica_id"] == "doomed")
    assert doomed["stream"] and not doomed["healthy"]


def test_closed_stream_drops_replica_and_unblocks_the_round(servers) -> None:
    server = servers(min_replicas=1, heartbeat_timeout_ms=60_000, join_timeout_ms=60_000)
    client = LighthouseClient(server.address())
    stream = client.heartbeat_stream("leaver", timedelta(milliseconds=50))
    wait_until(lambda: "leaver" in server.run_in_loop(lambda: set(server.state.heartbeats)))
    # "stayer" waits for the healthy "leaver" (join timeout 60 s) until the stream closes.
    done: list[Quorum] = []
    t = threading.Thread(target=lambda: done.append(client.quorum("stayer", T)))
    t.start()
    time.sleep(0.3)
    assert not done
    stream.close()
    t.join(timeout=10)
    assert [ids(q) for q in done] == [["stayer"]]


def test_requests_without_requester_or_with_garbage_are_rejected(servers) -> None:
    server = servers(min_replicas=1)
    channel = grpc.insecure_channel(server.address().removeprefix("http://"))
    raw = channel.unary_unary("/torchft.LighthouseService/Quorum")
    for payload, expected in [
        (pb.LighthouseQuorumRequest().SerializeToString(), "requester is missing"),
        (
            pb.LighthouseQuorumRequest(requester=pb.QuorumMember()).SerializeToString(),
            "replica_id is empty",
        ),
        (b"\xff\xff\xff\xff", "malformed LighthouseQuorumRequest"),
        (
            pb.LighthouseQuorumRequest(
                requester=pb.QuorumMember(replica_id="x", data="{not json")
            ).SerializeToString(),
            "is not JSON text",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            raw(payload, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in err.value.details()
    heartbeat = channel.unary_unary("/torchft.LighthouseService/Heartbeat")
    with pytest.raises(grpc.RpcError) as err:
        heartbeat(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    # Still serving.
    assert ids(LighthouseClient(server.address()).quorum("ok", T)) == ["ok"]
    assert server.run_in_loop(lambda: server.state.metrics.bad_requests) == 5


def test_client_reports_rejection_as_value_error(servers) -> None:
    server = servers(min_replicas=1)
    with pytest.raises(ValueError, match="replica_id is empty"):
        LighthouseClient(server.address()).quorum("", T)


def test_quorum_timeout_when_lighthouse_is_down() -> None:
    client = LighthouseClient(f"http://127.0.0.1:{free_port()}")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no quorum from the lighthouse"):
        client.quorum("r", timedelta(milliseconds=700))
    assert time.monotonic() - start < 5


def start_cli(port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchtitan_ft.lighthouse.cli",
            "--bind",
            f"127.0.0.1:{port}",
            "--status_bind",
            "off",
            "--min_replicas",
            "2",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.multiprocess
def test_restarted_lighthouse_never_reissues_a_quorum_id_and_replicas_resume() -> None:
    port = free_port()
    addr = f"http://127.0.0.1:{port}"
    first_run = start_cli(port)
    try:
        wait_serving(first_run)
        before = ask_all(addr, ["a", "b"])["a"]
    finally:
        first_run.kill()
        first_run.wait()

    # Replicas keep asking through the outage and get through once it is back.
    waiting: dict[str, Quorum] = {}
    asker = threading.Thread(target=lambda: waiting.update(ask_all(addr, ["a", "b"])))
    asker.start()
    time.sleep(0.5)
    second_run = start_cli(port)
    try:
        wait_serving(second_run)
        asker.join(timeout=15)
        assert "a" in waiting, "the replica did not resume through the restarted lighthouse"
        after = waiting["a"]
    finally:
        second_run.kill()
        second_run.wait()
    assert after.quorum_id > before.quorum_id


def test_status_page_json_and_metrics(servers) -> None:
    server = servers(min_replicas=2, status_bind="127.0.0.1:0")
    ask_all(server.address(), ["r-0", "r-1"], step=5, address="http://127.0.0.1:9")
    base = server.status_address()

    code, page = get(base + "/")
    assert code == 200
    assert page.count('<tr class="member">') == 2
    assert "r-0" in page and "r-1" in page and "kill" not in page

    code, body = get(base + "/status.json")
    status = json.loads(body)
    assert code == 200
    assert [m["replica_id"] for m in status["quorum"]["members"]] == ["r-0", "r-1"]
    assert status["quorum"]["members"][0]["step"] == 5
    assert "all 2 eligible healthy replicas asked" in status["reason"]
    assert {h["replica_id"] for h in status["heartbeats"]} == {"r-0", "r-1"}

    code, metrics = get(base + "/metrics")
    assert code == 200
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert values["torchft_lighthouse_quorums_issued_total"] == "1"
    assert values["torchft_lighthouse_quorum_members"] == "2"
    assert int(values["torchft_lighthouse_decision_seconds_count"]) >= 1

    assert get(base + "/nope")[0] == 404
    assert get(base + "/", method="DELETE")[0] == 405


def test_kill_action_absent_without_token(servers) -> None:
    server = servers(min_replicas=1, status_bind="127.0.0.1:0")
    ask_all(server.address(), ["r"])
    code, body = get(server.status_address() + "/replica/r/kill", method="POST")
    assert code == 404 and "no kill action" in body


def test_kill_action_needs_the_token(servers) -> None:
    server = servers(min_replicas=1, status_bind="127.0.0.1:0", auth_token="s3cret")
    ask_all(server.address(), ["r"], "s3cret", address=f"http://127.0.0.1:{free_port()}")
    url = server.status_address() + "/replica/r/kill"
    assert get(url, method="POST")[0] == 401
    assert get(url, {"Authorization": "Bearer wrong"}, method="POST")[0] == 401
    code, body = get(
        server.status_address() + "/replica/ghost/kill",
        {"Authorization": "Bearer s3cret"},
        method="POST",
    )
    assert code == 404 and "not in the current quorum" in body
    code, page = get(server.status_address() + "/")
    assert "kill" in page and "s3cret" not in page


_KILLABLE_MANAGER = """
import sys, time
from datetime import timedelta
from torchtitan_ft.manager import ManagerServer
server = ManagerServer(
    "victim", sys.argv[1], hostname="127.0.0.1", bind="127.0.0.1:0",
    store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
    connect_timeout=timedelta(seconds=5), auth_token="s3cret",
)
print(server.address(), flush=True)
time.sleep(600)
"""


@pytest.mark.multiprocess
def test_kill_action_kills_the_replica_with_the_token(servers) -> None:
    server = servers(min_replicas=1, status_bind="127.0.0.1:0", auth_token="s3cret")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE_MANAGER, server.address()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        manager_addr = proc.stdout.readline().strip()
        ask_all(server.address(), ["victim"], "s3cret", address=manager_addr)
        code, body = get(
            server.status_address() + "/replica/victim/kill",
            {"Authorization": "Bearer s3cret"},
            method="POST",
        )
        assert (code, body.strip()) == (200, "killed victim")
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()
        proc.wait()


def test_bind_in_use_is_a_clear_error(servers) -> None:
    first = servers(min_replicas=1)
    bind = first.address().removeprefix("http://")
    with pytest.raises(OSError, match=f"cannot bind the lighthouse to {bind}: port .* is in use"):
        LighthouseServer(bind=bind, min_replicas=1)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"min_replicas": 0}, "--min_replicas must be >= 1"),
        ({"min_replicas": 1, "join_timeout_ms": -1}, "--join_timeout_ms must be >= 0"),
        ({"min_replicas": 1, "quorum_tick_ms": 0}, "--quorum_tick_ms must be > 0"),
        ({"min_replicas": 1, "heartbeat_timeout_ms": -5}, "--heartbeat_timeout_ms must be > 0"),
        ({"min_replicas": 1, "bind": "localhost"}, "is not host:port"),
    ],
)
def test_constructor_validation(kw, message) -> None:
    kw.setdefault("bind", "127.0.0.1:0")
    with pytest.raises(ValueError, match=message):
        LighthouseServer(**kw)


# -- QuorumStream: our clients' quorum path --------------------------------------------------


def _request(replica_id: str, step: int = 0) -> pb.LighthouseQuorumRequest:
    return pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=replica_id, step=step))


def test_quorum_stream_answers_each_request_on_one_call(servers) -> None:
    server = servers(min_replicas=1)
    channel = grpc.insecure_channel(server.address().removeprefix("http://"))
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = channel.stream_stream(
        "/torchft.LighthouseService/QuorumStream",
        request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
        response_deserializer=pb.LighthouseQuorumResponse.FromString,
    )(iter(requests.get, None), timeout=30)
    answers = []
    for step in (3, 4, 5):
        requests.put(_request("solo", step))
        answers.append(next(call))
    requests.put(None)
    assert list(call) == []  # the server ends the call once the client is done writing
    assert [a.quorum.participants[0].step for a in answers] == [3, 4, 5]
    assert len({a.quorum.quorum_id for a in answers}) == 1  # same member: same quorum_id
    channel.close()


def test_stream_and_unary_askers_share_one_quorum(servers) -> None:
    server = servers(min_replicas=2)
    channel = grpc.insecure_channel(server.address().removeprefix("http://"))
    unary = channel.unary_unary(
        "/torchft.LighthouseService/Quorum",
        request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
        response_deserializer=pb.LighthouseQuorumResponse.FromString,
    ).future(_request("torchft-client"), timeout=30)
    streamed = LighthouseClient(server.address()).quorum("ours", T)
    assert ids(streamed) == ["ours", "torchft-client"]
    assert unary.result().quorum.quorum_id == streamed.quorum_id
    channel.close()


def test_garbage_on_quorum_stream_is_rejected_and_the_server_keeps_serving(servers) -> None:
    server = servers(min_replicas=1)
    channel = grpc.insecure_channel(server.address().removeprefix("http://"))
    raw = channel.stream_stream("/torchft.LighthouseService/QuorumStream")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([b"\xff\xff\xff\xff"]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed LighthouseQuorumRequest" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([pb.LighthouseQuorumRequest().SerializeToString()]), timeout=5))
    assert "requester is missing" in err.value.details()
    channel.close()
    assert ids(LighthouseClient(server.address()).quorum("ok", T)) == ["ok"]
    assert server.run_in_loop(lambda: server.state.metrics.bad_requests) == 2


def test_streamed_request_that_times_out_is_withdrawn_and_the_client_recovers(servers) -> None:
    server = servers(min_replicas=2, join_timeout_ms=60_000)
    client = LighthouseClient(server.address())
    with pytest.raises(TimeoutError, match="no quorum"):
        client.quorum("early", timedelta(milliseconds=500))
    # Its call was cancelled: the lighthouse no longer counts it as waiting.
    wait_until(lambda: not server.run_in_loop(lambda: set(server.state.pending)))
    # The same client asks again (a new stream) and forms a quorum with a second replica.
    got: list[Quorum] = []
    t = threading.Thread(target=lambda: got.append(client.quorum("early", T)))
    t.start()
    wait_until(lambda: "early" in server.run_in_loop(lambda: set(server.state.pending)))
    late = LighthouseClient(server.address()).quorum("late", T)
    t.join(timeout=T.total_seconds())
    assert ids(late) == ["early", "late"]
    assert [ids(q) for q in got] == [["early", "late"]]
    client.close()


def test_closing_the_client_ends_a_streamed_wait(servers) -> None:
    server = servers(min_replicas=2, join_timeout_ms=60_000)
    client = LighthouseClient(server.address())
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            client.quorum("waiting", T)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=ask)
    t.start()
    wait_until(lambda: "waiting" in server.run_in_loop(lambda: set(server.state.pending)))
    client.close()
    t.join(timeout=T.total_seconds() / 2)  # well before the quorum's own timeout
    assert not t.is_alive()
    assert len(errors) == 1 and "CANCELLED" in str(errors[0])
    wait_until(lambda: not server.run_in_loop(lambda: set(server.state.pending)))


def test_a_client_dropped_without_close_ends_its_stream(servers) -> None:
    server = servers(min_replicas=1)
    before = threading.active_count()
    client = LighthouseClient(server.address())
    assert ids(client.quorum("dropped", T)) == ["dropped"]
    assert threading.active_count() > before  # gRPC's threads of the open stream
    del client
    gc.collect()
    # The stream ended with the client: its threads are gone, nothing is left per client.
    wait_until(lambda: threading.active_count() <= before)


def test_gone_members_names_a_silent_member_and_tells_it_when_it_is_back(servers) -> None:
    """A member that stops heartbeating (hung: its process alive, no stream end) is named gone
    to a waiting peer once the heartbeat timeout passes; asking again itself, it learns it was
    named gone until a quorum has it again."""
    server = servers(min_replicas=1, heartbeat_timeout_ms=300)
    client = LighthouseClient(server.address())
    client.heartbeat("hung")
    stream = client.heartbeat_stream("alive", timedelta(milliseconds=50))
    try:
        first = client.gone_members("alive", ["alive", "hung"], timedelta(0)).result()
        assert (list(first.gone), first.requester_gone, first.heartbeat_timeout_ms) == (
            [],
            False,
            300,
        )
        started = time.monotonic()
        answer = client.gone_members("alive", ["alive", "hung"], timedelta(seconds=10)).result()
        assert list(answer.gone) == ["hung"] and not answer.requester_gone
        assert time.monotonic() - started < 5.0  # the long poll ends when it is gone
        back = client.gone_members("hung", ["alive"], timedelta(0)).result()
        assert back.requester_gone and list(back.gone) == []
        stream.close()  # "alive" leaves: "hung" alone is a majority
        client.quorum("hung", T)  # a quorum that has it again: no longer gone
        again = client.gone_members("hung", ["alive"], timedelta(0)).result()
        assert not again.requester_gone
    finally:
        stream.close()
        client.close()


def test_a_silent_rank_stream_makes_its_group_gone_and_so_does_its_end(servers) -> None:
    """Group rank 1 of "g" stops heartbeating on its own stream (hung, the stream open) while
    the group's own stream goes on: a peer's long poll names "g" gone after the heartbeat
    timeout. Heard from again, "g" is no longer gone. Its rank stream ending (the rank died:
    the group cannot train without it, torchrun restarts it whole) makes "g" gone at once, and
    a quorum the peer asks for alone does not wait the join timeout for "g"."""
    server = servers(min_replicas=1, heartbeat_timeout_ms=300, join_timeout_ms=60000)
    client = LighthouseClient(server.address())
    group = client.heartbeat_stream("g", timedelta(milliseconds=50))
    peer = client.heartbeat_stream("peer", timedelta(milliseconds=50))
    beats: queue.SimpleQueue[pb.LighthouseHeartbeatRequest | None] = queue.SimpleQueue()
    channel = grpc.insecure_channel(server.address().removeprefix("http://"))
    rank = pb_grpc.LighthouseServiceStub(channel).HeartbeatStream.future(iter(beats.get, None))
    try:
        beats.put(pb.LighthouseHeartbeatRequest(replica_id="g", group_rank=1))
        wait_until(lambda: server.run_in_loop(lambda: "g" in server.state.rank_heartbeats))
        started = time.monotonic()
        answer = client.gone_members("peer", ["peer", "g"], timedelta(seconds=10)).result()
        assert list(answer.gone) == ["g"]
        assert time.monotonic() - started < 5.0
        beats.put(pb.LighthouseHeartbeatRequest(replica_id="g", group_rank=1))
        wait_until(lambda: not client.gone_members("peer", ["g"], timedelta(0)).result().gone)
        beats.put(None)  # the rank dies: its stream ends, the group's own stream goes on
        rank.result(timeout=10)
        assert list(client.gone_members("peer", ["g"], timedelta(0)).result().gone) == ["g"]
        started = time.monotonic()
        quorum = client.quorum("peer", timedelta(seconds=30))
        assert [m.replica_id for m in quorum.participants] == ["peer"]
        assert time.monotonic() - started < 20.0  # not the 60 s join timeout
    finally:
        beats.put(None)
        channel.close()
        group.close()
        peer.close()
        client.close()


def test_a_unary_heartbeat_for_a_group_rank_is_refused(servers) -> None:
    server = servers(min_replicas=1)
    channel = grpc.insecure_channel(server.address().removeprefix("http://"))
    try:
        stub = pb_grpc.LighthouseServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Heartbeat(
                pb.LighthouseHeartbeatRequest(replica_id="g", group_rank=2),
                timeout=T.total_seconds(),
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "group_rank must be 0" in refused.value.details()
        stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="g"), timeout=T.total_seconds())
    finally:
        channel.close()
