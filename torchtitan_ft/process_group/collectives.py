"""The collectives of a process group, declared once, in every rank.

Each entry of :data:`COLLECTIVES` names a collective, its arguments, the argument its future
completes with, its options class, the argument it reads (for byte counters) and what it does
in a group of one process. :class:`~torchtitan_ft.process_group.base.ProcessGroup` gets one
method per entry (``pg.allreduce(tensors, opts)`` and so on), which checks the arguments and
hands them to the group's one hook, ``_collective(collective, args)``; the wrappers, the fakes,
the baby groups and the benchmarks' byte counter all work from this table.

To add a collective, add an entry here: every group type then has it (the gloo and NCCL groups
and the baby groups' children run it on the torch group by the same name, ``Collective.call``;
the wrappers forward it; ``ProcessGroupDummy`` does its ``one_rank``). Then add a case for it
to ``tests/process_group/test_collectives.py``, which checks that every group type agrees on
it (and fails until the case exists).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
)

Args = tuple[Any, ...]
"""A collective's arguments, in the order of :attr:`Collective.params`, defaults filled in and
options normalized (:meth:`Collective.bind`)."""


class Yields(enum.Enum):
    """What a collective's future completes with."""

    ARGUMENT = "argument"
    """The argument :attr:`Collective.result` names, as passed (a list of tensors, or of lists
    of tensors)."""
    ARGUMENT_IN_LIST = "argument_in_list"
    """``[argument]``: the single tensor :attr:`Collective.result` names, in a list (torch's
    convention for its single-tensor collectives)."""
    NOTHING = "nothing"
    """``None``."""


@dataclass(frozen=True)
class Collective:
    """One collective: what ``ProcessGroup`` methods of that name take and return."""

    name: str
    """Method name, as torch's ``ProcessGroup`` spells it (``dist.*`` calls it)."""
    params: tuple[str, ...]
    """Argument names after ``self``, in order; ``opts`` is last where present."""
    result: str | None
    """The argument the future completes with (see :attr:`yields`): the tensors the collective
    writes, or those it sends; ``None`` with :attr:`Yields.NOTHING`."""
    yields: Yields
    """How the future's value is made from :attr:`result`."""
    input: str | None
    """The argument holding the tensors this rank contributes (what byte counters count)."""
    options: type | None
    """Class of the ``opts`` argument (``None``: the collective takes none). ``opts=None``
    becomes a default instance; for options with a ``reduceOp``, a ``ReduceOp`` is accepted
    in their place."""
    one_rank: Callable[[Args], None]
    """What the collective does to its arguments in a group of one process (what
    ``ProcessGroupDummy`` does)."""
    doc: str
    """The method's docstring."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Default values of trailing arguments other than ``opts`` (which defaults to ``None``)."""

    def __post_init__(self) -> None:
        if (self.result is None) != (self.yields is Yields.NOTHING):
            raise ValueError(f"{self.name}: result={self.result!r} and yields={self.yields}")

    @property
    def signature(self) -> inspect.Signature:
        """The method's signature (``self`` first)."""
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter("self", kind)]
        for name in self.params:
            if name == "opts":
                params.append(inspect.Parameter(name, kind, default=None))
            elif name in self.defaults:
                params.append(inspect.Parameter(name, kind, default=self.defaults[name]))
            else:
                params.append(inspect.Parameter(name, kind))
        return inspect.Signature(params)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
        """The arguments of a call (``args`` and ``kwargs`` as the caller passed them, without
        ``self``) in :attr:`params` order, defaults filled in and ``opts`` normalized.

        Raises:
            TypeError: for missing or unknown arguments, or options of another class.
        """
        if kwargs or len(args) != len(self.params):
            bound = self.signature.bind(None, *args, **kwargs)
            bound.apply_defaults()
            args = bound.args[1:]
        if self.options is None:
            return tuple(args)
        return (*args[:-1], self._options(self.options, args[-1]))

    def _options(self, options_class: type, value: object) -> Any:
        if value is None:
            return options_class()
        if isinstance(value, options_class):
            return value
        takes_op = hasattr(options_class(), "reduceOp")
        if takes_op and isinstance(value, ReduceOp | ReduceOp.RedOpType):
            options = options_class()
            options.reduceOp = value
            return options
        raise TypeError(
            f"{self.name}: opts must be {options_class.__name__}"
            + (", a ReduceOp" if takes_op else "")
            + f" or None, got {value!r}"
        )

    def arg(self, args: Args, name: str) -> Any:
        """The argument ``name`` of ``args``."""
        return args[self.params.index(name)]

    def value(self, args: Args) -> object:
        """What the future of this collective completes with, for ``args``."""
        if self.result is None:
            return None
        result = self.arg(args, self.result)
        return [result] if self.yields is Yields.ARGUMENT_IN_LIST else result

    def input_tensors(self, args: Args) -> list[torch.Tensor]:
        """The tensors of :attr:`input` in ``args``, flattened (empty without an input)."""
        return [] if self.input is None else _flatten(self.arg(args, self.input))

    def call(self, pg: Any, args: Args) -> Work:
        """Run this collective on ``pg`` (any ``torch.distributed.ProcessGroup``)."""
        return getattr(pg, self.name)(*args)


def _flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _flatten(v)]


# ---- what each collective does in a group of one process ----


def _unchanged(args: Args) -> None:
    """Every rank's result is this rank's own data: nothing to do."""


def _copy_pairs(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    for output, tensor in zip(outputs, inputs, strict=True):
        output.copy_(tensor)


def _into_first_slots(args: Args) -> None:
    """``outputs[i][0] = inputs[i]`` (allgather, gather: one rank's contribution each)."""
    outputs, inputs = args[0], args[1]
    _copy_pairs([slots[0] for slots in outputs], inputs)


def _from_first_chunks(args: Args) -> None:
    """``outputs[i] = inputs[i][0]`` (reduce_scatter, scatter: this rank's only chunk)."""
    outputs, inputs = args[0], args[1]
    _copy_pairs(outputs, [chunks[0] for chunks in inputs])


def _copy_lists(args: Args) -> None:
    """``outputs[i] = inputs[i]`` (the coalesced tensor forms)."""
    _copy_pairs(args[0], args[1])


def _copy_tensor(args: Args) -> None:
    """``output = input`` (the single-tensor forms, alltoall)."""
    args[0].copy_(args[1])


# ---- the table ----

_OPTS = "opts: options (timeout{extra}); ``None`` for the defaults."

COLLECTIVES: tuple[Collective, ...] = (
    Collective(
        name="allreduce",
        params=("tensors", "opts"),
        result="tensors",
        yields=Yields.ARGUMENT,
        input="tensors",
        options=AllreduceOptions,
        one_rank=_unchanged,
        doc="""Reduce ``tensors`` in place across the group (``dist.all_reduce``).

        Args:
            tensors: tensors to reduce; each is overwritten with the result.
            opts: ``AllreduceOptions`` or a ``ReduceOp``; ``None`` means SUM.""",
    ),
    Collective(
        name="allreduce_coalesced",
        params=("tensors", "opts"),
        result="tensors",
        yields=Yields.ARGUMENT,
        input="tensors",
        options=AllreduceCoalescedOptions,
        one_rank=_unchanged,
        doc="""Reduce several tensors in one collective (``dist.all_reduce_coalesced``).

        Args:
            tensors: tensors to reduce; each is overwritten with the result.
            """
        + _OPTS.format(extra=", reduce op: default SUM"),
    ),
    Collective(
        name="allgather",
        params=("output_tensors", "input_tensors", "opts"),
        result="output_tensors",
        yields=Yields.ARGUMENT,
        input="input_tensors",
        options=AllgatherOptions,
        one_rank=_into_first_slots,
        doc="""Gather every rank's input into ``output_tensors`` (``dist.all_gather``).

        Args:
            output_tensors: ``output_tensors[i][r]`` receives rank ``r``'s ``input_tensors[i]``.
            input_tensors: this rank's contribution.
            """
        + _OPTS.format(extra=""),
    ),
    Collective(
        name="allgather_into_tensor_coalesced",
        params=("output_tensors", "input_tensors", "opts"),
        result="output_tensors",
        yields=Yields.ARGUMENT,
        input="input_tensors",
        options=AllgatherOptions,
        one_rank=_copy_lists,
        doc="""Gather several tensors in one collective: ``output_tensors[i]`` receives every
        rank's ``input_tensors[i]`` concatenated along dim 0, in rank order (what
        ``dist.all_gather_into_tensor`` does for one tensor).

        Args:
            output_tensors: one per input, ``world_size`` times its size along dim 0.
            input_tensors: this rank's contributions.
            """
        + _OPTS.format(extra=""),
    ),
    Collective(
        name="broadcast",
        params=("tensor_list", "opts"),
        result="tensor_list",
        yields=Yields.ARGUMENT,
        input="tensor_list",
        options=BroadcastOptions,
        one_rank=_unchanged,
        doc="""Copy the root's tensors to every rank (``dist.broadcast``).

        Args:
            tensor_list: tensors sent by the root and overwritten on the other ranks.
            """
        + _OPTS.format(extra=", ``rootRank``: default 0"),
    ),
    Collective(
        name="reduce_scatter",
        params=("output_tensors", "input_tensors", "opts"),
        result="output_tensors",
        yields=Yields.ARGUMENT,
        input="input_tensors",
        options=ReduceScatterOptions,
        one_rank=_from_first_chunks,
        doc="""Reduce ``input_tensors[i][r]`` over ranks into rank ``r``'s ``output_tensors[i]``.

        Args:
            output_tensors: receive this rank's reduced chunk.
            input_tensors: ``input_tensors[i]`` has one chunk per rank.
            """
        + _OPTS.format(extra=", reduce op: default SUM"),
    ),
    Collective(
        name="reduce_scatter_tensor_coalesced",
        params=("output_tensors", "input_tensors", "opts"),
        result="output_tensors",
        yields=Yields.ARGUMENT,
        input="input_tensors",
        options=ReduceScatterOptions,
        one_rank=_copy_lists,
        doc="""Reduce several tensors over ranks in one collective; rank ``r``'s
        ``output_tensors[i]`` receives the ``r``-th dim-0 chunk of the reduced
        ``input_tensors[i]`` (what ``dist.reduce_scatter_tensor`` does for one tensor).

        Args:
            output_tensors: one per input, ``1 / world_size`` of its size along dim 0.
            input_tensors: this rank's full-size contributions.
            """
        + _OPTS.format(extra=", reduce op: default SUM"),
    ),
    Collective(
        name="alltoall_base",
        params=("output", "input", "output_split_sizes", "input_split_sizes", "opts"),
        result="output",
        yields=Yields.ARGUMENT_IN_LIST,
        input="input",
        options=AllToAllOptions,
        one_rank=_copy_tensor,
        doc="""Rank ``r`` receives every rank's ``r``-th slice of ``input`` into ``output``
        (``dist.all_to_all_single``); empty split sizes mean equal slices.

        Args:
            output: receives one slice from each rank, in rank order.
            input: split along dim 0 into one slice per rank.
            output_split_sizes: rows received from each rank; [] for equal slices.
            input_split_sizes: rows sent to each rank; [] for equal slices.
            """
        + _OPTS.format(extra=""),
    ),
    Collective(
        name="all_gather_single",
        params=("output", "input", "opts"),
        result="output",
        yields=Yields.ARGUMENT_IN_LIST,
        input="input",
        options=AllgatherOptions,
        one_rank=_copy_tensor,
        doc="""Gather every rank's ``input`` into ``output`` (dim 0, rank order;
        ``dist.all_gather_into_tensor``).

        Args:
            output: ``world_size`` times the size of ``input`` along dim 0.
            input: this rank's contribution.
            """
        + _OPTS.format(extra=""),
    ),
    Collective(
        name="reduce_scatter_single",
        params=("output", "input", "opts"),
        result="output",
        yields=Yields.ARGUMENT_IN_LIST,
        input="input",
        options=ReduceScatterOptions,
        one_rank=_copy_tensor,
        doc="""Reduce ``input`` over ranks; rank ``r`` receives its ``r``-th dim-0 chunk
        (``dist.reduce_scatter_tensor``).

        Args:
            output: ``1 / world_size`` of the size of ``input`` along dim 0.
            input: this rank's full-size contribution.
            """
        + _OPTS.format(extra=", reduce op: default SUM"),
    ),
    Collective(
        name="gather",
        params=("output_tensors", "input_tensors", "opts"),
        result="output_tensors",
        yields=Yields.ARGUMENT,
        input="input_tensors",
        options=GatherOptions,
        one_rank=_into_first_slots,
        doc="""Gather every rank's input on ``opts.rootRank`` (``dist.gather``).

        Args:
            output_tensors: on the root, ``output_tensors[i][r]`` receives rank ``r``'s
                ``input_tensors[i]``; empty on the other ranks.
            input_tensors: this rank's contribution.
            """
        + _OPTS.format(extra=", ``rootRank``: default 0"),
    ),
    Collective(
        name="scatter",
        params=("output_tensors", "input_tensors", "opts"),
        result="output_tensors",
        yields=Yields.ARGUMENT,
        input="input_tensors",
        options=ScatterOptions,
        one_rank=_from_first_chunks,
        doc="""Send ``opts.rootRank``'s ``input_tensors[0][r]`` to rank ``r`` (``dist.scatter``).

        Args:
            output_tensors: receive this rank's chunk.
            input_tensors: on the root, one chunk per rank; empty on the other ranks.
            """
        + _OPTS.format(extra=", ``rootRank``: default 0"),
    ),
    Collective(
        name="reduce",
        params=("tensors", "opts"),
        result="tensors",
        yields=Yields.ARGUMENT,
        input="tensors",
        options=ReduceOptions,
        one_rank=_unchanged,
        doc="""Reduce ``tensors`` onto ``opts.rootRank`` (``dist.reduce``).

        Args:
            tensors: contributed by every rank; overwritten with the result on the root.
            """
        + _OPTS.format(extra=", reduce op: default SUM, ``rootRank``: default 0"),
    ),
    Collective(
        name="send",
        params=("tensors", "dst_rank", "tag"),
        result="tensors",
        yields=Yields.ARGUMENT,
        input="tensors",
        options=None,
        one_rank=_unchanged,
        defaults={"tag": 0},
        doc="""Send ``tensors`` to ``dst_rank`` (``dist.send``); the future completes with
        them.

        Args:
            tensors: tensors to send.
            dst_rank: receiving rank in this group.
            tag: matches the receiver's tag.""",
    ),
    Collective(
        name="recv",
        params=("tensors", "src_rank", "tag"),
        result="tensors",
        yields=Yields.ARGUMENT,
        input=None,
        options=None,
        one_rank=_unchanged,
        defaults={"tag": 0},
        doc="""Receive into ``tensors`` from ``src_rank`` (``dist.recv``).

        Args:
            tensors: overwritten with the received data.
            src_rank: sending rank in this group.
            tag: matches the sender's tag.""",
    ),
    Collective(
        name="barrier",
        params=("opts",),
        result=None,
        yields=Yields.NOTHING,
        input=None,
        options=BarrierOptions,
        one_rank=_unchanged,
        doc="""Complete once every rank has entered the barrier.

        Args:
            """
        + _OPTS.format(extra=""),
    ),
)
"""Every collective of :class:`~torchtitan_ft.process_group.base.ProcessGroup`."""

BY_NAME: dict[str, Collective] = {c.name: c for c in COLLECTIVES}
""":data:`COLLECTIVES` by :attr:`Collective.name`."""
