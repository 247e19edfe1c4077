"""Time of one full quorum round of the lighthouse with N fake replicas; prints JSON.

A round is timed from the first Quorum request sent to the last response received, with all
N replicas asking concurrently. Round 1 is the first quorum (every replica new); the steady
rounds that follow are fast quorums (same members).

The lighthouse runs in its own process (one core); the fake replicas run in this process as
asyncio gRPC calls over several channels, sending pre-serialized requests and not parsing the
responses. To show that the client side is not the bottleneck, the same client is also timed
against a null server in the same run that answers every request at once with a response of
the same size: ``client_floor_ms`` is what the client alone costs per round.

    python -m benchmarks.lighthouse_scale [--sizes 10,100,500,1000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import grpc

from benchmarks import machine
from benchmarks._reference import load_reference
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb

QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
CHANNELS = 8


def fake_member(i: int) -> QuorumMember:
    return QuorumMember(
        replica_id=f"replica_{i:04d}:4f9a0c1e-5b2d-4c3e-9a7f-0d1e2f3a4b5c",
        address=f"http://trainer-{i:04d}.cluster.local:29512",
        store_address=f"trainer-{i:04d}.cluster.local:29500",
        step=1000,
        world_size=8,
    )


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def run_lighthouse(n: int, conn) -> None:
    from torchtitan_ft.lighthouse import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=600_000, heartbeat_timeout_ms=60_000
    )
    conn.send(server.address().rsplit(":", 1)[1])
    while conn.recv() == "cpu":
        conn.send(_cpu_seconds())
    server.shutdown()


def run_reference_lighthouse(n: int, conn) -> None:
    """torchft 0.2.0's Rust lighthouse (see benchmarks/_reference.py)."""
    os.environ["RUST_LOG"] = "warn"  # it logs every arrival at INFO
    from benchmarks._reference import load_reference

    server = load_reference().LighthouseServer(
        bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=600_000, heartbeat_timeout_ms=60_000
    )
    conn.send(server.address().rsplit(":", 1)[1])
    while conn.recv() == "cpu":
        conn.send(_cpu_seconds())
    server.shutdown()


def run_null_server(n: int, conn) -> None:
    """Answers every Quorum at once with a prebuilt response of N members."""

    async def serve() -> None:
        msg = pb.LighthouseQuorumResponse()
        msg.quorum.quorum_id = 1
        msg.quorum.participants.extend(fake_member(i).to_proto() for i in range(n))
        payload = msg.SerializeToString()

        async def quorum(request: bytes, context) -> bytes:
            return payload

        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20)])
        handler = grpc.method_handlers_generic_handler(
            "torchft.LighthouseService",
            {
                "Quorum": grpc.unary_unary_rpc_method_handler(
                    quorum, request_deserializer=None, response_serializer=None
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(str(port))
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) == "cpu":
            conn.send(_cpu_seconds())
        await server.stop(None)

    asyncio.run(serve())


async def time_rounds(port: str, n: int, rounds: int, conn) -> tuple[list[float], float]:
    """Times ``rounds`` rounds; also returns the server's CPU seconds per steady round."""
    channels = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i)],
        )
        for i in range(CHANNELS)
    ]
    calls = [ch.unary_unary(QUORUM_METHOD) for ch in channels]
    requests = [
        pb.LighthouseQuorumRequest(requester=fake_member(i).to_proto()).SerializeToString()
        for i in range(n)
    ]
    for ch in channels:
        await ch.channel_ready()
    times = []
    for r in range(rounds):
        if r == 1:
            conn.send("cpu")
            cpu_start = conn.recv()
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(calls[i % CHANNELS](req, timeout=120) for i, req in enumerate(requests))
        )
        times.append(time.perf_counter() - start)
        if len(answers) != n or not all(answers):
            raise RuntimeError(f"round got {len(answers)} answers for {n} replicas")
    conn.send("cpu")
    server_cpu = (conn.recv() - cpu_start) / (rounds - 1)
    # One response parsed in full, to check the lighthouse answered with everyone.
    got = pb.LighthouseQuorumResponse.FromString(answers[0])
    if len(got.quorum.participants) != n:
        raise RuntimeError(f"quorum has {len(got.quorum.participants)} members, expected {n}")
    for ch in channels:
        await ch.close()
    return times, server_cpu


def measure(target, n: int, rounds: int) -> tuple[list[float], float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(n, child), daemon=True)
    proc.start()
    port = parent.recv()
    try:
        return asyncio.run(time_rounds(port, n, rounds, parent))
    finally:
        parent.send("stop")
        proc.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,500,1000")
    parser.add_argument("--rounds", type=int, default=10, help="steady rounds after the first")
    parser.add_argument(
        "--reference-max",
        type=int,
        default=1000,
        help="largest N to run torchft 0.2.0's lighthouse at (it is quadratic)",
    )
    args = parser.parse_args()
    has_reference = load_reference() is not None
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        lighthouse, lighthouse_cpu = measure(run_lighthouse, n, args.rounds + 1)
        floor, null_cpu = measure(run_null_server, n, args.rounds + 1)
        reference = None
        if has_reference and n <= args.reference_max:
            reference, _ = measure(run_reference_lighthouse, n, args.rounds + 1)
        steady = statistics.median(lighthouse[1:])
        client_floor = statistics.median(floor[1:])
        results.append(
            {
                "replicas": n,
                "first_round_ms": round(lighthouse[0] * 1e3, 2),
                "steady_round_ms": round(steady * 1e3, 2),
                "steady_round_max_ms": round(max(lighthouse[1:]) * 1e3, 2),
                "steady_us_per_replica": round(steady / n * 1e6, 1),
                "client_floor_ms": round(client_floor * 1e3, 2),
                "client_share_of_round": round(client_floor / steady, 2),
                "lighthouse_cpu_ms_per_round": round(lighthouse_cpu * 1e3, 2),
                "null_server_cpu_ms_per_round": round(null_cpu * 1e3, 2),
                "reference_steady_round_ms": (
                    round(statistics.median(reference[1:]) * 1e3, 2) if reference else None
                ),
                "speedup_vs_reference": (
                    round(statistics.median(reference[1:]) / steady, 2) if reference else None
                ),
            }
        )
        print(json.dumps(results[-1]), file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "lighthouse_scale",
                "machine": machine(),
                "command": " ".join(["python -m benchmarks.lighthouse_scale", *sys.argv[1:]]),
                "client": f"asyncio grpc.aio, {CHANNELS} channels, pre-serialized requests, "
                "responses not parsed; client_floor_ms = same client against a null server "
                "answering at once with a same-size response (measured in this run)",
                "targets_ms": {"500": 50, "1000": 100},
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
