"""What a flood at the connection cap costs the job (issue 20, N2 and N3); prints JSON.

Servers, each in a process of its own with 256 descriptors (the lighthouse's gRPC cap is then
128, a ManagerServer's 64):

- ``guarded``: the servers as they are (``connection_guard``);
- ``unguarded``: the same without the guard and its marking interceptor (what they were
  before), for the guard's own cost; under a flood it lets no new client in (``starved``).

Cases, the trials interleaved (one of each, then the next trial), each measured with no flood
and with a flood at the cap (``testing.flood.Flood``: cap + 8 connections that completed the
HTTP/2 handshake, each calling without the token every 2 s and reopened whenever closed; a
case starts 1.5 s into the flood):

- lighthouse ``steady_quorum_ms``: a quorum round trip on a client's open connection (one
  replica, so the round is decided at once), the median of ``--rounds``;
- lighthouse ``new_client_quorum_ms``: a new ``LighthouseClient``'s first quorum (connect
  included): what a restarted group waits;
- ManagerServer ``round_ms``: the two ranks' Quorum then ShouldCommit, on their open
  connections, the median of ``--rounds``;
- ManagerServer ``heal_ms``: a new ``ManagerClient`` (a healing rank) connects and gets
  CheckpointMetadata.

Also the guard's own costs, in this process: one look over the server's connections (with the
flood's connections open) and the marking of one call.

    python -m benchmarks.flood [--trials 5] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from datetime import timedelta
from typing import Any

from benchmarks import machine
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer
from torchtitan_ft.lighthouse.server import connection_limits
from torchtitan_ft.manager import ManagerClient
from torchtitan_ft.manager.server import connection_cap
from torchtitan_ft.testing.flood import FLOOD_BOUND, Flood

FD_LIMIT = 256
TOKEN = "bench-token"
SETTLE_S = 1.5
REFILL_S = 0.5
STARVED_AFTER = timedelta(seconds=3)
"""How long an unguarded server's new client is given under a flood before it counts as
starved (it would wait for gRPC's idle timeout: 30 s at the lighthouse, an hour at a
ManagerServer)."""

_PRELUDE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[1])))
if sys.argv[2] == "unguarded":
    import grpc
    from torchtitan_ft import connection_guard, rpc_server

    class _PassThrough(grpc.aio.ServerInterceptor):
        def __init__(self, peers):
            pass

        async def intercept_service(self, continuation, details):
            return await continuation(details)

    rpc_server.MarkingInterceptor = _PassThrough
    connection_guard.ConnectionGuard.start = lambda self: None
"""
_LIGHTHOUSE = (
    _PRELUDE
    + """
import time
from torchtitan_ft.lighthouse import LighthouseServer
server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token=sys.argv[3])
print(server.address(), flush=True)
time.sleep(3600)
"""
)
_MANAGER = (
    _PRELUDE
    + """
import time
from datetime import timedelta
from torchtitan_ft.manager import ManagerServer
server = ManagerServer(
    "group", sys.argv[3], hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="127.0.0.1:1",
    world_size=2, heartbeat_interval=timedelta(milliseconds=100),
    connect_timeout=timedelta(seconds=5), auth_token=sys.argv[4],
)
print(server.address(), flush=True)
time.sleep(3600)
"""
)
T = timedelta(seconds=30)


def _start(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(FD_LIMIT), *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    address = proc.stdout.readline().strip()
    if not address.startswith("http://"):
        raise RuntimeError(f"server did not start (exit {proc.wait()})")
    return proc, address


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _new_client_quorum(address: str, timeout: timedelta) -> float | None:
    start = time.perf_counter()
    client = LighthouseClient(address, auth_token=TOKEN)
    try:
        client.quorum("r", timeout)
    except TimeoutError:
        return None
    finally:
        client.close()
    return time.perf_counter() - start


def _heal(address: str, timeout: timedelta) -> float | None:
    start = time.perf_counter()
    try:
        healer = ManagerClient(address, connect_timeout=timeout, auth_token=TOKEN)
    except TimeoutError:
        return None
    try:
        healer._checkpoint_metadata(1, timeout)
    finally:
        healer.close()
    return time.perf_counter() - start


class Group:
    """A ManagerServer's two ranks, each a ``ManagerClient`` on its own connection."""

    def __init__(self, address: str) -> None:
        self.ranks = [ManagerClient(address, connect_timeout=T, auth_token=TOKEN) for _ in "01"]
        self.step = 0
        self._pool = futures.ThreadPoolExecutor(2)

    def round(self) -> float:
        self.step += 1
        step = self.step

        def rank(r: int) -> None:
            self.ranks[r]._quorum(
                group_rank=r,
                step=step,
                checkpoint_metadata=f"rank-{r}-{step}",
                shrink_only=False,
                timeout=T,
            )
            self.ranks[r].should_commit(r, step, True, T)

        start = time.perf_counter()
        for f in [self._pool.submit(rank, r) for r in (0, 1)]:
            f.result()
        return time.perf_counter() - start

    def close(self) -> None:
        for client in self.ranks:
            client.close()
        self._pool.shutdown()


def _case(
    mode: str, flooded: bool, lighthouse: str, manager: str, group: Group, rounds: int
) -> dict[str, Any]:
    starve = STARVED_AFTER if mode == "unguarded" and flooded else FLOOD_BOUND
    steady_client = LighthouseClient(lighthouse, auth_token=TOKEN)
    steady_client.quorum("r", T)  # connected before any flood, as a running job's client

    def measure() -> dict[str, Any]:
        steady = [_timed(lambda: steady_client.quorum("r", T)) for _ in range(rounds)]
        # gRPC shares one connection among a process's channels to the same server: the new
        # client would reuse this one. (Its slot is the flood's once the flood next passes.)
        steady_client.close()
        rounds_s = [group.round() for _ in range(rounds)]
        time.sleep(REFILL_S)
        first = _new_client_quorum(lighthouse, starve)
        heal = _heal(manager, starve)
        return {
            "steady_quorum_ms": _ms(statistics.median(steady)),
            "new_client_quorum_ms": None if first is None else _ms(first),
            "round_ms": _ms(statistics.median(rounds_s)),
            "heal_ms": None if heal is None else _ms(heal),
        }

    try:
        if not flooded:
            return measure()
        lighthouse_cap, _ = connection_limits(FD_LIMIT)
        manager_cap = connection_cap(FD_LIMIT)
        with (
            Flood(_port(lighthouse), lighthouse_cap + 8, "/torchft.LighthouseService/Heartbeat"),
            Flood(_port(manager), manager_cap + 8, "/torchft.ManagerService/Quorum"),
        ):
            time.sleep(SETTLE_S)
            return measure()
    finally:
        steady_client.close()


def _guard_costs() -> dict[str, float]:
    """One look of a guard over a lighthouse with its cap's worth of flood connections open,
    and the marking of one call (the wrapper's extra await and ``context.peer()``)."""
    from torchtitan_ft.connection_guard import AuthenticatedPeers, _marking

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, auth_token=TOKEN)
    try:
        cap, _ = connection_limits(FD_LIMIT)
        assert server.guard is not None
        with Flood(_port(server.address()), cap, "/torchft.LighthouseService/Heartbeat"):
            time.sleep(0.5)
            looks = [_timed(server.guard.look) for _ in range(20)]
    finally:
        server.shutdown()

    class Context:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:41234"

    class Handler:
        response_streaming = request_streaming = False

        def __init__(self, unary_unary: Any) -> None:
            self.unary_unary = unary_unary

        def _replace(self, **kw: Any) -> Handler:
            return Handler(kw["unary_unary"])

    async def behavior(request: Any, context: Any) -> Any:
        return request

    plain = Handler(behavior)
    marked = _marking(plain, AuthenticatedPeers().mark)

    async def calls(handler: Handler, n: int) -> float:
        context = Context()
        start = time.perf_counter()
        for _ in range(n):
            await handler.unary_unary(b"", context)
        return (time.perf_counter() - start) / n

    n = 20000
    extra = asyncio.run(calls(marked, n)) - asyncio.run(calls(plain, n))
    return {
        "look_ms_median": _ms(statistics.median(looks)),
        "look_connections": cap,
        "marking_us_per_call": round(extra * 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    started = time.monotonic()
    manager_lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    procs: list[subprocess.Popen] = []
    groups: dict[str, Group] = {}
    servers: dict[str, tuple[str, str]] = {}
    trials: dict[str, list[dict[str, Any]]] = {}
    try:
        for mode in ("unguarded", "guarded"):
            lighthouse_proc, lighthouse = _start(_LIGHTHOUSE, mode, TOKEN)
            manager_proc, manager = _start(_MANAGER, mode, manager_lighthouse.address(), TOKEN)
            procs += [lighthouse_proc, manager_proc]
            servers[mode] = (lighthouse, manager)
            groups[mode] = Group(manager)
        for _ in range(args.trials):
            for mode in ("unguarded", "guarded"):
                for flooded in (False, True):
                    if mode == "unguarded" and flooded and trials.get("unguarded_flood"):
                        continue  # starved once is enough: each try waits STARVED_AFTER
                    name = f"{mode}_{'flood' if flooded else 'quiet'}"
                    result = _case(mode, flooded, *servers[mode], groups[mode], args.rounds)
                    trials.setdefault(name, []).append(result)
                    print(json.dumps({name: result}), file=sys.stderr)
    finally:
        for group in groups.values():
            group.close()
        for proc in procs:
            proc.kill()
            proc.wait()
        manager_lighthouse.shutdown()
    summary = {name: _summary(results) for name, results in trials.items()}
    out = {
        "benchmark": "flood",
        "machine": machine(),
        "command": " ".join(["python -m benchmarks.flood", *sys.argv[1:]]),
        "setup": (
            f"servers in processes of their own with {FD_LIMIT} descriptors (lighthouse cap "
            f"{connection_limits(FD_LIMIT)[0]}, ManagerServer cap {connection_cap(FD_LIMIT)}); "
            "flood: cap + 8 handshake-complete connections per server, one call without the "
            "token every 2 s each, reopened when closed; loopback"
        ),
        "bound_ms": _ms(FLOOD_BOUND.total_seconds()),
        "summary": summary,
        "ratios_guarded_flood_vs_quiet": _ratios(summary, "guarded_flood", "guarded_quiet"),
        "ratios_guarded_vs_unguarded_quiet": _ratios(summary, "guarded_quiet", "unguarded_quiet"),
        "guard_costs": _guard_costs(),
        "trials": trials,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out, indent=1))


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if any(v is None for v in values):
            out[key] = "starved"
            continue
        out[f"{key}_median"] = round(statistics.median(values), 2)
        out[f"{key}_max"] = max(values)
    return out


def _ratios(summary: dict[str, Any], over: str, under: str) -> dict[str, float | str]:
    ratios: dict[str, float | str] = {}
    for key, value in summary.get(over, {}).items():
        if not key.endswith("_median"):
            continue
        base = summary.get(under, {}).get(key)
        ratios[key.removesuffix("_median")] = round(value / base, 2) if base else "n/a"
    return ratios


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
