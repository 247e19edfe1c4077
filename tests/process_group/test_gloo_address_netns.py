"""The address the cross-group gloo group listens on, between two test hosts joined by two links
(``torchtitan_ft.testing.netns``): the quorum's store on link 0 (the address the host names
would resolve to), the heal pin (``TORCHFT_HEAL_INTERFACES=eth1``) moves the group's traffic to
link 1, and ``GLOO_SOCKET_IFNAME`` still wins (issue 37).

With no configuration the rule takes a link the kernel reports faster than the route's; both
links here are veth pairs, which report the same 10 Gbit/s whatever ``tc`` limits them to, so
that case is table-tested only (tests/test_addresses.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ft.testing import netns

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,  # default tier: tests/test_addresses.py's gloo_address table
    pytest.mark.multihost,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason())
    ),
]

_WORKER = """
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torchtitan_ft.addresses import gloo_bind_address
from torchtitan_ft.process_group import ProcessGroupGloo

host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore(host, port, 2, rank == 0, timeout=timedelta(seconds=120),
                      wait_for_workers=False)
pg = ProcessGroupGloo(timedelta(seconds=120))
pg.configure(f"{host}:{port}/t", f"replica_{rank}", rank, 2)
t = torch.ones(4_000_000)  # 16 MB each way
pg.allreduce([t], ReduceOp.SUM).wait()
print(json.dumps({"bind": gloo_bind_address(host, os.environ), "sum": t[0].item()}), flush=True)
store.set(f"done{rank}", "1")
store.wait(["done0", "done1"])
"""

_MB = 16e6


def _run_group(net: netns.HostNetwork, env: dict[str, str]) -> tuple[list[dict], list[int]]:
    """Two ranks, one on each host, allreduce 16 MB over a store on A's link-0 address; each
    rank's answer and the bytes host B received over each link meanwhile."""
    a, b = net["A"], net["B"]
    before = [b.bytes_received(link) for link in (0, 1)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    procs = [
        host.popen(
            [sys.executable, "-c", _WORKER, a.addresses[0], "29611", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        for rank, host in enumerate((a, b))
    ]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        answers.append(json.loads(out))
    return answers, [b.bytes_received(link) - before[link] for link in (0, 1)]


@pytest.mark.timeout(600)
def test_the_heal_pin_moves_the_gloo_group_to_its_link_and_gloo_socket_ifname_wins() -> None:
    with netns.HostNetwork(["A", "B"], links=2) as net:
        a, b = net["A"], net["B"]
        # No configuration: both links report the same speed, the route to the store (link 0).
        answers, received = _run_group(net, {})
        assert [r["bind"] for r in answers] == [a.addresses[0], b.addresses[0]]
        assert all(r["sum"] == 2.0 for r in answers)
        assert received[0] > _MB > received[1], received
        # The heal pin: the group listens, and its bytes travel, on link 1.
        answers, received = _run_group(net, {"TORCHFT_HEAL_INTERFACES": "eth1"})
        assert [r["bind"] for r in answers] == [a.addresses[1], b.addresses[1]]
        assert received[1] > _MB > received[0], received
        # GLOO_SOCKET_IFNAME is gloo's choice, pin or not.
        env = {"TORCHFT_HEAL_INTERFACES": "eth1", "GLOO_SOCKET_IFNAME": "eth0"}
        answers, received = _run_group(net, env)
        assert [r["bind"] for r in answers] == [None, None]
        assert received[0] > _MB > received[1], received
