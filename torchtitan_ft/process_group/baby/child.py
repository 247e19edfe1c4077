"""The child process of a baby process group: builds the real group, then runs the
collectives its parent sends over a pipe until the pipe closes (``child_main``, the spawned
process's target)."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from torch.futures import Future

from torchtitan_ft.process_group.baby.wire import (
    ErrorInfo,
    Reply,
    ReplyMessage,
    Request,
    describe,
    from_wire,
)
from torchtitan_ft.process_group.backend import BackendProcessGroup
from torchtitan_ft.process_group.base import GroupConfig
from torchtitan_ft.process_group.collectives import BY_NAME


def child_main(
    backend: type[BackendProcessGroup],
    config: GroupConfig,
    timeout_s: float,
    requests: Connection,
    replies: Connection,
) -> None:  # runs in the spawned child
    """Build the group, then run the collectives the parent sends until its pipe closes.

    Replies (:class:`~.wire.ReplyMessage`) are :attr:`Reply.STARTED` once imports are done,
    then :attr:`Reply.READY` or :attr:`Reply.FAILED` once, then :attr:`Reply.DONE` or
    :attr:`Reply.ERROR` per collective, sent from the backend's threads as collectives
    complete (hence the lock).
    """
    reply_lock = threading.Lock()

    def reply(kind: Reply, op_id: int | None, error: ErrorInfo | None) -> None:
        with reply_lock, contextlib.suppress(OSError):  # parent gone: nothing to tell
            replies.send(ReplyMessage(kind, op_id, error))

    reply(Reply.STARTED, None, None)
    try:
        # The parent enforces timeout_s (from now on, for configure) and kills this process when
        # it passes; the group's own timeout is only a backstop behind it, so that the error
        # reported is the parent's TimeoutError.
        pg = backend(timeout=timedelta(seconds=2 * timeout_s))
        pg.configure(**asdict(config))
    except Exception as e:  # reported to the parent, which raises it from configure()
        reply(Reply.FAILED, None, describe(e))
        os._exit(1)
    reply(Reply.READY, None, None)

    in_flight: dict[int, Any] = {}  # keeps the shared tensors alive until the op completes

    def on_done(op_id: int, fut: Future[Any]) -> None:
        in_flight.pop(op_id, None)
        try:
            fut.wait()
        except Exception as e:  # a collective's failure, handed to the parent as data
            reply(Reply.ERROR, op_id, describe(e))
        else:
            reply(Reply.DONE, op_id, None)

    while True:
        try:
            op_id, op, args = Request(*requests.recv())
        except (EOFError, OSError):
            break  # the parent closed the pipe or died: nothing more to do
        try:
            call_args = from_wire(args)
            in_flight[op_id] = call_args
            work = BY_NAME[op].call(pg, call_args)
            work.get_future().add_done_callback(lambda fut, op_id=op_id: on_done(op_id, fut))
        except Exception as e:  # e.g. a bad argument: fails this op only
            in_flight.pop(op_id, None)
            reply(Reply.ERROR, op_id, describe(e))
    # os._exit: skip interpreter teardown, which would wait for a hung collective's threads.
    os._exit(0)
