"""A fault-tolerant parameter server (torchft 0.2.0's prototype, same names and behaviour): the
server process holds parameters; each client gets its own two-process group with it.

A client asks the server's HTTP endpoint for a session (``GET /new_session``). The server
answers with a session id and a TCPStore address whose key prefix is unique to the session,
then configures a new process group on it as rank 0 and runs :meth:`ParameterServer.forward`
on a thread of its own; the client configures its group as rank 1 on the same address. Every
session has its own group, so a client that dies, hangs or misbehaves fails only its own
session's collectives: the server logs the error, frees that group and goes on serving the
others. A client recovers by asking for a new session.

Subclasses choose the process group (:meth:`ParameterServer.new_process_group`) and the
protocol (:meth:`ParameterServer.forward`, which runs once per session and loops for as long as
the session should last). See docs/parameter_server.md.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.request
import uuid
from abc import ABC, abstractmethod
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist

from torchtitan_ft.addresses import advertised_host
from torchtitan_ft.netaddr import join_host_port, url_host
from torchtitan_ft.process_group import ProcessGroup

logger = logging.getLogger(__name__)

_NEW_SESSION = "/new_session"


class ParameterServer(ABC):
    """Serves sessions to clients, one reconfigurable process group per session.

    The HTTP endpoint and the sessions run on daemon threads; the constructor returns once the
    endpoint listens.

    Args:
        port: port of the HTTP endpoint (0: a free one; see :meth:`address`).
        store_port: port of the TCPStore the sessions' groups meet on (0: a free one).
        hostname: keyword-only. Interface the HTTP endpoint binds and the name clients are
            told to dial, for the endpoint and the store. Default ``""``: every interface,
            advertised as this machine's host name (torchft's behaviour). ``"127.0.0.1"`` keeps
            everything on this host. The TCPStore itself listens on every interface (torch
            does not let it bind one).
    """

    def __init__(self, port: int, store_port: int = 0, *, hostname: str = "") -> None:
        self._host = advertised_host(hostname)
        self.store = dist.TCPStore(
            host_name=self._host, port=store_port, is_master=True, wait_for_workers=False
        )
        self._lock = threading.Lock()
        self._sessions: dict[str, ProcessGroup] = {}
        self._http = _SessionServer((hostname or "0.0.0.0", port), _Handler, self)
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="parameter-server-http",
            daemon=True,
        )
        self._thread.start()
        logger.info("parameter server listening on %s", self.address())

    def address(self) -> str:
        """The URL clients pass to :meth:`new_session`: ``http://host:port/new_session``."""
        return f"http://{url_host(self._host)}:{self._http.server_address[1]}{_NEW_SESSION}"

    def active_sessions(self) -> list[str]:
        """Ids of the sessions whose ``forward`` is running."""
        with self._lock:
            return list(self._sessions)

    def shutdown(self) -> None:
        """Stop accepting sessions and abort the running ones (their collectives fail)."""
        self._http.shutdown()
        self._http.server_close()
        with self._lock:
            sessions = list(self._sessions.values())
        for pg in sessions:
            pg.abort()

    # ---- what subclasses provide ----

    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A new, unconfigured process group, for one session (on the server and the client).

        E.g. ``ProcessGroupGloo(timeout=timedelta(seconds=10))``: its timeout bounds how long
        the server waits for a client that stopped responding.
        """

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Serve one session: called once, on the session's own thread, with its configured
        group (server rank 0, client rank 1). Loop inside for a session of many requests.

        Whatever it raises ends this session only: the error is logged, the group freed, and
        the client must ask for a new session.

        Args:
            session_id: unique id of the session (a UUID).
            pg: the session's process group, configured.
        """

    # ---- client side ----

    @classmethod
    def new_session(cls, address: str, timeout: float = 60.0) -> ProcessGroup:
        """Open a session on the server at ``address`` and return the client's process group
        (rank 1; the server is rank 0), configured.

        Args:
            address: the server's :meth:`address`.
            timeout: keyword. Seconds to wait for the HTTP answer. Configuring the group is
                bounded by the group's own timeout. Default 60.

        Raises:
            ConnectionError: if the server cannot be reached or does not answer a session.
        """
        try:
            with urllib.request.urlopen(address, timeout=timeout) as response:
                answer = json.load(response)
            session_id, store_addr = str(answer["session_id"]), str(answer["store_addr"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # URLError is an OSError
            raise ConnectionError(
                f"parameter server at {address} did not open a session: {e}"
            ) from e
        logger.info("parameter server session %s on %s", session_id, store_addr)
        pg = cls.new_process_group()
        pg.configure(
            store_addr=store_addr, replica_id=f"ps_client_{session_id}", rank=1, world_size=2
        )
        return pg

    # ---- server side ----

    def _open_session(self) -> dict[str, str]:
        """Reserve a session and start serving it; returns what the client is told."""
        session_id = str(uuid.uuid4())
        store_addr = f"{join_host_port(self._host, self.store.port)}/session/{session_id}"
        threading.Thread(
            target=self._run_session,
            args=(session_id, store_addr),
            name=f"parameter-server-session-{session_id[:8]}",
            daemon=True,  # a session may last as long as the server; never hold up exit
        ).start()
        return {"session_id": session_id, "store_addr": store_addr}

    def _run_session(self, session_id: str, store_addr: str) -> None:
        pg = self.new_process_group()
        with self._lock:
            self._sessions[session_id] = pg
        try:
            pg.configure(
                store_addr=store_addr, replica_id=f"ps_session_{session_id}", rank=0, world_size=2
            )
            self.forward(session_id, pg)
        # Isolation boundary: forward is the subclass's code and may raise anything; a failed
        # session must never take the server or the other sessions with it.
        except Exception as e:
            logger.warning("parameter server session %s failed: %r", session_id, e)
            self.on_session_error(session_id, e)
        else:
            logger.info("parameter server session %s ended", session_id)
        finally:
            with self._lock:
                self._sessions.pop(session_id, None)
            pg.shutdown()

    def on_session_error(self, session_id: str, error: Exception) -> None:  # noqa: B027 (optional hook)
        """Called (on the session's thread) when a session ends with an error; does nothing
        by default. Override to count or report failed clients.

        Args:
            session_id: the failed session.
            error: what its ``configure`` or ``forward`` raised.
        """


class _SessionServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, owner: ParameterServer) -> None:
        self.owner = owner
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall; skip it.
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()


class _Handler(BaseHTTPRequestHandler):
    server: _SessionServer

    def do_GET(self) -> None:
        if urlsplit(self.path).path != _NEW_SESSION:
            self._reply(404, "text/plain", f"unknown path {self.path!r}; use {_NEW_SESSION}\n")
            return
        body = json.dumps(self.server.owner._open_session()) + "\n"
        self._reply(200, "application/json", body)

    def _reply(self, status: int, content_type: str, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("parameter server http: " + format, *args)


__all__ = ["ParameterServer"]
