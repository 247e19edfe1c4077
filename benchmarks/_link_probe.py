"""TCP throughput of a link, for ``benchmarks.wan`` (no torch: starts in milliseconds).

    python -m benchmarks._link_probe serve HOST PORT     # prints {"bytes": n, "seconds": t}
    python -m benchmarks._link_probe send HOST PORT NBYTES

The receiver times from the first byte to the sender's close, so the sender's socket buffers
do not inflate the rate.
"""

from __future__ import annotations

import json
import socket
import sys
import time

_CHUNK = 1 << 20


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(120)
            received, first = 0, None
            while data := conn.recv(_CHUNK):
                first = first or time.perf_counter()
                received += len(data)
            seconds = time.perf_counter() - first if first else 0.0
    print(json.dumps({"bytes": received, "seconds": seconds}), flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    payload = b"\0" * _CHUNK
    deadline = time.monotonic() + 30
    while True:  # the receiver may still be starting
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.settimeout(120)
        sent = 0
        while sent < nbytes:
            conn.sendall(payload[: min(_CHUNK, nbytes - sent)])
            sent += min(_CHUNK, nbytes - sent)


if __name__ == "__main__":
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "serve":
        serve(host, port)
    else:
        send(host, port, int(sys.argv[4]))
