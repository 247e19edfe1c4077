"""Fault-tolerant data-parallel training of a small model, as in torchft's README: a Manager,
``DistributedDataParallel`` and the ``Optimizer`` wrapper around an ordinary training loop.

    python examples/train_ddp.py

starts a lighthouse and two replica groups on this machine and trains both for ``STEPS`` steps;
each group prints its summary, and the job checks that the groups end bitwise identical.

Running the groups yourself, e.g. on two machines (same commands, another REPLICA_GROUP_ID).
With ``--min_replicas 1`` a group keeps training while the other is down, and one that starts
or restarts later heals from it:

    torchft_lighthouse --min_replicas 1 --bind 0.0.0.0:29510
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://LIGHTHOUSE_HOST:29510 python examples/train_ddp.py
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn, optim

from torchtitan_ft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

STEPS = 50
BATCH = 32
"""Samples in each group's batch of a step."""


def train(replica_group: int) -> dict[str, Any]:
    torch.manual_seed(replica_group)  # different inits: the first quorum makes them equal
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    inner = optim.AdamW(model.parameters(), lr=1e-3)

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
        replica_id=f"train_ddp_{replica_group}",
        hostname=advertised_host(),
        timeout=timedelta(seconds=10),
        samples_per_batch=BATCH,  # the lighthouse's status page shows committed samples/s
    )
    ddp_model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)

    data = torch.Generator().manual_seed(1000 + replica_group)  # each group its own batches
    while manager.current_step() < STEPS:
        x = torch.randn(BATCH, 16, generator=data)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()  # starts this step's quorum
        loss = nn.functional.mse_loss(ddp_model(x), y)
        loss.backward()  # gradients averaged across the groups taking part
        optimizer.step()  # applied only if every group's step can commit
    summary = {
        "replica_group": replica_group,
        "step": manager.current_step(),
        "loss": loss.item(),
        "state_sha1": state_sha1(model, inner),
    }
    manager.shutdown()
    return summary


def advertised_host() -> str:
    """The name other groups dial for this one: this machine's, or loopback when the whole job
    runs here (a lighthouse on loopback)."""
    lighthouse = urlsplit(os.environ.get("TORCHFT_LIGHTHOUSE", "")).hostname
    return "127.0.0.1" if lighthouse in ("127.0.0.1", "localhost") else socket.gethostname()


def state_sha1(model: nn.Module, inner: optim.Optimizer | None = None) -> str:
    """SHA-1 of the parameters (and the optimizer state), to compare groups bitwise."""
    digest = hashlib.sha1()
    state = inner.state_dict()["state"] if inner is not None else {}
    for tensor in [*model.state_dict().values(), *_tensors(state)]:
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _tensors(state: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
    return [v for _, per in sorted(state.items()) for _, v in sorted(per.items())]


if __name__ == "__main__":
    if "REPLICA_GROUP_ID" in os.environ:
        print(json.dumps(train(int(os.environ["REPLICA_GROUP_ID"]))), flush=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _local import run_locally

        run_locally(os.path.abspath(__file__), groups=2)
