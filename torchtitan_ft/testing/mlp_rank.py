"""A replica-group rank of the tiny-MLP harness (:mod:`torchtitan_ft.testing.mlp`):
:func:`train_worker`, the FT training loop of a user script, and :func:`ft_stack`, the FT stack
around a model that the rank and the benchmarks build. Imported by the rank's process (the
forkserver preloads it) and by the benchmarks' workers, which train anyway.

    python -m torchtitan_ft.testing.mlp_rank '{...}'

runs one rank from a JSON :class:`~torchtitan_ft.testing.mlp.WorkerConfig`, for a process that
multiprocessing cannot start (one inside a test host's network namespace).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan_ft.checkpoint import HTTPTransport
from torchtitan_ft.ddp import DistributedDataParallel, PureDistributedDataParallel
from torchtitan_ft.manager import Manager, WorldSizeMode
from torchtitan_ft.optim import OptimizerWrapper
from torchtitan_ft.process_group import ProcessGroupBabyGloo, ProcessGroupGloo
from torchtitan_ft.testing.mlp import BATCH_SIZE, HOST, WorkerConfig


def _batch(replica: int, group_rank: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * replica + 100 * group_rank + step)
    return torch.randn(BATCH_SIZE, 16, generator=g), torch.randn(BATCH_SIZE, 4, generator=g)


def _busy(products: int) -> None:
    """Fixed CPU work: ``products`` 128x128 matrix products."""
    if products:
        a = torch.ones(128, 128)
        for _ in range(products):
            a = torch.tanh(a @ a / 128)


def eval_batch() -> tuple[Any, Any]:
    """A fixed batch no worker trains on, to compare final losses between runs."""
    return _batch(999, 0, 0)


def state_hash(model: Any, optim: Any) -> str:
    """SHA-1 of the parameters and the optimizer state (bitwise)."""
    digest = hashlib.sha1()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    for index, per_param in sorted(optim.state_dict()["state"].items()):
        for key, value in sorted(per_param.items()):
            digest.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().contiguous().numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


def _log_iteration(
    path: str, manager: Any, model: Any, optim: Any, committed: bool, loss: float
) -> None:
    with torch.no_grad():
        x, y = eval_batch()
        eval_loss = torch.nn.functional.mse_loss(model(x), y).item()
    record = {
        "pid": os.getpid(),
        "step": manager.current_step(),
        "committed": committed,
        "participants": manager.num_participants(),
        "participating": manager.is_participating(),
        "hash": state_hash(model, optim),
        "loss": loss,
        "eval_loss": eval_loss,
        "time": time.time(),
    }
    with open(path, "a") as f:  # one write per line: a SIGKILL leaves at most a torn last line
        f.write(json.dumps(record) + "\n")


def ft_stack(
    model: Any,
    inner: Any,
    *,
    replica: int,
    lighthouse_addr: str,
    timeout_s: float,
    quorum_timeout_s: float,
    group_rank: int = 0,
    group_world_size: int = 1,
    store_port: int | None = None,
    min_replica_size: int = 1,
    world_size_mode: str = "DYNAMIC",
    process_group: str = "gloo",
    ddp: str = "bucketed",
    bucket_cap_mb: float | None = None,
    auth_token: str | None = None,
    retry_inflight_allreduce: bool = False,
    events_dir: str | None = None,
    marks: dict[str, float] | None = None,
    host: str = HOST,
    lighthouse_outage: str | None = None,
    on_state_loss: str | None = None,
) -> tuple[Any, Any, Any, Any]:
    """(manager, pg, ddp, optim): the FT stack of one replica-group rank around ``model`` and
    its optimizer ``inner``, everything on 127.0.0.1: a ``Manager`` (async quorum, replica id
    ``replica_{replica}``, healing ``{"model", "optim"}`` over ``HTTPTransport``), the
    cross-group process group, the DDP wrapper and ``OptimizerWrapper``. The harness's worker
    and the benchmarks build theirs with it.

    Args:
        timeout_s: the Manager's, the process group's and the transport's timeout, seconds.
        quorum_timeout_s: the Manager's ``quorum_timeout``, seconds.
        store_port: the group's TCPStore port (needed when ``group_world_size > 1``).
        world_size_mode: a ``WorldSizeMode`` name.
        process_group: ``"gloo"`` (``ProcessGroupGloo``) or ``"baby_gloo"``
            (``ProcessGroupBabyGloo``).
        ddp: ``"bucketed"`` (``DistributedDataParallel``) or ``"pure"``
            (``PureDistributedDataParallel``).
        bucket_cap_mb: the bucketed wrapper's bucket size; None: its default.
        auth_token, retry_inflight_allreduce, events_dir, min_replica_size,
            lighthouse_outage, on_state_loss: the Manager's.
        marks: if given, gets the time the Manager was constructed (``"manager"``).
        host: the address its servers bind and advertise.
    """
    groups = {"gloo": ProcessGroupGloo, "baby_gloo": ProcessGroupBabyGloo}
    if process_group not in groups:
        raise ValueError(f"process_group must be one of {sorted(groups)}, got {process_group!r}")
    if ddp not in ("bucketed", "pure"):
        raise ValueError(f"ddp must be 'bucketed' or 'pure', got {ddp!r}")

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=timeout_s)
    pg = groups[process_group](timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timeout,
        rank=group_rank,
        world_size=group_world_size,
        world_size_mode=WorldSizeMode[world_size_mode],
        store_addr=host,
        store_port=store_port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"replica_{replica}",
        hostname=host,
        checkpoint_transport=HTTPTransport(
            timeout=timeout, num_chunks=0, hostname=host, auth_token=auth_token
        ),
        auth_token=auth_token,
        retry_inflight_allreduce=retry_inflight_allreduce,
        events_dir=events_dir,
        samples_per_batch=BATCH_SIZE * group_world_size,  # the status page's samples/s
        lighthouse_outage=lighthouse_outage,
        on_state_loss=on_state_loss,
    )
    if marks is not None:
        marks["manager"] = time.time()
    if ddp == "pure":
        wrapped = PureDistributedDataParallel(manager, model)
    elif bucket_cap_mb is None:
        wrapped = DistributedDataParallel(manager, model)
    else:
        wrapped = DistributedDataParallel(manager, model, bucket_cap_mb=bucket_cap_mb)
    return manager, pg, wrapped, OptimizerWrapper(manager, inner)


def _inject_faults(cfg: WorkerConfig, manager: Any, pg: Any) -> None:
    """Arms the faults ``cfg`` asks for: the first checkpoint fetch failing
    (``fail_first_heal``), a SIGKILL or SIGSTOP at the all-reduce of a step (``kill_at_step``,
    ``hang_at_step``), a SIGSTOP whenever ``hang_file`` appears."""
    if cfg.fail_first_heal:
        transport = manager._checkpoint_transport
        # The Manager receives with recv_checkpoint_borrowed (HTTPTransport's reused buffer).
        real_recv = transport.recv_checkpoint_borrowed

        def recv_fails_once(*args: Any, **kwargs: Any) -> Any:
            transport.recv_checkpoint_borrowed = real_recv
            raise ConnectionResetError("injected: donor lost mid-transfer")

        transport.recv_checkpoint_borrowed = recv_fails_once
    if cfg.kill_at_step is not None or cfg.hang_at_step is not None:
        real_allreduce = pg.allreduce
        at_step, sig = (
            (cfg.kill_at_step, signal.SIGKILL)
            if cfg.kill_at_step is not None
            else (cfg.hang_at_step, signal.SIGSTOP)
        )
        fired = []

        def allreduce_then_die(tensors: Any, opts: Any = None) -> Any:
            fire = (
                not fired
                and manager.current_step() >= at_step
                and manager.num_participants() >= cfg.kill_participants
            )
            if fire and sig == signal.SIGSTOP:
                fired.append(sig)
                os.kill(os.getpid(), sig)
            work = real_allreduce(tensors, opts)
            if fire and sig == signal.SIGKILL:
                os.kill(os.getpid(), sig)
            return work

        pg.allreduce = allreduce_then_die  # type: ignore[method-assign]
    if cfg.hang_file is not None:
        hang_file, allreduce = Path(cfg.hang_file), pg.allreduce

        def allreduce_or_hang(tensors: Any, opts: Any = None) -> Any:
            try:
                hang_file.unlink()
            except FileNotFoundError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
            return allreduce(tensors, opts)

        pg.allreduce = allreduce_or_hang  # type: ignore[method-assign]


def _stop_step(cfg: WorkerConfig) -> int | None:
    """The step to stop at: ``stop_step``, or the one ``stop_step_file`` names (None: no file
    yet, no stop)."""
    if cfg.stop_step_file is None:
        return cfg.stop_step
    try:
        return int(Path(cfg.stop_step_file).read_text())
    except FileNotFoundError:
        return None


def train_worker(cfg: WorkerConfig) -> None:
    marks = {"start": time.time()}
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s r{cfg.replica}/{cfg.group_rank} %(name)s %(message)s",
    )
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed if cfg.seed is not None else 17 + cfg.replica)
    model = nn.Sequential(nn.Linear(16, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, 4))
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    manager, pg, ddp, optim = ft_stack(
        model,
        inner,
        replica=cfg.replica,
        lighthouse_addr=cfg.lighthouse_addr,
        timeout_s=cfg.timeout_s,
        quorum_timeout_s=max(30.0, cfg.timeout_s),  # >= the process group timeout
        group_rank=cfg.group_rank,
        group_world_size=cfg.group_world_size,
        store_port=cfg.store_port or None,
        min_replica_size=cfg.min_replica_size,
        world_size_mode=cfg.world_size_mode,
        process_group=cfg.process_group,
        ddp=cfg.ddp,
        auth_token=cfg.auth_token,
        events_dir=cfg.events_dir,
        marks=marks,
        host=cfg.host,
        lighthouse_outage=cfg.lighthouse_outage,
        on_state_loss=cfg.on_state_loss,
    )
    _inject_faults(cfg, manager, pg)

    commits: list[tuple[int, bool, int, bool, float]] = []
    for _ in range(cfg.max_iterations):
        optim.zero_grad()
        if cfg.shared_batches:
            x, y = _batch(0, 0, manager.current_step())
        else:
            x, y = _batch(cfg.replica, cfg.group_rank, manager.current_step())
        loss = nn.functional.mse_loss(ddp(x), y)
        _busy(cfg.work)
        loss.backward()
        committed = optim.step()
        if cfg.commit_log is not None:
            _log_iteration(cfg.commit_log, manager, model, inner, committed, loss.item())
        commits.append(
            (
                manager.current_step(),
                committed,
                manager.num_participants(),
                manager.is_participating(),
                time.time(),
            )
        )
        stop_step = _stop_step(cfg)
        if (
            committed
            and stop_step is not None
            and manager.current_step() >= stop_step
            and manager.num_participants() == cfg.stop_participants
        ):
            break
        if cfg.step_sleep_s:
            time.sleep(cfg.step_sleep_s)
    torch.save(
        {
            "step": manager.current_step(),
            "batches_committed": manager.batches_committed(),
            "model": model.state_dict(),
            "optim": inner.state_dict(),
            "commits": commits,
            "marks": marks,
        },
        cfg.out_path,
    )
    manager.shutdown(wait=False)
    # Not pg.shutdown(): it frees the gloo group on a daemon thread, which aborts the
    # interpreter at exit ("terminate called without an active exception"); reported.


if __name__ == "__main__":
    train_worker(WorkerConfig(**json.loads(sys.argv[1])))
