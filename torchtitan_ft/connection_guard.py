"""The connection guard of the job's gRPC servers: connections that never make an
authenticated call get a short life, so a flood of them cannot hold the connection cap.

gRPC's cap (``grpc.max_allowed_incoming_connections``) refuses newcomers once full and cannot
evict anyone; its idle timeout counts any call, refused ones too. A stranger who completes the
HTTP/2 handshake and sends one refused call now and then would hold a slot for as long as it
likes, and enough of them lock the job's own clients out (issue 20, N2 and N3).

Pieces:

- ``MarkingInterceptor`` records the peer (``context.peer()``, the client's address) of every
  call that reaches its handler: behind the ``auth.TokenInterceptor``, only calls that carried
  the job token do; without a token, any call to one of the server's methods.
- ``ConnectionGuard``, a thread, lists the server's own connections every ``period_s``
  (``server_connections``: the process's socket descriptors connected on the server's port),
  asks ``connections_to_close`` which to end, and shuts those sockets down; gRPC then drops the
  connection and frees its slot.

``connections_to_close`` is the policy, pure: a connection whose peer never made an
authenticated call is closed once older than ``unauthenticated_life_s``; beyond
``cap - reserve`` connections, the oldest such connections are closed at once, so that the
last ``reserve`` slots stay for the job's clients. A connection that made an authenticated
call is never closed by the guard (gRPC's idle timeout still applies to it).
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

logger = logging.getLogger(__name__)

PERIOD_S = 0.25
"""How often the guard looks at the server's connections. A flood refilled faster than this
can fill the slots above the reserve between two looks (the guard then closes the newest
strangers' connections at the next one)."""
UNAUTHENTICATED_LIFE_S = 3.0
"""How long a connection may stay without an authenticated call. The job's clients call as
soon as they connect (a ``ManagerClient`` that waited for its channel and calls later is
reconnected by gRPC at that call)."""


class Reason(enum.Enum):
    """Why the guard closed a connection."""

    EXPIRED = "no authenticated call within its life"
    CROWDING = "the cap's reserve for the job's clients was reached"


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard allows.

    Args:
        cap: the server's connection cap (gRPC refuses connections beyond it).
        reserve: slots kept for connections that make authenticated calls: connections without
            one are closed, oldest first, while more than ``cap - reserve`` are open.
        unauthenticated_life_s: how long a connection may stay without an authenticated call.
    """

    cap: int
    reserve: int
    unauthenticated_life_s: float = UNAUTHENTICATED_LIFE_S

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"cap must be >= 1, got {self.cap}")
        if not 0 <= self.reserve < self.cap:
            raise ValueError(f"reserve must be in [0, cap={self.cap}), got {self.reserve}")
        if not self.unauthenticated_life_s > 0:
            raise ValueError(
                f"unauthenticated_life_s must be > 0 seconds, got {self.unauthenticated_life_s}"
            )

    @classmethod
    def for_cap(cls, cap: int) -> GuardPolicy:
        """The servers' policy for ``cap``: a quarter of it (at least one slot) in reserve."""
        return cls(cap=cap, reserve=max(1, cap // 4) if cap > 1 else 0)


@dataclass(frozen=True)
class Connection:
    """One of the server's connections as the guard sees it.

    Args:
        inode: the socket's inode (unique while the socket is open).
        peer: the client's address as gRPC names it (``ipv4:10.0.0.5:41234``).
        first_seen: when the guard first listed it (monotonic seconds).
        authenticated: whether a call from ``peer`` reached its handler.
    """

    inode: int
    peer: str
    first_seen: float
    authenticated: bool


def connections_to_close(
    connections: Sequence[Connection], now: float, policy: GuardPolicy
) -> list[tuple[Connection, Reason]]:
    """Which ``connections`` to close at ``now``, and why (see the module doc)."""
    strangers = sorted((c for c in connections if not c.authenticated), key=_age_order)
    expired = [c for c in strangers if now - c.first_seen >= policy.unauthenticated_life_s]
    young = strangers[len(expired) :]  # sorted oldest first: the expired come first
    excess = len(connections) - len(expired) - (policy.cap - policy.reserve)
    return [(c, Reason.EXPIRED) for c in expired] + [
        (c, Reason.CROWDING) for c in young[: max(0, excess)]
    ]


def _age_order(c: Connection) -> tuple[float, int]:
    return (c.first_seen, c.inode)


# ------------------------------------------------------------------------- who authenticated


class AuthenticatedPeers:
    """The peers whose calls reached a handler, with when they last did. Thread-safe: the
    server's loop marks, the guard reads and forgets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_call: dict[str, float] = {}

    def mark(self, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._last_call[peer] = now

    def snapshot(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._last_call)

    def forget_closed(self, open_peers: Iterable[str], listed_at: float) -> None:
        """Forgets the peers without an open connection at ``listed_at`` that made no call
        since (a call after the listing may come from a connection it missed)."""
        still_open = set(open_peers)
        with self._lock:
            for peer, last in list(self._last_call.items()):
                if peer not in still_open and last < listed_at:
                    del self._last_call[peer]


class MarkingInterceptor(grpc.aio.ServerInterceptor):
    """Marks the peer of every call that reaches its handler in ``peers``. Placed after the
    ``auth.TokenInterceptor``, which answers calls without the token itself."""

    def __init__(self, peers: AuthenticatedPeers) -> None:
        self._peers = peers

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        return None if handler is None else _marking(handler, self._peers.mark)


def _marking(handler: Any, mark: Callable[[str], None]) -> Any:
    """``handler`` with a behaviour that first marks the call's peer."""
    if handler.response_streaming:
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        behavior = getattr(handler, kind)

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            mark(context.peer())
            async for response in behavior(request, context):
                yield response

        return handler._replace(**{kind: streaming})
    kind = "stream_unary" if handler.request_streaming else "unary_unary"
    behavior = getattr(handler, kind)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        mark(context.peer())
        return await behavior(request, context)

    return handler._replace(**{kind: unary})


# ------------------------------------------------------------------------- the server's sockets


@dataclass(frozen=True)
class OpenConnection:
    """A socket of this process connected on the server's port: its descriptor (valid when
    listed; check ``inode`` before acting on it), inode and gRPC-style peer name."""

    fd: int
    inode: int
    peer: str


def grpc_peer(address: Any) -> str:
    """A socket's ``getpeername()`` as gRPC's ``context.peer()`` writes it: ``ipv4:H:P``,
    ``ipv6:[H]:P``; an IPv4-mapped IPv6 address as IPv4."""
    host, port = address[0], address[1]
    if ":" not in host:
        return f"ipv4:{host}:{port}"
    if host.lower().startswith("::ffff:") and "." in host:
        return f"ipv4:{host[7:]}:{port}"
    return f"ipv6:[{host}]:{port}"


PeerCache = dict[tuple[int, int], "str | None"]
"""(descriptor, inode) -> the socket's peer if it is one of the server's connections, else
None: what ``server_connections`` learnt about each socket (a socket's inode stays its own
while it is open, so only new sockets cost more than an ``fstat``)."""


def server_connections(
    port: int, cache: PeerCache | None = None, unexamined: list[int] | None = None
) -> list[OpenConnection]:
    """This process's TCP sockets connected on local ``port`` (the server's accepted
    connections; the listening socket has no peer). Linux only (``/proc/self/fd``). With
    ``cache``, sockets already in it are not asked again, and it is left holding the sockets
    seen now. A socket it could not examine (no descriptor left to duplicate it) is missing
    from the answer and, with ``unexamined``, appended there: the listing is then incomplete."""
    known = {} if cache is None else cache
    seen: PeerCache = {}
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            info = os.fstat(fd)
        except OSError:
            continue  # closed since the listing
        if not stat.S_ISSOCK(info.st_mode):
            continue
        key = (fd, info.st_ino)
        peer = known[key] if key in known else _peer_on_port(fd, port)
        if peer is _UNEXAMINED:
            if unexamined is not None:
                unexamined.append(fd)
            continue  # not cached: asked again next time
        seen[key] = peer
        if peer is not None:
            found.append(OpenConnection(fd, info.st_ino, peer))
    if cache is not None:
        cache.clear()
        cache.update(seen)
    return found


_UNEXAMINED = "unexamined"
"""What ``_peer_on_port`` answers for a socket it could not duplicate."""


def _peer_on_port(fd: int, port: int) -> str | None:
    try:
        dup = os.dup(fd)
    except OSError:
        return _UNEXAMINED
    with socket.socket(fileno=dup) as s:
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            if s.type != socket.SOCK_STREAM or s.getsockname()[1] != port:
                return None
            return grpc_peer(s.getpeername())
        except OSError:
            return None  # not connected (the listening socket), or closed meanwhile


def close_connection(connection: OpenConnection) -> bool:
    """Shuts ``connection`` down if its descriptor still holds the same socket (a descriptor
    closed and reused since the listing is left alone); whether it did."""
    try:
        dup = os.dup(connection.fd)
    except OSError:
        return False
    with socket.socket(fileno=dup) as s:
        if os.fstat(dup).st_ino != connection.inode:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------- the guard thread


class ConnectionGuard:
    """Closes the connections ``connections_to_close`` picks among those of the server on
    ``port``, every ``period_s``, on a daemon thread of its own.

    Args:
        port: the server's port.
        policy: what it allows.
        peers: who authenticated (fed by a ``MarkingInterceptor`` on the server).
        name: names the server in the log and the thread.
        period_s: how often it looks.
        on_listed: called (on the guard's thread) after each look that examined every socket
            with the peers of the connections open at that look, and the monotonic time it
            began (a connection missing there has closed).
    """

    def __init__(
        self,
        port: int,
        policy: GuardPolicy,
        peers: AuthenticatedPeers,
        name: str,
        period_s: float = PERIOD_S,
        on_listed: Callable[[frozenset[str], float], None] | None = None,
    ) -> None:
        self._port = port
        self._policy = policy
        self._peers = peers
        self._name = name
        self._period_s = period_s
        self._on_listed = on_listed
        self._first_seen: dict[int, float] = {}
        self._sockets: PeerCache = {}
        self._stop = threading.Event()
        self.closed = {reason: 0 for reason in Reason}
        """How many connections it closed, per reason."""
        self._thread = threading.Thread(target=self._run, name=f"{name} guard", daemon=True)

    def start(self) -> None:
        if not os.path.isdir("/proc/self/fd"):
            logger.info("%s: no /proc/self/fd, connections are not guarded", self._name)
            return
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._period_s):
            try:
                self.look()
                failing = False
            except OSError as e:  # /proc unreadable (descriptors exhausted): try again later
                if not failing:
                    logger.warning("%s: cannot list its connections: %s", self._name, e)
                failing = True

    def look(self) -> None:
        """One pass: list the connections, close those the policy picks, report the rest."""
        listed_at = time.monotonic()
        unexamined: list[int] = []
        open_now = server_connections(self._port, self._sockets, unexamined)
        self._first_seen = {c.inode: self._first_seen.get(c.inode, listed_at) for c in open_now}
        self._peers.forget_closed((c.peer for c in open_now), listed_at)
        authenticated = self._peers.snapshot()
        by_inode = {c.inode: c for c in open_now}
        seen = [
            Connection(c.inode, c.peer, self._first_seen[c.inode], c.peer in authenticated)
            for c in open_now
        ]
        for connection, reason in connections_to_close(seen, listed_at, self._policy):
            if connection.peer in self._peers.snapshot():
                continue  # its first call arrived meanwhile
            if close_connection(by_inode[connection.inode]):
                self._count(reason)
                del by_inode[connection.inode]
        if self._on_listed is not None and not unexamined:
            self._on_listed(frozenset(c.peer for c in by_inode.values()), listed_at)

    def _count(self, reason: Reason) -> None:
        if sum(self.closed.values()) == 0:
            logger.info(
                "%s closed a connection: %s (connections that make no authenticated call "
                "are closed after %.0f s; further closes are counted, not logged)",
                self._name,
                reason.value,
                self._policy.unauthenticated_life_s,
            )
        self.closed[reason] += 1
