"""What crosses the pipes between a baby process group and its child, in both processes:
collective arguments made picklable (:func:`to_wire`, :func:`from_wire`; tensors travel as
shared memory, :func:`share`), exceptions as plain data (:func:`describe`) and the messages of
the pipe protocol (:class:`Request` one way, :class:`ReplyMessage` with a :class:`Reply` kind
the other)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.multiprocessing  # registers the reductions that pickle tensors as shared memory
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import ReduceOp

from torchtitan_ft.process_group.base import reduce_op_of
from torchtitan_ft.process_group.collectives import COLLECTIVES

ErrorInfo = tuple[str, str]
"""An exception as ``(type name, message)``."""


class Reply(enum.Enum):
    """The kinds of message the child sends to the parent, in this order."""

    STARTED = "started"
    """Once, when the child's imports are done (its start is not counted against the
    group's timeout)."""
    READY = "ready"
    """Once, when the child's group is built; or :attr:`FAILED`."""
    FAILED = "failed"
    """Once, with the error, when the child could not build its group; then it exits."""
    DONE = "done"
    """Per collective: it completed."""
    ERROR = "error"
    """Per collective: it failed, with the error."""


class ReplyMessage(NamedTuple):
    """One message from the child."""

    kind: Reply
    op_id: int | None
    """The collective's id (from its :class:`Request`) for :attr:`Reply.DONE` and
    :attr:`Reply.ERROR`, else ``None``."""
    error: ErrorInfo | None
    """For :attr:`Reply.FAILED` and :attr:`Reply.ERROR`, else ``None``."""


class Request(NamedTuple):
    """One collective sent to the child."""

    op_id: int
    """Unique among the parent's requests to this child; its replies carry it."""
    op: str
    """The collective's name (``collectives.Collective.name``)."""
    args: tuple[Any, ...]
    """Its arguments, through :func:`to_wire`."""


_OPTION_TYPES = tuple({c.options for c in COLLECTIVES if c.options is not None})
"""The c10d options classes the collectives take (from the table)."""


@dataclass(frozen=True)
class WireOptions:
    """A c10d options object as plain data (the C++ objects do not pickle)."""

    kind: str
    """Class name in ``torch.distributed.distributed_c10d``, e.g. ``"AllreduceOptions"``."""
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WireReduceOp:
    """A ``ReduceOp`` (the c10d class does not pickle; its ``RedOpType`` members do)."""

    op: Any


def to_wire(value: Any) -> Any:
    """``value`` (collective arguments) with options and reduce ops made picklable."""
    if isinstance(value, list | tuple):
        return type(value)(to_wire(v) for v in value)
    if isinstance(value, _OPTION_TYPES):
        fields = {
            name: to_wire(getattr(value, name))
            for name in dir(value)
            if not name.startswith("_") and not callable(getattr(value, name))
        }
        return WireOptions(type(value).__name__, fields)
    if isinstance(value, ReduceOp | ReduceOp.RedOpType):
        return WireReduceOp(reduce_op_of(value))
    return value


def from_wire(value: Any) -> Any:
    """Inverse of :func:`to_wire`, in the child."""
    if isinstance(value, list | tuple):
        return type(value)(from_wire(v) for v in value)
    if isinstance(value, WireOptions):
        options = getattr(c10d, value.kind)()
        for name, v in value.fields.items():
            setattr(options, name, from_wire(v))
        return options
    if isinstance(value, WireReduceOp):
        return value.op
    return value


def share(value: Any) -> None:
    """Move the CPU tensors in ``value`` (nested lists) to shared memory, in place."""
    if isinstance(value, list | tuple):
        for v in value:
            share(v)
    elif isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_shared():
        value.share_memory_()


def describe(e: BaseException) -> ErrorInfo:
    """An exception as plain data (gloo's errors do not always unpickle)."""
    return type(e).__name__, str(e)
