"""DiLoCo over the real Manager, lighthouse and gloo process group, one process per replica group.

- a replica group SIGKILLed in the middle of a sync: the survivors discard that sync and end
  bit-identical (parameters, global parameters, outer-optimizer momentum);
- a replica group joining mid-run heals to the global parameters and outer-optimizer state
  (its momentum equals the others' afterwards, which a fresh optimizer could not have).

Both also run with the one-step-delayed outer update (``outer_overlap="delayed"``) and the
eager one (``"eager"``): there the victim dies at the start of an overlapped round, whose
allreduce fails while the survivors train on, and the healer joins at a sync point with the
next round about to go on the wire (eager: it starts that round from the outer step with a
zero share, the survivors from theirs); every group calls ``flush`` after its last step, so
the models end equal to the global ones.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.semi_sync import DiLoCo, OuterOptimizerConfig

from ._helpers import loss_fn, make_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SYNC_EVERY = 4


def _replica(
    replica: int,
    lighthouse: str,
    out_dir: str,
    target_step: int,
    kill_on_allreduce: int | None = None,
    pause_at_step: int | None = None,
    start_with: tuple[int, ...] = (),
    overlap: str = "none",
) -> None:
    """One replica group (1 rank): DiLoCo until the Manager's step reaches ``target_step``.

    Starts training once the replicas in ``start_with`` have built their Managers (so they
    are all known to the lighthouse and form the first quorum together).
    """
    from torchtitan_ft.manager import Manager
    from torchtitan_ft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    out = Path(out_dir)
    model = make_model(replica)  # different inits: init_sync must make them agree
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    loads: list[int] = []

    def load_user(sd: dict[str, Any]) -> None:
        loads.append(1)
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_user,
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        store_addr="127.0.0.1",
        store_port=0,
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
    )
    diloco = DiLoCo(
        manager, [model], inner, OuterOptimizerConfig(), SYNC_EVERY, outer_overlap=overlap
    )
    if kill_on_allreduce is not None:
        real_allreduce, calls = manager.allreduce, [0]

        def dying_allreduce(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == kill_on_allreduce:  # in the quorum of a sync, before sending
                os.kill(os.getpid(), signal.SIGKILL)
            return real_allreduce(*args, **kwargs)

        manager.allreduce = dying_allreduce  # type: ignore[method-assign]

    (out / f"ready_{replica}").touch()
    while not all((out / f"ready_{r}").exists() for r in start_with):
        time.sleep(0.05)
    step = 0
    while manager.current_step() < target_step:
        step += 1
        if pause_at_step is not None and step == pause_at_step:
            (out / f"paused_{replica}").touch()
            while not (out / "resume").exists():
                time.sleep(0.05)
        diloco.start_step()
        loss_fn(model, replica, step).backward()
        if diloco.before_step():
            inner.step()
        diloco.after_step()
        inner.zero_grad()
    diloco.flush()  # the overlapped update's last round (nothing without overlap)
    outer = diloco.outer_optimizers()[0]
    torch.save(
        {
            "params": [p.detach().clone() for p in model.parameters()],
            "global": diloco.state_dict()["global"],
            "momentum": [outer.state[p]["momentum_buffer"] for p in model.parameters()],
            "step": manager.current_step(),
            "failed": diloco.stats.syncs_failed,
            "loads": len(loads),
        },
        out / f"result_{replica}.pt",
    )
    manager.shutdown()


def _spawn(ctx: Any, *args: Any, **kwargs: Any) -> Any:
    p = ctx.Process(target=_replica, args=args, kwargs=kwargs)
    p.start()
    return p


def _join(procs: list[Any], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            for q in procs:
                if q.is_alive():
                    q.kill()
            raise TimeoutError("a replica process did not finish")


def _assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a["momentum"], b["momentum"], strict=True):
        assert torch.equal(x, y)
    for ga, gb in zip(a["global"], b["global"], strict=True):
        for name in ga:
            assert torch.equal(ga[name], gb[name])


OVERLAP = pytest.mark.parametrize(
    "overlap",
    # The default tier covers the overlapped updates with simulated groups (test_overlap.py).
    [
        "none",
        pytest.param("delayed", marks=pytest.mark.slow),
        pytest.param("eager", marks=pytest.mark.slow),
    ],
)


@OVERLAP
def test_replica_group_killed_during_sync_survivors_stay_identical(
    tmp_path: Path, overlap: str
) -> None:
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=1000
    )
    try:
        ctx = mp.get_context("spawn")
        target = 1 + 6  # the initial quorum, then 6 committed syncs
        all3 = (0, 1, 2)
        survivors = [
            _spawn(
                ctx, r, server.address(), str(tmp_path), target, start_with=all3, overlap=overlap
            )
            for r in (0, 1)
        ]
        # allreduce 1 is the initial quorum's barrier, 2 the first sync, 3 the second sync
        # (overlapped: started after the first sync committed, in flight for the next 4 steps)
        victim = _spawn(
            ctx,
            2,
            server.address(),
            str(tmp_path),
            target,
            kill_on_allreduce=3,
            start_with=all3,
            overlap=overlap,
        )
        _join([*survivors, victim])
    finally:
        server.shutdown()
    assert victim.exitcode == -signal.SIGKILL
    assert all(p.exitcode == 0 for p in survivors)
    results = [torch.load(tmp_path / f"result_{r}.pt") for r in (0, 1)]
    # overlapped: the loop ends with a sync in flight, which flush commits
    assert results[0]["step"] == results[1]["step"] == target + (overlap != "none")
    assert results[0]["failed"] == results[1]["failed"] == 1
    _assert_identical(results[0], results[1])


@OVERLAP
def test_joining_replica_group_heals_outer_optimizer_state(tmp_path: Path, overlap: str) -> None:
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=2000
    )
    try:
        ctx = mp.get_context("spawn")
        target = 1 + 8
        # The first two pause at step 13 (after 3 syncs) until the third has started.
        first = [
            _spawn(
                ctx,
                r,
                server.address(),
                str(tmp_path),
                target,
                pause_at_step=13,
                start_with=(0, 1),
                overlap=overlap,
            )
            for r in (0, 1)
        ]
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"paused_{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "first replicas did not reach the pause"
            time.sleep(0.05)
        joiner = _spawn(ctx, 2, server.address(), str(tmp_path), target, overlap=overlap)
        while not (tmp_path / "ready_2").exists():
            assert time.monotonic() < deadline, "joiner did not start"
            time.sleep(0.05)
        time.sleep(0.5)  # its first quorum request reaches the lighthouse
        (tmp_path / "resume").touch()
        _join([*first, joiner])
    finally:
        server.shutdown()
    assert all(p.exitcode == 0 for p in [*first, joiner])
    results = [torch.load(tmp_path / f"result_{r}.pt") for r in (0, 1, 2)]
    assert {r["step"] for r in results} == {target + (overlap != "none")}
    assert results[2]["loads"] >= 1  # healed from a peer
    assert all(r["failed"] == 0 for r in results)
    _assert_identical(results[0], results[1])
    _assert_identical(results[0], results[2])
