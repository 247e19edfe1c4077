"""The collective table (``torchtitan_ft.process_group.collectives``) and every group type's
agreement with it: each collective of the table, run on each group type, leaves the same
tensors and completes its future with the same value as on the plain gloo group.

The two ranks of a group run on two threads of this process (one gloo device serves both).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions, BroadcastOptions

from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
)
from torchtitan_ft.process_group.collectives import BY_NAME, COLLECTIVES, Yields

TIMEOUT = timedelta(seconds=60)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _z(n: int) -> torch.Tensor:
    return torch.zeros(n)


# Per collective: (rank, world_size) -> (the collective this rank runs, its arguments without
# opts). Both ranks run the same collective, except for send and recv, which pair up.
Case = Callable[[int, int], tuple[str, tuple[Any, ...]]]

CASES: dict[str, Case] = {
    "allreduce": lambda r, w: ("allreduce", ([_t(r + 1, 2 * r)],)),
    "allreduce_coalesced": lambda r, w: ("allreduce_coalesced", ([_t(r + 1), _t(3, r)],)),
    "allgather": lambda r, w: ("allgather", ([[_z(2) for _ in range(w)]], [_t(r, r + 1)])),
    "allgather_into_tensor_coalesced": lambda r, w: (
        "allgather_into_tensor_coalesced",
        ([_z(2 * w)], [_t(r + 1, r + 2)]),
    ),
    "broadcast": lambda r, w: ("broadcast", ([_t(r + 5, r)],)),
    "reduce_scatter": lambda r, w: (
        "reduce_scatter",
        ([_z(2)], [[_t(r + i, i) for i in range(w)]]),
    ),
    "reduce_scatter_tensor_coalesced": lambda r, w: (
        "reduce_scatter_tensor_coalesced",
        ([_z(2)], [torch.arange(2.0 * w) + r]),
    ),
    "alltoall_base": lambda r, w: ("alltoall_base", (_z(2 * w), torch.arange(2.0 * w) + r, [], [])),
    "all_gather_single": lambda r, w: ("all_gather_single", (_z(2 * w), _t(r, 7))),
    "reduce_scatter_single": lambda r, w: (
        "reduce_scatter_single",
        (_z(2), torch.arange(2.0 * w) * (r + 1)),
    ),
    "gather": lambda r, w: (
        "gather",
        ([[_z(2) for _ in range(w)]] if r == 0 else [], [_t(r + 1, 4)]),
    ),
    "scatter": lambda r, w: (
        "scatter",
        ([_z(2)], [[_t(i + 3, i) for i in range(w)]] if r == 0 else []),
    ),
    "reduce": lambda r, w: ("reduce", ([_t(r + 1, 9)],)),
    "send": lambda r, w: ("send", ([_t(4, 5)], 1, 7)) if r == 0 else ("recv", ([_z(2)], 0, 7)),
    "recv": lambda r, w: ("recv", ([_z(2)], 1, 3)) if r == 0 else ("send", ([_t(6, 1)], 0, 3)),
    "barrier": lambda r, w: ("barrier", ()),
}
"""A case for every collective of the table (checked by ``test_every_collective_has_a_case``)."""

PAIRED = ("send", "recv")
"""Cases that need two ranks."""


def _plain(value: Any) -> Any:
    """Tensors as lists of numbers, lists as lists, everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value


def _run_case(
    pg: ProcessGroup, name: str, args: tuple[Any, ...], device: str = "cpu"
) -> tuple[Any, Any]:
    """Run one collective on tensors of ``device``; returns (its arguments after it ran, its
    future's value)."""
    args = _to(args, device)
    work = getattr(pg, name)(*args)
    value = work.get_future().wait()
    assert work.wait() is True
    collective = BY_NAME[name]
    bound = collective.bind(args, {})
    assert _plain(value) == _plain(collective.value(bound)), name
    return _plain(args), _plain(value)


def _on_ranks(groups: list[ProcessGroup], fn: Callable[[int, ProcessGroup], Any]) -> list[Any]:
    """``fn(rank, group)`` on one thread per rank; their results, in rank order."""
    results: list[Any] = [None] * len(groups)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, groups[rank])
        except BaseException as e:  # handed to the test below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * TIMEOUT.total_seconds())
    if errors:
        raise errors[0]
    return results


def _results(
    make: Callable[[], ProcessGroup],
    store: dist.TCPStore,
    prefix: str,
    world: int,
    device: str = "cpu",
) -> dict[str, list[Any]]:
    """Every case run on a group of ``world`` ranks made by ``make``, on tensors of
    ``device``: per case, per rank, (arguments after, future value)."""
    groups = [make() for _ in range(world)]
    addr = f"127.0.0.1:{store.port}/{prefix}"
    _on_ranks(groups, lambda r, pg: pg.configure(addr, f"replica_{r}", r, world))
    try:
        out: dict[str, list[Any]] = {}
        for case, make_args in CASES.items():
            if world == 1 and case in PAIRED:
                continue
            out[case] = _on_ranks(
                groups,
                lambda r, pg, make_args=make_args: _run_case(
                    pg, *make_args(r, world), device=device
                ),
            )
        return out
    finally:
        for pg in groups:
            pg.shutdown()


GROUP_TYPES: dict[str, Callable[[], ProcessGroup]] = {
    "ProcessGroupWrapper": lambda: ProcessGroupWrapper(ProcessGroupGloo(TIMEOUT)),
    "ErrorSwallowingProcessGroupWrapper": lambda: ErrorSwallowingProcessGroupWrapper(
        ProcessGroupGloo(TIMEOUT)
    ),
    "FakeProcessGroupWrapper": lambda: FakeProcessGroupWrapper(ProcessGroupGloo(TIMEOUT)),
    "ProcessGroupBabyGloo": lambda: ProcessGroupBabyGloo(TIMEOUT),
}


def test_every_collective_has_a_case() -> None:
    assert set(CASES) == set(BY_NAME)


def test_table_entries_are_consistent() -> None:
    for collective in COLLECTIVES:
        if collective.options is not None:
            assert collective.params[-1] == "opts", collective.name
        for name in (collective.result, collective.input):
            assert name is None or name in collective.params, collective.name
        assert (collective.result is None) == (collective.yields is Yields.NOTHING)


def test_every_collective_is_a_method_with_the_table_signature() -> None:
    for collective in COLLECTIVES:
        method = getattr(ProcessGroup, collective.name)
        params = list(inspect.signature(method).parameters)
        assert params == ["self", *collective.params], collective.name
        assert method.__doc__ == collective.doc


def test_options_are_normalized_and_misuse_is_rejected() -> None:
    allreduce = BY_NAME["allreduce"]
    tensors = [torch.ones(1)]
    (_, opts) = allreduce.bind((tensors,), {})
    assert isinstance(opts, AllreduceOptions) and opts.reduceOp == ReduceOp.SUM
    (_, opts) = allreduce.bind((tensors, ReduceOp.MAX), {})
    assert opts.reduceOp == ReduceOp.MAX
    (_, opts) = allreduce.bind((), {"tensors": tensors, "opts": ReduceOp.AVG})
    assert opts.reduceOp == ReduceOp.AVG
    with pytest.raises(TypeError, match="broadcast: opts must be BroadcastOptions or None"):
        BY_NAME["broadcast"].bind((tensors, ReduceOp.SUM), {})
    with pytest.raises(TypeError, match="allreduce: opts must be AllreduceOptions, a ReduceOp"):
        allreduce.bind((tensors, BroadcastOptions()), {})
    with pytest.raises(TypeError):
        allreduce.bind((), {})
    assert BY_NAME["send"].bind((tensors, 1), {}) == (tensors, 1, 0)


def test_a_collective_a_group_lacks_is_refused_by_name() -> None:
    class Bare(ProcessGroup):
        pass

    with pytest.raises(NotImplementedError, match="Bare does not implement gather"):
        Bare().gather([], [torch.ones(1)])


def test_capabilities_are_declared_on_the_base_and_forwarded_by_wrappers() -> None:
    gloo = ProcessGroupGloo(timedelta(seconds=7))
    assert gloo.can_wait_abandoned() and gloo.get_timeout() == timedelta(seconds=7)
    assert gloo.wait_abandoned(timedelta(seconds=1))  # nothing dropped yet
    for wrapper in (
        ProcessGroupWrapper(gloo),
        ErrorSwallowingProcessGroupWrapper(gloo),
        FakeProcessGroupWrapper(ProcessGroupWrapper(gloo)),
    ):
        assert wrapper.can_wait_abandoned()
        assert wrapper.get_timeout() == timedelta(seconds=7)
        assert wrapper.wait_abandoned(timedelta(seconds=1))
    gloo.set_timeout(timedelta(seconds=9))
    assert ProcessGroupWrapper(gloo).get_timeout() == timedelta(seconds=9)
    dummy = ProcessGroupDummy(0, 1)
    assert not ProcessGroupWrapper(dummy).can_wait_abandoned()
    assert ProcessGroupWrapper(dummy).get_timeout() is None
    with pytest.raises(NotImplementedError, match="ProcessGroupDummy does not implement wait"):
        ProcessGroupWrapper(dummy).wait_abandoned(timedelta(seconds=1))


@pytest.mark.multiprocess
def test_every_group_type_agrees_with_gloo_on_every_collective(store: dist.TCPStore) -> None:
    reference = _results(lambda: ProcessGroupGloo(TIMEOUT), store, "gloo", 2)
    for name, make in GROUP_TYPES.items():
        assert _results(make, store, name, 2) == reference, name


def test_the_dummy_group_agrees_with_a_one_rank_gloo_group(store: dist.TCPStore) -> None:
    reference = _results(lambda: ProcessGroupGloo(TIMEOUT), store, "gloo", 1)
    assert _results(lambda: ProcessGroupDummy(0, 1), store, "dummy", 1) == reference
    dummy = ProcessGroupDummy(0, 1)
    for name in PAIRED:  # no peer to pair with: the future still yields the declared value
        _run_case(dummy, *CASES[name](0, 2))


def test_nccl_groups_agree_with_gloo_where_there_is_a_gpu(store: dist.TCPStore) -> None:
    if not torch.cuda.is_available() or getattr(dist, "ProcessGroupNCCL", None) is None:
        pytest.skip("needs CUDA and a torch build with NCCL (NCCL groups take CUDA tensors)")
    # One rank: NCCL gives each rank a GPU of its own.
    reference = _results(lambda: ProcessGroupGloo(TIMEOUT), store, "gloo", 1)
    for name, make in (
        ("nccl", lambda: ProcessGroupNCCL(TIMEOUT)),
        ("baby_nccl", lambda: ProcessGroupBabyNCCL(TIMEOUT)),
    ):
        assert _results(make, store, name, 1, device="cuda") == reference, name
