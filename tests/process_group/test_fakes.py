"""``ProcessGroupDummy`` and ``FakeProcessGroupWrapper`` (``torchtitan_ft.process_group.fakes``),
in process; the wrapper over a real gloo group is checked with a world-size-1 group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from torchtitan_ft.process_group import (
    FakeProcessGroupWrapper,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ReconfigureOptions,
)


def test_dummy_rejects_more_than_one_process() -> None:
    with pytest.raises(ValueError, match="rank=0, world=1, got rank=1, world=2"):
        ProcessGroupDummy(1, 2)


def test_dummy_completes_every_collective_as_one_rank_would() -> None:
    pg = ProcessGroupDummy(0, 1)
    assert (pg.size(), pg.rank(), pg.getBackendName()) == (1, 0, "torchft-dummy")
    pg.configure("unused:0/p", "r", 0, 1)
    pg.configure("unused:0/q", "r", 0, 1)
    assert pg.configure_count == 2
    assert pg.reconfigure(ReconfigureOptions()).wait()
    assert (pg.configure_count, pg.reconfigure_count) == (2, 1)

    t = torch.arange(3.0)
    work = pg.allreduce([t], ReduceOp.SUM)
    assert work.wait() and work.is_completed()
    assert work.get_future().wait()[0] is t
    torch.testing.assert_close(t, torch.arange(3.0))

    out = [[torch.zeros(3)]]
    pg.allgather(out, [t]).wait()
    torch.testing.assert_close(out[0][0], t)

    rs_out = [torch.zeros(3)]
    pg.reduce_scatter(rs_out, [[t + 1]]).wait()
    torch.testing.assert_close(rs_out[0], t + 1)

    coalesced = [torch.zeros(3)]
    pg.allgather_into_tensor_coalesced(coalesced, [t + 2]).wait()
    torch.testing.assert_close(coalesced[0], t + 2)
    pg.reduce_scatter_tensor_coalesced(coalesced, [t + 3]).wait()
    torch.testing.assert_close(coalesced[0], t + 3)
    pg.set_timeout(timedelta(seconds=1))

    a2a = torch.zeros(3)
    pg.alltoall_base(a2a, t * 2, [], []).wait()
    torch.testing.assert_close(a2a, t * 2)

    for work in (pg.barrier(), pg.send([t], 0), pg.recv([t], 0), pg.broadcast_one(t, 0)):
        assert work.wait()
    torch.testing.assert_close(t, torch.arange(3.0))


def test_torch_ddp_runs_on_the_dummy_group() -> None:
    """torchft's users run torch's DDP on it to skip communication in tests."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy(0, 1))
    ddp(torch.rand(2, 3)).sum().backward()
    assert model.weight.grad is not None


def test_fake_wrapper_fails_exactly_the_next_allreduce() -> None:
    inner = ProcessGroupDummy(0, 1)
    pg = FakeProcessGroupWrapper(inner)
    assert pg.parent is inner
    t = torch.ones(2)
    assert pg.allreduce([t]).wait()

    pg.report_future_error(RuntimeError("injected allreduce error"))
    failing = pg.allreduce([t])
    with pytest.raises(RuntimeError, match="injected allreduce error"):
        failing.wait()
    with pytest.raises(RuntimeError, match="injected allreduce error"):
        failing.get_future().wait()

    # Consumed: the next one succeeds, and other collectives were never affected.
    assert pg.allreduce([t]).get_future().wait() == [t]


def test_fake_wrapper_configure_forgets_an_unconsumed_error() -> None:
    inner = ProcessGroupDummy(0, 1)
    pg = FakeProcessGroupWrapper(inner)
    pg.report_future_error(RuntimeError("injected"))
    pg.configure("unused:0/p", "r", 0, 1, quorum_id=3)
    assert inner.configure_count == 1
    assert pg.allreduce([torch.ones(1)]).wait()


def test_fake_wrapper_over_gloo_still_runs_the_collective() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timedelta(seconds=5)))
    pg.configure(f"127.0.0.1:{store.port}/q0", "r", 0, 1)
    assert (pg.size(), pg.getBackendName()) == (1, "torchft-gloo")
    t = torch.full((2,), 3.0)
    pg.report_future_error(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        pg.allreduce([t], ReduceOp.SUM).wait()
    # The group itself is healthy: the error was only injected into the Work.
    assert pg.errored() is None
    pg.allreduce([t], ReduceOp.SUM).wait()
    torch.testing.assert_close(t, torch.full((2,), 3.0))
    pg.shutdown()
