"""The clients of a group's ManagerServer, behind one call layer (``_ManagerCalls``: one
request builder, one session rule, one status-to-exception mapping):

- ``ManagerClient``: every rank of a replica group reaches its group's ManagerServer (or a
  donor group's, when healing) over gRPC, blocking;
- ``LocalManagerClient``: the rank in the ManagerServer's own process (group rank 0) calls the
  server's handlers on its event loop, without gRPC.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc

from torchtitan_ft.auth import GROUP_KEY_METADATA, grpc_metadata, resolve_group_key, resolve_token
from torchtitan_ft.lighthouse.client import CHANNEL_OPTIONS, grpc_target
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.manager.rounds import NEW_SESSION, SESSION_METADATA
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from torchtitan_ft.manager.server import ManagerServer

T = TypeVar("T")
Metadata = Sequence[tuple[str, str]]

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


class _ManagerCalls:
    """The calls a group rank makes as a rank (``_quorum``, ``should_commit``), written once
    for both clients: the request, the session rule and the errors. A client provides
    ``_invoke``, which makes one call and raises what ``_failure`` maps its status to.

    The session rule: a server binds each group rank to the client of its Quorum call, to its
    connection and to a session it returns with the first answer (``rounds.SESSION_METADATA``
    in the trailing metadata). The client keeps each rank's session and presents it on the
    rank's later ``_quorum`` and ``should_commit`` calls (``NEW_SESSION`` on a quorum before it
    has one), so the rank keeps its binding when the connection changes.
    """

    _addr: str
    _rank_metadata: list[tuple[str, str]]
    """What the calls acting for a rank carry besides the session."""
    _sessions: dict[int, str]
    """group rank -> the session the server gave it."""

    def _invoke(
        self, name: str, request: Any, timeout: timedelta, metadata: Metadata
    ) -> tuple[Any, Metadata]:
        """One call of ``ManagerService/<name>``: its response and trailing metadata."""
        raise NotImplementedError

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
            response, trailing = self._invoke("Quorum", request, timeout, metadata)
        except TimeoutError as e:
            raise QuorumTimeoutError(str(e)) from None
        for key, value in trailing:
            if key == SESSION_METADATA:
                self._sessions[group_rank] = value
        return QuorumResult.from_proto(response)

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
        response, _ = self._invoke("ShouldCommit", request, timeout, metadata)
        return response.should_commit

    def _failure(self, name: str, code: grpc.StatusCode, details: str) -> Exception:
        """The error a call of ``name`` that ended with ``code`` raises: ``TimeoutError`` for
        a deadline or a cancellation (as torchft reports it), ``ReplicaGroupMismatchError``
        for FAILED_PRECONDITION, ``RuntimeError`` with the status otherwise."""
        text = f"ManagerService/{name} at {self._addr} failed: {code.name}: {details}"
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return TimeoutError(text)
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            return ReplicaGroupMismatchError(details)
        return RuntimeError(text)


class ManagerClient(_ManagerCalls):
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

    A rank is bound to this client by its connection and its session (``_ManagerCalls``), so
    it keeps its binding when the channel reconnects. Make a rank's calls through one client; a
    new client (a restarted process) takes the rank back only once the old client's connection
    has closed (``manager/rounds.py``); closing a client closes its connection.

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
        self._sessions = {}
        self._channel = grpc.insecure_channel(grpc_target(addr), options=_OPTIONS)
        self._stub = pb_grpc.ManagerServiceStub(self._channel)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout.total_seconds())
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise TimeoutError(
                f"manager server at {addr} not reachable within {connect_timeout}"
            ) from None

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The checkpoint metadata group rank ``rank`` sent in its last quorum call."""
        request = pb.CheckpointMetadataRequest(rank=rank)
        response = self._call("CheckpointMetadata", self._stub.CheckpointMetadata, request, timeout)
        return response.checkpoint_metadata

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

    def _invoke(
        self, name: str, request: Any, timeout: timedelta, metadata: Metadata
    ) -> tuple[Any, Metadata]:
        method = getattr(self._stub, name).with_call
        response, call = self._call(name, method, request, timeout, metadata)
        return response, call.trailing_metadata() or ()

    def _call(
        self,
        name: str,
        method: grpc.UnaryUnaryMultiCallable,
        request: Any,
        timeout: timedelta,
        metadata: Metadata | None = None,
    ) -> Any:
        try:
            return method(
                request,
                timeout=timeout.total_seconds(),
                metadata=self._metadata if metadata is None else metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            raise self._failure(name, e.code(), e.details()) from None


LOCAL_PEER = "in-process:manager-server"
"""The peer name the ManagerServer gives calls from its own process."""
_LOCAL_NET_S = 30.0
"""An in-process call whose handler asks the lighthouse waits for that request's own answer
(``LocalContext.answered_by``) up to this long past its deadline: a net for a request that
hangs, not a deadline a working one meets (it ends before the call's deadline)."""


class LocalManagerClient(_ManagerCalls):
    """``ManagerClient``'s ``_quorum`` and ``should_commit`` for the rank in the ManagerServer's
    own process (group rank 0): the server's handlers run on its event loop without gRPC, so a
    quorum costs no serialization and no trip through the network stack each way (about half
    the ManagerServer's part of a quorum round trip, docs/performance.md). The rank binds to
    the server by the same rule as over gRPC (``_ManagerCalls``): its calls come from
    ``LOCAL_PEER`` and present the session the server gave it. No token or group key: the
    calls never leave the process. Errors are ``ManagerClient``'s. Healing peers and the
    other ranks still use gRPC.
    """

    def __init__(self, server: ManagerServer, addr: str) -> None:
        self._server = server
        self._addr = addr
        self._rank_metadata = []
        self._sessions = {}

    def close(self, wait: bool = True) -> None:
        """Nothing to close (the server is the rendezvous's to stop)."""

    def _invoke(
        self, name: str, request: Any, timeout: timedelta, metadata: Metadata
    ) -> tuple[Any, Metadata]:
        handler = {"Quorum": self._server.quorum, "ShouldCommit": self._server.should_commit}
        context = LocalContext(time.monotonic() + timeout.total_seconds(), metadata)
        handling = handler[name](request, context)
        call = _guarded(context, timeout.total_seconds(), handling)
        try:
            future = asyncio.run_coroutine_threadsafe(call, self._server._loop)
        except RuntimeError:  # the server's loop is closed: neither coroutine will run
            call.close()
            handling.close()
            raise
        try:
            return future.result(), context.trailing
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "in process"
        except LocalAbort as e:
            code, details = e.code, e.details
        except concurrent.futures.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "server stopped"
        raise self._failure(name, code, details) from None


class LocalAbort(Exception):
    """A handler called for the in-process client aborted with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """The part of ``aio.ServicerContext`` the ``Quorum`` and ``ShouldCommit`` handlers use,
    for a call from this process (``LocalManagerClient``)."""

    def __init__(self, deadline: float, metadata: Metadata) -> None:
        self._deadline = deadline
        self._metadata = tuple(metadata)
        self.trailing: Metadata = ()
        self.guard: asyncio.Timeout | None = None
        """The call's deadline on the server's loop (``_guarded``); None outside the call."""

    def answered_by(self, when: float) -> None:
        """The handler will answer by itself, by loop time ``when`` (the end of the lighthouse
        request its round made, from this call or another rank's, which ends before the
        deadline): the guard moves to ``_LOCAL_NET_S``
        after the later of ``when`` and the deadline, so that it fires only if that request
        hangs. However late a starved loop runs, the caller then gets the request's own error
        (e.g. "no quorum from the lighthouse at ...") rather than the deadline, whose timer a
        loop waking after both would otherwise run before the failure's callbacks."""
        if self.guard is not None and (at := self.guard.when()) is not None:
            self.guard.reschedule(max(at, when) + _LOCAL_NET_S)

    def time_remaining(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    def peer(self) -> str:
        return LOCAL_PEER

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self.trailing = metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise LocalAbort(code, details)


async def _guarded(context: LocalContext, timeout_s: float, coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result, or ``TimeoutError`` after ``timeout_s`` (later where the handler
    says it answers by itself, ``LocalContext.answered_by``): ``asyncio.wait_for`` without its
    extra task (one event-loop turn less on a quorum's path)."""
    try:
        async with asyncio.timeout(timeout_s) as context.guard:
            return await coro
    finally:
        context.guard = None  # the call is over: a later answered_by changes nothing
