"""The job token: how servers check it and how clients present it.

One secret per job (``auth_token``), the same in every replica group and in the lighthouse. A
client presents it as ``authorization: Bearer <token>`` (gRPC metadata or an HTTP header); a
server compares in constant time. Without a configured token a server checks nothing, which is
what torchft 0.2.0's clients expect.

``TokenInterceptor`` checks the token of gRPC calls before the request is deserialized or any
handler runs, so a caller without it costs the server one metadata comparison.

A replica group may also have a *group key* (``TORCHFT_GROUP_KEY``): a secret that only the
group's own processes receive at launch. Its ManagerServer then also requires it on the calls
that act for one of its ranks (``Quorum``, ``ShouldCommit``: ``GroupKeyInterceptor``), so a
process of another group, which holds the job token but not this key, cannot act for this
group. A launcher derives each group's key with ``group_key`` from a secret of its own (not the
job token, which every process holds), so it keeps one secret and hands each group only its
key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import grpc

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "TORCHFT_AUTH_TOKEN"
"""The environment variable a component reads the job token from when it is given none: the
lighthouse CLI, the Manager, ``LighthouseClient``, ``ManagerClient`` and ``HTTPTransport``. It
is how a program written for torchft, whose API has no token argument, joins a job that has
one."""

GROUP_KEY_ENV = "TORCHFT_GROUP_KEY"
"""The environment variable the replica group's ``ManagerServer`` and ``ManagerClient`` read
the group key from when given none (unset or empty: no group key)."""

GROUP_KEY_METADATA = "torchtitan-ft-group-key"
"""The gRPC metadata key carrying the group key; sent only to the group's own ManagerServer."""

AUTHORIZATION = "authorization"
"""The gRPC metadata key (lower case, as gRPC requires) and HTTP header carrying the token."""

_MAX_LOGGED_PEERS = 1024


def bearer(token: str) -> str:
    """The ``authorization`` value presenting ``token``."""
    return f"Bearer {token}"


def presents(value: str | bytes | None, token: str) -> bool:
    """Whether an ``authorization`` value presents ``token`` (constant-time comparison).

    Compares bytes: a ``str`` value is encoded as UTF-8 (lone surrogates kept as their own
    bytes), so no two different values can encode alike, and ``token`` is visible ASCII
    (``check_token``), which only the exact value encodes to.
    """
    if value is None:
        return False
    given = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return hmac.compare_digest(given, bearer(token).encode("ascii"))


def resolve_token(token: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The job token: ``token`` if given, else ``$TORCHFT_AUTH_TOKEN`` (empty counts as
    unset), else ``None`` (no token). Raises ValueError, naming where it came from, for a token
    no client could present (``check_token``)."""
    if token is not None:
        check_token(token, "auth_token")
        return token
    value = (os.environ if env is None else env).get(AUTH_TOKEN_ENV) or None
    check_token(value, f"${AUTH_TOKEN_ENV}")
    return value


def resolve_group_key(key: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The group key: ``key`` if given, else ``$TORCHFT_GROUP_KEY`` (empty counts as unset),
    else ``None``. Raises ValueError, naming where it came from, for a key no client could
    present (``check_token``'s rule)."""
    if key is not None:
        check_token(key, "group_key")
        return key
    value = (os.environ if env is None else env).get(GROUP_KEY_ENV) or None
    check_token(value, f"${GROUP_KEY_ENV}")
    return value


def group_key(secret: str, group: str) -> str:
    """The key of replica group ``group``, derived from a launcher's ``secret`` (HMAC-SHA256,
    URL-safe base64: 43 visible ASCII characters). Only the holder of ``secret`` can derive
    it, so ``secret`` must not be a secret the groups hold (the job token)."""
    digest = hmac.new(secret.encode(), b"torchtitan-ft group key\0" + group.encode(), "sha256")
    return base64.urlsafe_b64encode(digest.digest()).decode("ascii").rstrip("=")


def presents_key(value: str | bytes | None, key: str) -> bool:
    """Whether a ``GROUP_KEY_METADATA`` value is ``key`` (constant-time comparison)."""
    if value is None:
        return False
    given = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return hmac.compare_digest(
        hashlib.sha256(given).digest(), hashlib.sha256(key.encode()).digest()
    )


def grpc_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting ``token``; empty without one (torchft servers ignore it)."""
    return () if token is None else ((AUTHORIZATION, bearer(token)),)


def check_token(token: str | None, what: str) -> None:
    """Raises ValueError for a token no client could present (``None`` means "no token").

    A token is a non-empty string of visible ASCII characters (``!`` to ``~``): gRPC metadata
    carries nothing else, and a space, a control character or a trailing newline (a token
    read from a file) would be kept by the server and dropped or refused on the client's side.
    """
    if token is None:
        return
    if not isinstance(token, str) or not token:
        raise ValueError(f"{what} must be None (no token) or a non-empty string, got {token!r}")
    bad = sorted({c for c in token if not "!" <= c <= "~"})
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5])
        raise ValueError(
            f"{what} may hold only visible ASCII characters ('!' to '~'), and it has {shown}: "
            "use letters, digits and punctuation (e.g. the output of "
            "'python -c \"import secrets; print(secrets.token_urlsafe(32))\"'), and strip "
            "a trailing newline if the token was read from a file"
        )


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.5:41234`` -> ``ipv4:10.0.0.5``: one log line per host, not per port."""
    return peer.rpartition(":")[0] or peer


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``methods`` that do not carry the job token, with UNAUTHENTICATED.

    Args:
        token: the job token.
        methods: full method names (``/package.Service/Method``) that need it; others pass.
        server_name: how the refusal names this server, e.g. ``"the lighthouse"``.
        on_refused: called once per refused call (e.g. to count it in metrics).
    """

    def __init__(
        self,
        token: str,
        methods: Collection[str],
        server_name: str,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        check_token(token, "token")
        self._token = token
        self._methods = frozenset(methods)
        self._server_name = server_name
        self._on_refused = on_refused
        self._refusals = RefusalLog(server_name)
        self._reason = "no valid job token"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method not in self._methods:
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self._carries(metadata):
            return handler
        self._on_refused()
        return self._refusal(handler, details.method)

    def _carries(self, metadata: Mapping[str, Any]) -> bool:
        """Whether a call with ``metadata`` carries what this interceptor checks."""
        return presents(metadata.get(AUTHORIZATION), self._token)

    def _message(self, method: str) -> str:
        return (
            f"{method} refused: {self._server_name} has a job token and this call did not "
            f"carry it (metadata '{AUTHORIZATION}: Bearer <token>'); give this client the "
            "job's auth_token"
        )

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED.

        Its deserializer drops the request bytes unread: nothing a stranger sent is parsed.
        """
        message = self._message(method.lstrip("/"))

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
            self._refusals.refused(peer_host(context.peer()), method.lstrip("/"), self._reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def ignore(_data: bytes) -> None:
            return None

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=ignore)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=ignore)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse, request_deserializer=ignore)
        return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=ignore)


class GroupKeyInterceptor(TokenInterceptor):
    """Refuses calls to ``methods`` that do not carry the replica group's key ``key``
    (metadata ``GROUP_KEY_METADATA``), with UNAUTHENTICATED; placed after the
    ``TokenInterceptor``."""

    def __init__(self, key: str, methods: Collection[str], server_name: str) -> None:
        super().__init__(key, methods, server_name)
        self._reason = "not this group's key"

    def _carries(self, metadata: Mapping[str, Any]) -> bool:
        return presents_key(metadata.get(GROUP_KEY_METADATA), self._token)

    def _message(self, method: str) -> str:
        return (
            f"{method} refused: {self._server_name} has a group key and this call did not "
            f"carry it (metadata '{GROUP_KEY_METADATA}'): only the group's own ranks may call "
            f"it; give each rank of this group the same ${GROUP_KEY_ENV} (or group_key)"
        )


class RefusalLog:
    """Logs the first refused request from each peer host; later ones from that host are not
    logged (a flood of them stays one line per host)."""

    def __init__(self, server_name: str) -> None:
        self._server_name = server_name
        self._hosts: set[str] = set()

    def refused(self, host: str, what: str, reason: str = "no valid job token") -> None:
        if host in self._hosts or len(self._hosts) >= _MAX_LOGGED_PEERS:
            return
        self._hosts.add(host)
        logger.warning(
            "%s refused %s from %s: %s (further refusals from this host are not logged)",
            self._server_name,
            what,
            host,
            reason,
        )
