"""The semi-sync deadline over real processes: an outer sync proceeds with the replica groups
that are ready by the lighthouse's join timeout, and a late group heals from its result.

Three DiLoCo groups (one process each, the real Manager, lighthouse and gloo); the last one is
put under a CPU limit of 0.05 (``testing.cpulimit``'s duty cycle), which makes its inner steps
some twenty times slower than the others'. The test checks, from what the groups record at
every sync (the Manager's step, its participants, the heals it received):

- the others' syncs commit without it (2 participants), each after at most the deadline;
- it heals (receives the global parameters and outer-optimizer state) and takes part again;
- once the limit is lifted, all three end at the same step, bitwise identical (parameters,
  global parameters, outer-optimizer momentum).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.semi_sync import DiLoCo, OuterOptimizerConfig
from torchtitan_ft.testing.cpulimit import CpuLimit
from torchtitan_ft.testing.mlp import write_stop_step

from ._helpers import loss_fn, make_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(480)]

SYNC_EVERY = 4
DEADLINE_MS = 2000
"""The lighthouse's join timeout: how long an outer sync waits for a group that has not come.
Longer than a heal on the loaded test machine: a group that heals into a sync must not be
late for the next one because of it."""
GROUPS = 3
WORK = 200
"""128x128 matrix products in each inner step (tens of ms on a free core), so that a CPU limit
slows the step measurably."""


def _replica(replica: int, lighthouse: str, out_dir: str) -> None:
    """One replica group: DiLoCo until the stop step (read from ``stop`` once it exists) is
    reached in a sync that every group took part in; one JSON line per sync in ``syncs_N``."""
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
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=load_user,
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=2,
        use_async_quorum=False,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        store_addr="127.0.0.1",
        store_port=0,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=20),
    )
    diloco = DiLoCo(manager, [model], inner, OuterOptimizerConfig(), SYNC_EVERY)
    work = torch.randn(128, 128) / 128
    (out / f"ready_{replica}").touch()
    while not all((out / f"ready_{r}").exists() for r in range(GROUPS)):
        time.sleep(0.05)
    log = out / f"syncs_{replica}"
    step, last = 0, -1
    while True:
        step += 1
        diloco.start_step()
        h = work
        for _ in range(WORK):
            h = torch.tanh(h @ work)
        loss_fn(model, replica, step).backward()
        if diloco.before_step():
            inner.step()
        diloco.after_step()
        inner.zero_grad()
        if manager.current_step() == last:
            continue
        last = manager.current_step()
        participants = manager.num_participants()
        record = {"step": last, "participants": participants, "loads": len(loads), "t": time.time()}
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        stop = out / "stop"
        if stop.exists() and last >= int(stop.read_text()) and participants == GROUPS:
            break
    outer = diloco.outer_optimizers()[0]
    torch.save(
        {
            "params": [p.detach().clone() for p in model.parameters()],
            "global": diloco.state_dict()["global"],
            "momentum": [outer.state[p]["momentum_buffer"] for p in model.parameters()],
            "step": manager.current_step(),
        },
        out / f"result_{replica}.pt",
    )
    manager.shutdown()


def _syncs(out: Path, replica: int) -> list[dict[str, int]]:
    path = out / f"syncs_{replica}"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait(out: Path, procs: list[Any], what: str, until: Any, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        dead = [i for i, p in enumerate(procs) if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            logs = {r: _syncs(out, r)[-6:] for r in range(GROUPS)}
            pytest.fail(f"{what}: not seen in {timeout} s (exited: {dead}); last syncs: {logs}")
        time.sleep(0.1)


def test_outer_sync_proceeds_without_late_group_which_heals(tmp_path: Path) -> None:
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=DEADLINE_MS,
        heartbeat_timeout_ms=10_000,  # a throttled process still counts as alive (and waited for)
    )
    slow = GROUPS - 1
    limit: CpuLimit | None = None
    procs: list[Any] = []
    try:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_replica, args=(r, server.address(), str(tmp_path)))
            for r in range(GROUPS)
        ]
        for p in procs:
            p.start()
        _wait(tmp_path, procs, "the first quorum", lambda: bool(_syncs(tmp_path, slow)), 200)
        # A duty cycle: a twentieth of its peers' speed whatever the machine's load (a cgroup
        # quota of 0.1 CPU is no slowdown when every process gets less); a long period, so
        # that its thread's late wake-ups on a busy machine barely change the share.
        limit = CpuLimit("deadline", [procs[slow].pid], 0.05, duty_cycle=True, duty_period_s=0.5)
        heals_before = _syncs(tmp_path, slow)[-1]["loads"]  # init_sync's heal, perhaps

        def without_slow_and_healed() -> bool:
            fast = [s for s in _syncs(tmp_path, 0) if s["participants"] == GROUPS - 1]
            # The slow group healed from a sync it missed and took part in the next one.
            rejoined = [
                s
                for s in _syncs(tmp_path, slow)
                if s["loads"] > heals_before and s["participants"] == GROUPS
            ]
            return len(fast) >= 2 and bool(rejoined)

        _wait(
            tmp_path, procs, "syncs without the slow group, then its heal", without_slow_and_healed
        )
        limit.close()
        limit = None
        stop = max(s["step"] for r in range(GROUPS) for s in _syncs(tmp_path, r)) + 3
        write_stop_step(tmp_path / "stop", stop)  # whole: the groups read it as it appears
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0] * GROUPS
    finally:
        if limit is not None:
            limit.close()
        for p in procs:
            if p.is_alive():
                p.kill()
        server.shutdown()
    fast = [s for s in _syncs(tmp_path, 0) if s["participants"] == GROUPS - 1]
    assert fast, "no sync went ahead without the slow group"
    results = [torch.load(tmp_path / f"result_{r}.pt") for r in range(GROUPS)]
    assert len({r["step"] for r in results}) == 1
    for other in results[1:]:
        for x, y in zip(results[0]["params"], other["params"], strict=True):
            assert torch.equal(x, y)
        for x, y in zip(results[0]["momentum"], other["momentum"], strict=True):
            assert torch.equal(x, y)
        for ga, gb in zip(results[0]["global"], other["global"], strict=True):
            for name in ga:
                assert torch.equal(ga[name], gb[name])
