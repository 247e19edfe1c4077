"""Live healing over HTTP: the donor serves a snapshot of its committed state, receivers pull.

Donor side. ``send_checkpoint`` copies the state's tensors into a reused flat staging buffer (a
memcpy; a device-to-host copy for accelerator tensors) and returns: the donor keeps training
and mutating its live tensors while a background HTTP server serves the snapshot. Serving is
one blocking ``sendfile`` from the staging buffer (a memfd), so the donor's CPU does not copy
the bytes again and its training thread does not hand the GIL to a send loop.
``disallow_checkpoint`` stops offering the step to new receivers; receivers that already got
the header (they hold a *lease*) may finish fetching the bytes of that snapshot. A staging
buffer is reused for the next snapshot only once every receiver of the old one is done.

Receiver side. ``recv_checkpoint`` fetches a small JSON header (tree, dtypes, shapes, byte
offsets; no pickle), allocates the tensors (``recv_checkpoint_borrowed``: lays them out in a
receive buffer reused from heal to heal), and reads the raw bytes straight into them
(``recv_into`` with ``MSG_WAITALL``), either in one response (``num_chunks`` 0 or 1) or in
``num_chunks`` parallel range requests. A helper thread faults in new memory's pages
meanwhile (first-touch page faults cost as much as the copy). Any failure raises
``CheckpointTransferError`` and returns nothing.

Paths. The donor serves on every address it can (``checkpoint.paths.offered``: the address
``hostname`` resolves to, then the other up, non-loopback interfaces' addresses of its family,
or only the ``interfaces`` an operator allows) and lists them in its URL
(``paths.encode_offer``). The healer probes each path with a short download (``PROBE_BYTES``
within ``PROBE_LIMIT_S``; per donor, kept ``PROBE_TTL_S``), takes the fastest, and on a network
error or a stall (``stall_timeout`` without a byte) restarts the transfer on the next one; a
donor's refusal ends the heal at once. ``last_path`` records the path used (the Manager's
``heal_end`` event). A donor whose ``hostname`` is loopback offers only that (one host).

Routes (``metadata()`` is ``http://<hostname>:<port>/checkpoint``, plus the offer's query):

- ``GET /checkpoint/<step>/full`` -> 200; body: header length (8 bytes, big-endian), JSON
  header, then all tensor bytes.
- ``GET /checkpoint/probe?bytes=<n>`` -> 200, ``n`` zero bytes (at most
  ``_http_server.MAX_PROBE_BYTES``), to time a path.
- ``GET /checkpoint/<step>/header`` -> 200 JSON header; ``X-Checkpoint-Lease`` names the lease.
- ``GET /checkpoint/<step>/data?snapshot=<id>&lease=<lease>`` with ``Range: bytes=a-b`` -> 206
  raw bytes. 410 when the snapshot is gone or the lease unknown or expired; 416 for a bad range.
- ``full`` and ``header``: 503 while the requested step is not offered yet (nothing offered, or
  an older step: the donor's quorum thread may stage it a moment after the receiver asks; the
  receiver retries until its timeout); 400 naming both steps when the donor offers a newer one.
- anything else -> 404; with ``auth_token`` set, any request without
  ``Authorization: Bearer <token>`` -> 401.

Both sides bound what a stranger can make them spend: the server reads request heads on one
thread and serves only complete (authenticated) requests, each within ``timeout``
(``CheckpointServer``); the receiver checks a donor's announcements before allocating
(``_http_client``). Limits: docs/operations.md, "Limits against starvation".

DTensor leaves travel as their local shard plus their layout, and are rebuilt on the receiver's
own device mesh (see ``_dtensor``). Not supported yet: TLS (use ``auth_token`` and a private
network; the token travels in clear text).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TypeVar

from torchtitan_ft.addresses import (
    interface_with,
    is_local_address,
    is_loopback,
    local_interfaces,
    route_source,
)
from torchtitan_ft.auth import resolve_token
from torchtitan_ft.checkpoint._http_client import Source, receive_tensors
from torchtitan_ft.checkpoint._http_server import CheckpointServer, Snapshot
from torchtitan_ft.checkpoint._serialization import Header, flatten, layout, unflatten
from torchtitan_ft.checkpoint._staging import ReceiveBuffer
from torchtitan_ft.checkpoint.paths import (
    Candidate,
    NoPathError,
    Offer,
    PathUsed,
    ProbeCache,
    decode_offer,
    encode_offer,
    first_that_works,
    measured,
    not_here,
    offered,
    order,
)
from torchtitan_ft.checkpoint.transport import (
    CheckpointTransferError,
    CheckpointTransport,
    log_received,
)
from torchtitan_ft.netaddr import WILDCARD_HOSTS, split_host_port

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_BYTES = 4 << 20
"""What a path's probe downloads: enough to tell a 100 Mbit/s link (~0.34 s alone; its token
bucket's first burst a small part of it) from a fast one (milliseconds). The probes race
(``PROBE_GRACE``), so a heal pays about twice the fastest path's probe, not the slow one's."""
PROBE_LIMIT_S = 1.0
"""A probe's time limit; a slower path is measured by what arrived so far."""
PROBE_GRACE = 1.0
"""The paths are probed at once; once the first probe is done, the others get this many times
its duration more, then are measured by what arrived (they are slower: their order is known)."""
PROBE_TTL_S = 600.0
"""How long a donor's probed rates are reused (a failed path forgets them at once)."""
DEFAULT_STALL_TIMEOUT = timedelta(seconds=10)
"""``stall_timeout``'s default (the Manager's, ``heal_stall_timeout_ms``'s: the same)."""


class HTTPTransport(CheckpointTransport[T]):
    """Serves this rank's committed state over HTTP and fetches a peer's.

    Args:
        timeout: default time limit of one transfer; also how long a receiver's lease keeps a
            no-longer-offered snapshot alive, and how long the server waits on a stuck peer.
        num_chunks: parallel HTTP range requests per receive (0 or 1: a single stream).
        hostname: the host peers should dial, advertised in ``metadata()``. Default
            ``socket.gethostname()``. Set it when the machine's name resolves to the wrong
            (e.g. slow) network.
        bind: the address the server listens on. Default ``None``: the address ``hostname``
            resolves to, so the server listens only on the interface it advertises (not on
            all interfaces). Pass ``"0.0.0.0"`` or ``"::"`` to listen everywhere.
        port: the port to listen on; 0 (default) picks a free one.
        auth_token: when set, the server answers only requests with
            ``Authorization: Bearer <auth_token>`` (401 otherwise), and this transport sends it
            when receiving. Use the same job-wide secret on every replica. Default ``None``:
            ``$TORCHFT_AUTH_TOKEN`` if set, else none.
        interfaces: the interfaces this rank may heal over (the operator's pin; Manager:
            ``ManagerOptions.heal_interfaces``): the donor serves only on their addresses and
            the healer takes only the donor's paths on them. Default empty: every interface
            (the donor offers all, the healer measures them). An interface that does not exist
            here raises ValueError naming it.
        stall_timeout: a path that delivers no byte for this long counts as failed and the
            heal restarts on the next path (capped by the transfer's timeout). Default 10 s
            (Manager: ``ManagerOptions.heal_stall_timeout``).
        reuse_receive_buffer: what ``recv_checkpoint_borrowed`` (the Manager's heals) receives
            into. True (default): one buffer kept from receive to receive, so every heal after
            the first writes into memory already mapped, at socket speed instead of page-fault
            speed; memory cost: the largest state received, held until ``shutdown`` (a receive
            allocates that much anyway; the buffer only keeps it). False: new tensors each time
            (no memory kept between heals). ``recv_checkpoint`` always returns new tensors.
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int,
        hostname: str | None = None,
        bind: str | None = None,
        port: int = 0,
        auth_token: str | None = None,
        reuse_receive_buffer: bool = True,
        interfaces: Sequence[str] = (),
        stall_timeout: timedelta = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive timedelta, got {timeout!r}")
        if not isinstance(num_chunks, int) or num_chunks < 0:
            raise ValueError(f"num_chunks must be an int >= 0, got {num_chunks!r}")
        auth_token = resolve_token(auth_token)
        if not isinstance(reuse_receive_buffer, bool):
            raise ValueError(f"reuse_receive_buffer must be a bool, got {reuse_receive_buffer!r}")
        if isinstance(interfaces, str) or not all(isinstance(i, str) for i in interfaces):
            raise ValueError(f"interfaces must be a sequence of names, got {interfaces!r}")
        if not isinstance(stall_timeout, timedelta) or stall_timeout.total_seconds() <= 0:
            raise ValueError(f"stall_timeout must be a positive timedelta, got {stall_timeout!r}")
        self._interfaces = tuple(interfaces)
        self._stall_s = stall_timeout.total_seconds()
        self._probes = ProbeCache(PROBE_TTL_S)
        self.last_path: PathUsed | None = None
        """The path of the last successful receive (``None`` before one)."""
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._receive_buffer = ReceiveBuffer() if reuse_receive_buffer else None
        self._auth_token = auth_token
        self._hostname = hostname or socket.gethostname()
        primary = _resolve(self._hostname) if bind is None or bind in WILDCARD_HOSTS else bind
        offers = offered(primary, local_interfaces(), self._interfaces)
        if bind is not None and bind not in WILDCARD_HOSTS:
            offers = [Offer(self._hostname, None)]  # listens on one address: offers it alone
        listen = [o.address for o in offers] if bind is None else [bind]
        self._server = CheckpointServer(
            listen[0], port, timeout.total_seconds(), auth_token, also=listen[1:]
        )
        if bind is None:
            offers = [o for o in offers if o.address in self._server.addresses]
        self._offers = offers
        self._url_host = self._hostname if offers[0].address == primary else offers[0].address
        self._store = self._server.store
        self._port = self._server.address[1]
        logger.info(
            "checkpoint server listening on %s port %d, advertised as %s (auth %s)",
            ", ".join(self._server.addresses),
            self._port,
            self.metadata(),
            "on" if auth_token else "off",
        )

    def metadata(self) -> str:
        """The URL receivers use: ``http://<hostname>:<port>/checkpoint``, with one ``via``
        per offered path when there are several (``paths.encode_offer``)."""
        return encode_offer(self._url_host, self._port, "/checkpoint", self._offers)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Snapshots ``state_dict`` and offers it as ``step``; returns once the copy is taken.

        The live tensors may be mutated as soon as this returns. ``dst_ranks`` and ``timeout``
        are accepted for interface compatibility: whoever holds the URL (and token) may fetch.
        Raises TypeError for state dicts with unsupported leaves (see ``_serialization``).
        """
        tree, tensors = flatten(state_dict)
        specs = layout(tensors)
        total = sum(s.nbytes for s in specs)
        started = time.perf_counter()
        staging = self._store.take_staging(total)
        try:
            staging.fill(tensors, [s.offset for s in specs])
        except BaseException:
            self._store.give_back(staging)
            raise
        header = Header(step=step, tree=tree, tensors=specs, snapshot_id=secrets.token_hex(8))
        self._store.offer(Snapshot(header, header.to_bytes(), staging))
        logger.info(
            "offering step %d to ranks %s: %d tensors, %.1f MB snapshotted in %.1f ms",
            step,
            dst_ranks,
            len(specs),
            total / 1e6,
            (time.perf_counter() - started) * 1e3,
        )

    def disallow_checkpoint(self) -> None:
        """Stops offering the step to new receivers; leased receivers may finish."""
        self._store.disallow()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches step ``step`` from the donor at ``metadata`` (its URL).

        Raises CheckpointTransferError (naming the donor, step and cause) on any failure:
        donor unreachable or killed, connection reset, timeout, refused (wrong step, 401),
        malformed header. Nothing is returned in that case.
        """
        return self._receive(src_rank, metadata, step, timeout, None)

    def recv_checkpoint_borrowed(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> T:
        """Like ``recv_checkpoint``, but the returned tensors are views of this transport's
        receive buffer (see ``reuse_receive_buffer``), valid until the next call: copy what
        you keep (the Manager copies them into the live state, ``healing.land_in_place``).
        A failed receive leaves garbage only in that buffer."""
        return self._receive(src_rank, metadata, step, timeout, self._receive_buffer)

    def _receive(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: timedelta,
        into: ReceiveBuffer | None,
    ) -> T:
        deadline = time.monotonic() + timeout.total_seconds()
        started = time.perf_counter()
        try:
            base, candidates = decode_offer(metadata)
            ranked = self._ranked(metadata, base, candidates, deadline)

            def attempt(candidate: Candidate) -> tuple[Header, list[Any]]:
                return self._fetch(self._source(candidate, base), step, deadline, into)

            (header, tensors), used, failures = first_that_works(ranked, attempt)
            state_dict = unflatten(header.tree, tensors)
        except (OSError, ValueError, NoPathError) as e:
            self._probes.forget(metadata)
            raise CheckpointTransferError(
                f"receiving step {step} from replica rank {src_rank} at {metadata} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        if failures:
            self._probes.forget(metadata)
            logger.warning(
                "healed over %s after %s failed",
                used.address,
                "; ".join(f.describe() for f in failures),
            )
        self.last_path = PathUsed(
            used.address, used.interface, used.probe_mb_s, tuple(f.describe() for f in failures)
        )
        log_received(logger, step, src_rank, header.total_bytes, started)
        return state_dict

    def _source(self, candidate: Candidate, base: str) -> Source:
        host, port = split_host_port(candidate.address, "heal path")
        return Source(host, port, base, self._auth_token, self._stall_s)

    def _fetch(
        self, source: Source, step: int, deadline: float, into: ReceiveBuffer | None
    ) -> tuple[Header, list[Any]]:
        """One try of the whole transfer over one path."""
        if self._num_chunks <= 1:
            return source.retrying(lambda: source.full(step, deadline, into), deadline)
        header, lease = source.retrying(lambda: source.header(step, deadline), deadline)
        tensors, fresh = receive_tensors(header, step, into)
        source.data(header, lease, tensors, self._num_chunks, deadline, fresh)
        return header, tensors

    def _ranked(
        self, peer: str, base: str, candidates: list[Candidate], deadline: float
    ) -> list[Candidate]:
        """The donor's paths in the order to try them (``paths.order``): those not on this
        host (``paths.not_here``), kept to the pinned interfaces when the donor named its,
        probed (or taken from the cache for this donor), with the link speed of the local
        interface the kernel routes each through."""
        candidates = not_here(candidates, is_local_address)
        pinned = self._interfaces if any(c.interface for c in candidates) else ()
        if pinned:
            candidates = order(candidates, pinned)
        if len(candidates) == 1:
            return candidates
        now = time.monotonic()
        rates = self._probes.rates(peer, now)
        if rates is None:
            rates = self._probe_all(candidates, base, min(deadline, now + PROBE_LIMIT_S))
            self._probes.store(peer, rates, now)
        speeds = {c.address: _route_speed(c.address) for c in candidates}
        return order(measured(candidates, rates, speeds))

    def _probe_all(
        self, candidates: list[Candidate], base: str, deadline: float
    ) -> dict[str, float]:
        """Probes every path at once (``heal-probe`` threads): MB/s by address; 0 for a path
        that failed (tried last), none for a donor without the probe route."""
        rates: dict[str, float] = {}
        started = time.monotonic()
        first_done: list[float] = []

        def cutoff() -> float:
            if not first_done:
                return deadline
            return min(deadline, first_done[0] + PROBE_GRACE * (first_done[0] - started))

        def probe(c: Candidate) -> None:
            try:
                rates[c.address] = self._source(c, base).probe(PROBE_BYTES, deadline, cutoff)
            except OSError:
                rates[c.address] = 0.0  # unreachable now: tried last
                return
            except ValueError:
                return  # the donor has no probe: the link speed decides
            first_done.append(time.monotonic())

        threads = [
            threading.Thread(target=probe, args=(c,), name="heal-probe", daemon=True)
            for c in candidates
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return rates

    def shutdown(self, wait: bool = True) -> None:
        """Stops accepting requests and frees the staging and receive buffers.

        Args:
            wait: block until in-flight responses finished (at most ``timeout``). Without it
                they still finish in the background; each snapshot's buffer is freed by its
                last reader.
        """
        self._server.shutdown(wait)
        self._receive_buffer = None


def _route_speed(address: str) -> float | None:
    """The link speed (Mbit/s) of the local interface the kernel routes ``address`` through."""
    source = route_source(split_host_port(address, "heal path")[0])
    interfaces = local_interfaces() if source is not None else []
    local = interface_with(source, interfaces) if source is not None else None
    return local.speed_mbit_s if local is not None else None


def _resolve(hostname: str) -> str:
    """The address ``hostname`` resolves to here, to bind the server to."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(
            f"cannot resolve the advertised hostname {hostname!r} to bind the checkpoint "
            f"server to it ({e}); pass hostname= or bind="
        ) from e
    address = str(infos[0][4][0])
    if is_loopback(address) and not is_loopback(hostname):
        logger.warning(
            "hostname %r resolves to loopback address %s here: replicas on other machines "
            "cannot reach this checkpoint server; pass hostname= (the address peers dial) "
            "or bind='0.0.0.0'",
            hostname,
            address,
        )
    return address
