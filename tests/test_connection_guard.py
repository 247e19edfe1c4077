"""The connection guard: its policy as a table, and one real server whose stranger
connections it closes while the job's client keeps its own (the floods at the cap are in
tests/lighthouse/test_security.py and tests/manager/test_security.py)."""

from __future__ import annotations

import contextlib
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest

from torchtitan_ft import connection_guard
from torchtitan_ft.connection_guard import (
    UNAUTHENTICATED_LIFE_S,
    AuthenticatedPeers,
    Connection,
    ConnectionGuard,
    GuardPolicy,
    Reason,
    connections_to_close,
    grpc_peer,
    server_connections,
)
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer
from torchtitan_ft.testing.flood import FLOOD_BOUND, call_frame, preface_connection

POLICY = GuardPolicy(cap=8, reserve=2, unauthenticated_life_s=3.0)
NOW = 100.0


def conns(*specs: tuple[float, bool]) -> list[Connection]:
    """Connections ``i`` first seen at ``first_seen`` (authenticated or not), in order."""
    return [Connection(i, f"ipv4:10.0.0.1:{i}", seen, auth) for i, (seen, auth) in enumerate(specs)]


A, S = True, False  # authenticated, stranger
OLD, YOUNG = NOW - 3.0, NOW - 1.0


@pytest.mark.parametrize(
    ("connections", "expected"),
    [
        pytest.param(conns(), [], id="none"),
        pytest.param(conns((OLD, A), (YOUNG, S)), [], id="young-stranger-stays"),
        pytest.param(conns((OLD, S), (YOUNG, S)), [(0, Reason.EXPIRED)], id="life-ends-at-3s"),
        pytest.param(conns((NOW - 1000, A)), [], id="authenticated-never"),
        pytest.param(conns(*[(YOUNG, S)] * 6), [], id="strangers-up-to-cap-minus-reserve"),
        pytest.param(
            conns((YOUNG + 0.5, S), *[(YOUNG, S)] * 6),
            [(1, Reason.CROWDING)],
            id="beyond-it-the-oldest-stranger",
        ),
        pytest.param(
            conns(*[(YOUNG, A)] * 8, (YOUNG, S)),
            [(8, Reason.CROWDING)],
            id="clients-in-the-reserve-push-strangers-out",
        ),
        pytest.param(
            conns(*[(YOUNG, A)] * 9),
            [],
            id="clients-beyond-the-cap-stay",
        ),
        pytest.param(
            conns((OLD, S), *[(YOUNG, S)] * 7),
            [(0, Reason.EXPIRED), (1, Reason.CROWDING)],
            id="expired-count-toward-the-room",
        ),
    ],
)
def test_which_connections_to_close(connections, expected) -> None:
    closed = [(c.inode, reason) for c, reason in connections_to_close(connections, NOW, POLICY)]
    assert closed == expected


@pytest.mark.parametrize(("cap", "reserve"), [(1, 0), (2, 1), (8, 2), (128, 32), (1024, 256)])
def test_a_quarter_of_the_cap_is_reserved(cap, reserve) -> None:
    assert GuardPolicy.for_cap(cap).reserve == reserve


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cap": 0, "reserve": 0}, "cap must be >= 1, got 0"),
        ({"cap": 4, "reserve": 4}, r"reserve must be in \[0, cap=4\), got 4"),
        ({"cap": 4, "reserve": 1, "unauthenticated_life_s": 0}, "must be > 0 seconds, got 0"),
    ],
)
def test_bad_policy_is_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        GuardPolicy(**kwargs)


@pytest.mark.parametrize(
    ("address", "peer"),
    [
        (("10.0.0.5", 41234), "ipv4:10.0.0.5:41234"),
        (("::ffff:10.0.0.5", 41234, 0, 0), "ipv4:10.0.0.5:41234"),
        (("fe80::1", 7, 0, 0), "ipv6:[fe80::1]:7"),
    ],
)
def test_peer_names_are_grpcs(address, peer) -> None:
    assert grpc_peer(address) == peer


def test_strangers_are_closed_and_the_jobs_client_keeps_its_connection() -> None:
    """A real lighthouse with a token: three connections that finished the HTTP/2 handshake
    (one sends refused calls) are closed after their life; the client's connection, which
    made an authenticated call, stays and answers without reconnecting."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token="tok")
    strangers: list[socket.socket] = []
    try:
        port = int(server.address().rpartition(":")[2])
        client = LighthouseClient(f"http://127.0.0.1:{port}", auth_token="tok")
        client.quorum("r", timedelta(seconds=10))
        (own,) = server_connections(port)
        strangers = [preface_connection(port) for _ in range(3)]
        deadline = time.monotonic() + 15
        stream_id = 1
        while server.guard.closed[Reason.EXPIRED] < 3 and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # closed by the guard in the meantime
                strangers[0].sendall(call_frame(stream_id, "/torchft.LighthouseService/Heartbeat"))
            stream_id += 2
            time.sleep(0.5)
        assert server.guard.closed == {Reason.EXPIRED: 3, Reason.CROWDING: 0}
        assert server.state.metrics.unauthenticated_requests >= 1
        assert server_connections(port) == [own]
        client.quorum("r", timedelta(seconds=10))
        assert server_connections(port) == [own]
    finally:
        for s in strangers:
            s.close()
        server.shutdown()


def test_a_look_reports_the_open_peers_only_when_it_examined_every_socket(monkeypatch) -> None:
    """What a ManagerServer takes as a rank's connection closed: a real listener and client
    socket; a look that could not duplicate a socket (descriptors exhausted) reports nothing,
    and a closed connection is missing from the next complete look."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    reports: list[tuple[frozenset[str], float]] = []
    guard = ConnectionGuard(
        port, POLICY, AuthenticatedPeers(), "test", on_listed=lambda *r: reports.append(r)
    )
    peer = grpc_peer(client.getsockname())
    try:
        with monkeypatch.context() as patched:
            patched.setattr(connection_guard.os, "dup", _no_descriptor_left)
            guard.look()
        assert reports == []
        before = time.monotonic()
        guard.look()
        assert reports[-1][0] == {peer} and reports[-1][1] >= before
        client.close()
        accepted.close()
        guard.look()
        assert reports[-1][0] == frozenset()
    finally:
        client.close()
        accepted.close()
        listener.close()


def _no_descriptor_left(fd: int) -> int:
    raise OSError(24, "Too many open files")


def test_the_operations_doc_states_the_tested_bound_and_life() -> None:
    """docs/operations.md states the flood tests' deadline as the bound, and the guard's life."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    assert f"by more than\n**{FLOOD_BOUND.total_seconds():g} s**" in doc
    assert f"is closed {UNAUTHENTICATED_LIFE_S:g} s after the guard first saw it" in doc
