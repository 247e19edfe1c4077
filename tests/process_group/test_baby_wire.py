"""What crosses a baby group's pipes (``torchtitan_ft.process_group.baby.wire``), in process:
the arguments made picklable, the protocol's messages, tensors moved to shared memory."""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions, BroadcastOptions

from torchtitan_ft.process_group.baby.wire import (
    Reply,
    ReplyMessage,
    Request,
    describe,
    from_wire,
    share,
    to_wire,
)


def test_options_and_reduce_ops_cross_the_pipe() -> None:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    opts.timeout = timedelta(seconds=7)
    bopts = BroadcastOptions()
    bopts.rootRank = 1
    t = torch.ones(2)
    back = from_wire(to_wire(([t], opts, (bopts, ReduceOp.AVG), 3)))
    tensors, got, (got_b, op), n = back
    assert tensors[0] is t and n == 3
    assert isinstance(got, AllreduceOptions) and got.reduceOp == ReduceOp.MAX
    assert got.timeout == timedelta(seconds=7)
    assert isinstance(got_b, BroadcastOptions) and got_b.rootRank == 1
    assert op == ReduceOp.AVG


def test_wire_arguments_and_messages_pickle() -> None:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.AVG
    request = Request(3, "allreduce", to_wire(([torch.ones(2)], opts)))
    op_id, op, args = pickle.loads(pickle.dumps(request))
    assert (op_id, op) == (3, "allreduce")
    tensors, got = from_wire(args)
    assert got.reduceOp == ReduceOp.AVG and tensors[0].tolist() == [1.0, 1.0]
    for message in (
        ReplyMessage(Reply.STARTED, None, None),
        ReplyMessage(Reply.ERROR, 7, describe(TimeoutError("late"))),
    ):
        assert pickle.loads(pickle.dumps(message)) == message
    assert describe(TimeoutError("late")) == ("TimeoutError", "late")
    assert [r.value for r in Reply] == ["started", "ready", "failed", "done", "error"]


def test_share_moves_nested_cpu_tensors_to_shared_memory_in_place() -> None:
    a, b = torch.ones(2), torch.zeros(3)
    share(([a], [[b]], 5, None))
    assert a.is_shared() and b.is_shared()
    assert a.tolist() == [1.0, 1.0]
