"""The client every rank of a replica group uses to reach its group's ManagerServer (or a
donor group's, when healing): ``torchft.ManagerService`` over gRPC, blocking.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import grpc

from torchtitan_ft.auth import GROUP_KEY_METADATA, grpc_metadata, resolve_group_key, resolve_token
from torchtitan_ft.lighthouse.client import CHANNEL_OPTIONS, grpc_target
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.manager.rounds import NEW_SESSION, SESSION_METADATA
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc

_OPTIONS = [
    *CHANNEL_OPTIONS,
    # A connection of its own: gRPC otherwise shares one among a process's channels to the
    # same server, and the server binds a group rank to its client's connection.
    ("grpc.use_local_subchannel_pool", 1),
]


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
        auth_token: the job token, sent with every call (``authorization: Bearer <token>``);
            a server with a token refuses calls without it (UNAUTHENTICATED), one without
            ignores it. Default ``None``: ``$TORCHFT_AUTH_TOKEN`` if set, else none. Every
            rank uses the ``auth_token`` its ``Manager`` resolved, the same one the group's
            ManagerServer checks.
        group_key: the replica group's key (``ManagerServer``'s ``group_key``), sent only
            on the calls that act for a rank (``_quorum``, ``should_commit``), never on
            ``_checkpoint_metadata`` or ``kill``, which go to other groups' servers too.
            Default ``None``: ``$TORCHFT_GROUP_KEY`` if set, else none.

    A server binds each group rank to the client of its Quorum call: to its connection, and to
    the session the server returns with the first answer, which this client keeps and presents
    on the rank's later ``_quorum`` and ``should_commit`` calls (so the rank keeps its binding
    when the channel reconnects). Make a rank's calls through one client; a new client (a
    restarted process) takes the rank back only once the old client's connection has closed
    (``manager/rounds.py``); closing a client closes its connection.

    Raises:
        TimeoutError: the server was not reachable within ``connect_timeout``.
        ValueError: ``auth_token`` or ``group_key`` is not a token a server could check
            (``auth.check_token``).
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta,
        auth_token: str | None = None,
        group_key: str | None = None,
    ) -> None:
        auth_token = resolve_token(auth_token)
        group_key = resolve_group_key(group_key)
        self._addr = addr
        self._connect_timeout = connect_timeout
        self._metadata = list(grpc_metadata(auth_token))
        self._rank_metadata = self._metadata + (
            [(GROUP_KEY_METADATA, group_key)] if group_key is not None else []
        )
        """What the calls acting for a rank carry: the token and the group key."""
        self._sessions: dict[int, str] = {}
        """group rank -> the session the server gave it."""
        self._channel = grpc.insecure_channel(grpc_target(addr), options=_OPTIONS)
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
        progress: pb.GroupProgress | None = None,
        reconfigure_handle: str = "",
    ) -> QuorumResult:
        """Joins this step's quorum round; returns this group rank's view of the quorum.

        Same argument order as torchft 0.2.0's ``ManagerClient._quorum``; prefer keywords.
        ``progress``: this rank's recent step timings, for the straggler report (a torchft
        0.2.0 server ignores them). ``reconfigure_handle``: this rank's process-group handle
        (torchft-nightly's ``get_reconfigure_handle``), "" for none; the answer's
        ``reconfigure_handles`` are then its cross-group group's (a torchft 0.2.0 server
        ignores it and answers none).
        """
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            init_sync=init_sync,
            commit_failures=commit_failures,
            progress=progress,
            reconfigure_handle=reconfigure_handle,
        )
        session = self._sessions.get(group_rank, NEW_SESSION)
        metadata = [*self._rank_metadata, (SESSION_METADATA, session)]
        try:
            response, call = self._call(
                "Quorum", self._stub.Quorum.with_call, request, timeout, metadata
            )
        except TimeoutError as e:
            raise QuorumTimeoutError(str(e)) from None
        for key, value in call.trailing_metadata() or ():
            if key == SESSION_METADATA:
                self._sessions[group_rank] = value
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
        metadata = self._rank_metadata
        if (session := self._sessions.get(group_rank)) is not None:
            metadata = [*metadata, (SESSION_METADATA, session)]
        response = self._call("ShouldCommit", self._stub.ShouldCommit, request, timeout, metadata)
        return response.should_commit

    def kill(
        self, msg: str, auth_token: str | None = None, timeout: timedelta | None = None
    ) -> None:
        """Asks the server's process to exit; it logs ``msg``. Needs the server's job token:
        ``auth_token``, else the client's."""
        metadata = list(grpc_metadata(auth_token)) if auth_token is not None else None
        self._call(
            "Kill",
            self._stub.Kill,
            pb.KillRequest(msg=msg),
            timeout if timeout is not None else self._connect_timeout,
            metadata,
        )

    def close(self, wait: bool = True) -> None:
        """Closes the channel; in-flight calls fail.

        Args:
            wait: return once the channel is closed (default). grpcio's close waits for the
                connectivity watcher that the constructor's readiness wait started, which
                wakes every 0.2 s: a client closed within 0.2 s of its construction blocks
                for the rest of that. ``False`` closes on a daemon thread instead, for a
                short-lived client whose caller must not wait (a healing rank's client of its
                donor, on the path every peer waits on).
        """
        if wait:
            self._channel.close()
        else:
            threading.Thread(
                target=self._channel.close, name="close-manager-client", daemon=True
            ).start()

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
                metadata=self._metadata if metadata is None else metadata,
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
