"""The lighthouse's client, with two faces over one call layer (``_LighthouseCalls``: the
channel options and token, the quorum request and its answer, the stream-or-unary fallback,
the retry rule and the errors):

- ``LighthouseClient`` (blocking): quorum requests, over a held-open ``QuorumStream`` with a
  fallback to unary ``Quorum`` (torchft's lighthouse), heartbeats, the ``GoneMembers`` long
  poll of the hung-peer watch, the link probe (``manager.linkprobe``), and the held-open
  heartbeat stream (``HeartbeatStream``);
- ``AsyncLighthouseClient``: the same quorum requests on the ManagerServer's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

import grpc
from grpc import aio

from torchtitan_ft.auth import grpc_metadata, resolve_token
from torchtitan_ft.deadlines import DEADLINES
from torchtitan_ft.lighthouse.types import GroupSpeed, Quorum, QuorumMember, StateLoss
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.proto import torchft_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Reach a restarted server within ~100 ms instead of gRPC's default 1 s..120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]
"""gRPC channel options for every client of the lighthouse and manager servers."""

_RETRY_SLEEP_S = 0.05
_STATE_POLL_S = 0.01
"""How often ``AsyncLighthouseClient.wait_unreachable`` looks at the channel's state."""


def grpc_target(addr: str) -> str:
    """``http://host:port`` (or a bare ``host:port``) as a gRPC target."""
    for scheme in ("http://", "https://"):
        if addr.startswith(scheme):
            return addr[len(scheme) :]
    return addr


class StreamFailure(enum.Enum):
    """What a quorum request does when it failed on the held-open stream
    (``_LighthouseCalls._stream_failed``)."""

    UNARY_FROM_NOW_ON = "unary_from_now_on"
    """UNIMPLEMENTED: torchft's lighthouse has no ``QuorumStream``; unary calls from now on."""
    UNARY_THIS_TIME = "unary_this_time"
    """INTERNAL: grpc.aio reports a stream that the lighthouse ended (a refused token) while
    the request was being written as INTERNAL, hiding the real status; a unary call gets it
    (and the stream is tried again on the next request)."""
    RAISE = "raise"
    """Any other status: the request's error (``_after_failure`` decides on a retry)."""


def stream_failure(code: grpc.StatusCode) -> StreamFailure:
    """What a quorum request that failed on the held-open stream with ``code`` does (pure)."""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return StreamFailure.UNARY_FROM_NOW_ON
    if code == grpc.StatusCode.INTERNAL:
        return StreamFailure.UNARY_THIS_TIME
    return StreamFailure.RAISE


class _LighthouseCalls:
    """What both faces of the client share: the address, the token's metadata, whether the
    lighthouse has ``QuorumStream``, and the rules of a quorum request (``_stream_failed``;
    ``_quorum_request``, ``_after_failure``, ``_pause`` and ``_quorum_answer`` below)."""

    def __init__(self, addr: str, auth_token: str | None) -> None:
        self.addr = addr
        self._metadata = grpc_metadata(resolve_token(auth_token))
        self._stream_supported = True

    def _stream_failed(self, e: grpc.RpcError) -> None:
        """After a quorum request failed on the held-open stream with ``e``: returns when the
        request is to be made as a unary call (``stream_failure``), raises ``e`` otherwise."""
        failure = stream_failure(e.code())
        if failure is StreamFailure.RAISE:
            raise e
        if failure is StreamFailure.UNARY_FROM_NOW_ON:
            self._stream_supported = False


class LighthouseClient(_LighthouseCalls):
    """A client of a lighthouse (ours or torchft's).

    Args:
        addr: the lighthouse URL, ``http://host:port``.
        connect_timeout: how long ``heartbeat`` waits for the lighthouse to accept a
            connection before raising ``TimeoutError``.
        auth_token: the job token, sent with every call (``authorization: Bearer <token>``)
            when set. A lighthouse with a token refuses calls without it (``PermissionError``);
            one without a token (ours or torchft's) ignores it. Default None:
            ``$TORCHFT_AUTH_TOKEN`` if set, else none sent.

    Raises:
        ValueError: ``auth_token`` is not a token a server could check (``auth.check_token``).
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        auth_token: str | None = None,
    ) -> None:
        super().__init__(addr, auth_token)
        self._connect_timeout = connect_timeout.total_seconds()
        self._channel = grpc.insecure_channel(grpc_target(addr), options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.LighthouseServiceStub(self._channel)
        self._stream: _QuorumStream | None = None
        self._stream_lock = threading.Lock()

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: dict[str, Any] | None = None,
        commit_failures: int = 0,
    ) -> Quorum:
        """Asks for the next quorum and waits until one containing ``replica_id`` is issued.

        Retries while the lighthouse is unreachable (for example restarting) until ``timeout``;
        raises ``TimeoutError`` then, ``ValueError`` when the lighthouse rejects the request,
        ``PermissionError`` when it refuses this client's token (or its lack of one).
        """
        quorum, _ = self.quorum_with_speeds(
            replica_id,
            timeout,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=data,
            commit_failures=commit_failures,
        )
        return quorum

    def quorum_with_speeds(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: dict[str, Any] | None = None,
        commit_failures: int = 0,
        progress: pb.GroupProgress | None = None,
        reconfigure_handles: Sequence[str] = (),
    ) -> tuple[Quorum, dict[str, GroupSpeed]]:
        """``quorum``, sending the group's recent step timings (``progress``) and its ranks'
        process-group handles (``reconfigure_handles``, group-rank order; torchft 0.2.0's
        lighthouse drops them), and returning the groups' speeds as the lighthouse judges them
        too (none from torchft's lighthouse).
        """
        request = _quorum_request(
            replica_id,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=data,
            commit_failures=commit_failures,
            progress=progress,
            reconfigure_handles=reconfigure_handles,
        )
        deadline = time.monotonic() + timeout.total_seconds()
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                response = self._ask(request, remaining)
                if response is not None:
                    return _quorum_answer(response)
            except grpc.RpcError as e:
                if _after_failure(e, self.addr, timeout) is _Retry.AFTER_PAUSE:
                    time.sleep(_pause(deadline - time.monotonic()))
        raise _no_quorum(self.addr, timeout)

    def _ask(
        self, request: pb.LighthouseQuorumRequest, timeout: float
    ) -> pb.LighthouseQuorumResponse | None:
        """One quorum request: over the held-open ``QuorumStream`` when this lighthouse has it
        and no other thread of this client is using it, else (or after ``_stream_failed``) a
        unary ``Quorum`` call. None when ``timeout`` (seconds) passed without an answer."""
        if self._stream_supported and self._stream_lock.acquire(blocking=False):
            try:
                if self._stream is None:
                    self._stream = _QuorumStream(self._stub, self._metadata)
                try:
                    return self._stream.ask(request, timeout)
                except grpc.RpcError as e:
                    self._stream_failed(e)
            finally:
                if self._stream is not None and self._stream.broken:
                    self._stream.close()
                    self._stream = None
                self._stream_lock.release()
        return self._stub.Quorum(
            request, timeout=timeout, metadata=self._metadata, wait_for_ready=True
        )

    def heartbeat(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Sends one unary heartbeat (what torchft clients do)."""
        wait = min(timeout.total_seconds(), self._connect_timeout)
        try:
            self._stub.Heartbeat(
                pb.LighthouseHeartbeatRequest(replica_id=replica_id),
                timeout=wait,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            _raise_for(e, self.addr, timedelta(seconds=wait))

    def gone_members(
        self, replica_id: str, members: list[str], wait: timedelta, wait_for_ready: bool = True
    ) -> grpc.Future:
        """Asks which of ``members`` (the other groups of ``replica_id``'s quorum) the
        lighthouse knows to be gone, waiting up to ``wait`` for one to be (torchtitan_ft
        extension; see the proto). ``wait`` 0 answers at once and counts as a heartbeat of
        ``replica_id``. Returns the call: ``result()`` is a ``LighthouseGoneResponse`` or
        raises ``grpc.RpcError`` (UNIMPLEMENTED from torchft's lighthouse); ``cancel()`` ends
        the wait. ``wait_for_ready`` False: a lighthouse that cannot be reached fails the call
        at once (UNAVAILABLE) instead of being waited for up to the connect timeout."""
        request = pb.LighthouseGoneRequest(
            replica_id=replica_id, members=members, wait_ms=round(wait.total_seconds() * 1000)
        )
        return self._stub.GoneMembers.future(
            request,
            timeout=wait.total_seconds() + self._connect_timeout,
            metadata=self._metadata,
            wait_for_ready=wait_for_ready,
        )

    def link_probe(self, replica_id: str, size: int, timeout: float) -> grpc.Future:
        """Sends ``size`` zero bytes to the lighthouse's ``LinkProbe`` for ``replica_id``
        (torchtitan_ft extension; see the proto and ``manager.linkprobe``) within ``timeout``
        seconds. Returns the call: ``result()`` is a ``LinkProbeResponse`` or raises
        ``grpc.RpcError`` (UNIMPLEMENTED from torchft's lighthouse); ``cancel()`` ends it."""
        request = pb.LinkProbeRequest(replica_id=replica_id, payload=bytes(size))
        return self._stub.LinkProbe.future(request, timeout=timeout, metadata=self._metadata)

    def heartbeat_stream(
        self,
        replica_id: str,
        interval: timedelta = timedelta(milliseconds=100),
        group_rank: int = 0,
    ) -> HeartbeatStream:
        """Opens a held-open heartbeat stream: the lighthouse drops ``replica_id`` as soon as
        it ends (process death). Reconnects in the background; ``close()`` ends it.

        ``group_rank`` > 0: the stream of that group rank of ``replica_id`` (not its group's
        heartbeat): while it is silent for the heartbeat timeout, our lighthouse counts the
        group as gone (a rank hung inside it). torchft's lighthouse has no such stream: then
        it ends without a fallback (a unary heartbeat would count for the whole group)."""
        return HeartbeatStream(
            self._stub, replica_id, interval.total_seconds(), self._metadata, group_rank
        )

    def close(self) -> None:
        # Without the stream lock: a quorum waiting on the stream in another thread holds it.
        # Cancelling the stream ends that wait (as closing the channel ends a unary call).
        stream = self._stream
        if stream is not None:
            stream.close()
        self._channel.close()


class AsyncLighthouseClient(_LighthouseCalls):
    """``LighthouseClient.quorum_with_speeds`` for a caller on an asyncio event loop (the
    ManagerServer's): grpc.aio on that loop, so a request and its answer cross no other
    thread. (The sync client hands each request to gRPC's thread that feeds the stream, and
    its caller needs a thread of its own: three thread hand-offs per quorum, about a third of
    a quorum round trip on loopback, docs/performance.md.) Same requests, retries, errors and
    fallback to unary calls (torchft's lighthouse) as ``LighthouseClient``.

    Create, use and ``close`` it on one running event loop.

    Args:
        addr: the lighthouse URL, ``http://host:port``.
        auth_token: as ``LighthouseClient``'s.

    Raises:
        ValueError: ``auth_token`` is not a token a server could check (``auth.check_token``).
    """

    def __init__(self, addr: str, auth_token: str | None = None) -> None:
        super().__init__(addr, auth_token)
        self._channel = aio.insecure_channel(grpc_target(addr), options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.LighthouseServiceStub(self._channel)
        self._stream: aio.StreamStreamCall | None = None
        self._stream_busy = False

    async def quorum_with_speeds(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: dict[str, Any] | None = None,
        commit_failures: int = 0,
        progress: pb.GroupProgress | None = None,
        reconfigure_handles: Sequence[str] = (),
    ) -> tuple[Quorum, dict[str, GroupSpeed]]:
        """As ``LighthouseClient.quorum_with_speeds``."""
        request = _quorum_request(
            replica_id,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=data,
            commit_failures=commit_failures,
            progress=progress,
            reconfigure_handles=reconfigure_handles,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout.total_seconds()
        while deadline - loop.time() > 0:
            try:
                response = await self._ask(request, deadline)
                if response is not None:
                    return _quorum_answer(response)
            except grpc.RpcError as e:
                if _after_failure(e, self.addr, timeout) is _Retry.AFTER_PAUSE:
                    await asyncio.sleep(_pause(deadline - loop.time()))
        raise _no_quorum(self.addr, timeout)

    async def _ask(
        self, request: pb.LighthouseQuorumRequest, deadline: float
    ) -> pb.LighthouseQuorumResponse | None:
        """As ``LighthouseClient._ask`` (``deadline`` on the loop's clock): on the held-open
        stream unless another request of this client is on it."""
        loop = asyncio.get_running_loop()
        if self._stream_supported and not self._stream_busy:
            self._stream_busy = True
            try:
                return await self._ask_on_stream(request, deadline - loop.time())
            except grpc.RpcError as e:
                self._stream_failed(e)
            finally:
                self._stream_busy = False
        return await self._stub.Quorum(
            request,
            timeout=max(deadline - loop.time(), 0.0),
            metadata=self._metadata,
            wait_for_ready=True,
        )

    async def _ask_on_stream(
        self, request: pb.LighthouseQuorumRequest, timeout: float
    ) -> pb.LighthouseQuorumResponse | None:
        """The next response on the held-open ``QuorumStream`` (opened if there is none), or
        None after ``timeout`` seconds. A request that fails or times out ends the call (gRPC
        has no deadline per message); the next request opens a new one."""
        if self._stream is None or self._stream.done():
            self._stream = self._stub.QuorumStream(metadata=self._metadata, wait_for_ready=True)
        call = self._stream
        try:
            async with asyncio.timeout(timeout):
                await call.write(request)
                response = await call.read()
        except TimeoutError:
            self._drop_stream(call)
            return None
        except BaseException:
            self._drop_stream(call)
            raise
        if response is aio.EOF:  # the lighthouse ended the call without an error
            self._drop_stream(call)
            raise _Ended()
        return response

    def _drop_stream(self, call: aio.StreamStreamCall) -> None:
        call.cancel()
        if self._stream is call:
            self._stream = None

    async def wait_unreachable(self) -> None:
        """Returns once the lighthouse is unreachable: the channel's last connection attempt
        failed (gRPC's TRANSIENT_FAILURE; a request waiting for it then waits for a reconnect,
        tried every 0.1 s to 1 s). Returns at once if it is so already; cancel it to stop.

        It looks every ``_STATE_POLL_S``: grpc.aio's ``wait_for_state_change`` would leave a
        watch without deadline in gRPC's core for every cancelled wait (one per quorum round
        while the channel stays READY)."""
        unreachable = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        while self._channel.get_state(try_to_connect=False) is not unreachable:
            await asyncio.sleep(_STATE_POLL_S)

    async def close(self) -> None:
        """Ends the stream and the channel (a request waiting on them fails)."""
        if self._stream is not None:
            self._drop_stream(self._stream)
        await self._channel.close()


class _Retry(enum.Enum):
    """What a quorum request does after a failed attempt (``_after_failure``)."""

    AFTER_PAUSE = "after_pause"
    """The lighthouse is unreachable (restarting, say): ask again after a short pause."""
    AT_ONCE = "at_once"
    """The attempt's own deadline passed: ask again at once while time is left."""


def _after_failure(e: grpc.RpcError, addr: str, timeout: timedelta) -> _Retry:
    """How a quorum request within ``timeout`` goes on after ``e``; raises the error its
    caller gets (``_raise_for``) when it does not."""
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return _Retry.AFTER_PAUSE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return _Retry.AT_ONCE
    _raise_for(e, addr, timeout)


def _pause(left_s: float) -> float:
    """The pause before asking an unreachable lighthouse again, ``left_s`` before the
    request's deadline."""
    return min(_RETRY_SLEEP_S, max(0.0, left_s))


def _quorum_request(
    replica_id: str,
    *,
    address: str,
    store_address: str,
    step: int,
    world_size: int,
    shrink_only: bool,
    data: dict[str, Any] | None,
    commit_failures: int,
    progress: pb.GroupProgress | None,
    reconfigure_handles: Sequence[str],
) -> pb.LighthouseQuorumRequest:
    member = QuorumMember(
        replica_id=replica_id,
        address=address,
        store_address=store_address,
        step=step,
        world_size=world_size,
        shrink_only=shrink_only,
        data=data,
        commit_failures=commit_failures,
        reconfigure_handles=tuple(reconfigure_handles),
    )
    return pb.LighthouseQuorumRequest(requester=member.to_proto(), progress=progress)


def _quorum_answer(response: pb.LighthouseQuorumResponse) -> tuple[Quorum, dict[str, GroupSpeed]]:
    speeds = {s.replica_id: GroupSpeed.from_proto(s) for s in response.speeds}
    quorum = Quorum.from_proto(response.quorum)
    if response.HasField("state_loss"):
        quorum = dataclasses.replace(quorum, state_loss=StateLoss.from_proto(response.state_loss))
    return quorum, speeds


def _no_quorum(addr: str, timeout: timedelta) -> TimeoutError:
    return TimeoutError(
        f"no quorum from the lighthouse at {addr} within {timeout}; is it running, "
        "and are at least min_replicas replica groups asking?"
    )


class _QuorumStream:
    """A held-open ``QuorumStream`` call: one quorum request at a time, each answered by the
    next response message.

    A round then costs the lighthouse one message each way per replica instead of a new call
    (see docs/performance.md, Lighthouse). A request that times out cancels the whole call
    (gRPC has no deadline per message); the next request opens a new one.
    """

    def __init__(self, stub: pb_grpc.LighthouseServiceStub, metadata: tuple) -> None:
        self._requests: queue.SimpleQueue[pb.LighthouseQuorumRequest | None] = queue.SimpleQueue()
        self._call = stub.QuorumStream(
            iter(self._requests.get, None), metadata=metadata, wait_for_ready=True
        )
        self.broken = False
        """The call failed, ended or was cancelled: open a new one for the next request."""
        # A client dropped without close() must not leave the call open (and gRPC's thread
        # that feeds it blocked on the queue): end both when this object goes away.
        self.close = weakref.finalize(self, _end_stream, self._requests, self._call)

    def ask(
        self, request: pb.LighthouseQuorumRequest, timeout: float
    ) -> pb.LighthouseQuorumResponse | None:
        """The response to ``request``, or None after ``timeout`` seconds (the call is then
        cancelled). Raises ``grpc.RpcError`` when the call fails; UNAVAILABLE when the
        lighthouse ended it without an error."""
        self._requests.put(request)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self._call.cancel()

        cancel_expiry = DEADLINES.schedule(timeout, expire)
        try:
            return next(self._call)
        except StopIteration:
            self.broken = True
            raise _Ended() from None
        except grpc.RpcError:
            self.broken = True
            if expired.is_set():
                return None
            raise
        finally:
            cancel_expiry()
            # The deadline may have fired just as the answer came: the call is cancelled then.
            self.broken = self.broken or expired.is_set()


def _end_stream(requests: queue.SimpleQueue, call: grpc.Call) -> None:
    requests.put(None)
    call.cancel()


class _Ended(grpc.RpcError):
    """The lighthouse closed a ``QuorumStream`` without an error (it is shutting down)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the lighthouse ended the quorum stream"


CLOSE_WAIT_S = 1.0
"""How long ``HeartbeatStream.close`` waits for the lighthouse to answer the stream it ended."""


class HeartbeatStream:
    """A background thread keeping one ``HeartbeatStream`` RPC open, reconnecting on failure.

    Against a lighthouse without the stream RPC (torchft's answers UNIMPLEMENTED) it falls
    back to a unary ``Heartbeat`` every interval, so the replica still counts as healthy there.
    """

    def __init__(
        self,
        stub: pb_grpc.LighthouseServiceStub,
        replica_id: str,
        interval: float,
        metadata: tuple[tuple[str, str], ...] = (),
        group_rank: int = 0,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {interval}")
        if group_rank < 0:
            raise ValueError(f"group_rank must be >= 0, got {group_rank}")
        self._group_rank = group_rank
        self._stub = stub
        self._metadata = metadata
        self._refused = False
        self._replica_id = replica_id
        self._interval = interval
        self._closed = threading.Event()
        self._goodbye = False
        self._call: grpc.Future | None = None
        self._lock = threading.Lock()
        self.breaks = 0
        """How many times the stream broke (the lighthouse went away, restarted, or dropped
        the connection) and was opened again."""
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{replica_id}", daemon=True
        )
        self._thread.start()

    def _requests(self):
        request = pb.LighthouseHeartbeatRequest(
            replica_id=self._replica_id, group_rank=self._group_rank
        )
        while not self._closed.is_set():
            yield request
            self._closed.wait(self._interval)
        if self._goodbye:
            yield pb.LighthouseHeartbeatRequest(
                replica_id=self._replica_id, group_rank=self._group_rank, goodbye=True
            )

    def _run(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                if self._closed.is_set():
                    return
                self._call = self._stub.HeartbeatStream.future(
                    self._requests(), metadata=self._metadata, wait_for_ready=True
                )
            try:
                self._call.result()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    if self._group_rank == 0:
                        self._run_unary()
                    return
                self._log_break(e)
            except grpc.FutureCancelledError:
                return
            self.breaks += 1
            self._closed.wait(self._interval)

    def _log_break(self, e: grpc.RpcError) -> None:
        # A refused token is an operator's mistake: say so once (not at every reconnect), and
        # keep trying, so that the stream recovers once the lighthouse has the same token.
        refused = e.code() == grpc.StatusCode.UNAUTHENTICATED
        if refused and not self._refused:
            logger.error(
                "the lighthouse refused the heartbeats of %s: %s", self._replica_id, e.details()
            )
        elif not refused:
            logger.debug(
                "heartbeat stream of %s broke (%s); reconnecting", self._replica_id, e.code()
            )
        self._refused = refused

    def _run_unary(self) -> None:
        logger.info(
            "the lighthouse has no HeartbeatStream; %s sends unary heartbeats (a dead process "
            "is then noticed only after the lighthouse's heartbeat timeout)",
            self._replica_id,
        )
        request = pb.LighthouseHeartbeatRequest(replica_id=self._replica_id)
        while not self._closed.wait(self._interval):
            try:
                self._stub.Heartbeat(
                    request, timeout=max(1.0, 5 * self._interval), metadata=self._metadata
                )
            except grpc.RpcError as e:
                logger.debug("heartbeat of %s failed: %s", self._replica_id, e.code())

    def close(self) -> None:
        """Ends the stream (the lighthouse then drops the replica) and stops the thread. The
        stream's last message says goodbye, so the lighthouse can tell a shutdown from a dead
        process; the call is cancelled only when the lighthouse's answer does not come within
        ``CLOSE_WAIT_S``."""
        with self._lock:
            self._goodbye = True
            self._closed.set()
            call = self._call
        if call is not None:
            ended = (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError)
            with contextlib.suppress(*ended):
                call.result(timeout=CLOSE_WAIT_S)
            call.cancel()
        self._thread.join(timeout=max(1.0, 2 * self._interval))


def _raise_for(e: grpc.RpcError, addr: str, timeout: timedelta) -> NoReturn:
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise TimeoutError(f"the lighthouse at {addr} did not answer within {timeout}") from e
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(f"the lighthouse at {addr} rejected the request: {e.details()}") from e
    if code == grpc.StatusCode.UNAUTHENTICATED:
        raise PermissionError(f"the lighthouse at {addr} refused this client: {e.details()}") from e
    raise RuntimeError(f"lighthouse at {addr}: {code.name}: {e.details()}") from e
