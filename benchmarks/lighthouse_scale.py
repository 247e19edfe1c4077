"""Time of one steady quorum round of the lighthouse with N fake replicas; prints JSON.

A round is timed from the first quorum request sent to the last response received, with all
N replicas asking concurrently. Round 1 is the first quorum (every replica new); the steady
rounds that follow are fast quorums (same members). Each server runs in its own process; the
fake replicas run in this process as asyncio gRPC calls over several channels, sending
pre-serialized requests and not parsing the responses.

Servers, each measured ``--trials`` times per N, the trials interleaved (one of each, then
the next round of trials) so that a change of machine load hits every server alike:

- ``ours_unary``: our lighthouse, unary ``Quorum`` calls (what torchft's clients send);
- ``ours_stream``: our lighthouse, ``QuorumStream`` (what our ``LighthouseClient`` sends:
  one held-open stream per replica, one message each way per round);
- ``ours_stream_page``: ``ours_stream`` with its status page served and open in
  ``PAGE_VIEWERS`` browsers, each refreshing it every ``PAGE_REFRESH_S`` as the page's script
  does (``/`` of the whole job, from a thread of the client process): what serving the page
  and its history costs the quorum round, against ``ours_stream`` in the same run;
- ``torchft``: torchft 0.2.0's Rust lighthouse, unary ``Quorum`` calls;
- serving-loop candidates, as *null servers* that answer every request at once with a
  prebuilt response of the same size (so they cost what the serving loop costs and nothing
  else): ``null_aio_unary`` (grpc.aio, our lighthouse's loop), ``null_aio_stream`` (grpc.aio,
  stream messages), ``null_sync_unary`` (grpcio's thread-pool server), ``null_aio_unary_x2``
  (two grpc.aio processes sharing the port with SO_REUSEPORT; connections spread over them).

    python -m benchmarks.lighthouse_scale [--sizes 10,100,500,1000] [--rounds 10] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from benchmarks import machine
from benchmarks._reference import load_reference
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb

SERVICE = "torchft.LighthouseService"
CHANNELS = 8
GOALS_MS = {10: 1.8, 100: 20, 500: 50, 1000: 100}
"""The steady round each N should take (issue 12), for our own clients."""


def fake_member(i: int) -> QuorumMember:
    return QuorumMember(
        replica_id=f"replica_{i:04d}:4f9a0c1e-5b2d-4c3e-9a7f-0d1e2f3a4b5c",
        address=f"http://trainer-{i:04d}.cluster.local:29512",
        store_address=f"trainer-{i:04d}.cluster.local:29500",
        step=1000,
        world_size=8,
    )


def _cpu_seconds() -> float:
    return time.process_time()  # all threads of the process, ns resolution


def _answer_cpu_queries(conn) -> None:
    while conn.recv() == "cpu":
        conn.send(_cpu_seconds())


def run_lighthouse(n: int, conn, port: int) -> None:
    from torchtitan_ft.lighthouse import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=600_000, heartbeat_timeout_ms=60_000
    )
    conn.send(server.address().rsplit(":", 1)[1])
    _answer_cpu_queries(conn)
    server.shutdown()


def run_lighthouse_page(n: int, conn, port: int) -> None:
    """Our lighthouse with its status page served; sends the gRPC port, then the page's."""
    from torchtitan_ft.lighthouse import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=n,
        join_timeout_ms=600_000,
        heartbeat_timeout_ms=60_000,
        status_bind="127.0.0.1:0",
    )
    conn.send(server.address().rsplit(":", 1)[1])
    conn.send(str(server.status_address()))
    _answer_cpu_queries(conn)
    server.shutdown()


PAGE_VIEWERS = 4
PAGE_REFRESH_S = 2.0
"""The page's own refresh period (lighthouse/status.py's script)."""


class PageViewers:
    """``PAGE_VIEWERS`` open pages, each fetching ``/?range=job`` every ``PAGE_REFRESH_S``
    (threads; staggered). Counts the pages fetched and fails loudly on an error."""

    def __init__(self, url: str) -> None:
        self.url = url + "/?range=job"
        self.stop = threading.Event()
        self.opened = threading.Event()
        self.fetched = 0
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._view, args=(i,), daemon=True) for i in range(PAGE_VIEWERS)
        ]
        for t in self.threads:
            t.start()

    def _view(self, i: int) -> None:
        self.stop.wait(PAGE_REFRESH_S * i / PAGE_VIEWERS)
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=30) as response:
                    response.read()
                self.fetched += 1
                self.opened.set()
            except OSError as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            self.stop.wait(PAGE_REFRESH_S)

    def wait_open(self) -> None:
        """Returns once a page was fetched: the rounds are timed with the page open."""
        if not self.opened.wait(30):
            raise RuntimeError(f"the status page did not load in 30 s: {self.errors[:1]}")

    def close(self) -> int:
        self.stop.set()
        for t in self.threads:
            t.join(35)
        if self.errors:
            raise RuntimeError(f"the status page failed: {self.errors[0]}")
        return self.fetched


def run_reference_lighthouse(n: int, conn, port: int) -> None:
    """torchft 0.2.0's Rust lighthouse (see benchmarks/_reference.py)."""
    os.environ["RUST_LOG"] = "warn"  # it logs every arrival at INFO
    server = load_reference().LighthouseServer(
        bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=600_000, heartbeat_timeout_ms=60_000
    )
    conn.send(server.address().rsplit(":", 1)[1])
    _answer_cpu_queries(conn)
    server.shutdown()


def _null_handler(payload: bytes, make_unary, make_stream) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Quorum": grpc.unary_unary_rpc_method_handler(make_unary(payload)),
            "QuorumStream": grpc.stream_stream_rpc_method_handler(make_stream(payload)),
        },
    )


def _null_payload(n: int) -> bytes:
    msg = pb.LighthouseQuorumResponse()
    msg.quorum.quorum_id = 1
    msg.quorum.participants.extend(fake_member(i).to_proto() for i in range(n))
    return msg.SerializeToString()


def run_null_aio(n: int, conn, port: int) -> None:
    """Answers every Quorum (and QuorumStream message) at once with a prebuilt N-member
    response, on grpc.aio. ``port`` > 0: shares it with other processes (SO_REUSEPORT)."""

    def unary(payload: bytes):
        async def quorum(request: bytes, context) -> bytes:
            return payload

        return quorum

    def stream(payload: bytes):
        async def quorum_stream(requests, context):
            async for _ in requests:
                yield payload

        return quorum_stream

    async def serve() -> None:
        server = grpc.aio.server(
            options=[("grpc.max_concurrent_streams", 1 << 20), ("grpc.so_reuseport", int(port > 0))]
        )
        server.add_generic_rpc_handlers((_null_handler(_null_payload(n), unary, stream),))
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        conn.send(str(bound))
        await asyncio.get_running_loop().run_in_executor(None, _answer_cpu_queries, conn)
        await server.stop(None)

    asyncio.run(serve())


def run_null_sync(n: int, conn, port: int) -> None:
    """The null server on grpcio's thread-pool server (handlers return at once, so a few
    workers suffice; a real lighthouse there would hold one worker per waiting request)."""

    def unary(payload: bytes):
        return lambda request, context: payload

    def stream(payload: bytes):
        return lambda requests, context: (payload for _ in requests)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_concurrent_streams", 1 << 20), ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((_null_handler(_null_payload(n), unary, stream),))
    conn.send(str(server.add_insecure_port("127.0.0.1:0")))
    server.start()
    _answer_cpu_queries(conn)
    server.stop(None)


@dataclass(frozen=True)
class Server:
    name: str
    target: Callable
    streaming: bool
    processes: int = 1
    page: bool = False
    """Whether the server serves its status page, and viewers keep it open."""


SERVERS = (
    Server("ours_unary", run_lighthouse, streaming=False),
    Server("ours_stream", run_lighthouse, streaming=True),
    Server("ours_stream_page", run_lighthouse_page, streaming=True, page=True),
    Server("torchft", run_reference_lighthouse, streaming=False),
    Server("null_aio_unary", run_null_aio, streaming=False),
    Server("null_aio_stream", run_null_aio, streaming=True),
    Server("null_sync_unary", run_null_sync, streaming=False),
    Server("null_aio_unary_x2", run_null_aio, streaming=False, processes=2),
)


async def time_rounds(
    port: str, n: int, rounds: int, streaming: bool, cpu: Callable[[], float]
) -> tuple[list[float], float]:
    """Times ``rounds`` rounds; also returns the servers' CPU seconds per steady round."""
    channels = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
        )
        for i in range(CHANNELS)
    ]
    requests = [
        pb.LighthouseQuorumRequest(requester=fake_member(i).to_proto()).SerializeToString()
        for i in range(n)
    ]
    for ch in channels:
        await ch.channel_ready()
    if streaming:
        streams = [
            channels[i % CHANNELS].stream_stream(f"/{SERVICE}/QuorumStream")() for i in range(n)
        ]

        async def ask(i: int, req: bytes) -> bytes:
            await streams[i].write(req)
            return await streams[i].read()
    else:
        calls = [ch.unary_unary(f"/{SERVICE}/Quorum") for ch in channels]

        async def ask(i: int, req: bytes) -> bytes:
            return await calls[i % CHANNELS](req, timeout=120)

    times = []
    for r in range(rounds):
        if r == 1:
            cpu_start = cpu()
        start = time.perf_counter()
        answers = await asyncio.gather(*(ask(i, req) for i, req in enumerate(requests)))
        times.append(time.perf_counter() - start)
        if len(answers) != n or not all(isinstance(a, bytes) and a for a in answers):
            raise RuntimeError(f"round got {len(answers)} answers for {n} replicas")
    server_cpu = (cpu() - cpu_start) / (rounds - 1)
    # One response parsed in full, to check the server answered with everyone.
    got = pb.LighthouseQuorumResponse.FromString(answers[0])
    if len(got.quorum.participants) != n:
        raise RuntimeError(f"quorum has {len(got.quorum.participants)} members, expected {n}")
    if streaming:
        for s in streams:
            s.cancel()
    for ch in channels:
        await ch.close()
    return times, server_cpu


def _shared_port() -> int:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(server: Server, n: int, rounds: int) -> tuple[list[float], float]:
    ctx = mp.get_context("spawn")
    share = _shared_port() if server.processes > 1 else 0
    conns, procs = [], []
    viewers: PageViewers | None = None
    try:
        for _ in range(server.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=server.target, args=(n, child, share), daemon=True)
            proc.start()
            conns.append(parent)
            procs.append(proc)
            port = parent.recv()
            if server.page:
                viewers = PageViewers(parent.recv())
                viewers.wait_open()

        def cpu() -> float:
            total = 0.0
            for c in conns:
                c.send("cpu")
                total += c.recv()
            return total

        result = asyncio.run(time_rounds(port, n, rounds, server.streaming, cpu))
        if viewers is not None:
            viewers, closing = None, viewers
            closing.close()
        return result
    finally:
        if viewers is not None:
            viewers.stop.set()
        for c in conns:
            c.send("stop")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def summarize(trials: list[tuple[list[float], float]]) -> dict:
    """Median and range over trials of each trial's median steady round."""
    steady = [statistics.median(times[1:]) for times, _ in trials]
    every = sorted(t for times, _ in trials for t in times[1:])
    return {
        "steady_round_ms": _ms(statistics.median(steady)),
        "steady_round_p95_ms": _ms(every[min(len(every) - 1, int(0.95 * len(every)))]),
        "steady_round_range_ms": [_ms(min(steady)), _ms(max(steady))],
        "first_round_ms": _ms(statistics.median(times[0] for times, _ in trials)),
        "server_cpu_ms_per_round": _ms(statistics.median(cpu for _, cpu in trials)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,500,1000")
    parser.add_argument("--rounds", type=int, default=10, help="steady rounds after the first")
    parser.add_argument("--trials", type=int, default=3, help="server processes per row")
    parser.add_argument(
        "--servers", default=",".join(s.name for s in SERVERS), help="which servers to run"
    )
    args = parser.parse_args()
    has_reference = load_reference() is not None
    chosen = [s for s in SERVERS if s.name in args.servers.split(",")]
    if not has_reference:
        chosen = [s for s in chosen if s.name != "torchft"]
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        trials: dict[str, list] = {s.name: [] for s in chosen}
        for _ in range(args.trials):
            for server in chosen:
                trials[server.name].append(measure(server, n, args.rounds + 1))
        row: dict = {"replicas": n, "goal_ms": GOALS_MS.get(n)}
        row.update({name: summarize(t) for name, t in trials.items()})
        if "torchft" in row:
            ref = row["torchft"]["steady_round_ms"]
            for name in ("ours_unary", "ours_stream"):
                if name in row:
                    row[f"{name}_over_torchft"] = round(row[name]["steady_round_ms"] / ref, 2)
        if "ours_stream" in row and "ours_stream_page" in row:
            row["page_over_no_page"] = round(
                row["ours_stream_page"]["steady_round_ms"] / row["ours_stream"]["steady_round_ms"],
                2,
            )
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "lighthouse_scale",
                "machine": machine(),
                "command": " ".join(["python -m benchmarks.lighthouse_scale", *sys.argv[1:]]),
                "client": f"asyncio grpc.aio in one process, {CHANNELS} channels, "
                "pre-serialized requests, responses not parsed",
                "statistic": f"per trial the median of {args.rounds} steady rounds; "
                f"steady_round_ms is the median over {args.trials} trials, the range their "
                "min and max",
                "reference": "torchft 0.2.0 Rust lighthouse, same client, same run"
                if has_reference
                else "not installed (scripts/install_reference.sh)",
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
