"""Helpers shared by the lighthouse tests."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta

from torchtitan_ft.lighthouse import LighthouseClient, Quorum
from torchtitan_ft.proto import torchft_pb2 as pb

T = timedelta(seconds=10)


def ask_all(
    addr: str,
    replica_ids: list[str],
    auth_token: str | None = None,
    progress: dict[str, pb.GroupProgress] | None = None,
    **kw,
) -> dict[str, Quorum]:
    """Every replica asks concurrently (with ``auth_token``, and its entry of ``progress`` if
    given); returns each one's quorum."""
    results: dict[str, Quorum] = {}
    errors: list[BaseException] = []

    def ask(rid: str) -> None:
        client = LighthouseClient(addr, auth_token=auth_token)
        try:
            if progress is None:
                results[rid] = client.quorum(rid, T, **kw)
            else:
                results[rid], _ = client.quorum_with_speeds(rid, T, progress=progress[rid], **kw)
        except BaseException as e:
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=ask, args=(r,)) for r in replica_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port ``p`` with ``p + 1`` free as well at this moment (the lighthouse's default status
    port is the next one: a lone free port's neighbour was once another test's)."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1 in 100 tries")


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_serving(proc: subprocess.Popen) -> None:
    """Returns once the lighthouse logged that it serves; fails with what it printed if it
    exited first."""
    seen = []
    for line in proc.stderr:
        if "lighthouse serving on" in line:
            return
        seen.append(line)
    raise AssertionError(f"lighthouse exited with {proc.wait()}: {''.join(seen)[-3000:]}")
