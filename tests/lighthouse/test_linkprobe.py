"""The link probe (``manager.linkprobe``): its pure schedule, a real prober against a real
lighthouse, and a link straggler reported from probes on the quorum responses, the status JSON
and /metrics."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from tests.lighthouse._helpers import T, get
from torchtitan_ft.lighthouse import LighthouseClient
from torchtitan_ft.lighthouse.client import grpc_target
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.manager.linkprobe import (
    OFF_RECHECK_S,
    LinkProber,
    ProbeAction,
    probe_action,
)
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc

KIB = 1024


@pytest.mark.parametrize(
    ("probe_bytes", "interval_s", "last_start", "now", "action"),
    [
        (None, 5.0, None, 0.0, ProbeAction.ASK),  # the settings are not known yet
        (None, 5.0, 9.9, 10.0, ProbeAction.ASK),  # the first answer failed: ask again
        (KIB, 5.0, None, 0.0, ProbeAction.PROBE),
        (KIB, 5.0, 6.0, 10.0, ProbeAction.WAIT),  # within the interval
        (KIB, 5.0, 5.0, 10.0, ProbeAction.PROBE),  # the interval has passed
        (KIB, 0.0, 10.0, 10.0, ProbeAction.PROBE),  # no interval: at every quorum
        (0, 5.0, 10.0, 10.0 + OFF_RECHECK_S - 1, ProbeAction.WAIT),  # probes off
        (0, 5.0, 10.0, 10.0 + OFF_RECHECK_S, ProbeAction.ASK),  # off: ask again now and then
    ],
)
def test_probe_action(
    probe_bytes: int | None,
    interval_s: float,
    last_start: float | None,
    now: float,
    action: ProbeAction,
) -> None:
    assert probe_action(probe_bytes, interval_s, last_start, now) is action


def _wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.02)


def test_a_prober_learns_the_settings_then_probes_once_per_kick(servers) -> None:
    """The first kick only asks (an empty payload); each later kick sends the lighthouse's
    payload and gets as much back; results come out once, numbered; the lighthouse counts the
    bytes."""
    server = servers(
        status_bind="127.0.0.1:0",
        stragglers=StragglerOptions(link_probe_bytes=64 * KIB, link_probe_interval_s=0.0),
    )
    client = LighthouseClient(server.address())
    prober = LinkProber(client, "g")
    try:
        prober.kick()
        _wait_for(lambda: prober.probe_bytes == 64 * KIB, "the prober learned the payload")
        assert prober.take() == []  # asking is no sample
        results: list[pb.LinkProbeResult] = []
        for _ in range(3):
            prober.kick()
            _wait_for(lambda: bool(got := prober.take()) and not results.extend(got), "a probe")
        assert [r.seq for r in results] == [1, 2, 3]
        assert all(r.bytes == 2 * 64 * KIB and r.seconds > 0 for r in results)
    finally:
        prober.close()
        client.close()
    _, metrics = get(server.status_address() + "/metrics")
    assert "torchft_lighthouse_link_probe_bytes_total 393216" in metrics.splitlines()


def test_probes_off_and_a_too_large_payload_refused_with_the_server_up(servers) -> None:
    server = servers(stragglers=StragglerOptions(link_probe_bytes=0))
    client = LighthouseClient(server.address())
    prober = LinkProber(client, "g")
    try:
        prober.kick()
        _wait_for(lambda: prober.probe_bytes == 0, "the prober learned that probes are off")
        prober.kick()  # within OFF_RECHECK_S: nothing is sent
        time.sleep(0.2)
        assert prober.take() == []
    finally:
        prober.close()
        client.close()
    channel = grpc.insecure_channel(grpc_target(server.address()))
    try:
        stub = pb_grpc.LighthouseServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.LinkProbe(pb.LinkProbeRequest(replica_id="g", payload=b"\0"), timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "payload has 1 bytes; this lighthouse takes at most 0" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.LinkProbe(pb.LinkProbeRequest(), timeout=10)
        assert "replica_id is empty" in err.value.details()
        assert stub.LinkProbe(pb.LinkProbeRequest(replica_id="g"), timeout=10).probe_bytes == 0
    finally:
        channel.close()


def test_a_group_with_slow_link_probes_is_reported_for_its_link(servers) -> None:
    """Two real clients ask for quorums with link probes; the group whose probes take 10x the
    other's is reported as a straggler for its link on the responses, the status JSON and
    /metrics; its compute is not judged slow."""
    server = servers(
        min_replicas=2,
        status_bind="127.0.0.1:0",
        stragglers=StragglerOptions(link_probes=2, link_window=1),
    )
    fast_probe = pb.LinkProbeResult(seq=1, bytes=KIB, seconds=0.01)
    server.run_in_loop(lambda: server.state.speeds.report_link("fast", [fast_probe], -1, 0.0))
    responses: dict[str, dict] = {}

    def run(rid: str, seconds: float) -> None:
        client = LighthouseClient(server.address())
        try:
            for step in range(4):
                probe = pb.LinkProbeResult(seq=step + 2, bytes=KIB, seconds=seconds)
                progress = pb.GroupProgress(link_probes=[probe])
                _, responses[rid] = client.quorum_with_speeds(rid, T, step=step, progress=progress)
        finally:
            client.close()

    threads = [
        threading.Thread(target=run, args=("fast", 0.01)),
        threading.Thread(target=run, args=("slow", 0.1)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for speeds in responses.values():
        slow = speeds["slow"]
        assert (slow.straggler, slow.cause, slow.straggler_since_step) == (True, "link", 0)
        assert slow.link_relative_speed == pytest.approx(0.1)
        assert not speeds["fast"].straggler
    base = server.status_address()
    _, body = get(base + "/status.json")
    by_id = {s["replica_id"]: s for s in json.loads(body)["speeds"]}
    assert by_id["slow"]["cause"] == "link" and by_id["slow"]["link_relative_speed"] == 0.1
    _, metrics = get(base + "/metrics")
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert values['torchft_lighthouse_link_straggler{replica_id="slow"}'] == "1"
    assert values['torchft_lighthouse_straggler{replica_id="slow"}'] == "1"
    assert values['torchft_lighthouse_link_straggler{replica_id="fast"}'] == "0"
    assert float(values['torchft_lighthouse_link_relative_speed{replica_id="slow"}']) == 0.1
    _, events = get(base + "/events?since=0")
    started = [e for e in json.loads(events)["events"] if e["kind"] == "straggler"]
    assert [e["group"] for e in started] == ["slow"]
