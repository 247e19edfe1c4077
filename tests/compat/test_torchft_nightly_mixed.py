"""A mixed fleet at the wire: torchft-nightly's own Rust ``ManagerServer`` and ``ManagerClient``
(from its wheel, unchanged) and ours, one group of each kind under one lighthouse of ours.

Both kinds join one quorum, each rank's process-group handle (``ManagerQuorumRequest`` field 7)
reaches every cross-group peer of either kind (``ManagerQuorumResponse`` field 14, in
replica-rank order), and the heal decisions agree in both directions: the group behind heals
from the other kind's server and reads its checkpoint metadata over that server's RPC.

What this does not cover, and why: a mixed *training* job. torchft-nightly's ``Manager`` forms
its cross-group group only from field-14 handles (``ProcessGroup.reconfigure``), and our
``Manager``, with the default ``process_group_kind = "rebuilt"``, forms it from the quorum's
store address (``pg.configure``) and sends no handle; a quorum holding one of our groups
therefore gives a nightly rank no handles, and its reconfigure fails (a ``"native"`` group
sends one; not yet run mixed). The two heal transports differ as well (nightly's HTTP
transport sends pickles, ours a JSON header and raw tensors), so a mixed job would pass both
Managers one transport. See docs/torchft_tests.md.

Then, in --full, a training job of two groups on nightly's own ``Manager`` and native-reconfigure
``ProcessGroupGloo`` under our lighthouse, one SIGKILLed and healed.

Everything here needs ``TORCHFT_NIGHTLY_PYTHON`` (a venv with the ``torchft_nightly`` wheel) and
skips without it. The wire tests load that venv's extension into this process (it links no
torch); the training job runs its workers with that interpreter.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.manager import ManagerClient, ManagerServer

T = timedelta(seconds=10)


NIGHTLY_PYTHON = os.environ.get("TORCHFT_NIGHTLY_PYTHON", "")
"""The one switch: a venv's interpreter that has the ``torchft_nightly`` wheel and a torch it
supports (>= 2.14). Unset: every test here skips."""


def _load_nightly() -> ModuleType | None:
    """torchft-nightly's ``_torchft`` extension from ``$TORCHFT_NIGHTLY_PYTHON``'s venv, or None."""
    if not NIGHTLY_PYTHON:
        return None
    venv = Path(NIGHTLY_PYTHON).parents[1]
    found = sorted(venv.glob("lib/python*/site-packages/torchft/_torchft*.so"))
    if not found:
        raise FileNotFoundError(
            f"TORCHFT_NIGHTLY_PYTHON={NIGHTLY_PYTHON}: no torchft/_torchft*.so under {venv}/lib; "
            "expected a venv with the torchft_nightly wheel installed"
        )
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(found[0]))
    spec = importlib.util.spec_from_loader("torchft._torchft", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


nightly = _load_nightly()
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        nightly is None,
        reason="TORCHFT_NIGHTLY_PYTHON unset (a venv with torchft_nightly; docs/torchft_tests.md)",
    ),
]


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], None]]]:
    callbacks: list[Callable[[], None]] = []
    yield callbacks
    for callback in reversed(callbacks):
        callback()


@pytest.fixture
def fleet(cleanup) -> dict[str, Any]:
    """One lighthouse of ours; group "nightly_0" on nightly's server, "ours_1" on ours (2 ranks
    each). Replica ranks follow replica ids: nightly_0 is 0, ours_1 is 1."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    cleanup.append(lighthouse.shutdown)
    nightly_server = nightly.ManagerServer(
        replica_id="nightly_0",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1001",
        world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
        quorum_retries=0,
    )
    cleanup.append(nightly_server.shutdown)
    our_server = ManagerServer(
        "ours_1",
        lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1002",
        world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    cleanup.append(our_server.shutdown)
    our_client = ManagerClient(our_server.address(), connect_timeout=T)
    cleanup.append(our_client.close)
    return {
        "nightly_address": nightly_server.address(),
        "our_address": our_server.address(),
        "nightly": nightly.ManagerClient(nightly_server.address(), connect_timeout=T),
        "ours": our_client,
    }


def _ask(client: Any, group_rank: int, step: int, handle: str) -> Callable[[], Any]:
    return lambda: client._quorum(
        group_rank=group_rank,
        step=step,
        checkpoint_metadata=f"meta-{handle}",
        shrink_only=False,
        timeout=T,
        commit_failures=0,
        init_sync=True,
        reconfigure_handle=handle,
    )


def _round(fleet: dict[str, Any], nightly_step: int, our_step: int) -> list[Any]:
    """One quorum round of all four ranks: [nightly r0, nightly r1, ours r0, ours r1]."""
    calls = [
        _ask(fleet["nightly"], 0, nightly_step, "n0"),
        _ask(fleet["nightly"], 1, nightly_step, "n1"),
        _ask(fleet["ours"], 0, our_step, "o0"),
        _ask(fleet["ours"], 1, our_step, "o1"),
    ]
    with futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(call) for call in calls]]


def test_one_quorum_carries_both_kinds_handles(fleet) -> None:
    n0, n1, o0, o1 = _round(fleet, nightly_step=4, our_step=4)
    assert len({r.quorum_id for r in (n0, n1, o0, o1)}) == 1
    assert [r.replica_rank for r in (n0, n1, o0, o1)] == [0, 0, 1, 1]
    assert {r.replica_world_size for r in (n0, n1, o0, o1)} == {2}
    assert n0.replica_ids == o0.replica_ids == ["nightly_0", "ours_1"]
    # Field 14: each group rank's cross-group group, both kinds, in replica-rank order.
    assert n0.reconfigure_handles == o0.reconfigure_handles == ["n0", "o0"]
    assert n1.reconfigure_handles == o1.reconfigure_handles == ["n1", "o1"]
    assert not any(r.heal for r in (n0, n1, o0, o1))


@pytest.mark.parametrize("behind", ["ours", "nightly"])
def test_heal_decisions_agree_in_both_directions(fleet, behind: str) -> None:
    """The group behind heals from the other kind's server; the donor is told to send to it,
    and the healer reads the donor rank's checkpoint metadata over the donor server's RPC."""
    n0, n1, o0, o1 = _round(fleet, *((7, 2) if behind == "ours" else (2, 7)))
    if behind == "ours":
        healers, donors, donor_address, healer_rank = (o0, o1), (n0, n1), "nightly_address", 1
        donor_server = ManagerClient(fleet[donor_address], connect_timeout=T)
        handle_prefix = "n"
    else:
        healers, donors, donor_address, healer_rank = (n0, n1), (o0, o1), "our_address", 0
        donor_server = nightly.ManagerClient(fleet[donor_address], connect_timeout=T)
        handle_prefix = "o"
    assert {r.max_step for r in (n0, n1, o0, o1)} == {7}
    for rank, healer in enumerate(healers):
        assert healer.heal
        assert healer.recover_src_manager_address == fleet[donor_address]
        assert healer.recover_src_replica_rank == 1 - healer_rank
        # What the healer's Manager asks the donor next (nightly's manager.py does the same).
        metadata = donor_server._checkpoint_metadata(rank, timeout=T)
        assert metadata == f"meta-{handle_prefix}{rank}"
    for donor in donors:
        assert not donor.heal
        assert list(donor.recover_dst_replica_ranks) == [healer_rank]
    if isinstance(donor_server, ManagerClient):
        donor_server.close()


# ------------------------------------------------------------------- nightly's Manager, training

WORKER = Path(__file__).with_name("_nightly_worker.py")


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        time.sleep(0.5)


@pytest.mark.slow
def test_nightly_managers_train_and_heal_on_our_lighthouse(cleanup, tmp_path: Path) -> None:
    """Two groups on nightly's Manager and native-reconfigure gloo group (their handles go
    through our lighthouse's field 9 and come back in field 14); one is SIGKILLed and restarted,
    heals from the other, and both then hold bitwise identical parameters at every common step."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200)
    cleanup.append(lighthouse.shutdown)
    stop = tmp_path / "stop"

    def start(replica_id: str, out: Path) -> subprocess.Popen:
        args = [NIGHTLY_PYTHON, str(WORKER), lighthouse.address(), replica_id, str(out), str(stop)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed by cleanup)
        cleanup.append(log.close)
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        cleanup.append(lambda: proc.kill() if proc.poll() is None else None)
        return proc

    a_out, b_out, b2_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "b2.jsonl"
    start("nightly_a", a_out)
    b = start("nightly_b", b_out)
    # Both trained together: a step both committed with the same parameters.
    _wait_for(
        lambda: (
            len({r["step"] for r in _records(a_out)} & {r["step"] for r in _records(b_out)}) >= 3
        ),
        "common steps of both groups",
    )
    b.send_signal(signal.SIGKILL)
    b.wait()
    killed_at = max(r["step"] for r in _records(b_out))
    start("nightly_b", b2_out)
    _wait_for(
        lambda: sum(r["healed"] for r in _records(b2_out)) >= 3, "healed steps of the restart"
    )
    stop.touch()

    a, b2 = _records(a_out), _records(b2_out)
    healed = [r for r in b2 if r["healed"]]
    assert healed[0]["step"] > killed_at, b2
    by_step = {r["step"]: r["hash"] for r in a}
    common = [r for r in _records(b_out) + healed if r["step"] in by_step]
    assert len(common) >= 5, (a, b2)
    assert [r["hash"] for r in common] == [by_step[r["step"]] for r in common]
