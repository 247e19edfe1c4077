"""Fault-tolerant DiLoCo (torchft's ``DiLoCo``): each replica group takes ``SYNC_EVERY`` inner
steps on its own, then the groups average their pseudo-gradients and an outer optimizer (SGD
with Nesterov momentum) steps the shared parameters. A group that dies between syncs costs the
others nothing; one that dies during a sync makes that sync be discarded by every group.

    python examples/train_diloco.py

starts a lighthouse and two replica groups on this machine and trains until ``OUTER_STEPS``
syncs have committed; each group prints its summary, and the job checks that the groups' model
parameters end bitwise identical (each group's inner optimizer state is its own).

Running the groups yourself, e.g. on two machines (same commands, another REPLICA_GROUP_ID).
With ``--min_replicas 1`` a group keeps training while the other is down, and one that starts
or restarts later heals from it:

    torchft_lighthouse --min_replicas 1 --bind 0.0.0.0:29510
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://LIGHTHOUSE_HOST:29510 \
        python examples/train_diloco.py
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
from torch import nn, optim

from torchtitan_ft import DiLoCo, Manager, ProcessGroupGloo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ddp import advertised_host, state_sha1

OUTER_STEPS = 6
SYNC_EVERY = 10
BATCH = 32
"""Samples in each group's batch of an inner step."""


def train(replica_group: int) -> dict[str, Any]:
    torch.manual_seed(replica_group)  # different inits: the first quorum makes them equal
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    inner = optim.AdamW(model.parameters(), lr=1e-3)
    outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,  # keep training while only one group is alive
        use_async_quorum=False,  # DiLoCo forms its quorums at the syncs
        replica_id=f"train_diloco_{replica_group}",
        hostname=advertised_host(),
        timeout=timedelta(seconds=10),
        # The Manager commits once per sync, which covers SYNC_EVERY inner batches: the
        # lighthouse's status page shows committed samples/s.
        samples_per_batch=BATCH * SYNC_EVERY,
    )
    data = torch.Generator().manual_seed(1000 + replica_group)  # each group its own batches
    # The context manager hooks the inner optimizer: every SYNC_EVERY-th step() syncs.
    with DiLoCo(manager, [model], inner, outer, sync_every=SYNC_EVERY) as diloco:
        while manager.current_step() < OUTER_STEPS:  # the Manager counts committed syncs
            x = torch.randn(BATCH, 16, generator=data)
            y = x.sum(dim=1, keepdim=True)
            inner.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            inner.step()
    summary = {
        "replica_group": replica_group,
        "outer_syncs_committed": manager.current_step(),
        "syncs_failed": diloco.stats.syncs_failed,
        "loss": loss.item(),
        "state_sha1": state_sha1(model),
    }
    manager.shutdown()
    return summary


if __name__ == "__main__":
    if "REPLICA_GROUP_ID" in os.environ:
        print(json.dumps(train(int(os.environ["REPLICA_GROUP_ID"]))), flush=True)
    else:
        from _local import run_locally

        run_locally(os.path.abspath(__file__), groups=2)
