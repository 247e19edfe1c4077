"""The ManagerServer's quorum fast paths: daemon threads kept for blocking calls (address
checks), and the in-process client of group rank 0."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from torchtitan_ft.addresses import Advertised, QuorumAddressCheck
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager.client import LocalManagerClient, ManagerClient, QuorumTimeoutError
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.manager.server import ManagerServer
from torchtitan_ft.rpc_server import DaemonThreads
from torchtitan_ft.testing.mlp import mp_context
from torchtitan_ft.testing.servers import loopback_manager_server


def test_a_done_thread_serves_the_next_call() -> None:
    threads = DaemonThreads("test-blocking")
    seen: list[threading.Thread] = []
    try:
        for _ in range(3):
            done = threading.Event()
            threads.run(lambda done=done: (seen.append(threading.current_thread()), done.set()))
            assert done.wait(10)
            while not threads._idle:  # it is put back right after the call returns
                threading.Event().wait(0.001)
    finally:
        threads.close()
    assert len(set(seen)) == 1 and seen[0].daemon


def test_a_blocked_call_does_not_hold_up_the_next() -> None:
    threads = DaemonThreads("test-blocking")
    release, second = threading.Event(), threading.Event()
    try:
        threads.run(lambda: release.wait(10))
        threads.run(second.set)
        assert second.wait(10)
    finally:
        release.set()
        threads.close()


def test_address_check_knows_an_unchanged_quorum() -> None:
    check = QuorumAddressCheck()
    me = Advertised("a", "http://127.0.0.1:1", "127.0.0.1:2")
    other = Advertised("b", "http://127.0.0.1:3", "127.0.0.1:4")
    assert not check.known(me, [me, other])
    check(me, [me, other])
    assert check.known(me, [other, me])  # order does not matter
    assert not check.known(me, [me])


def _dead_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server(lighthouse: str, name: str) -> ManagerServer:
    return loopback_manager_server(lighthouse, replica_id=name)


def test_the_in_process_client_joins_quorums_beside_a_grpc_client() -> None:
    """Group rank 0's client calls its server's handlers without gRPC; a group whose rank
    uses gRPC gets the same quorums, round after round."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    local_server = _server(lighthouse.address(), "local")
    remote_server = _server(lighthouse.address(), "remote")
    remote = ManagerClient(remote_server.address(), timedelta(seconds=10))
    local = LocalManagerClient(local_server, local_server.address())
    try:
        for step in range(3):
            answers: dict[str, QuorumResult] = {}

            def ask(name: str, client: Any, step: int = step, answers: dict = answers) -> None:
                answers[name] = client._quorum(
                    group_rank=0,
                    step=step,
                    checkpoint_metadata=name,
                    shrink_only=False,
                    timeout=timedelta(seconds=20),
                )

            threads = [
                threading.Thread(target=ask, args=args)
                for args in (("local", local), ("remote", remote))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert answers["local"].quorum_id == answers["remote"].quorum_id
            assert answers["local"].replica_world_size == 2
        # One session rule for both clients: each keeps the session its server gave the rank.
        assert local._sessions[0] == local_server._rounds.records[0].session is not None
        assert remote._sessions[0] == remote_server._rounds.records[0].session is not None
        assert local.should_commit(0, 2, True, timedelta(seconds=10))
        assert not local.should_commit(0, 3, False, timedelta(seconds=10))
    finally:
        remote.close()
        local_server.shutdown()
        remote_server.shutdown()
        lighthouse.shutdown()


def test_the_in_process_client_raises_what_the_grpc_client_raises() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    server = _server(lighthouse.address(), "alone")
    local = LocalManagerClient(server, server.address())
    try:
        with pytest.raises(QuorumTimeoutError, match="lighthouse"):
            local._quorum(
                group_rank=0,
                step=0,
                checkpoint_metadata="",
                shrink_only=False,
                timeout=timedelta(seconds=2),
            )
        with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT: .*group_rank"):
            local.should_commit(5, 0, True, timedelta(seconds=2))
    finally:
        server.shutdown()
        lighthouse.shutdown()


def test_the_in_process_client_names_the_lighthouse_even_when_its_loop_is_starved() -> None:
    """Group rank 0's call names the unreachable lighthouse, not its own deadline, even when
    the server's event loop wakes only after both the lighthouse request's budget and the
    call's deadline have passed (a trainer starved of CPU, or its GIL, on a busy machine): the
    handler that asks the lighthouse answers with the request's failure however late it runs.
    Here the loop is blocked from before the budget's end (1.5 s of the 2 s timeout) until
    after the deadline."""
    port = _dead_port()
    server = _server(f"http://127.0.0.1:{port}", "starved")
    local = LocalManagerClient(server, server.address())
    loop = server._loop
    try:
        loop.call_soon_threadsafe(loop.call_later, 1.2, time.sleep, 1.6)
        with pytest.raises(QuorumTimeoutError) as raised:
            local._quorum(
                group_rank=0,
                step=0,
                checkpoint_metadata="",
                shrink_only=False,
                timeout=timedelta(seconds=2),
            )
        assert f"no quorum from the lighthouse at http://127.0.0.1:{port}" in str(raised.value)
    finally:
        server.shutdown()


def test_the_in_process_rank_names_the_lighthouse_when_another_rank_asked_it() -> None:
    """As above, in a group of 2 whose rank 1 (over gRPC) arrives last and so makes the
    lighthouse request: rank 0's in-process call, starved across its deadline, still ends with
    the request's failure (a 2-rank TorchTitan group printed "DEADLINE_EXCEEDED: in process" for
    rank 0 on a busy machine)."""
    port = _dead_port()
    server = loopback_manager_server(f"http://127.0.0.1:{port}", replica_id="pair", world_size=2)
    local = LocalManagerClient(server, server.address())
    remote = ManagerClient(server.address(), timedelta(seconds=10))
    errors: dict[int, Exception] = {}

    def ask(rank: int, client: Any) -> None:
        try:
            client._quorum(
                group_rank=rank,
                step=0,
                checkpoint_metadata="",
                shrink_only=False,
                timeout=timedelta(seconds=2),
            )
        except Exception as e:  # the test reads it
            errors[rank] = e

    loop = server._loop
    try:
        first = threading.Thread(target=ask, args=(0, local))
        first.start()
        while server._local_call is None:  # rank 0 waits in the round
            time.sleep(0.01)
        loop.call_soon_threadsafe(loop.call_later, 1.2, time.sleep, 1.6)
        ask(1, remote)
        first.join(30)
        assert not first.is_alive()
        assert f"no quorum from the lighthouse at http://127.0.0.1:{port}" in str(errors[0])
    finally:
        remote.close()
        server.shutdown()


def _ask_unreachable_lighthouse(port: int, results: Any) -> None:  # a forked process
    """Group rank 0's in-process quorum call of 2 s against a lighthouse at ``port``, where
    nothing listens; says when it asks (``time.monotonic``, the same clock in every process)
    and what it raised."""
    server = _server(f"http://127.0.0.1:{port}", "stopped")
    local = LocalManagerClient(server, server.address())
    try:
        results.put(("asking", time.monotonic()))
        local._quorum(
            group_rank=0,
            step=0,
            checkpoint_metadata="",
            shrink_only=False,
            timeout=timedelta(seconds=2),
        )
        results.put(("answered", "", ""))
    except Exception as e:  # the test reads it
        results.put(("raised", type(e).__name__, str(e)))
    finally:
        server.shutdown()


@pytest.mark.multiprocess
def test_a_trainer_without_cpu_across_the_deadline_still_names_the_lighthouse() -> None:
    """The starved trainer of tests/titan/test_user_errors.py's unreachable-lighthouse run,
    on purpose: group rank 0's process (the ManagerServer and its in-process client, every
    thread, gRPC's own included) gets no CPU at all (SIGSTOP) from before the lighthouse
    request's budget ends (1.5 s of the 2 s call) until after the call's deadline, and the
    error is still the lighthouse's. A cgroup quota cannot do this on purpose: its throttle
    lasts at most one CFS period and hands out CPU at each period's start, so whether both
    instants fall in one throttled stretch is chance (a 0.3-CPU quota on the TorchTitan run
    passed against the unfixed server)."""
    port = _dead_port()
    results = mp_context().Queue()
    proc = mp_context().Process(target=_ask_unreachable_lighthouse, args=(port, results))
    proc.start()
    try:
        kind, asked_at = results.get(timeout=60)
        assert kind == "asking"
        time.sleep(max(asked_at + 1.2 - time.monotonic(), 0))
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(max(asked_at + 2.4 - time.monotonic(), 0))
        os.kill(proc.pid, signal.SIGCONT)
        # The stop must cover both instants, or the race was not exercised (a late test).
        assert stopped_at < asked_at + 1.45, f"stopped {stopped_at - asked_at:.2f} s in"
        kind, name, message = results.get(timeout=30)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert (kind, name) == ("raised", "QuorumTimeoutError"), (kind, name, message)
    assert f"no quorum from the lighthouse at http://127.0.0.1:{port}" in message
