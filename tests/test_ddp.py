"""DistributedDataParallel and PureDistributedDataParallel: unit tests against a scripted
manager, and PureDistributedDataParallel with two real replica groups.

The real Manager's allreduce is tested in test_manager.py; survival of a SIGKILLed peer with the
real stack is tested in test_manager_integration.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtitan_ft.ddp import DistributedDataParallel, PureDistributedDataParallel, _make_buckets
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager.decisions import RetryDecision
from torchtitan_ft.testing.mlp import WorkerConfig, spawn_rank


class ScriptedManager:
    """allreduce multiplies by ``factor`` in place and completes the future, optionally late
    from another thread (as gloo does). With ``fail`` set it records an error and completes
    at once, leaving the tensor untouched; the tensor is kept in ``abandoned`` (as a collective
    abandoned after a timeout keeps it)."""

    def __init__(self, factor: float = 0.5, late: bool = False) -> None:
        self.factor = factor
        self.late = late
        self.fail = False
        self.error: Exception | None = None
        self.calls: list[int] = []
        self.abandoned: list[torch.Tensor] = []
        self.retry = False
        """What ``retry_decision`` answers for a failed step."""

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.calls.append(tensor.numel())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self.fail:
            self.error = RuntimeError("injected: peer lost")
            self.abandoned.append(tensor)
            fut.set_result(tensor)
            return fut

        def complete() -> None:
            tensor.mul_(self.factor)
            fut.set_result(tensor)

        if self.late:
            threading.Timer(0.05, complete).start()
        else:
            complete()
        return fut

    def errored(self) -> Exception | None:
        return self.error

    def retry_decision(self) -> RetryDecision:
        return RetryDecision(self.retry and self.error is not None, "scripted")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _buffers(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    return [bucket.flat for bucket in ddp._buckets]


def _assert_grads_are_bucket_views(ddp: DistributedDataParallel) -> None:
    for bucket in ddp._buckets:
        offset = 0
        for p in bucket.params:
            assert p.grad is not None
            assert p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
            assert p.grad.data_ptr() == bucket.flat[offset:].data_ptr()
            offset += p.numel()


def _assert_averaged(module: nn.Module, reference: nn.Module, factor: float) -> None:
    """Bitwise: the wrapped module's gradients are the reference's times ``factor``."""
    for p_ref, p in zip(reference.parameters(), module.parameters(), strict=True):
        assert p.grad is not None and p_ref.grad is not None
        assert torch.equal(p.grad, p_ref.grad * factor)


@pytest.mark.parametrize("late", [False, True])
def test_gradients_are_replaced_by_the_allreduced_ones(late: bool) -> None:
    reference, wrapped_module = _model(), _model()
    manager = ScriptedManager(0.5, late=late)
    ddp = DistributedDataParallel(manager, wrapped_module)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    reference(x).sum().backward()
    ddp(x).sum().backward()
    _assert_averaged(wrapped_module, reference, 0.5)
    _assert_grads_are_bucket_views(ddp)
    assert sum(manager.calls) == sum(p.numel() for p in wrapped_module.parameters())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_steps_match_a_run_without_the_wrapper(set_to_none: bool) -> None:
    reference, wrapped_module = _model(), _model()
    ddp = DistributedDataParallel(ScriptedManager(0.5), wrapped_module, bucket_cap_mb=1e-4)  # type: ignore[arg-type]
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped_module.parameters(), lr=0.1)
    buffers = [flat.data_ptr() for flat in _buffers(ddp)]
    assert len(buffers) > 1
    for step in range(3):
        x = torch.randn(3, 4)
        opt_ref.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        views = [p.grad for p in wrapped_module.parameters()]
        reference(x).sum().backward()
        ddp(x).sum().backward()
        for p in reference.parameters():
            assert p.grad is not None
            p.grad.mul_(0.5)
        _assert_averaged(wrapped_module, reference, 1.0)
        _assert_grads_are_bucket_views(ddp)
        assert [flat.data_ptr() for flat in _buffers(ddp)] == buffers  # allocated once
        if step > 0 and not set_to_none:  # autograd accumulated into the views themselves
            assert all(p.grad is v for p, v in zip(wrapped_module.parameters(), views, strict=True))
        opt_ref.step()
        opt.step()
        for p_ref, p in zip(reference.parameters(), wrapped_module.parameters(), strict=True):
            assert torch.equal(p, p_ref)


def test_small_buckets_and_no_sync() -> None:
    module = _model()
    manager = ScriptedManager(1.0)
    ddp = DistributedDataParallel(manager, module, bucket_cap_mb=64 / 2**20)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert manager.calls == []
    ddp(x).sum().backward()
    assert len(manager.calls) > 1  # several buckets
    assert sum(manager.calls) == sum(p.numel() for p in module.parameters())


def test_no_sync_accumulates_in_the_views_then_averages_the_sum() -> None:
    reference, wrapped_module = _model(), _model()
    manager = ScriptedManager(0.5)
    ddp = DistributedDataParallel(manager, wrapped_module)  # type: ignore[arg-type]
    batches = [torch.randn(3, 4) for _ in range(3)]
    for x in batches:
        reference(x).sum().backward()
    with ddp.no_sync():
        for x in batches[:2]:
            ddp(x).sum().backward()
            _assert_grads_are_bucket_views(ddp)
    assert manager.calls == []
    ddp(batches[2]).sum().backward()
    _assert_averaged(wrapped_module, reference, 0.5)
    _assert_grads_are_bucket_views(ddp)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(2, 2)
        self.sometimes = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, both: bool = True) -> Any:
        return self.used(x) + (self.sometimes(x) if both else 0)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_unused_parameters_get_the_average(set_to_none: bool) -> None:
    module = TwoHeads()
    ddp = DistributedDataParallel(ScriptedManager(1.0), module)  # type: ignore[arg-type]
    ddp(torch.ones(1, 2), both=False).sum().backward()
    assert torch.equal(module.sometimes.weight.grad, torch.zeros(2, 2))  # type: ignore[arg-type]
    _assert_grads_are_bucket_views(ddp)
    # used, then unused: it takes part with zeros, not with the buffer's stale gradient
    module.zero_grad(set_to_none=set_to_none)
    ddp(torch.ones(1, 2)).sum().backward()
    assert not torch.equal(module.sometimes.weight.grad, torch.zeros(2, 2))  # type: ignore[arg-type]
    module.zero_grad(set_to_none=set_to_none)
    ddp(torch.ones(1, 2), both=False).sum().backward()
    assert torch.equal(module.sometimes.weight.grad, torch.zeros(2, 2))  # type: ignore[arg-type]
    assert torch.equal(module.sometimes.bias.grad, torch.zeros(2))  # type: ignore[arg-type]
    _assert_grads_are_bucket_views(ddp)


def test_mixed_dtypes_and_non_contiguous_parameters() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.transposed = nn.Parameter(torch.randn(3, 4).t())  # its gradient is too
            self.head = nn.Linear(3, 2).double()

        def forward(self, x: torch.Tensor) -> Any:
            return self.head((x @ self.transposed).double())

    reference, wrapped_module = Mixed(), Mixed()
    assert not reference.transposed.is_contiguous()
    ddp = DistributedDataParallel(ScriptedManager(0.5), wrapped_module)  # type: ignore[arg-type]
    assert [b.flat.dtype for b in ddp._buckets] == [torch.float64, torch.float32]
    for _ in range(2):  # a fresh non-contiguous gradient, then accumulation into the view
        x = torch.randn(5, 4)
        reference(x).sum().backward()
        for p in reference.parameters():
            p.grad.mul_(0.5)  # type: ignore[union-attr]
        ddp(x).sum().backward()
        _assert_averaged(wrapped_module, reference, 1.0)
        _assert_grads_are_bucket_views(ddp)


def test_a_failed_allreduce_leaves_its_buffer_behind() -> None:
    reference, wrapped_module = _model(), _model()
    manager = ScriptedManager(0.5)
    manager.fail = True
    ddp = DistributedDataParallel(manager, wrapped_module)  # type: ignore[arg-type]
    ddp(torch.randn(3, 4)).sum().backward()  # does not raise
    _assert_grads_are_bucket_views(ddp)
    assert manager.abandoned and all(
        flat.data_ptr() != old.data_ptr() for flat in _buffers(ddp) for old in manager.abandoned
    )
    # the abandoned collective writes late; the next step (healthy) must not see it
    manager.fail, manager.error = False, None
    wrapped_module.zero_grad(set_to_none=False)
    for old in manager.abandoned:
        old.fill_(float("nan"))
    x = torch.randn(3, 4)
    reference(x).sum().backward()
    ddp(x).sum().backward()
    _assert_averaged(wrapped_module, reference, 0.5)


def test_a_step_the_manager_retries_keeps_its_buffers() -> None:
    manager = ScriptedManager(0.5)
    manager.fail, manager.retry = True, True
    ddp = DistributedDataParallel(manager, _model())  # type: ignore[arg-type]
    before = [flat.data_ptr() for flat in _buffers(ddp)]
    ddp(torch.randn(3, 4)).sum().backward()
    # the retry re-runs the allreduces in these very buffers, which the gradients view
    assert [flat.data_ptr() for flat in _buffers(ddp)] == before
    assert [t.data_ptr() for t in manager.abandoned] == before
    _assert_grads_are_bucket_views(ddp)


def test_a_second_gradient_in_one_backward_is_an_error() -> None:
    manager = ScriptedManager(1.0)
    ddp = DistributedDataParallel(manager, nn.Linear(4, 4))  # type: ignore[arg-type]
    x = torch.randn(2, 4, requires_grad=True)
    inner = checkpoint(ddp.module, x, use_reentrant=True)  # its backward: a graph task of its own
    with pytest.raises(RuntimeError, match="twice in one backward"):
        ddp(inner).sum().backward()
    assert len(manager.calls) == 1


def test_make_buckets_respects_cap_and_dtype() -> None:
    params = [
        nn.Parameter(torch.zeros(10)),
        nn.Parameter(torch.zeros(10)),
        nn.Parameter(torch.zeros(10, dtype=torch.float64)),
    ]
    buckets = _make_buckets(params, cap_bytes=80)
    # reverse order; the float64 one alone, the two float32 ones together (80 bytes)
    assert [[id(p) for p in b.params] for b in buckets] == [
        [id(params[2])],
        [id(params[1]), id(params[0])],
    ]
    assert [b.flat.numel() for b in buckets] == [10, 20]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(ScriptedManager(), _model(), bucket_cap_mb=0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# PureDistributedDataParallel
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("late", [False, True])
def test_pure_ddp_averages_each_gradient_before_backward_returns(late: bool) -> None:
    reference, wrapped_module = _model(), _model()
    manager = ScriptedManager(0.5, late=late)
    ddp = PureDistributedDataParallel(manager, wrapped_module)  # type: ignore[arg-type]
    assert ddp.module is wrapped_module
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped_module.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(3, 4)
        opt_ref.zero_grad()
        opt.zero_grad()
        reference(x).sum().backward()
        ddp(x).sum().backward()
        # one collective per parameter, completed (even the late ones) when backward returns
        assert manager.calls[-4:] == [
            p.numel() for p in reversed(list(wrapped_module.parameters()))
        ]
        _assert_averaged(wrapped_module, reference, 0.5)
        for p in reference.parameters():
            assert p.grad is not None
            p.grad.mul_(0.5)
        opt_ref.step()
        opt.step()
        for p_ref, p in zip(reference.parameters(), wrapped_module.parameters(), strict=True):
            assert torch.equal(p, p_ref)
    assert len(manager.calls) == 8


def test_pure_ddp_a_failed_allreduce_does_not_raise() -> None:
    manager = ScriptedManager(0.5)
    manager.fail = True
    module = _model()
    ddp = PureDistributedDataParallel(manager, module)  # type: ignore[arg-type]
    ddp(torch.randn(3, 4)).sum().backward()  # the error is data: nothing raises
    assert manager.errored() is not None
    assert len(manager.abandoned) == 4


def _run_two_groups(
    tmp_path: Any, ddp: str, process_group: str = "gloo", timeout_s: float = 10.0
) -> list[dict[str, Any]]:
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=3000,
    )
    procs = []
    try:
        outs = [tmp_path / f"{ddp}_{process_group}_{i}.pt" for i in range(2)]
        for i in range(2):
            cfg = WorkerConfig(
                lighthouse_addr=lighthouse.address(),
                replica=i,
                out_path=str(outs[i]),
                min_replica_size=2,
                stop_step=5,
                stop_participants=2,
                max_iterations=60,
                ddp=ddp,
                process_group=process_group,
                timeout_s=timeout_s,
            )
            procs.append(spawn_rank(cfg))
        for proc in procs:
            proc.join(75)
            assert proc.exitcode == 0, f"{ddp} worker exit code {proc.exitcode}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        lighthouse.shutdown()
    return [torch.load(out, weights_only=False) for out in outs]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_pure_ddp_two_replica_groups_match_the_bucketed_ddp(tmp_path: Any) -> None:
    """Two real replica groups (lighthouse, Manager, ProcessGroupGloo) train 5 steps with each
    wrapper on different data per group; both wrappers average the same gradients, so the
    groups end identical to each other and to the bucketed run."""
    pure = _run_two_groups(tmp_path, "pure")
    bucketed = _run_two_groups(tmp_path, "bucketed")
    for runs in (pure, bucketed):
        assert [r["step"] for r in runs] == [5, 5]
        for name, tensor in runs[0]["model"].items():
            assert torch.equal(tensor, runs[1]["model"][name]), name
        # after the first step (group 1 heals from group 0: init_sync), both groups take part
        assert [(ok, n) for _, ok, n, _, _ in runs[0]["commits"][1:]] == [(True, 2)] * 4
    for name, tensor in pure[0]["model"].items():
        torch.testing.assert_close(tensor, bucketed[0]["model"][name], rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_replica_groups_over_baby_gloo_train_as_over_gloo(tmp_path: Any) -> None:
    """The Manager drives a ProcessGroupBabyGloo (collectives in a child process of each
    trainer) as it drives ProcessGroupGloo: the same commits and the same final parameters."""
    baby = _run_two_groups(tmp_path, "pure", "baby_gloo", timeout_s=30)
    gloo = _run_two_groups(tmp_path, "pure", "gloo")
    for runs in (baby, gloo):
        assert [r["step"] for r in runs] == [5, 5]
        assert [(ok, n) for _, ok, n, _, _ in runs[0]["commits"][1:]] == [(True, 2)] * 4
    for name, tensor in baby[0]["model"].items():
        assert torch.equal(tensor, baby[1]["model"][name]), name
        assert torch.equal(tensor, gloo[0]["model"][name]), name
