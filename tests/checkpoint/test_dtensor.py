"""DTensors in checkpoints (``torchtitan_ft.checkpoint._dtensor``): the layout round trip on a
1-rank mesh in process, both transports in process, and both transports between two real
2-rank replica groups (4 processes), each receiver rebuilding the DTensor on its own mesh."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard

from tests.process_group._workers import run_workers, store_client
from torchtitan_ft.checkpoint import HTTPTransport, PGTransport
from torchtitan_ft.checkpoint._dtensor import choose_group
from torchtitan_ft.checkpoint._serialization import flatten, unflatten

TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """This process as a 1-rank torch.distributed world (a 1-rank mesh needs one)."""
    if dist.is_initialized():
        pytest.skip("another test left torch.distributed initialized")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state(mesh: DeviceMesh) -> dict[str, Any]:
    full = torch.arange(12.0).reshape(4, 3)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "r": distribute_tensor(torch.ones(2), mesh, [Replicate()]),
        "nested": [distribute_tensor(full.t(), mesh, [Shard(1)])],
        "plain": torch.tensor([5, 6, 7]),
        "step": 3,
    }


def _assert_same_dtensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("w", "r"):
        assert isinstance(got[key], DTensor), key
        assert got[key]._spec == want[key]._spec, key
        assert torch.equal(got[key].to_local(), want[key].to_local()), key
    assert got["nested"][0]._spec == want["nested"][0]._spec
    assert torch.equal(got["plain"], want["plain"]) and got["step"] == 3


def test_dtensor_layout_round_trip(world_of_one: None) -> None:
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp_shard",))
    state = _state(mesh)
    state["partial"] = DTensor.from_local(torch.ones(2), mesh, [Partial("sum")])
    state["strided"] = DTensor.from_local(
        torch.ones(4), mesh, [_StridedShard(0, split_factor=2)], run_check=False
    )
    tree, tensors = flatten(state)
    assert all(not isinstance(t, DTensor) for t in tensors)  # only local shards travel
    got = unflatten(tree, [t.clone() for t in tensors])
    _assert_same_dtensors(got, state)
    for key in ("partial", "strided"):
        assert got[key].placements == state[key].placements, key
    # Rebuilt on this process's groups: usable, and one mesh object for the whole state dict.
    torch.testing.assert_close(got["w"].full_tensor(), torch.arange(12.0).reshape(4, 3))
    assert got["w"].device_mesh is got["r"].device_mesh
    assert got["w"].device_mesh == mesh


@pytest.mark.parametrize(
    ("row", "groups", "sent", "chosen"),
    [
        ([0, 1], [("a", [0, 1]), ("b", [0, 1])], "b", "b"),  # the sender's name, if it fits
        ([0, 1], [("a", [0, 1]), ("b", [0, 1])], "x", "a"),  # else the first created
        ([0, 1], [("a", [0]), ("b", [0, 1])], "a", "b"),  # a name with other ranks is not it
        ([0, 1], [("a", [1, 0])], "a", None),  # group-rank order matters
        ([2, 3], [("a", [0, 1]), ("b", [2])], "a", None),
        ([5], [("a", [0, 5]), ("b", [5])], "", "b"),
    ],
)
def test_choose_group_by_ranks(
    row: list[int], groups: list[tuple[str, list[int]]], sent: str, chosen: str | None
) -> None:
    assert choose_group(row, groups, sent) == chosen


def test_a_dtensor_is_rebuilt_on_the_group_with_its_ranks_whatever_its_name(
    world_of_one: None,
) -> None:
    """TorchTitan's FT trainer names each replica group's world group by its global ranks, so
    the sender's group name may not exist here; the group with the row's ranks is used."""
    mesh = DeviceMesh("cpu", [0])
    state = {"w": distribute_tensor(torch.ones(2), mesh, [Replicate()])}
    tree, tensors = flatten(state)
    tree["D"][0][1]["DT"][0]["groups"] = ["no-such-group"]
    got = unflatten(tree, tensors)
    assert got["w"]._spec == state["w"]._spec
    assert got["w"].device_mesh.get_group(0) is dist.group.WORLD


def test_dtensor_on_a_mesh_without_this_rank_is_a_clear_error(world_of_one: None) -> None:
    mesh = DeviceMesh("cpu", [0])
    tree, tensors = flatten({"w": distribute_tensor(torch.ones(2), mesh, [Replicate()])})
    tree["D"][0][1]["DT"][0]["mesh"] = [1]
    with pytest.raises(RuntimeError, match=r"mesh \[1\] .* without this process's rank 0"):
        unflatten(tree, tensors)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("mesh", "zero"),
        ("mesh", [0, 0]),  # a rank twice
        ("shape", [-1]),
        ("groups", [3]),
        ("groups", ["a", "b"]),  # one group per mesh dimension
        ("placements", [["shard", "x"]]),
        ("placements", [["exploding"]]),
    ],
)
def test_a_malformed_dtensor_layout_is_refused(world_of_one: None, field: str, bad: Any) -> None:
    """A header comes from a peer: a layout the sender could not have produced is a ValueError."""
    mesh = DeviceMesh("cpu", [0])
    tree, tensors = flatten({"w": distribute_tensor(torch.ones(2), mesh, [Replicate()])})
    tree["D"][0][1]["DT"][0][field] = bad
    with pytest.raises(ValueError, match="malformed checkpoint header tree"):
        unflatten(tree, tensors)


def test_dtensor_without_torch_distributed_is_a_clear_error(world_of_one: None) -> None:
    mesh = DeviceMesh("cpu", [0])
    tree, tensors = flatten({"w": distribute_tensor(torch.ones(2), mesh, [Replicate()])})
    dist.destroy_process_group()
    try:
        with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialized"):
            unflatten(tree, tensors)
    finally:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def test_http_transport_sends_dtensors(world_of_one: None) -> None:
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp_shard",))
    state = _state(mesh)
    donor = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    receiver = HTTPTransport(TIMEOUT, num_chunks=2, hostname="127.0.0.1")
    try:
        donor.send_checkpoint([1], 7, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, donor.metadata(), 7, TIMEOUT)
    finally:
        donor.shutdown()
        receiver.shutdown()
    _assert_same_dtensors(got, state)


# --------------------------------------------------------------------------------------------
# Two real replica groups of 2 ranks
# --------------------------------------------------------------------------------------------

_FULL = torch.arange(24.0).reshape(8, 3)


def _replica_group_rank(rank: int, port: int) -> dict[str, Any]:  # runs in a forked process
    """Ranks 0-1: the donor replica group; ranks 2-3: the receiving one. Each group is its own
    2-rank torch.distributed world with a 1-D mesh; rank r of the receiver heals from rank r
    of the donor, by HTTP and by a PGTransport over a 2-process group of the pair. Each world
    is started with its global ranks, as TorchTitan's FT trainer does: the two worlds' groups
    then have different names."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    group, local = divmod(rank, 2)
    store = store_client(port)
    dist.init_process_group(
        "gloo",
        rank=local,
        world_size=2,
        store=dist.PrefixStore(f"group{group}", store),
        _ranks=[2 * group, 2 * group + 1],
    )
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    pair = dist.ProcessGroupGloo(dist.PrefixStore(f"pair{local}", store), group, 2, TIMEOUT)
    pg_transport = PGTransport(pair, TIMEOUT, torch.device("cpu"))
    http = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    try:
        if group == 0:
            state = {"w": distribute_tensor(_FULL, mesh, [Shard(0)]), "step": 5}
            http.send_checkpoint([1], 5, state, TIMEOUT)
            store.set(f"meta{local}", http.metadata())
            pg_transport.send_checkpoint([1], 5, state, TIMEOUT)
            store.wait([f"done{local}"], TIMEOUT)  # keep serving until the receiver has it
            return {"local": state["w"].to_local().tolist()}
        own = distribute_tensor(torch.zeros_like(_FULL), mesh, [Shard(0)])
        meta = store.get(f"meta{local}").decode()
        by_http = http.recv_checkpoint(0, meta, 5, TIMEOUT)["w"]
        by_pg = pg_transport.recv_checkpoint(0, "<n/a>", 5, TIMEOUT)["w"]
        store.set(f"done{local}", "1")
        out: dict[str, Any] = {}
        for name, got in (("http", by_http), ("pg", by_pg)):
            out[name] = {
                "is_dtensor": isinstance(got, DTensor),
                "same_spec_as_own": got._spec == own._spec,
                "local": got.to_local().tolist(),
                # a collective over the receiver's own groups
                "full": got.full_tensor().tolist(),
            }
        return out
    finally:
        http.shutdown()
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_rank_replica_groups_heal_dtensors_by_http_and_pg() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_workers(_replica_group_rank, 4, (store.port,), timeout=120)
    for local in (0, 1):
        donor_local = results[local]["local"]
        assert donor_local == _FULL.chunk(2)[local].tolist()
        for transport in ("http", "pg"):
            got = results[2 + local][transport]
            assert got["is_dtensor"] and got["same_spec_as_own"], (transport, got)
            assert got["local"] == donor_local, transport
            assert got["full"] == _FULL.tolist(), transport
