"""One replica group (one rank) training a tiny linear model on torchft-nightly's own ``Manager``
and ``ProcessGroupGloo``, for tests/compat/test_torchft_nightly_mixed.py.

Run it by path with an interpreter that has the ``torchft_nightly`` wheel. It imports only
torch and torchft, so the nightly package is the ``torchft`` it finds; it lives with the tests
because the package never imports torchft (tests/test_torchft_compat.py):

    python tests/compat/_nightly_worker.py LIGHTHOUSE REPLICA_ID OUT_FILE STOP_FILE

Each committed step appends ``{"step", "hash", "healed"}`` (the step the Manager reports after
the commit, a SHA-256 of the parameters' bytes, and whether this process ever healed) as one
JSON line to OUT_FILE. It trains until STOP_FILE exists. Every group draws the same batch for a
step (seeded by the step), so the groups that commit a step hold identical parameters after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

STEP_PAUSE_S = 0.2
"""Seconds each step sleeps, so a test can kill a group mid-run before the other stops."""


def _hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(lighthouse: str, replica_id: str, out_file: str, stop_file: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    healed = False

    def load_state_dict(state: dict) -> None:
        nonlocal healed
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        healed = True

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=replica_id,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        use_async_quorum=False,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=60),
    )
    while not os.path.exists(stop_file):
        manager.start_quorum()
        generator = torch.Generator().manual_seed(manager.current_step())
        batch = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        for param in model.parameters():
            manager.allreduce(param.grad).wait()
        if manager.should_commit():
            optimizer.step()
            with open(out_file, "a") as f:
                record = {"step": manager.current_step(), "hash": _hash(model), "healed": healed}
                f.write(json.dumps(record) + "\n")
        time.sleep(STEP_PAUSE_S)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(*sys.argv[1:5])
