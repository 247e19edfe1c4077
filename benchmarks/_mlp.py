"""Shared pieces of ``benchmarks.manager_step`` and ``benchmarks.recovery``.

Only the standard library is imported at module level: ``benchmarks.recovery`` times the
replacement's imports from its first line, so torch is imported inside the functions.

- ``mlp``: a 2-layer MLP (two square ``Linear`` layers) of about ``size_mb`` MB of float32
  parameters, the same on every replica (fixed seed);
- ``batch``: a fixed-size random batch, different per replica and step;
- ``ft_setup``: Manager + ProcessGroupGloo + HTTPTransport + DistributedDataParallel +
  OptimizerWrapper for one replica group of one process, everything on 127.0.0.1 (ours: the
  test harness's ``torchtitan_ft.testing.mlp_rank.ft_stack``; torchft's: set up the same way).
"""

from __future__ import annotations

import math
import statistics
import time
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"
BATCH = 32
LR = 1e-3


def mlp_dim(size_mb: float) -> int:
    """Width ``d`` of the two ``d x d`` layers holding ``size_mb`` MB (1e6 bytes) of fp32."""
    return int(math.sqrt(size_mb * 1e6 / 4 / 2))


def mlp(size_mb: float) -> Any:
    import torch

    d = mlp_dim(size_mb)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d))


def param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def batch(dim: int, replica: int, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * replica + step % 16)
    return torch.randn(BATCH, dim, generator=g), torch.randn(BATCH, dim, generator=g)


def optimizer(params: Any) -> Any:
    """Plain SGD: no optimizer state, so a heal transfers exactly the parameters."""
    import torch

    return torch.optim.SGD(params, lr=LR)


IMPLS = ("ours", "torchft")
"""``ours``: torchtitan_ft; ``torchft``: the reference, torchft 0.2.0's own Python runtime (its
Manager, DDP, optimizer wrapper, ProcessGroupGloo and HTTPTransport) and Rust servers."""


def ft_setup(
    replica: int,
    lighthouse_addr: str,
    model: Any,
    timeout_s: float = 30.0,
    marks: dict[str, float] | None = None,
    bucket_cap_mb: float = 25.0,
    impl: str = "ours",
    retry_inflight_allreduce: bool = False,
) -> tuple[Any, Any, Any, Any]:
    """(manager, pg, ddp, optim) for replica group ``replica`` (1 process, async quorum), of
    ``impl`` (see :data:`IMPLS`; ``retry_inflight_allreduce`` is our Manager's).

    ``marks`` (if given) gets the wall-clock times at which the optimizer and the Manager
    were constructed."""
    if impl == "torchft":
        return _torchft_setup(replica, lighthouse_addr, model, timeout_s, marks)
    from torchtitan_ft.testing.mlp_rank import ft_stack

    marks = {} if marks is None else marks
    inner = optimizer(model.parameters())
    marks["optimizer"] = time.time()
    return ft_stack(
        model,
        inner,
        replica=replica,
        lighthouse_addr=lighthouse_addr,
        timeout_s=timeout_s,
        quorum_timeout_s=120.0,
        bucket_cap_mb=bucket_cap_mb,
        retry_inflight_allreduce=retry_inflight_allreduce,
        marks=marks,
    )


def _torchft_setup(
    replica: int,
    lighthouse_addr: str,
    model: Any,
    timeout_s: float,
    marks: dict[str, float] | None,
) -> tuple[Any, Any, Any, Any]:
    """:func:`ft_setup` with torchft 0.2.0's own classes, set up the same way. torchft's
    Manager needs a TCPStore already listening (torchrun's, normally): hosted here."""
    import torch.distributed as dist

    from benchmarks._reference import import_torchft

    torchft = import_torchft()
    marks = {} if marks is None else marks
    inner = optimizer(model.parameters())
    marks["optimizer"] = time.time()

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    pg = torchft.ProcessGroupGloo(timeout=timeout)
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=True,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=HOST,
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"replica_{replica}",
        hostname=HOST,
    )
    manager._benchmark_store = store  # kept alive with the Manager
    marks["manager"] = time.time()
    ddp = _torchft_ddp(torchft, manager, model)
    optim = torchft.Optimizer(manager, inner)  # torchft.optim.OptimizerWrapper
    return manager, pg, ddp, optim


def _torchft_ddp(torchft: Any, manager: Any, model: Any) -> Any:
    """torchft 0.2.0's ``DistributedDataParallel`` with one fix to its comm hook, which asserts
    (``assert fut._fut``) when the allreduce fails -- a peer SIGKILLed mid-allreduce -- and so
    kills the survivor's backward. Its Manager has already recorded the error then (the step
    will not commit), so the hook returns the bucket unchanged, as its Manager's error path
    intends; everything else is torchft's."""
    import torch

    class _DDP(torchft.DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # unannotated: DDP checks the annotations
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            # a _ManagedFuture wraps the inner future; an errored Manager's dummy work returns
            # a plain one
            fut = getattr(fut, "_fut", fut)
            if fut is None:
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
            return fut

    return _DDP(manager, model)


def summary(values: list[float]) -> dict[str, float]:
    """Median, quartiles, min and max of ``values`` (seconds in, milliseconds out)."""
    ms = sorted(v * 1e3 for v in values)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return {
        "median_ms": round(statistics.median(ms), 2),
        "p25_ms": round(q[0], 2),
        "p75_ms": round(q[2], 2),
        "min_ms": round(ms[0], 2),
        "max_ms": round(ms[-1], 2),
        "n": len(ms),
    }


def setup() -> dict[str, object]:
    """The setup both Manager benchmarks share, for their JSON output."""
    return {
        "model": "Linear(d,d)-ReLU-Linear(d,d), fp32",
        "batch": BATCH,
        "optimizer": f"SGD(lr={LR})",
        "replica_groups": 2,
        "processes_per_group": 1,
    }
