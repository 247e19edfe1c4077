"""The ManagerServer's daemon threads for blocking calls (lighthouse quorum, address checks)."""

from __future__ import annotations

import threading

from torchtitan_ft.addresses import Advertised, QuorumAddressCheck
from torchtitan_ft.manager.server import _DaemonThreads


def test_a_done_thread_serves_the_next_call() -> None:
    threads = _DaemonThreads("test-blocking")
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
    threads = _DaemonThreads("test-blocking")
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
