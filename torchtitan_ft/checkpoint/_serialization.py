"""Splitting a state dict into a small JSON header and a list of raw tensors.

Both transports send the same two things: a header that describes the tree (nested dicts, lists,
tuples, plain values) with every tensor replaced by an index into a tensor table (dtype, shape,
byte size), and then the tensors' raw bytes in table order. The header is JSON, never pickle: a
receiver does not execute anything a peer sends it.

Supported leaves: ``torch.Tensor`` (dense, any device; sent as its contiguous bytes),
``DTensor`` (its local shard is sent as a tensor and its layout as JSON; the receiver rebuilds it
on its own process groups, see ``_dtensor``), ``None``, ``bool``, ``int``, ``float`` (including
nan/inf), ``str``, ``bytes``, ``torch.Size``. Containers: ``dict`` (any supported, hashable key;
``OrderedDict`` comes back as ``dict`` in the same order), ``list``, ``tuple``. Anything else
raises ``TypeError`` naming its path. Not supported yet: tensor aliasing (two entries sharing
storage arrive as two tensors), ``requires_grad`` (tensors arrive detached).

A receiver trusts nothing in a header: ``Header.from_bytes`` and ``unflatten`` raise ValueError
for anything a sender could not have produced (wrong types, a tensor index used twice or out of
range, invalid base64, nesting deeper than the parser goes), and ``check_receivable`` bounds the
memory a header may make a receiver allocate.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

HEADER_VERSION = 1
MAX_HEADER_BYTES = 64 << 20
"""Largest header a receiver reads: ~100 bytes per tensor plus the tree, so room for hundreds of
thousands of tensors; a claim beyond it is refused before anything is allocated."""
MAX_HEADER_TENSORS = 100_000
"""Most tensors a receiver accepts in one header: a state dict holds a few per parameter (the
weight, its optimizer moments), so about a thousand for Llama 3 405B with Adam; each costs the
receiver a parse and an allocation (400,000 one-byte tensors took 11 s of CPU and 600 MiB)."""
MAX_HEADER_CONTAINERS = 1_000_000
"""Most JSON objects and arrays (``{`` and ``[``) a receiver parses in one header, counted
before parsing: each costs a Python dict or list, while a long string (a ``bytes`` leaf) costs
one object for its whole length. A tensor takes about five (its spec and shape, its tree node,
its key), so twice what the tensor cap needs."""
_MAX_DIM = (1 << 63) - 1


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the flat byte stream that follows the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's first byte in the stream."""
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TensorSpec:
        dtype = getattr(torch, str(obj["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"checkpoint header names unknown dtype {obj['dtype']!r}")
        shape, nbytes, offset = obj["shape"], obj["nbytes"], obj["offset"]
        if not isinstance(shape, list) or not all(_is_int(d, _MAX_DIM) for d in shape):
            raise ValueError(f"checkpoint header tensor shape {shape!r} is not a list of sizes")
        if not _is_int(nbytes) or not _is_int(offset):
            raise ValueError(
                f"checkpoint header tensor nbytes {nbytes!r} / offset {offset!r} are not sizes"
            )
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise ValueError(
                f"checkpoint header tensor {obj!r}: shape {shape} of {dtype} is not {nbytes} bytes"
            )
        return cls(dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes)


@dataclass(frozen=True)
class Header:
    """Everything a receiver needs before the tensor bytes: step, tree and tensor table."""

    step: int
    tree: Any
    """The state dict with containers and tensors encoded as JSON nodes (see ``_encode``)."""
    tensors: tuple[TensorSpec, ...]
    snapshot_id: str = ""
    """Identifies one snapshot on the sender, so chunks of two snapshots never mix."""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "version": HEADER_VERSION,
                "step": self.step,
                "snapshot_id": self.snapshot_id,
                "tensors": [t.to_json() for t in self.tensors],
                "tree": self.tree,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Header:
        """Parses a header; raises ValueError when it is not one this version understands."""
        try:
            # Bounded before parsing: a stranger's header costs at most its length in strings
            # and MAX_HEADER_CONTAINERS in dicts and lists.
            containers = data.count(b"{") + data.count(b"[")
            if containers > MAX_HEADER_CONTAINERS:
                raise ValueError(
                    f"{containers} JSON objects and arrays, expected at most "
                    f"{MAX_HEADER_CONTAINERS}"
                )
            obj = json.loads(data)
            version = obj["version"]
            if version != HEADER_VERSION:
                raise ValueError(f"header version {version}, expected {HEADER_VERSION}")
            if (count := len(obj["tensors"])) > MAX_HEADER_TENSORS:
                raise ValueError(f"{count} tensors, expected at most {MAX_HEADER_TENSORS}")
            tensors = tuple(TensorSpec.from_json(t) for t in obj["tensors"])
            if tensors != layout_specs(tensors):
                raise ValueError("tensor offsets are not packed back to back")
            if not _is_int(obj["step"]) or not isinstance(obj["snapshot_id"], str):
                raise ValueError(f"step {obj['step']!r} / snapshot_id {obj['snapshot_id']!r}")
            return cls(
                step=obj["step"],
                tree=obj["tree"],
                tensors=tensors,
                snapshot_id=obj["snapshot_id"],
            )
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed checkpoint header: {e}") from e
        except RecursionError:
            raise ValueError("malformed checkpoint header: nested too deeply") from None


def check_header_length(nbytes: int) -> None:
    """Raises ValueError unless a header of ``nbytes`` may be read (before reading it)."""
    if not 0 < nbytes <= MAX_HEADER_BYTES:
        raise ValueError(
            f"the sender announces a {nbytes}-byte header; expected 1..{MAX_HEADER_BYTES} bytes"
        )


def check_receivable(header: Header) -> None:
    """Raises ValueError when the header's tensors would not fit in this machine's available
    memory: a state that large cannot be received, and allocating it would only hurt."""
    available = available_memory()
    if header.total_bytes > available:
        raise ValueError(
            f"the sender's header describes {header.total_bytes} bytes of tensors, more than "
            f"the {available} bytes of memory available here"
        )


def available_memory() -> int:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``; elsewhere all
    physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def flatten(state_dict: Any) -> tuple[Any, list[torch.Tensor]]:
    """Returns ``(tree, tensors)``: the JSON-able tree and the tensors it indexes, in order."""
    tensors: list[torch.Tensor] = []
    tree = _encode(state_dict, tensors, "state_dict")
    return tree, tensors


def layout(tensors: list[torch.Tensor]) -> tuple[TensorSpec, ...]:
    """Packs the tensors back to back, in order, into one byte stream."""
    specs = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(t.dtype, tuple(t.shape), offset, nbytes))
        offset += nbytes
    return tuple(specs)


def layout_specs(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """The same specs with offsets recomputed by ``layout``'s packing rule."""
    out, offset = [], 0
    for s in specs:
        out.append(TensorSpec(s.dtype, s.shape, offset, s.nbytes))
        offset += s.nbytes
    return tuple(out)


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds the state dict from a header tree and its received tensors.

    Raises ValueError when the tree is malformed: a tensor index that is not an int in range,
    or that appears twice (two entries would alias one tensor) or never; invalid base64; nesting
    deeper than Python's recursion limit.
    """
    used = [False] * len(tensors)
    try:
        state_dict = _decode(tree, tensors, used, _MeshesOnDemand())
    except (IndexError, TypeError, KeyError, ValueError) as e:
        raise ValueError(f"malformed checkpoint header tree: {e}") from e
    except RecursionError:
        raise ValueError("malformed checkpoint header tree: nested too deeply") from None
    if not all(used):
        unused = [i for i, u in enumerate(used) if not u]
        raise ValueError(f"malformed checkpoint header tree: tensors {unused[:10]} are unused")
    return state_dict


class _MeshesOnDemand:
    """The device meshes of one state dict's DTensors, rebuilt on first use (torch's DTensor
    modules are imported only when a state dict holds DTensors)."""

    def __init__(self) -> None:
        self._cache: Any = None

    def decode(self, layout: Any, local: torch.Tensor) -> torch.Tensor:
        from torchtitan_ft.checkpoint import _dtensor  # DTensor modules only where used (above)

        if self._cache is None:
            self._cache = _dtensor.MeshCache()
        return _dtensor.decode(layout, local, self._cache)


def _encode(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    # Order matters: bool before int, Size before tuple, str/bytes before containers.
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        if _is_dtensor(obj):
            from torchtitan_ft.checkpoint import _dtensor  # DTensor modules only where used

            layout = _dtensor.encode_layout(obj, path)  # type: ignore[arg-type]
            return {"DT": [layout, _encode(obj.to_local(), tensors, f"{path} local shard")]}
        if obj.is_sparse or obj.layout != torch.strided:
            raise TypeError(f"{path} is a {obj.layout} tensor; only dense tensors are supported")
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if isinstance(obj, bytes):
        return {"B": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, torch.Size):
        return {"S": list(obj)}
    if isinstance(obj, dict):
        return {
            "D": [
                [_encode(k, tensors, f"{path} key {k!r}"), _encode(v, tensors, f"{path}[{k!r}]")]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, list):
        return {"L": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"U": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    raise TypeError(
        f"{path} has type {type(obj).__qualname__}, which a checkpoint transport cannot send; "
        "supported: tensors, dict, list, tuple, None, bool, int, float, str, bytes, torch.Size"
    )


def _decode(
    node: Any, tensors: list[torch.Tensor], used: list[bool], meshes: _MeshesOnDemand
) -> Any:
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"malformed checkpoint header node {_excerpt(node)}")
    ((tag, value),) = node.items()
    match tag:
        case "T":
            if not _is_int(value, len(tensors) - 1):
                raise ValueError(f"tensor index {value!r} is not one of 0..{len(tensors) - 1}")
            if used[value]:
                raise ValueError(f"tensor index {value} appears twice")
            used[value] = True
            return tensors[value]
        case "B":
            if not isinstance(value, str):
                raise ValueError(f"bytes node {_excerpt(value)} is not base64 text")
            return base64.b64decode(value, validate=True)
        case "S":
            if not isinstance(value, list) or not all(_is_int(d, _MAX_DIM) for d in value):
                raise ValueError(f"torch.Size node {_excerpt(value)} is not a list of sizes")
            return torch.Size(value)
        case "D":
            return {
                _decode(k, tensors, used, meshes): _decode(v, tensors, used, meshes)
                for k, v in value
            }
        case "L":
            return [_decode(v, tensors, used, meshes) for v in value]
        case "U":
            return tuple(_decode(v, tensors, used, meshes) for v in value)
        case "DT":
            if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], dict):
                raise ValueError(f"DTensor node {_excerpt(value)} is not [layout, local shard]")
            local = _decode(value[1], tensors, used, meshes)
            if not isinstance(local, torch.Tensor):
                raise ValueError(f"DTensor node {_excerpt(value)} has no local shard tensor")
            return meshes.decode(value[0], local)
    raise ValueError(f"malformed checkpoint header node tag {_excerpt(tag)}")


def _is_int(value: Any, most: int | None = None) -> bool:
    """A JSON integer (not a bool) in ``0..most``."""
    return type(value) is int and value >= 0 and (most is None or value <= most)


def _excerpt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor  # optional: builds without distributed
    except ImportError:  # builds without distributed
        return False
    return isinstance(t, DTensor)
