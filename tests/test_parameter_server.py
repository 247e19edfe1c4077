"""The fault-tolerant parameter server (``torchtitan_ft.parameter_server``): a real server in
this process, real clients in forked processes over gloo on 127.0.0.1, one of them SIGKILLed
in the middle of its session while another keeps pushing."""

from __future__ import annotations

import http.client
import os
import queue
import signal
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from torchtitan_ft.parameter_server import ParameterServer
from torchtitan_ft.process_group import ProcessGroup, ProcessGroupGloo
from torchtitan_ft.testing.mlp import mp_context

WIDTH = 4


class AddingServer(ParameterServer):
    """Holds a parameter vector. Each request carries ``[1, delta...]``: the delta is added and
    the new parameters are sent back; ``[0, ...]`` ends the session."""

    def __init__(self) -> None:
        super().__init__(port=0, hostname="127.0.0.1")
        self.params = torch.zeros(WIDTH)
        self.params_lock = threading.Lock()
        self.failed: dict[str, Exception] = {}

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupGloo(timeout=timedelta(seconds=20))

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        while True:
            request = torch.zeros(1 + WIDTH)
            pg.broadcast_one(request, root=1).wait()
            if request[0].item() == 0:
                return
            with self.params_lock:
                self.params += request[1:]
                reply = self.params.clone()
            pg.broadcast_one(reply, root=0).wait()

    def on_session_error(self, session_id: str, error: Exception) -> None:
        self.failed[session_id] = error


def _client(
    address: str, rounds: int, delta: float, pause_s: float, hang: bool, results: Any
) -> None:  # runs in a forked process
    pg = AddingServer.new_session(address)
    seen = []
    for _ in range(rounds):
        pg.broadcast_one(torch.cat([torch.ones(1), torch.full((WIDTH,), delta)]), root=1).wait()
        reply = torch.zeros(WIDTH)
        pg.broadcast_one(reply, root=0).wait()
        seen.append(reply[0].item())
        time.sleep(pause_s)
    if hang:
        results.put(("hanging", os.getpid(), seen))
        time.sleep(600)  # mid-session, until the test kills it
    pg.broadcast_one(torch.zeros(1 + WIDTH), root=1).wait()
    results.put(("done", os.getpid(), seen))


def _start(address: str, results: Any, **kwargs: Any) -> Any:
    args = (address, kwargs["rounds"], kwargs["delta"], kwargs.get("pause_s", 0.0))
    proc = mp_context().Process(
        target=_client, args=(*args, kwargs.get("hang", False), results), daemon=True
    )
    proc.start()
    return proc


def _get(results: Any, timeout_s: float) -> tuple[str, int, list[float]]:
    try:
        return results.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no client reported within {timeout_s}s") from None


def test_unknown_path_is_404_and_the_server_keeps_serving() -> None:
    server = AddingServer()
    try:
        url = urlsplit(server.address())
        assert (url.hostname, url.path) == ("127.0.0.1", "/new_session")
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
        conn.request("GET", "/nope")
        response = conn.getresponse()
        assert response.status == 404
        assert b"/new_session" in response.read()
        conn.close()
        assert server.active_sessions() == []
    finally:
        server.shutdown()
    with pytest.raises(ConnectionError, match="did not open a session"):
        AddingServer.new_session(server.address(), timeout=2)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_client_fails_only_its_own_session() -> None:
    server = AddingServer()
    results = mp_context().Queue()
    procs = []
    try:
        # B pushes 3 times then hangs mid-session; A pushes throughout B's death.
        procs.append(_start(server.address(), results, rounds=3, delta=100.0, hang=True))
        status, victim_pid, victim_seen = _get(results, 60)
        assert status == "hanging" and len(victim_seen) == 3
        procs.append(_start(server.address(), results, rounds=12, delta=1.0, pause_s=0.1))
        deadline = time.monotonic() + 60
        while len(server.active_sessions()) < 2:  # A's session is running
            assert time.monotonic() < deadline, "the second client's session never started"
            time.sleep(0.05)
        os.kill(victim_pid, signal.SIGKILL)

        status, _, a_seen = _get(results, 60)
        assert status == "done" and len(a_seen) == 12
        assert a_seen == sorted(a_seen)  # every push applied once, in order

        # The victim's session failed on the server, which keeps serving new clients.
        deadline = time.monotonic() + 30
        while not server.failed:
            assert time.monotonic() < deadline, "the killed client's session did not fail"
            time.sleep(0.05)
        assert len(server.failed) == 1
        procs.append(_start(server.address(), results, rounds=3, delta=10.0))
        status, _, c_seen = _get(results, 60)
        assert status == "done" and len(c_seen) == 3
        # Every completed push counted exactly once: 3 x 100 + 12 x 1 + 3 x 10.
        torch.testing.assert_close(server.params, torch.full((WIDTH,), 342.0))
        assert c_seen[-1] == 342.0
        assert len(server.failed) == 1
        deadline = time.monotonic() + 10
        while server.active_sessions():
            assert time.monotonic() < deadline, server.active_sessions()
            time.sleep(0.05)
    finally:
        server.shutdown()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
