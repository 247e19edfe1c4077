"""DTensors in a checkpoint header: the local shard travels as an ordinary tensor, and the
layout (device mesh, placements, global shape and stride) as JSON.

The receiver rebuilds each DTensor on its own process groups: for each mesh dimension, the
group of this process whose ranks are exactly this process's row of the sender's mesh along that
dimension (:func:`choose_group`). The sender's group names go along and are preferred, but names
are not enough: torch names a group by a hash of its ranks and of how many groups existed
before it, and TorchTitan's FT trainer starts each replica group's world with that group's
global ranks (``init_process_group(_ranks=...)``), so group 0's world group and group 1's have
different names although both are ranks [0, 1] of their own world. The received DTensor holds
the received local shard, so it is valid on a receiver whose rank holds the same shard as the
sender's (the same coordinate in the mesh), as the ranks of replica groups running the same
program do.

Relies on private parts of torch 2.13 (``DeviceMesh``'s ``_dim_group_names``, ``_pg_registry``
and ``_init_backend``, as its own ``__setstate__`` does; c10d's ``_world.pg_names``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard


def encode_placement(placement: Placement, path: str) -> list[Any]:
    """``placement`` as a JSON list; ``TypeError`` naming ``path`` for unknown kinds."""
    if isinstance(placement, _StridedShard):
        return ["strided_shard", placement.dim, int(placement.split_factor)]
    if type(placement) is Shard:
        return ["shard", placement.dim]
    if isinstance(placement, Replicate):
        return ["replicate"]
    if isinstance(placement, Partial):
        return ["partial", placement.reduce_op]
    raise TypeError(
        f"{path} is a DTensor with placement {placement!r}, which a checkpoint transport "
        "cannot send (supported: Shard, _StridedShard, Replicate, Partial)"
    )


def decode_placement(node: Any) -> Placement:
    match node:
        case ["shard", int(dim)]:
            return Shard(dim)
        case ["strided_shard", int(dim), int(split_factor)]:
            return _StridedShard(dim, split_factor=split_factor)
        case ["replicate"]:
            return Replicate()
        case ["partial", str(op)]:
            return Partial(op)
    raise ValueError(f"unknown DTensor placement {node!r} in checkpoint header")


def encode_layout(t: DTensor, path: str) -> dict[str, Any]:
    """Everything but the local shard, as JSON."""
    mesh = t.device_mesh
    return {
        "device_type": mesh.device_type,
        "mesh": mesh.mesh.tolist(),
        "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "groups": list(getattr(mesh, "_dim_group_names", [])),
        "placements": [encode_placement(p, path) for p in t.placements],
        "shape": list(t.shape),
        "stride": list(t.stride()),
    }


def _check_layout(layout: dict[str, Any]) -> None:
    """ValueError unless ``layout`` has the shape ``encode_layout`` gives (it comes from a peer)."""

    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)

    def nested_ints(value: Any) -> bool:
        return type(value) is int or (
            isinstance(value, list) and all(nested_ints(v) for v in value)
        )

    names = layout.get("dim_names")
    ok = (
        isinstance(layout.get("device_type"), str)
        and nested_ints(layout.get("mesh"))  # an int for a 0-d mesh
        and (names is None or (isinstance(names, list) and all(isinstance(n, str) for n in names)))
        and isinstance(layout.get("groups"), list)
        and all(isinstance(g, str) for g in layout["groups"])
        and len(layout["groups"]) == _ndim(layout["mesh"])
        and isinstance(layout.get("placements"), list)
        and ints(layout.get("shape"))
        and ints(layout.get("stride"))
        and len(layout["shape"]) == len(layout["stride"])
    )
    if not ok:
        text = repr(layout)
        raise ValueError(f"malformed DTensor layout {text[:200]}")


def _ndim(mesh: Any) -> int:
    return 1 + _ndim(mesh[0]) if isinstance(mesh, list) and mesh else int(isinstance(mesh, list))


def choose_group(row: list[int], groups: list[tuple[str, list[int]]], sent: str) -> str | None:
    """The name of the group to use for a mesh dimension whose row (this process's ranks along
    it, in mesh order) is ``row``: among ``groups`` (``(name, ranks in group-rank order)`` of
    this process's groups, in creation order), the one named ``sent`` (the sender's) if its
    ranks are ``row``, else the first created with ranks ``row``; ``None`` if there is none.

    Every rank of a row has the same groups, created in the same order (they run the same
    program), so all pick the same group and its collectives match.
    """
    matching = [name for name, ranks in groups if ranks == row]
    if sent in matching:
        return sent
    return matching[0] if matching else None


def _local_groups() -> list[tuple[str, list[int]]]:
    """This process's groups as :func:`choose_group` takes them (dicts keep creation order)."""
    groups = []
    for pg, name in _world.pg_names.items():
        group_rank_of = _world.pg_group_ranks.get(pg, {})  # {global rank: group rank}
        groups.append((name, sorted(group_rank_of, key=group_rank_of.__getitem__)))
    return groups


class MeshCache:
    """Meshes rebuilt while decoding one state dict: DTensors on the same mesh share one."""

    def __init__(self) -> None:
        self._meshes: dict[str, DeviceMesh] = {}

    def get(self, layout: dict[str, Any]) -> DeviceMesh:
        key = repr((layout["device_type"], layout["mesh"], layout["dim_names"], layout["groups"]))
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = _rebuild_mesh(layout)
            self._meshes[key] = mesh
        return mesh


def _rebuild_mesh(layout: dict[str, Any]) -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "the checkpoint holds DTensors, and rebuilding them needs torch.distributed "
            "initialized with the same device mesh as the sender's (init_process_group and "
            "init_device_mesh before receiving)"
        )
    names = layout["dim_names"]
    try:
        mesh = DeviceMesh(
            layout["device_type"],
            layout["mesh"],
            mesh_dim_names=tuple(names) if names else None,
            _init_backend=False,
        )
    except (AssertionError, RuntimeError, TypeError, ValueError) as e:  # torch's own checks
        mesh_text = repr(layout["mesh"])[:200]
        raise ValueError(f"DTensor layout has an invalid device mesh {mesh_text}: {e}") from e
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(
            f"the checkpoint holds a DTensor on a device mesh {layout['mesh']} (dims {names}) "
            f"without this process's rank {dist.get_rank()}: heal from the rank that holds "
            "the same shard"
        )
    local = _local_groups()
    by_name = {pg_name: pg for pg, pg_name in _world.pg_names.items()}
    groups = []
    for dim, sent in enumerate(layout["groups"]):
        index: list[int | slice] = list(coordinate)
        index[dim] = slice(None)
        row = mesh.mesh[tuple(index)].tolist()
        name = choose_group(row, local, sent)
        if name is None:
            raise RuntimeError(
                f"the checkpoint holds a DTensor on a device mesh {layout['mesh']} (dims "
                f"{names}) whose dimension {dim} needs a process group of ranks {row}, and "
                "this process has none: build the same device mesh as the sender's before "
                "receiving"
            )
        mesh._pg_registry[name] = by_name[name]
        groups.append(name)
    mesh._dim_group_names = groups
    return mesh


def decode(layout: dict[str, Any], local: torch.Tensor, meshes: MeshCache) -> DTensor:
    """The DTensor described by ``layout`` around the received ``local`` shard.

    Raises:
        ValueError: if the layout is malformed.
        RuntimeError: if this process lacks the mesh's process groups.
    """
    _check_layout(layout)
    placements = tuple(decode_placement(p) for p in layout["placements"])
    meta = TensorMeta(
        torch.Size(int(d) for d in layout["shape"]),
        tuple(int(s) for s in layout["stride"]),
        local.dtype,
    )
    spec = DTensorSpec(meshes.get(layout), placements, tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)
