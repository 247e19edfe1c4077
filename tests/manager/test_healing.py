"""Healing into place: a received state lands in the receiver's own tensors, all or nothing.

Real HTTP transports on 127.0.0.1 (and a real donor process to kill); the donor group's
ManagerServer, which only tells the healer the donor's URL, is replaced by a stub (its
``CheckpointMetadata`` RPC is tested in test_server.py).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from tests.checkpoint.state_dicts import assert_bitwise_equal
from torchtitan_ft.checkpoint import CheckpointTransferError, HTTPTransport, _http_client
from torchtitan_ft.events import Event, EventKind, EventWriter
from torchtitan_ft.manager import healing
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.manager.healing import Healing, land_in_place
from torchtitan_ft.manager.stats import Counters

TIMEOUT = timedelta(seconds=20)


# ------------------------------------------------------------------------------ land_in_place


def test_land_in_place_writes_matching_live_tensors_and_returns_them() -> None:
    live_w, live_step = torch.zeros(4, 3), torch.tensor(0.0)
    live = {"w": live_w, "opt": {"state": {0: {"step": live_step}}, "lr": 0.1}, "seq": [live_w]}
    received = {
        "w": torch.arange(12.0).view(4, 3),
        "opt": {"state": {0: {"step": torch.tensor(7.0)}}, "lr": 0.5},
        "seq": [torch.ones(4, 3)],
    }
    out = land_in_place(received, live)
    assert out["w"] is live_w and out["opt"]["state"][0]["step"] is live_step
    assert out["seq"][0] is live_w
    assert torch.equal(live_w, torch.ones(4, 3))  # the later leaf wins, like two loads would
    assert live_step.item() == 7.0
    assert out["opt"]["lr"] == 0.5  # plain values as received


def test_land_in_place_clones_what_has_no_matching_live_tensor() -> None:
    buffer = torch.arange(8.0)
    received = {
        "other_shape": buffer[:4],
        "other_dtype": buffer[4:6],
        "no_live": buffer[6:],
        "tuple": (buffer[:2],),
    }
    live = {"other_shape": torch.zeros(2, 2), "other_dtype": torch.zeros(2, dtype=torch.float64)}
    out = land_in_place(received, live)
    buffer.fill_(-1.0)  # the next heal overwrites the receive buffer
    assert out["other_shape"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["other_dtype"].tolist() == [4.0, 5.0]
    assert out["no_live"].tolist() == [6.0, 7.0]
    assert isinstance(out["tuple"], tuple) and out["tuple"][0].tolist() == [0.0, 1.0]
    assert torch.equal(live["other_shape"], torch.zeros(2, 2))  # untouched


# ------------------------------------------------------------------------------ real heals


class _DonorGroupStub:
    """Stands in for the donor group's ManagerClient: answers CheckpointMetadata."""

    metadata = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return self.metadata

    def close(self, wait: bool = True) -> None:
        pass


def _heal_result(step: int) -> QuorumResult:
    return QuorumResult(
        quorum_id=1,
        recover_src_manager_address="http://donor-group:1",
        recover_src_replica_rank=0,
        recover_dst_replica_ranks=[],
        store_address="127.0.0.1:1",
        max_step=step,
        max_replica_rank=None,
        max_world_size=1,
        replica_rank=1,
        replica_world_size=2,
        heal=True,
        commit_failures=0,
        replica_ids=["a", "b"],
    )


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 64)).sum().backward()
    optim.step()  # creates the optimizer state (exp_avg, exp_avg_sq, step)
    return model, optim


def _user_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {
            k: {kk: vv.clone() for kk, vv in v.items()}
            for k, v in optim.state_dict()["state"].items()
        },
    }


def _storage(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[int]:
    ptrs = [p.data_ptr() for p in model.parameters()]
    return ptrs + [t.data_ptr() for s in optim.state.values() for t in s.values()]


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Healing, Any, Any, list[str]]]:
    monkeypatch.setattr(healing, "ManagerClient", _DonorGroupStub)
    transport: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    model, optim = _trained(seed=1)
    errors: list[str] = []
    heal = Healing(
        transport,
        group_rank=0,
        timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        auth_token=None,
        counters=Counters(),
        events=EventWriter(None, "", 0, lambda: 0),
        log=lambda level, msg: None,
    )

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])

    heal.register("default", load, lambda: _user_state(model, optim))
    yield heal, model, optim, errors
    transport.shutdown()


def _apply(heal: Healing, errors: list[str], loaded: list[dict[str, int]]) -> None:
    heal.apply_all_or_nothing(
        healing=True,
        group_and=lambda received: received,  # a group of one rank
        report_error=lambda e: errors.append(str(e)),
        load_manager_state=loaded.append,
    )


def test_heal_lands_bitwise_in_the_live_storage_and_reuses_the_receive_buffer(
    receiver: tuple[Healing, Any, Any, list[str]],
) -> None:
    heal, model, optim, errors = receiver
    storage_before = _storage(model, optim)
    donor: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    try:
        _DonorGroupStub.metadata = donor.metadata()
        buffers = []
        for step, seed in ((5, 2), (6, 3)):  # two heals: the second reuses the buffer
            d_model, d_optim = _trained(seed)
            donor.send_checkpoint(
                [1],
                step,
                {
                    "user": {"default": _user_state(d_model, d_optim)},
                    "torchft": {"step": step, "batches_committed": 2 * step},
                },
                TIMEOUT,
            )
            heal.new_step()
            heal.exchange(_heal_result(step), {"step": 0, "batches_committed": 0})
            buffers.append(heal._pending["user"]["default"]["model"]["0.weight"].data_ptr())
            loaded: list[dict[str, int]] = []
            _apply(heal, errors, loaded)
            assert loaded == [{"step": step, "batches_committed": 2 * step}]
            assert_bitwise_equal(_snapshot(model, optim), _snapshot(d_model, d_optim))
            assert optim.state_dict()["param_groups"] == d_optim.state_dict()["param_groups"]
            assert _storage(model, optim) == storage_before  # written in place
        assert buffers[0] == buffers[1]
        assert errors == []
    finally:
        donor.shutdown()


_DONOR = """
import time, torch
from datetime import timedelta
from torchtitan_ft.checkpoint import HTTPTransport
t = HTTPTransport(timedelta(seconds=30), 0, hostname="127.0.0.1")
state = {"model": {"0.weight": torch.full((8 << 20,), 3.0)}}  # 32 MB
t.send_checkpoint([1], 9, {"user": {"default": state}, "torchft": {"step": 9}},
                  timedelta(seconds=30))
print(t.metadata(), flush=True)
time.sleep(60)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_chunks", [0, 2])
def test_donor_killed_mid_heal_leaves_the_live_state_untouched(
    receiver: tuple[Healing, Any, Any, list[str]], monkeypatch: pytest.MonkeyPatch, num_chunks: int
) -> None:
    heal, model, optim, errors = receiver
    heal.transport._num_chunks = num_chunks
    # A first heal warms the receive buffer, so the failed one writes into reused memory.
    first: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    try:
        _DonorGroupStub.metadata = first.metadata()
        d_model, d_optim = _trained(seed=2)
        donor_state = {**_user_state(d_model, d_optim), "pad": torch.zeros(9 << 20)}  # 36 MB
        first.send_checkpoint(
            [1], 4, {"user": {"default": donor_state}, "torchft": {"step": 4}}, TIMEOUT
        )
        heal.new_step()
        heal.exchange(_heal_result(4), {"step": 0})
        _apply(heal, errors, [])
        buffer_bytes = heal.transport._receive_buffer.nbytes
        assert buffer_bytes > 32 << 20
    finally:
        first.shutdown()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # trains on after the heal
    before = _snapshot(model, optim)

    donor = subprocess.Popen([sys.executable, "-c", _DONOR], stdout=subprocess.PIPE, text=True)
    try:
        _DonorGroupStub.metadata = donor.stdout.readline().strip()
        real_readinto = _http_client.Response.readinto

        def read_then_kill(self, view, deadline):  # type: ignore[no-untyped-def]
            if len(view) > 1 << 20 and donor.poll() is None:
                real_readinto(self, view[: 1 << 20], deadline)  # the transfer is under way
                donor.kill()
                donor.wait()
                view = view[1 << 20 :]
            real_readinto(self, view, deadline)

        monkeypatch.setattr(_http_client.Response, "readinto", read_then_kill)
        heal.new_step()
        with pytest.raises(CheckpointTransferError, match="step 9 from replica rank 0"):
            heal.exchange(_heal_result(9), {"step": 4})
        assert donor.returncode == -9
        assert heal.transport._receive_buffer.nbytes == buffer_bytes  # reused, now garbage
        loaded: list[dict[str, int]] = []
        _apply(heal, errors, loaded)
        assert loaded == []  # nothing applied
        assert_bitwise_equal(_snapshot(model, optim), before)
    finally:
        donor.kill()
        donor.wait()


def test_heal_end_records_the_path_the_state_came_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """The donor's address and interface (the link the status page names), the probed rate and
    the paths tried before it."""
    monkeypatch.setattr(healing, "ManagerClient", _DonorGroupStub)
    seen: list[Event] = []
    receiver: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    donor: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    heal = Healing(
        receiver,
        group_rank=0,
        timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        auth_token=None,
        counters=Counters(),
        events=EventWriter(None, "replica_1:u", 0, lambda: 0, seen.append),
        log=lambda level, msg: None,
    )
    heal.register("default", lambda state: None, lambda: {"w": torch.zeros(4)})
    try:
        _DonorGroupStub.metadata = donor.metadata()
        state = {"user": {"default": {"w": torch.ones(4)}}, "torchft": {"step": 5}}
        donor.send_checkpoint([1], 5, state, TIMEOUT)
        heal.new_step()
        heal.exchange(_heal_result(5), {"step": 0})
        _apply(heal, [], [])
    finally:
        donor.shutdown()
        receiver.shutdown()
    (end,) = [e for e in seen if e.kind is EventKind.HEAL_END]
    port = urlsplit(donor.metadata()).port
    assert end["outcome"] == "applied"
    assert end["path"] == f"127.0.0.1:{port} on lo"
    assert (end["path_address"], end["path_interface"]) == (f"127.0.0.1:{port}", "lo")
    assert end["path_probe_mb_s"] is None and end["path_failures"] == []  # one path: no probe
