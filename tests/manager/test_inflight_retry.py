"""A step whose allreduce loses a peer is finished by the survivors (``retry_inflight_allreduce``).

Real lighthouse, Managers, ``ProcessGroupGloo`` and ``DistributedDataParallel`` in three
processes; one is SIGKILLed at the moment it would send its gradients, so the other two are
inside the allreduce when it dies. The survivors must commit that same step (no step
discarded), with an average over exactly themselves, and a data ledger (a one-hot
participation allreduce, as TorchTitan's ``CommitGatedOptimizers`` takes it) naming them. Their
parameters are checked against a reference recomputed here from the ledger: plain SGD on each
step's average over the groups the ledger names.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.testing.mlp import mp_context

pytestmark = pytest.mark.multiprocess

GROUPS = 3
VICTIM = 2
KILL_AT_STEP = 3
STOP_STEP = 8
LR = 0.1


@dataclass
class _Config:
    lighthouse_addr: str
    replica: int
    out_path: str
    started: Any
    """A barrier of all the groups: each passes it once its Manager is built, so that the first
    quorum has all three however slowly the processes start (a group that missed the join
    timeout would take part in no step before it healed)."""
    kill_at_step: int | None = None


def _model() -> torch.nn.Module:
    torch.manual_seed(5)  # every group starts identical (init_sync=False)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _worker(cfg: _Config) -> None:
    import logging

    from torchtitan_ft.checkpoint import HTTPTransport
    from torchtitan_ft.ddp import DistributedDataParallel
    from torchtitan_ft.manager import Manager
    from torchtitan_ft.optim import OptimizerWrapper
    from torchtitan_ft.process_group import ProcessGroupGloo

    logging.basicConfig(level=logging.INFO, format=f"r{cfg.replica} %(name)s %(message)s")
    torch.set_num_threads(1)
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    timeout = timedelta(seconds=20)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout,
        store_addr="127.0.0.1",
        lighthouse_addr=cfg.lighthouse_addr,
        replica_id=f"replica_{cfg.replica}",
        hostname="127.0.0.1",
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0, hostname="127.0.0.1"),
        init_sync=False,
        retry_inflight_allreduce=True,
    )
    if cfg.kill_at_step is not None:
        real_allreduce = pg.allreduce

        def die_instead_of_sending(tensors: Any, opts: Any = None) -> Any:
            # The peers have launched theirs and wait for this group's bytes.
            if manager.current_step() >= cfg.kill_at_step and manager.num_participants() == GROUPS:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_allreduce(tensors, opts)

        pg.allreduce = die_instead_of_sending  # type: ignore[method-assign]
    cfg.started.wait(60)

    ddp = DistributedDataParallel(manager, model)
    optim = OptimizerWrapper(manager, inner)
    steps: list[dict[str, Any]] = []
    while len(steps) < 300:
        retried = [s["step"] for s in steps if s["retried"]]
        if manager.current_step() >= STOP_STEP and retried and steps[-1]["step"] > retried[0]:
            break
        optim.zero_grad()
        step = manager.current_step()
        x, y = _batch(cfg.replica, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ledger = torch.zeros(GROUPS)
        ledger[cfg.replica] = 1.0
        manager.allreduce(ledger, reduce_op=torch.distributed.ReduceOp.SUM)
        retried_before = manager.stats().steps_retried
        attempt_participants = manager.num_participants()
        committed = optim.step()
        steps.append(
            {
                "step": step,
                "committed": committed,
                "retried": manager.stats().steps_retried > retried_before,
                "participants": [int(i) for i in torch.nonzero(ledger > 0.5).flatten()],
                "num_participants": manager.num_participants(),
                "attempt_participants": attempt_participants,
            }
        )
        time.sleep(0.05)  # a group that starts late catches up (then the victim is killed)
    stats = manager.stats()
    torch.save(
        {
            "model": model.state_dict(),
            "steps": steps,
            "steps_retried": stats.steps_retried,
            "steps_discarded": stats.steps_discarded,
            "batches_committed": manager.batches_committed(),
        },
        cfg.out_path,
    )
    manager.shutdown(wait=False)
    pg.shutdown()


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:  # only our own children, by pid
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)


def _reference(ledger: list[list[int]]) -> dict[str, torch.Tensor]:
    """SGD on each committed step's average gradient over exactly the groups in the ledger."""
    model = _model()
    for step, groups in enumerate(ledger):
        grads = []
        for g in groups:
            model.zero_grad()
            x, y = _batch(g, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * sum(gr[i] for gr in grads) / len(groups)
    return model.state_dict()


def test_survivors_finish_the_step_the_victim_died_in(tmp_path: Path, procs: list[Any]) -> None:
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=3000,  # the three start together (the barrier): the first quorum has all
        quorum_tick_ms=50,
        heartbeat_timeout_ms=3000,
    )
    try:
        outs = [tmp_path / f"r{i}.pt" for i in range(GROUPS)]
        started = mp_context().Barrier(GROUPS)
        for i in range(GROUPS):
            cfg = _Config(
                lighthouse.address(),
                i,
                str(outs[i]),
                started,
                kill_at_step=KILL_AT_STEP if i == VICTIM else None,
            )
            proc = mp_context().Process(target=_worker, args=(cfg,), daemon=True)
            proc.start()
            procs.append(proc)
        procs[VICTIM].join(90)
        assert procs[VICTIM].exitcode == -signal.SIGKILL
        for proc in procs[:VICTIM]:
            proc.join(90)
            assert proc.exitcode == 0, f"survivor pid {proc.pid} exited {proc.exitcode}"
    finally:
        lighthouse.shutdown()

    survivors = [torch.load(outs[i], weights_only=False) for i in range(VICTIM)]
    for r in survivors:
        committed = [s for s in r["steps"] if s["committed"]]
        # Nothing discarded: the step of the kill was finished by the survivors, once.
        assert r["steps_discarded"] == 0 and r["steps_retried"] == 1, r
        assert [s["step"] for s in r["steps"]] == list(range(len(r["steps"]))), r["steps"]
        ledger = [s["participants"] for s in committed]
        # The victim died in the first step at or after KILL_AT_STEP in which all three
        # took part (a group that starts late heals first); that step was retried and
        # committed with the survivors only, and so were the next ones.
        killed = [s for s in r["steps"] if s["retried"]]
        assert len(killed) == 1 and killed[0]["step"] >= KILL_AT_STEP, r["steps"]
        assert killed[0]["attempt_participants"] == GROUPS, killed
        assert all(p == [0, 1] for p in ledger[killed[0]["step"] :]), ledger
        assert all(p in ([0, 1], [0, 1, 2]) for p in ledger), ledger
        assert [s["num_participants"] for s in committed] == [len(p) for p in ledger]
        assert r["batches_committed"] == sum(len(p) for p in ledger)
    assert survivors[0]["steps"] == survivors[1]["steps"]
    expected = _reference([s["participants"] for s in survivors[0]["steps"]])
    for r in survivors:
        for name, tensor in expected.items():
            # Same sums in another order (gloo's ring): equal to float rounding.
            torch.testing.assert_close(r["model"][name], tensor, rtol=1e-5, atol=1e-6)
    # Both survivors hold bitwise the same parameters.
    for name, tensor in survivors[0]["model"].items():
        assert torch.equal(tensor, survivors[1]["model"][name]), name
