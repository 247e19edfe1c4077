"""The wrapping process groups (``torchtitan_ft.process_group.wrappers``): errors as data over
a fake inner group, and the Manager-routed group over a fake Manager, in process and inside a
forked FSDP + TorchTitan child (TorchTitan is imported only there: importing it here would fix
its ``device_type`` before other tests can make it CPU)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import Work
from torch.futures import Future

from tests.process_group._workers import run_workers, store_client
from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupWrapper,
)


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


# --------------------------------------------------------------------------------------------
# multi-process tests
# --------------------------------------------------------------------------------------------


def _fsdp_hook_worker(rank: int, port: int) -> dict[str, Any]:
    """A ManagedProcessGroup in an FSDP all-reduce hook and in TorchTitan's dist_sum/dist_max."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchtitan.distributed import utils as dist_utils

    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default", store_client(port)), rank=0, world_size=1
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
    out = run_workers(_fsdp_hook_worker, 1, (store.port,), timeout=60)[0]
    assert out["grad"] == out["expected"]
    assert out["ops"][0].endswith("AVG")
    assert out["dist_sum"] == 3.0 and out["dist_max"] == 3.0


def test_plain_wrapper_forwards_configure_collectives_and_errors() -> None:
    inner = ProcessGroupDummy(0, 1)
    wrapper = ProcessGroupWrapper(inner)
    assert wrapper.parent is inner
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"
    wrapper.configure("unused:0/p", "r", 0, 1)
    assert inner.configure_count == 1
    t = torch.ones(3)
    work = wrapper.allreduce([t])
    assert work.wait() and work.get_future().wait() == [t]
    assert (wrapper.size(), wrapper.getBackendName()) == (1, inner.getBackendName())
    assert wrapper.errored() is None
    assert isinstance(ErrorSwallowingProcessGroupWrapper(inner), ProcessGroupWrapper)
