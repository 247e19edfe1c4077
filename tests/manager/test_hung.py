"""``HungPeerWatch`` against a real lighthouse: a silent member of the armed quorum is
reported once the heartbeat timeout passes; a disarmed watch reports nothing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer
from torchtitan_ft.manager.hung import HungPeerWatch


def test_armed_watch_aborts_for_a_silent_peer_and_a_disarmed_one_does_not() -> None:
    server = LighthouseServer(bind="127.0.0.1:0", heartbeat_timeout_ms=300, quorum_tick_ms=50)
    peer = LighthouseClient(server.address())
    reasons: list[str] = []
    aborted = threading.Event()

    def on_abort(reason: str) -> None:
        reasons.append(reason)
        aborted.set()

    stream = peer.heartbeat_stream("me", timedelta(milliseconds=50))
    watch = HungPeerWatch(LighthouseClient(server.address()), "me", on_abort, lambda *_: None)
    try:
        peer.heartbeat("quiet")
        watch.arm(["me", "quiet"])
        deadline = time.monotonic() + 10
        while watch.heartbeat_timeout is None:  # the first call answers at once
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watch.heartbeat_timeout == 0.3
        watch.disarm()  # between steps: a verdict then is dropped
        time.sleep(0.6)
        assert not aborted.is_set()
        watch.arm(["me", "quiet"])
        assert aborted.wait(10), "the silent peer was never reported"
        assert "['quiet']" in reasons[0]
        assert watch.fence() is None  # "me" was never named gone
    finally:
        watch.close()
        stream.close()
        peer.close()
        server.shutdown()


def test_the_commit_fence_does_not_wait_for_a_lighthouse_that_is_down() -> None:
    """During a lighthouse outage the groups commit on their previous quorum; a long step's
    commit fence must fail at once, not wait out the client's 60 s connect timeout."""
    gone = LighthouseServer(bind="127.0.0.1:0")
    addr = gone.address()
    gone.shutdown()
    client = LighthouseClient(addr, connect_timeout=timedelta(seconds=60))
    watch = HungPeerWatch(client, "me", lambda _: None, lambda *_: None)
    try:
        started = time.monotonic()
        assert watch.fence() is None  # heartbeat timeout not known yet: the fence asks
        assert time.monotonic() - started < 10.0
    finally:
        watch.close()
