"""The replica group's ManagerServer, on group rank 0: ``torchft.ManagerService`` over gRPC,
speaking to the lighthouse once for the whole group.

What each RPC does is in docs/architecture.md ("The pieces", "One step" and "Group
consistency"). Wire-compatible with torchft 0.2.0 in both directions. It runs grpc.aio on its
own event-loop thread, so it keeps answering while the training thread is busy. Its lighthouse
quorum requests run on that loop too (``lighthouse_quorum.LighthouseQuorums``: no thread
hand-off; shutdown cancels them), and its blocking calls (address checks, which may look names
up) on kept daemon threads (``rpc_server.DaemonThreads``), so that shutdown never waits for them.

The rounds themselves (who has joined, who voted, what is recorded, who is refused) are
``rounds.GroupRounds``: each handler feeds its call in, then only does what the decision says
(ask the lighthouse, wait for the round's end, answer or abort). How a group rank is bound to
its client (the connection of its Quorum call and a session, ``rounds.SESSION_METADATA``, in
that call's trailing metadata), and when another client may take the rank over, is in
``rounds.py``'s module doc. Who may call what is docs/operations.md, "Security": with a job
token every call must carry it (``TokenInterceptor``, UNAUTHENTICATED before the request is
parsed). Malformed requests get INVALID_ARGUMENT; connections are capped, idle ones closed,
requests at most ``rpc_server.MAX_REQUEST_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import grpc
from grpc import aio

from torchtitan_ft.auth import RefusalLog, check_token, peer_host, resolve_group_key
from torchtitan_ft.connection_guard import AuthenticatedPeers, ConnectionGuard, GuardPolicy
from torchtitan_ft.lighthouse.client import LighthouseClient
from torchtitan_ft.manager.client import LOCAL_PEER, LocalContext
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.manager.identity import GroupIdentity
from torchtitan_ft.manager.lighthouse_quorum import (
    LighthouseQuorums,
    QuorumOutcome,
    RpcFailure,
    lighthouse_budget,
)
from torchtitan_ft.manager.linkprobe import LinkProber
from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.rounds import (
    SESSION_METADATA,
    Ask,
    Ballot,
    Decided,
    GroupRounds,
    Held,
    Joined,
    Refused,
    Unknown,
    Waiting,
)
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.rpc_server import (
    CannotListen,
    DaemonThreads,
    Malformed,
    Rpc,
    ServerThread,
    countable_descriptors,
    descriptor_limit,
    grpc_server,
    listen,
    unary,
)

logger = logging.getLogger(__name__)

_KILL_EXIT_FALLBACK_S = 1.0

SERVICE = "torchft.ManagerService"
_IDLE_CONNECTION_MS = 60 * 60 * 1000
"""A connection with no call for an hour is closed. Much longer than the lighthouse's 30 s: a
torchft client's vote must come on the connection of its Quorum call (ours also presents its
session, ``rounds.py``), a whole step later."""


class AddressInUseError(RuntimeError):
    """The manager server's port is already taken by another process."""

    def __init__(self, bind: str, message: str | None = None) -> None:
        super().__init__(message or f"manager server cannot listen on {bind!r}: address in use")
        self.bind = bind


class ManagerServer:
    """Serves ``torchft.ManagerService`` for one replica group (normally on group rank 0).

    Starts serving before the constructor returns and keeps a streaming heartbeat to the
    lighthouse, so the lighthouse notices at once when this process dies.

    Args:
        replica_id: this replica group's id in the lighthouse (unique per group and
            incarnation, e.g. ``"train_0:<uuid>"``).
        lighthouse_addr: lighthouse URL, ``http://host:port``.
        hostname: host name advertised in ``address()`` (and so to other replica groups that
            heal from this one). Default ``None``: ``socket.gethostname()``, looked up when the
            server is constructed. Set it when that name resolves to a slow or unreachable
            network.
        bind: ``host:port`` to listen on; port 0 picks a free port. Default ``"[::]:0"`` (all
            interfaces).
        store_addr: ``host:port`` of this replica group's TCPStore, advertised to the lighthouse;
            when this group is the primary for a group rank, the cross-group process group of
            that rank rendezvouses there.
        world_size: number of group ranks in this replica group; a ``Quorum`` round and a
            ``ShouldCommit`` round complete when this many distinct ranks have called.
        heartbeat_interval: interval between heartbeats on the lighthouse stream.
        connect_timeout: how long the lighthouse client waits to (re)connect.
        quorum_retries: how many times a failed lighthouse quorum request is retried (with a
            short backoff, within the waiting ranks' deadline) before the ranks get the error.
            Default 0.
        auth_token: the job token. When set, every call (``Quorum``, ``ShouldCommit``,
            ``CheckpointMetadata``, ``Kill``) must carry ``authorization: Bearer <auth_token>``
            (UNAUTHENTICATED otherwise; ``ManagerClient(auth_token=...)`` sends it), and this
            server presents it to the lighthouse. Default ``None``: anyone who reaches the port
            may call everything but ``Kill``, which is refused (torchft 0.2.0's clients send no
            token and work only in this mode).
        lighthouse_outage: what the group does while the lighthouse cannot be reached:
            ``LighthouseOutage.PREVIOUS_QUORUM`` (default) goes on committing steps on the
            group's previous quorum while that is sound (``outage.previous_quorum_round``;
            docs/lighthouse.md, "A lighthouse outage"), ``WAIT`` waits for it as torchft 0.2.0
            does.
        group_key: this replica group's key, a secret only its own ranks received at launch
            (``auth.group_key``). When set, ``Quorum`` and ``ShouldCommit`` must also carry it
            (UNAUTHENTICATED otherwise; ``ManagerClient`` sends it), so a process of another
            group that holds the job token cannot act for this group's ranks. Default
            ``None``: ``$TORCHFT_GROUP_KEY`` if set, else none.

    Raises:
        ValueError: an argument is out of range.
        AddressInUseError: the port of ``bind`` is taken.
        RuntimeError: ``bind`` cannot be listened on for another reason.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str | None = None,
        bind: str = "[::]:0",
        *,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int = 0,
        auth_token: str | None = None,
        lighthouse_outage: LighthouseOutage = LighthouseOutage.PREVIOUS_QUORUM,
        group_key: str | None = None,
    ) -> None:
        if not replica_id:
            raise ValueError("replica_id must be a non-empty string")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {quorum_retries}")
        if heartbeat_interval <= timedelta(0):
            raise ValueError(f"heartbeat_interval must be positive, got {heartbeat_interval}")
        if not isinstance(lighthouse_outage, LighthouseOutage):
            raise ValueError(
                f"lighthouse_outage must be a LighthouseOutage, got {lighthouse_outage!r}"
            )
        check_token(auth_token, "auth_token")
        self._group_key = resolve_group_key(group_key)

        self._replica_id = replica_id
        self._lighthouse_addr = lighthouse_addr
        self._hostname = socket.gethostname() if hostname is None else hostname
        self._store_addr = store_addr
        self._world_size = world_size
        self._auth_token = auth_token

        # Only touched on the event-loop thread.
        self._rounds = GroupRounds(replica_id, world_size)
        # The in-process rank's (group rank 0's) latest quorum call: whichever rank's call asks
        # the lighthouse, that call ends with the request (LocalContext.answered_by).
        self._local_call: LocalContext | None = None
        self._round_ends: dict[int, asyncio.Future[Any]] = {}
        """round number -> what its waiting calls get (created by the first to wait)."""
        self._forming_changed: asyncio.Future[None] | None = None
        """Done when the forming quorum round changes (held calls wait for it)."""
        self._impostors = RefusalLog(f"the manager server of replica {replica_id!r}")
        self._thread = ServerThread(f"manager-server-{replica_id}")
        self._loop = self._thread.loop
        self._tasks: set[asyncio.Task[None]] = set()
        self._blocking = DaemonThreads("manager-blocking-call")

        self._closed = False
        self._lighthouse = LighthouseClient(lighthouse_addr, connect_timeout, auth_token)
        """The heartbeat stream's and the link probe's client (their own threads)."""
        self._prober = LinkProber(self._lighthouse, replica_id)
        self._quorums = LighthouseQuorums(
            replica_id,
            store_addr,
            world_size,
            lighthouse_addr,
            auth_token,
            quorum_retries,
            lighthouse_outage,
            self._prober,
            self._blocking,
            breaks=lambda: self._heartbeat.breaks,
        )
        """Quorum requests, on this server's event loop (opened there by ``_start``)."""
        self._server: aio.Server | None = None
        self._guard: ConnectionGuard | None = None
        try:
            self._port = self._thread.start(lambda: self._start(bind))
        except BaseException:
            self._prober.close()
            self._lighthouse.close()
            raise
        try:
            self._heartbeat = self._lighthouse.heartbeat_stream(
                replica_id, interval=heartbeat_interval
            )
        except BaseException:
            self._closed = True
            self._thread.stop(self._stop)
            self._prober.close()
            self._lighthouse.close()
            raise
        logger.info(
            "manager server of replica %s listening on %s (world_size=%d, lighthouse %s)",
            replica_id,
            self.address(),
            world_size,
            lighthouse_addr,
        )

    def address(self) -> str:
        """This server's URL, ``http://{hostname}:{port}``."""
        return f"http://{self._hostname}:{self._port}"

    def set_identity(self, identity: GroupIdentity) -> None:
        """What this group sends in ``QuorumMember.data`` from the next lighthouse request on,
        and checks the other members against (see the module doc)."""
        self._quorums.identity = identity

    def shutdown(self) -> None:
        """Stops serving (in-flight calls are cancelled) and leaves the lighthouse. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.close()
        self._thread.stop(self._stop)
        self._blocking.close()
        self._prober.close()
        self._lighthouse.close()
        logger.info("manager server of replica %s stopped", self._replica_id)

    async def _start(self, bind: str) -> int:
        cap = connection_cap(descriptor_limit())
        authenticated = AuthenticatedPeers()
        name = f"the manager server of replica {self._replica_id!r}"
        server = grpc_server(
            SERVICE,
            self._rpcs(),
            max_connections=cap,
            idle_connection_ms=_IDLE_CONNECTION_MS,
            auth_token=self._auth_token,
            group_key=self._group_key,
            server_name=name,
            authenticated=authenticated,
        )
        try:
            port = listen(server, bind)
        except CannotListen as e:
            if e.in_use:
                raise AddressInUseError(bind) from None
            raise RuntimeError(f"manager server cannot listen on {bind!r}: {e.problem}") from None
        await server.start()
        self._server = server
        self._quorums.open(f"http://{self._hostname}:{port}")
        self._guard = ConnectionGuard(
            port, GuardPolicy.for_cap(cap), authenticated, name, on_listed=self._listed
        )
        self._guard.start()
        return port

    async def _stop(self) -> None:
        if self._guard is not None:
            self._guard.stop()
        if self._server is not None:
            await self._server.stop(grace=None)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._quorums.close()

    def _listed(self, peers: frozenset[str], listed_at: float) -> None:
        """The guard's listing of this server's open connections (on the guard's thread):
        held Quorum calls decide again when it shows a rank's holder gone."""

        def apply() -> None:
            if self._rounds.connections_listed(peers | {LOCAL_PEER}, listed_at):
                self._changed()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
            self._loop.call_soon_threadsafe(apply)

    def _new_future(self) -> asyncio.Future[Any]:
        fut = self._loop.create_future()
        # Every waiter may have given up already; don't warn about an unretrieved error.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error(
                "replica %s: manager server task failed",
                self._replica_id,
                exc_info=(type(error), error, error.__traceback__),
            )

    def _rpcs(self) -> list[Rpc]:
        """``torchft.ManagerService``'s RPC table, requests parsed by ``rpc_server.parser``:
        every RPC needs the job token when one is set (``Kill`` is refused without one)."""
        quorum = unary(self.quorum, pb.ManagerQuorumRequest)
        vote = unary(self.should_commit, pb.ShouldCommitRequest)
        metadata = unary(self.checkpoint_metadata, pb.CheckpointMetadataRequest)
        kill = unary(self.kill, pb.KillRequest)
        # Quorum and ShouldCommit act for one of the group's ranks: the group's key too.
        # CheckpointMetadata: other groups' healers; Kill: the lighthouse.
        return [
            Rpc("Quorum", quorum, needs_token=True, needs_group_key=True),
            Rpc("ShouldCommit", vote, needs_token=True, needs_group_key=True),
            Rpc("CheckpointMetadata", metadata, needs_token=True, needs_group_key=False),
            Rpc("Kill", kill, needs_token=True, needs_group_key=False),
        ]

    # ---------------------------------------------------------------------------------- quorum

    async def _refuse(
        self, context: aio.ServicerContext, action: str, group_rank: int, refused: Refused
    ) -> NoReturn:
        """Aborts with PERMISSION_DENIED: this call may not ``action`` as ``group_rank``."""
        what = f"a call to {action} as group rank {group_rank}"
        bound = f"that rank is bound to {refused.bound_peer}"
        self._impostors.refused(peer_host(context.peer()), what, bound)
        await _abort(context, grpc.StatusCode.PERMISSION_DENIED, refused.reason)

    def _round_end(self, round: int) -> asyncio.Future[Any]:
        if round not in self._round_ends:
            self._round_ends[round] = self._new_future()
        return self._round_ends[round]

    def _changed(self) -> None:
        """The forming quorum round changed, or a holder is gone: held calls decide again."""
        fut, self._forming_changed = self._forming_changed, None
        if fut is not None:
            fut.set_result(None)

    async def _hold(self) -> None:
        """Waits until the forming quorum round changes or a holder is gone (``_changed``)."""
        if self._forming_changed is None:
            self._forming_changed = self._new_future()
        await asyncio.shield(self._forming_changed)

    def _end_round(self, round: int, outcome: Any) -> None:
        """Wakes the calls waiting for ``round`` with ``outcome`` (an exception: raised)."""
        fut = self._round_ends.pop(round, None)
        if fut is None:
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    async def quorum(
        self, request: pb.ManagerQuorumRequest | Malformed, context: aio.ServicerContext
    ) -> pb.ManagerQuorumResponse:
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        remaining = context.time_remaining()
        if remaining is None:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "ManagerService/Quorum requires a deadline (set a timeout on the call)",
            )
        group_rank = request.group_rank
        if (error := self._rounds.rank_error(group_rank)) is not None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)

        if isinstance(context, LocalContext):
            self._local_call = context
        call = Joined(
            group_rank=group_rank,
            peer=context.peer(),
            session=_session(context),
            step=request.step,
            shrink_only=request.shrink_only,
            commit_failures=request.commit_failures,
            checkpoint_metadata=request.checkpoint_metadata,
            init_sync=request.init_sync,
            progress=request.progress if request.HasField("progress") else None,
            reconfigure_handle=request.reconfigure_handle,
        )
        decision = self._rounds.join(call)
        self._changed()
        held = None
        while isinstance(decision, Held):
            held = decision
            try:
                await self._hold()
            except BaseException:  # cancelled: the caller gave up
                self._rounds.withdraw(held.round, call)
                self._changed()
                raise
            decision = self._rounds.retry(call, held.round)
            if not isinstance(decision, Held):  # counted (or refused): the round changed
                self._changed()
        if isinstance(decision, Refused):
            await self._refuse(context, "join the quorum", group_rank, decision)
        if held is not None:
            logger.warning(
                "replica %s: group rank %d taken over by the connection %s: the connection of "
                "the rank's client (%s) has closed",
                self._replica_id,
                group_rank,
                call.peer,
                held.bound_peer,
            )
        logger.debug(
            "replica %s: group rank %d joined quorum round (%d/%d)",
            self._replica_id,
            group_rank,
            len(decision.calls) if isinstance(decision, Ask) else decision.count,
            self._world_size,
        )
        if isinstance(decision, Ask):
            if held is not None:  # it waited: less time is left
                remaining = context.time_remaining() or 0.0
            budget = lighthouse_budget(remaining)
            self._spawn(self._run_lighthouse_quorum(decision, budget))
            if self._local_call is not None:  # it waits in this round: it ends with the request
                self._local_call.answered_by(asyncio.get_running_loop().time() + budget)
        end = self._round_end(decision.round)
        try:
            outcome: QuorumOutcome = await asyncio.shield(end)
        except RpcFailure as e:
            await _abort(context, e.code, e.details)
        finally:
            self._rounds.withdraw(decision.round, call)  # counts only while the round forms
            self._changed()

        answer = outcome.answer(call)
        if isinstance(answer, ValueError):
            await _abort(context, grpc.StatusCode.INTERNAL, str(answer))
        if (session := outcome.sessions.get(call)) is not None:
            context.set_trailing_metadata(((SESSION_METADATA, session),))
        if answer.heal:
            logger.info(
                "replica %s group rank %d: heals from replica rank %s (step %d -> max_step %d)",
                self._replica_id,
                group_rank,
                answer.recover_src_replica_rank,
                request.step,
                answer.max_step,
            )
        return answer.to_proto()

    async def _run_lighthouse_quorum(self, ask: Ask, budget_s: float) -> None:
        """Asks the lighthouse for quorum round ``ask``, records the ranks that succeeded and
        wakes the round's calls (with an ``RpcFailure`` if it failed)."""
        outcome: QuorumOutcome | RpcFailure = RpcFailure(
            grpc.StatusCode.UNAVAILABLE,
            f"manager server of replica {self._replica_id!r} stopped or failed "
            "while asking the lighthouse for a quorum; see its log",
        )
        try:
            outcome = await self._quorums.ask(ask, budget_s)
        except RpcFailure as e:
            log = logger.error if e.code is grpc.StatusCode.FAILED_PRECONDITION else logger.warning
            log("replica %s: %s", self._replica_id, e.details)
            outcome = e
        finally:  # also when cancelled by shutdown, or on an unexpected error
            answers = outcome.answers if isinstance(outcome, QuorumOutcome) else {}
            succeeded = [c.group_rank for c, a in answers.items() if isinstance(a, QuorumResult)]
            sessions = self._rounds.finish_quorum(ask.round, succeeded, time.monotonic())
            if isinstance(outcome, QuorumOutcome):
                issued = {ask.calls[rank]: session for rank, session in sessions.items()}
                outcome = dataclasses.replace(outcome, sessions=issued)
            self._end_round(ask.round, outcome)

    # ------------------------------------------------------------------- checkpoint metadata

    async def checkpoint_metadata(
        self, request: pb.CheckpointMetadataRequest | Malformed, context: aio.ServicerContext
    ) -> pb.CheckpointMetadataResponse:
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        while isinstance(answer := self._rounds.checkpoint_metadata(request.rank), Waiting):
            # The rank's first quorum is with the lighthouse: its metadata comes when it ends.
            with contextlib.suppress(RpcFailure):
                await asyncio.shield(self._round_end(answer.round))
        if isinstance(answer, Unknown):
            await _abort(context, grpc.StatusCode.NOT_FOUND, answer.reason)
        return pb.CheckpointMetadataResponse(checkpoint_metadata=answer.checkpoint_metadata)

    # ---------------------------------------------------------------------------- should_commit

    async def should_commit(
        self, request: pb.ShouldCommitRequest | Malformed, context: aio.ServicerContext
    ) -> pb.ShouldCommitResponse:
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        group_rank, step = request.group_rank, request.step
        if (error := self._rounds.rank_error(group_rank)) is not None:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        ballot = Ballot(group_rank, step, request.should_commit, context.peer(), _session(context))
        decision = self._rounds.vote(ballot)
        if isinstance(decision, Refused):
            await self._refuse(context, "vote", group_rank, decision)
        if isinstance(decision, Decided):
            logger.info(
                "replica %s: step %d should_commit=%s (votes %s)",
                self._replica_id,
                step,
                decision.should_commit,
                dict(decision.votes),
            )
            self._end_round(decision.round, decision.should_commit)
            return pb.ShouldCommitResponse(should_commit=decision.should_commit)
        end = self._round_end(decision.round)
        try:
            should_commit = await asyncio.shield(end)
        finally:
            if not end.done() and self._rounds.withdraw_vote(decision.round, ballot):
                del self._round_ends[decision.round]
        return pb.ShouldCommitResponse(should_commit=should_commit)

    # ------------------------------------------------------------------------------------ kill

    async def kill(
        self, request: pb.KillRequest | Malformed, context: aio.ServicerContext
    ) -> pb.KillResponse:
        # With a token, TokenInterceptor has already refused calls without it.
        if self._auth_token is None:
            await _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"Kill is disabled on the manager server of replica {self._replica_id!r}: "
                "no auth_token is configured",
            )
        if isinstance(request, Malformed):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        logger.warning(
            "replica %s: killed on request from %s: %s",
            self._replica_id,
            context.peer(),
            request.msg,
        )
        # Exit once the reply is on its way; the timer covers a callback that never runs.
        context.add_done_callback(lambda _: _exit_process())
        self._loop.call_later(_KILL_EXIT_FALLBACK_S, _exit_process)
        return pb.KillResponse()


def connection_cap(fd_limit: int) -> int:
    """How many connections the ManagerServer accepts with ``fd_limit`` file descriptors.

    Its callers are the group's ranks, one healing rank per group rank of each group that
    heals, and the lighthouse's kill: far fewer than 1024. It shares the process with the
    training (gloo, TCPStore, data loaders), so it takes at most a quarter of the descriptors.
    """
    return max(16, min(1024, countable_descriptors(fd_limit) // 4))


def _exit_process() -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def _session(context: aio.ServicerContext) -> str | None:
    """The session a call presented (``Joined.session``)."""
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA and isinstance(value, str):
            return value
    return None


async def _abort(context: aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: ServicerContext.abort() raises")
