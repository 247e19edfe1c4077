"""Tests of torchtitan_ft.process_group.

In-process tests use world-size-1 gloo groups or fakes; the ``multiprocess`` tests fork real
processes that build gloo groups on a TCPStore served by the test (127.0.0.1). Worker functions
run in the children, report ``("ok", data)`` or ``("error", traceback)`` through a queue, and
are killed if they overrun.

TorchTitan is imported only inside a child process: importing it here would fix its
``device_type`` before other tests can make it CPU.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    Work,
)
from torch.futures import Future

from tests._mp import _mp_context
from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    parse_store_addr,
)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture
def store() -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1 (as the replica group's primary would serve it)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _client(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)


def _child(
    fn: Callable[..., Any], rank: int, results: Any, args: tuple[Any, ...]
) -> None:  # runs in a forked process
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))


def _run_workers(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...],
    timeout: float,
    expect_killed: frozenset[int] = frozenset(),
) -> dict[int, Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; return each rank's result.
    They fork from the tests' preloaded forkserver (tests/_mp.py): a spawned child needs
    seconds to import torch on this 2-core machine, and forking the pytest process itself is
    unsafe once earlier tests have left gRPC threads running in it (seen: a segfault).
    """
    ctx = _mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, results, args)) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        while len(outcome) < nprocs - len(expect_killed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            outcome[rank] = (status, value)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    missing = set(range(nprocs)) - set(outcome) - expect_killed
    assert not missing, f"ranks {sorted(missing)} did not report within {timeout}s"
    for r in expect_killed:
        assert procs[r].exitcode == -signal.SIGKILL, f"rank {r} exit code {procs[r].exitcode}"
    for r in outcome:
        assert procs[r].exitcode == 0, f"rank {r} exit code {procs[r].exitcode}"
    return {r: v for r, (_, v) in outcome.items()}


def _allreduce(pg: ProcessGroup, value: float, op: Any = ReduceOp.SUM, n: int = 4) -> list[float]:
    t = torch.full((n,), float(value))
    pg.allreduce([t], op).wait()
    return t.tolist()


class _FakeManager:
    """The part of Manager that ManagedProcessGroup uses; doubles each tensor in place."""

    def __init__(self, participants: int = 2, fail_with: Exception | None = None) -> None:
        self.participants = participants
        self.fail_with = fail_with
        self.calls: list[Any] = []
        self.errors: list[Exception] = []

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> Future[torch.Tensor]:
        self.calls.append(reduce_op)
        fut: Future[torch.Tensor] = Future()
        if self.fail_with is not None:
            fut.set_exception(self.fail_with)
        else:
            fut.set_result(tensor * 2)  # a new tensor: the group must copy it back
        return fut

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return 0

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None


# --------------------------------------------------------------------------------------------
# in-process tests
# --------------------------------------------------------------------------------------------


def test_parse_store_addr() -> None:
    assert parse_store_addr("127.0.0.1:29600/torchft/3/0") == ("127.0.0.1", 29600, "torchft/3/0")
    assert parse_store_addr("[::1]:5/p") == ("::1", 5, "p")
    for bad in ["127.0.0.1:29600", "127.0.0.1:29600/", "host/p", ":1/p", "h:x/p"]:
        with pytest.raises(ValueError, match="host:port/prefix"):
            parse_store_addr(bad)


def test_gloo_misuse_is_rejected(store: dist.TCPStore) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ProcessGroupGloo(timedelta(0))
    pg = ProcessGroupGloo(timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([torch.ones(1)])
    with pytest.raises(ValueError, match="rank"):
        pg.configure(f"127.0.0.1:{store.port}/a", "r", 2, 2)
    with pytest.raises(ValueError, match="prefix"):
        pg.configure(f"127.0.0.1:{store.port}", "r", 0, 1)
    assert pg.errored() is None
    assert pg.size() == 0


def test_gloo_world_size_one(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timedelta(seconds=5))
    pg.configure(f"127.0.0.1:{store.port}/q0", "replica_0", 0, 1, quorum_id=0)
    assert (pg.size(), pg.rank(), pg.getBackendName()) == (1, 0, "torchft-gloo")
    assert isinstance(pg, dist.ProcessGroup)

    t = torch.arange(3.0)
    work = pg.allreduce([t], ReduceOp.AVG)
    assert work.wait() is True
    assert work.get_future().wait() == [t]
    dist.all_reduce(t, group=pg)  # torch.distributed API accepts it
    assert t.tolist() == [0.0, 1.0, 2.0]
    pg.broadcast_one(t, root=0).wait()
    pg.barrier().wait()

    pg.register("test_gloo_world_size_one")
    try:
        assert pg.group_name == "test_gloo_world_size_one"
        assert (funcol.all_reduce(torch.ones(2), "sum", pg) + 0).tolist() == [1.0, 1.0]
    finally:
        pg.unregister()
    pg.shutdown()
    assert pg.size() == 0


def test_gloo_peer_never_joins_is_a_clean_error(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="configure failed"):
        pg.configure(f"127.0.0.1:{store.port}/q0", "replica_0", 0, 2)
    assert time.monotonic() - start < 2.0  # the 1 s timeout, plus scheduling
    error = pg.errored()
    assert isinstance(error, RuntimeError)
    # Errored: collectives fail at once, without communicating.
    work = pg.allreduce([torch.ones(1)])
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="configure failed"):
        work.wait()
    # A new configure clears the error.
    pg.configure(f"127.0.0.1:{store.port}/q1", "replica_0", 0, 1)
    assert pg.errored() is None
    assert _allreduce(pg, 3.0) == [3.0] * 4


class _FakePG(ProcessGroup):
    """Inner group for the wrapper: fails or succeeds on demand, counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next: Exception | None = None
        self.raise_next: BaseException | None = None
        self.calls: list[str] = []
        self.configured: list[tuple[Any, ...]] = []

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, **kw: Any):
        self.configured.append((store_addr, replica_id, rank, world_size, kw))
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            raise error

    def _work(self, name: str, value: object) -> Work:
        self.calls.append(name)
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            raise error
        fut: Future[Any] = Future()
        if self.fail_next is not None:
            fut.set_exception(self.fail_next)
            self.fail_next = None
        else:
            fut.set_result(value)
        return _FutureWork(fut)

    def allreduce(self, tensors, opts=None):  # type: ignore[no-untyped-def]
        for t in tensors:
            t.add_(1)
        return self._work("allreduce", tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):  # type: ignore[no-untyped-def]
        return self._work("allgather", output_tensors)

    def broadcast(self, tensor_list, opts=None):  # type: ignore[no-untyped-def]
        return self._work("broadcast", tensor_list)

    def barrier(self, opts=None):  # type: ignore[no-untyped-def]
        return self._work("barrier", None)

    def size(self) -> int:
        return 2

    def getBackendName(self) -> str:
        return "fake"


class _FutureWork(Work):
    def __init__(self, fut: Future[Any]) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> Future[Any]:
        return self._fut


def test_error_swallowing_wrapper() -> None:
    inner = _FakePG()
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    assert (pg.size(), pg.getBackendName(), pg.parent) == (2, "fake", inner)

    t = torch.zeros(2)
    assert pg.allreduce([t]).wait() is True
    assert t.tolist() == [1.0, 1.0] and pg.error() is None

    # A failing collective: wait() does not raise, the error is recorded.
    inner.fail_next = RuntimeError("Connection closed by peer")
    assert pg.allreduce([t]).wait() is True
    assert str(pg.error()) == "Connection closed by peer"
    assert pg.errored() is pg.error()

    # Later collectives complete at once without reaching the inner group.
    calls = len(inner.calls)
    work = pg.allreduce([t])
    assert work.wait() is True and work.get_future().wait() == [t]
    out = [[torch.zeros(1)]]
    assert pg.allgather(out, [torch.ones(1)]).get_future().wait() is out
    pg.broadcast([t]).wait()
    pg.barrier().wait()
    assert len(inner.calls) == calls and t.tolist() == [2.0, 2.0]

    # configure clears the error and forwards every argument.
    pg.configure("127.0.0.1:1/q7", "replica_1", 1, 2, quorum_id=7, group_rank=0)
    assert pg.error() is None
    assert inner.configured[-1][:4] == ("127.0.0.1:1/q7", "replica_1", 1, 2)
    assert inner.configured[-1][4]["quorum_id"] == 7

    # Errors through the future are swallowed too, returning the default result.
    inner.fail_next = RuntimeError("Read error")
    assert pg.allreduce([t]).get_future().wait() == [t]
    assert str(pg.error()) == "Read error"

    # An error raised when the collective starts is swallowed.
    pg.configure("127.0.0.1:1/q8", "replica_1", 0, 2)
    inner.raise_next = TimeoutError("gave up")
    assert pg.allreduce([t]).wait() is True
    assert isinstance(pg.error(), TimeoutError)

    # A configure failure is recorded and raised; API misuse is never swallowed.
    inner.raise_next = RuntimeError("peer did not join")
    with pytest.raises(RuntimeError, match="peer did not join"):
        pg.configure("127.0.0.1:1/q9", "replica_1", 0, 2)
    assert str(pg.error()) == "peer did not join"
    pg.configure("127.0.0.1:1/q10", "replica_1", 0, 2)
    with pytest.raises(NotImplementedError):
        pg.send([t], 1)
    inner.raise_next = TypeError("bad argument")
    with pytest.raises(TypeError):
        pg.allreduce([t])
    assert pg.error() is None


def test_managed_process_group_with_functional_collectives() -> None:
    manager = _FakeManager(participants=3)
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    try:
        assert pg.size() == 3
        assert pg.getBackendName() == "torchft-managed"
        name = pg.group_name
        assert dist.distributed_c10d._resolve_process_group(name) is pg

        # functional collectives, by group and by name, as TorchTitan's dist_sum/dist_max do
        x = torch.tensor(3.0)
        assert funcol.all_reduce(x, "sum", pg).item() == 6.0
        assert funcol.all_reduce(x, "max", name).item() == 6.0
        assert x.item() == 3.0  # functional: input untouched
        # torch.distributed API, as an FSDP all-reduce hook calls it
        t = torch.ones(2)
        dist.all_reduce(t, op=ReduceOp.AVG, group=pg)
        assert t.tolist() == [2.0, 2.0]
        assert manager.calls == [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG]

        # TorchTitan registers under its own name.
        pg.register("test_dp_replicate")
        assert pg.group_name == "test_dp_replicate"
        assert funcol.all_reduce(x, "avg", "test_dp_replicate").item() == 6.0
        with pytest.raises(RuntimeError):
            dist.distributed_c10d._resolve_process_group(name)
        other = ManagedProcessGroup(manager, name="test_other")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="already registered"):
            other.register("test_dp_replicate")
        other.unregister()
    finally:
        pg.unregister()
    with pytest.raises(RuntimeError, match="register"):
        _ = pg.group_name


def test_managed_process_group_errors_are_data() -> None:
    manager = _FakeManager(fail_with=RuntimeError("allreduce failed"))
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    try:
        t = torch.ones(2)
        assert pg.allreduce([t], ReduceOp.AVG).wait() is True
        assert t.tolist() == [1.0, 1.0]
        assert [str(e) for e in manager.errors] == ["allreduce failed"]
        assert pg.allreduce([t]).get_future().wait() == [t]
        assert funcol.all_reduce(t, "sum", pg).tolist() == [1.0, 1.0]
    finally:
        pg.unregister()


def test_nccl_is_rejected_on_cpu_builds(store: dist.TCPStore) -> None:
    if hasattr(dist, "ProcessGroupNCCL"):
        pytest.skip("this torch build has NCCL")
    pg = ProcessGroupNCCL(timedelta(seconds=2))
    assert pg.getBackendName() == "torchft-nccl"
    with pytest.raises(RuntimeError, match="NCCL"):
        pg.configure(f"127.0.0.1:{store.port}/n0", "replica_0", 0, 1)


# --------------------------------------------------------------------------------------------
# multi-process tests
# --------------------------------------------------------------------------------------------


def _collectives_worker(rank: int, port: int) -> dict[str, Any]:
    """3 ranks: collectives, reconfigure to a different world size, abort and timeout."""
    addr = f"127.0.0.1:{port}"
    control = _client(port)
    pg = ProcessGroupGloo(timedelta(seconds=5))
    out: dict[str, Any] = {}

    # Phase A: world size 3.
    pg.configure(f"{addr}/a", f"replica_{rank}", rank, 3, quorum_id=1)
    out["sum"] = _allreduce(pg, rank + 1)
    out["avg"] = _allreduce(pg, rank + 1, ReduceOp.AVG)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    out["max"] = _allreduce(pg, rank + 1, opts)
    gathered = [[torch.zeros(2) for _ in range(3)]]
    pg.allgather(gathered, [torch.full((2,), float(rank))]).wait()
    out["allgather"] = [t.tolist() for t in gathered[0]]
    b = torch.full((2,), float(rank))
    bopts = BroadcastOptions()
    bopts.rootRank = 2
    pg.broadcast([b], bopts).wait()
    out["broadcast"] = b.tolist()
    rs_out = torch.zeros(1)
    pg.reduce_scatter([rs_out], [[torch.full((1,), float(r + rank)) for r in range(3)]]).wait()
    out["reduce_scatter"] = rs_out.tolist()
    rs_opts = ReduceScatterOptions()
    rs_opts.reduceOp = ReduceOp.AVG
    pg.reduce_scatter(
        [rs_out], [[torch.full((1,), float(r + rank)) for r in range(3)]], rs_opts
    ).wait()
    out["reduce_scatter_avg"] = rs_out.tolist()
    pg.barrier().wait()
    if rank == 0:
        pg.send([torch.full((2,), 7.0)], 1).wait()
    elif rank == 1:
        r = torch.zeros(2)
        pg.recv([r], 0).wait()
        out["recv"] = r.tolist()
    fut_value = pg.allreduce([torch.ones(1)]).get_future().wait()
    out["future"] = [t.tolist() for t in fut_value]

    # Phase B: rank 2 leaves; ranks 0 and 1 form a world of 2 on a new prefix, rank 2 is alone.
    if rank == 2:
        pg.configure(f"{addr}/b-solo", "replica_2", 0, 1, quorum_id=2)
        out["solo"] = _allreduce(pg, 5)
        return out
    pg.configure(f"{addr}/b", f"replica_{rank}", rank, 2, quorum_id=2)
    out["size_b"] = pg.size()
    out["sum_b"] = _allreduce(pg, rank + 1)

    # Phase C: rank 1 does not join a collective; abort() releases rank 0's wait at once.
    pg.configure(f"{addr}/c", f"replica_{rank}", rank, 2, quorum_id=3)
    if rank == 0:
        work = pg.allreduce([torch.ones(1)])
        threading.Timer(0.3, pg.abort).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="aborted"):
            work.wait()
        out["abort_released_after_s"] = time.monotonic() - start
        assert isinstance(pg.errored(), RuntimeError)
        with pytest.raises(RuntimeError, match="aborted"):
            pg.allreduce([torch.ones(1)]).wait()  # fails fast, no communication
        control.set("c_done", "1")
    else:
        # Keep the phase C group open: dropping it would fail rank 0's collective first.
        control.wait(["c_done"], timedelta(seconds=10))

    # Phase D: the same, released by wait()'s timeout instead.
    pg.configure(f"{addr}/d", f"replica_{rank}", rank, 2, quorum_id=4)
    if rank == 0:
        work = pg.allreduce([torch.ones(1)])
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            work.wait(timedelta(seconds=0.5))
        out["timeout_released_after_s"] = time.monotonic() - start
        assert isinstance(pg.errored(), TimeoutError)
        control.set("d_done", "1")
    else:
        control.wait(["d_done"], timedelta(seconds=10))

    # Phase E: both continue on a new group.
    pg.configure(f"{addr}/e", f"replica_{rank}", rank, 2, quorum_id=5)
    out["sum_e"] = _allreduce(pg, 10 * (rank + 1))
    pg.shutdown()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collectives_reconfigure_abort_timeout(store: dist.TCPStore) -> None:
    results = _run_workers(_collectives_worker, 3, (store.port,), timeout=45)
    for rank, out in results.items():
        assert out["sum"] == [6.0] * 4
        assert out["avg"] == [2.0] * 4
        assert out["max"] == [3.0] * 4
        assert out["allgather"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        assert out["broadcast"] == [2.0, 2.0]
        # rank r receives the sum over ranks k of (r + k)
        assert out["reduce_scatter"] == [float(3 * rank + 3)]
        assert out["reduce_scatter_avg"] == [float(rank + 1)]
        assert out["future"] == [[3.0]]
    assert results[1]["recv"] == [7.0, 7.0]
    assert results[2]["solo"] == [5.0] * 4
    for rank in (0, 1):
        assert results[rank]["size_b"] == 2
        assert results[rank]["sum_b"] == [3.0] * 4
        assert results[rank]["sum_e"] == [30.0] * 4
    assert results[0]["abort_released_after_s"] < 1.5
    assert 0.4 < results[0]["timeout_released_after_s"] < 1.5
    print("gloo hung collective:", {k: v for k, v in results[0].items() if k.endswith("_s")})


_BIG = 1 << 20  # floats per allreduce in the kill test (4 MB)


def _peer_death_worker(rank: int, port: int) -> dict[str, Any]:
    """Rank 2 is SIGKILLed mid-allreduce; 0 (raw group) and 1 (error-swallowing) survive."""
    addr = f"127.0.0.1:{port}"
    control = _client(port)
    timeout = timedelta(seconds=3)
    gloo = ProcessGroupGloo(timeout)
    pg: ProcessGroup = gloo if rank != 1 else ErrorSwallowingProcessGroupWrapper(gloo)
    pg.configure(f"{addr}/q1", f"replica_{rank}", rank, 3, quorum_id=1)
    big = torch.ones(_BIG)
    for _ in range(3):
        pg.allreduce([big]).wait()
    if rank == 2:
        pg.allreduce([big])  # the others are now inside this collective
        control.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    out: dict[str, Any] = {}
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(RuntimeError):
            while True:
                pg.allreduce([big]).wait()
        detected = time.time()
        out["error"] = str(gloo.errored())
        # Errored: the next collective fails at once.
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            pg.allreduce([big]).wait()
        out["fail_fast_s"] = time.monotonic() - t0
    else:
        while pg.error() is None:  # type: ignore[attr-defined]
            assert pg.allreduce([big]).wait() is True  # never raises
        detected = time.time()
        out["error"] = str(pg.error())  # type: ignore[attr-defined]
        # Later collectives are no-ops: completed at once, tensor untouched.
        t = torch.full((4,), 5.0)
        work = pg.allreduce([t])
        out["noop_completed"] = work.is_completed() and work.wait() and t.tolist() == [5.0] * 4
    out["detect_s"] = detected - float(control.get("killed_at").decode())
    out["loop_s"] = time.monotonic() - start

    # A quorum computed before the death still lists rank 2: building fails cleanly.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="configure failed"):
        pg.configure(f"{addr}/q2", f"replica_{rank}", rank, 3, quorum_id=2)
    out["dead_peer_configure_s"] = time.monotonic() - t0
    assert pg.errored() is not None

    # The survivors continue together, then each alone.
    pg.configure(f"{addr}/q3", f"replica_{rank}", rank, 2, quorum_id=3)
    assert pg.errored() is None
    out["pair"] = _allreduce(pg, rank + 1)
    pg.configure(f"{addr}/q4-{rank}", f"replica_{rank}", 0, 1, quorum_id=4)
    out["alone"] = _allreduce(pg, 7, ReduceOp.AVG)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_peer_sigkilled_mid_collective(store: dist.TCPStore) -> None:
    results = _run_workers(
        _peer_death_worker, 3, (store.port,), timeout=45, expect_killed=frozenset({2})
    )
    for rank in (0, 1):
        out = results[rank]
        assert out["error"] not in ("", "None")
        assert out["detect_s"] < 2.0, out  # seen as a connection error, not a timeout (3 s)
        assert out["dead_peer_configure_s"] < 4.5, out  # the 3 s timeout, plus scheduling
        assert out["pair"] == [3.0] * 4
        assert out["alone"] == [7.0] * 4
    assert results[0]["fail_fast_s"] < 0.5
    assert results[1]["noop_completed"] is True
    print(
        "peer death:",
        {r: {k: v for k, v in out.items() if k.endswith("_s")} for r, out in results.items()},
    )


def _fsdp_hook_worker(rank: int, port: int) -> dict[str, Any]:
    """A ManagedProcessGroup in an FSDP all-reduce hook and in TorchTitan's dist_sum/dist_max."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchtitan.distributed import utils as dist_utils

    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default", _client(port)), rank=0, world_size=1
    )
    manager = _FakeManager(participants=2)
    pg = ManagedProcessGroup(manager, name="dp_replicate")  # type: ignore[arg-type]
    model = torch.nn.Linear(4, 4, bias=False)
    fully_shard(model)
    assert isinstance(model, FSDPModule)

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=pg, op=ReduceOp.AVG)

    model.set_all_reduce_hook(all_reduce_hook)
    x = torch.ones(2, 4)
    model(x).sum().backward()
    grad = model.weight.grad.full_tensor()  # type: ignore[union-attr]
    out = {
        "grad": grad.tolist(),
        "expected": (torch.ones(4, 4) * 2 * 2).tolist(),  # d(sum)/dW = 2 per entry, doubled
        "ops": [str(op) for op in manager.calls],
        "dist_sum": dist_utils.dist_sum(torch.tensor(1.5), None, pg),
        "dist_max": dist_utils.dist_max(torch.tensor(1.5), None, pg),
    }
    pg.unregister()
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_managed_process_group_in_fsdp_hook_and_torchtitan(store: dist.TCPStore) -> None:
    out = _run_workers(_fsdp_hook_worker, 1, (store.port,), timeout=60)[0]
    assert out["grad"] == out["expected"]
    assert out["ops"][0].endswith("AVG")
    assert out["dist_sum"] == 3.0 and out["dist_max"] == 3.0
