"""The client every rank of a replica group uses to reach its group's ManagerServer (or a
donor group's, when healing): ``torchft.ManagerService`` over gRPC, blocking.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc

from torchtitan_ft.lighthouse.client import CHANNEL_OPTIONS, grpc_target
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc


class ReplicaGroupMismatchError(RuntimeError):
    """This replica group cannot join the job's quorum: it is inconsistent with a live group
    (same replica id, different model or group size). The message is one line saying what to
    change; retrying does not help."""


class QuorumTimeoutError(TimeoutError):
    """No quorum within ``quorum_timeout``: the lighthouse is unreachable, or fewer than its
    ``min_replicas`` replica groups asked. The message is one line naming the lighthouse."""


class ManagerClient:
    """Blocking client of a ``ManagerServer`` (or of a torchft 0.2.0 manager server).

    Calls wait for the server to be reachable (``wait_for_ready``) within their own timeout, and
    the channel reconnects with a short backoff (``CHANNEL_OPTIONS``, shared with the
    lighthouse client), so a restarting server is reached quickly.
    Errors: ``TimeoutError`` when a call's deadline passes (or the call is cancelled, as torchft
    reports it), ``ReplicaGroupMismatchError`` when ``Quorum`` refuses this group as
    inconsistent with the job, ``RuntimeError`` with the gRPC status and details otherwise.

    Args:
        addr: server URL, ``http://host:port`` (a bare ``host:port`` also works).
        connect_timeout: how long the constructor waits for the server to be reachable; also
            the deadline of ``kill`` when it is given none.

    Raises:
        TimeoutError: the server was not reachable within ``connect_timeout``.
    """

    def __init__(self, addr: str, connect_timeout: timedelta) -> None:
        self._addr = addr
        self._connect_timeout = connect_timeout
        self._channel = grpc.insecure_channel(grpc_target(addr), options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.ManagerServiceStub(self._channel)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout.total_seconds())
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise TimeoutError(
                f"manager server at {addr} not reachable within {connect_timeout}"
            ) from None

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int = 0,
        init_sync: bool = True,
    ) -> QuorumResult:
        """Joins this step's quorum round; returns this group rank's view of the quorum.

        Same argument order as torchft 0.2.0's ``ManagerClient._quorum``; prefer keywords.
        """
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            init_sync=init_sync,
            commit_failures=commit_failures,
        )
        try:
            response = self._call("Quorum", self._stub.Quorum, request, timeout)
        except TimeoutError as e:
            raise QuorumTimeoutError(str(e)) from None
        return QuorumResult.from_proto(response)

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The checkpoint metadata group rank ``rank`` sent in its last quorum call."""
        request = pb.CheckpointMetadataRequest(rank=rank)
        response = self._call("CheckpointMetadata", self._stub.CheckpointMetadata, request, timeout)
        return response.checkpoint_metadata

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Votes for step ``step``; returns True only if every group rank voted True."""
        request = pb.ShouldCommitRequest(
            should_commit=should_commit, group_rank=group_rank, step=step
        )
        response = self._call("ShouldCommit", self._stub.ShouldCommit, request, timeout)
        return response.should_commit

    def kill(
        self, msg: str, auth_token: str | None = None, timeout: timedelta | None = None
    ) -> None:
        """Asks the server's process to exit; it logs ``msg``. Needs the server's auth token."""
        metadata = [("authorization", f"Bearer {auth_token}")] if auth_token is not None else []
        self._call(
            "Kill",
            self._stub.Kill,
            pb.KillRequest(msg=msg),
            timeout if timeout is not None else self._connect_timeout,
            metadata,
        )

    def close(self) -> None:
        """Closes the channel; in-flight calls fail."""
        self._channel.close()

    def _call(
        self,
        name: str,
        method: grpc.UnaryUnaryMultiCallable,
        request: Any,
        timeout: timedelta,
        metadata: list[tuple[str, str]] | None = None,
    ) -> Any:
        try:
            return method(
                request,
                timeout=timeout.total_seconds(),
                metadata=metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            text = f"ManagerService/{name} at {self._addr} failed: {code.name}: {details}"
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise TimeoutError(text) from None
            if code is grpc.StatusCode.FAILED_PRECONDITION:
                raise ReplicaGroupMismatchError(details) from None
            raise RuntimeError(text) from None
