"""Every rank's watch for hung peers: while a step's collectives run, a background thread asks
the lighthouse (``GoneMembers``, a long poll) whether a member of the step's quorum is gone.

A SIGKILLed peer fails the collective at once (its connections close). A hung one (SIGSTOPped,
its connections open) would hold the collective for the process group's whole timeout; the
lighthouse notices it after its heartbeat timeout, and this watch then aborts the step's
collectives: the step is discarded and the next quorum leaves the hung group out. A hung group
that comes back learns it was named gone (``requester_gone``) and discards its step too; the
commit fence (``fence``) keeps it from committing a step its peers aborted when its collective
completed anyway. Decisions: ``decisions.hung_peer_abort`` and ``decisions.needs_commit_fence``.

A rank hung inside a group (group rank N > 0; rank 0's ManagerServer goes on heartbeating for
the group) holds its peers the same way: rank N of every other group waits in the collective
with it. So each rank N > 0 keeps a heartbeat stream of its own to the lighthouse (``group_rank``
in the stream's messages); the lighthouse counts a group as heard from only as recently as its
most silent rank (``lighthouse.decision.group_last_seen``), so the group is named gone after
the same heartbeat timeout, and the watch aborts as for a hung group. Not torchft 0.2.0's
behaviour: its peers wait for the process group's timeout (said once at run time, at the
first abort).

Against torchft's lighthouse (no ``GoneMembers``) the watch stops after its first call: a hung
peer then costs the process group's timeout, as in torchft 0.2.0.

``HungPeerWatch`` is the watch thread; ``HungPeerGuard`` is the Manager's use of it on the
training thread: it arms the watch once a step, at the step's first collective, disarms it when
the step's collectives have settled, asks the commit fence, and carries out the watch's verdict.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from torchtitan_ft.lighthouse.client import LighthouseClient
from torchtitan_ft.manager.decisions import QuorumResult, hung_peer_abort, needs_commit_fence
from torchtitan_ft.manager.settings import ManagerSettings, Source
from torchtitan_ft.manager.step_collectives import StepCollectives

_WAIT = timedelta(seconds=10)
"""Longest wait of one ``GoneMembers`` long poll (a new step's watch cancels it)."""
_RETRY_S = 0.5
"""Pause after a failed call (lighthouse restarting) before asking again."""


class HungPeerError(RuntimeError):
    """A member of the step's quorum (or this group) was named gone by the lighthouse."""


class HungPeerWatch:
    """Watches the members of the current step's quorum for this rank (see the module doc).

    Args:
        client: a lighthouse client of this rank's own (one long poll at a time).
        replica_id: this replica group's id in the lighthouse.
        on_abort: called with the reason, on the watch thread, when the armed step must be
            aborted; ``disarm`` waits for a call in progress.
        log: the Manager's logger (level, message).
        group_rank: this rank in its replica group; a rank > 0 also sends its own heartbeats
            (see the module doc). Default 0: none (group rank 0's ManagerServer heartbeats
            for the group).
        heartbeat_interval: the interval of those heartbeats (the Manager's
            ``heartbeat_interval``).
    """

    def __init__(
        self,
        client: LighthouseClient,
        replica_id: str,
        on_abort: Callable[[str], None],
        log: Callable[[int, str], None],
        group_rank: int = 0,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
    ) -> None:
        self._client = client
        self._replica_id = replica_id
        self._on_abort = on_abort
        self._log = log
        self._cond = threading.Condition()
        self._armed: list[str] | None = None
        self._step_started = time.monotonic()
        self._call: grpc.Future | None = None
        self._call_members: list[str] = []
        self._closed = False
        self._said_not_torchft = False
        self.supported = True
        """False once the lighthouse answered UNIMPLEMENTED (torchft's)."""
        self.heartbeat_timeout: float | None = None
        """The lighthouse's heartbeat timeout (seconds), once it has answered."""
        self._thread = threading.Thread(
            target=self._run, name=f"hung-peer-watch-{replica_id}", daemon=True
        )
        self._thread.start()
        self._rank_heartbeats = (
            client.heartbeat_stream(replica_id, heartbeat_interval, group_rank)
            if group_rank > 0
            else None
        )

    def new_step(self) -> None:
        """Starts the step clock of ``fence`` (at ``start_quorum``: a group stopped before
        its first collective must fence too)."""
        self._step_started = time.monotonic()

    def arm(self, quorum_ids: list[str]) -> None:
        """Watches ``quorum_ids`` (the step's quorum) until ``disarm``. A long poll already
        watching the same members goes on: a stable quorum costs no call per step."""
        with self._cond:
            self._armed = list(quorum_ids)
            if self._call is not None and self._call_members != self._armed:
                self._cancel_call()
            self._cond.notify_all()

    def disarm(self) -> None:
        """Stops watching; once it returns no abort of the armed step happens."""
        with self._cond:
            self._armed = None

    def fence(self) -> str | None:
        """Before the commit vote: the reason to vote no when the lighthouse named this group
        gone during the step (asked only after a long step, ``needs_commit_fence``), else
        None. A failed call is no reason: the peers' collectives decide then. A lighthouse
        that cannot be reached fails it at once: during a lighthouse outage the groups commit
        on their previous quorum (``manager.outage``), and the vote must not wait for it."""
        if not self.supported:
            return None
        if not needs_commit_fence(time.monotonic() - self._step_started, self.heartbeat_timeout):
            return None
        try:
            answer = self._client.gone_members(
                self._replica_id, [], timedelta(0), wait_for_ready=False
            ).result()
        except grpc.RpcError as e:
            self._log(logging.DEBUG, f"commit fence: the lighthouse did not answer: {e.code()}")
            return None
        self.heartbeat_timeout = answer.heartbeat_timeout_ms / 1000
        return hung_peer_abort([], self._replica_id, [], answer.requester_gone)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._armed = None
            self._cancel_call()
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        if self._rank_heartbeats is not None:
            self._rank_heartbeats.close()
        self._client.close()

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def _run(self) -> None:
        first = True
        while True:
            with self._cond:
                while self._armed is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                members = self._armed
                if self._call is None:
                    # The first call answers at once: it learns the heartbeat timeout (fence).
                    wait = timedelta(0) if first else _WAIT
                    self._call = self._client.gone_members(self._replica_id, members, wait)
                    self._call_members = members
                    first = False
                call, members = self._call, self._call_members
            try:
                answer = call.result()
            except grpc.FutureCancelledError:
                continue
            except grpc.RpcError as e:
                with self._cond:
                    if self._call is call:
                        self._call = None
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.supported = False
                    self._log(
                        logging.INFO,
                        "the lighthouse has no GoneMembers (torchft's): a hung peer holds a "
                        "collective for the process group's timeout",
                    )
                    return
                if e.code() != grpc.StatusCode.CANCELLED:
                    self._log(logging.DEBUG, f"GoneMembers failed: {e.code()}; asking again")
                    time.sleep(_RETRY_S)
                continue
            self.heartbeat_timeout = answer.heartbeat_timeout_ms / 1000
            reason = hung_peer_abort(
                members, self._replica_id, list(answer.gone), answer.requester_gone
            )
            with self._cond:
                if self._call is call:
                    self._call = None
                # A verdict between steps, or about another quorum, is dropped; the next arm
                # asks again (at once answered while the member is still gone).
                if reason is None or self._armed != members:
                    continue
                self._armed = None
                if not self._said_not_torchft:
                    self._said_not_torchft = True
                    self._log(
                        logging.INFO,
                        "aborting a step's collectives because the lighthouse named a member "
                        "of its quorum gone: not torchft 0.2.0's behaviour, where peers wait "
                        "in the collective for the process group's timeout",
                    )
                self._on_abort(reason)


class HungPeerGuard:
    """A step's protection against hung peers, for the Manager (training thread, but ``_abort``):
    watches the step's quorum from its first collective until its collectives have settled,
    and fails the step when a member is gone. A rank with no lighthouse to ask (group rank > 0
    given no lighthouse address: ``TORCHFT_LIGHTHOUSE`` unset, or no argument) has no watch,
    and every method does nothing.

    Args:
        settings: this rank's settings: its group rank, the lighthouse's address and the
            job token, ``connect_timeout`` for the watch's own lighthouse client.
        replica_id: this replica group's id in the lighthouse.
        collectives: the step's collectives, failed by a verdict.
        pg: the cross-replica-group process group, aborted by a verdict.
        heartbeat_interval: the Manager's (group ranks > 0 heartbeat at it, ``HungPeerWatch``).
        log: the Manager's logger (level, message).
    """

    def __init__(
        self,
        settings: ManagerSettings,
        replica_id: str,
        *,
        collectives: StepCollectives,
        pg: Any,
        heartbeat_interval: timedelta,
        log: Callable[[int, str], None],
    ) -> None:
        self._collectives = collectives
        self._pg = pg
        self._armed = False
        """The watch was armed this step (training thread)."""
        self.watch: HungPeerWatch | None = None
        group_rank = settings.group_rank.value
        if group_rank == 0 or settings.lighthouse_addr.source is not Source.DEFAULT:
            client = LighthouseClient(
                settings.lighthouse_addr.value,
                settings.connect_timeout.value,
                settings.auth_token.value,
            )
            self.watch = HungPeerWatch(
                client,
                replica_id,
                on_abort=self._abort,
                log=log,
                group_rank=group_rank,
                heartbeat_interval=heartbeat_interval,
            )

    def new_step(self) -> None:
        """A step starts (``start_quorum``): not armed yet; the fence's step clock starts."""
        self._armed = False
        if self.watch is not None:
            self.watch.new_step()

    def arm(self, result: QuorumResult | None) -> None:
        """The step's collectives start over quorum ``result``: watches its members, from the
        step's first collective on (later ones, and no quorum yet, change nothing)."""
        if self.watch is not None and not self._armed and result is not None:
            self._armed = True
            self.watch.arm(result.replica_ids)

    def disarm(self) -> None:
        """The step's collectives have settled: no abort of them happens after this returns."""
        if self.watch is not None:
            self.watch.disarm()
        self._armed = False

    def fence(self) -> None:
        """Before the commit vote: records a ``HungPeerError`` (the step is not committed)
        when the lighthouse named this group gone during the step (``HungPeerWatch.fence``)."""
        if self.watch is not None and (reason := self.watch.fence()) is not None:
            self._collectives.report_error(HungPeerError(reason))

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def _abort(self, reason: str) -> None:
        """The watch's verdict (its thread): fails the step's collectives now. Not a
        retryable collective error: gloo may still write the hung collectives' tensors once
        the peer resumes, so the step is discarded and its buffers left to them."""
        self._collectives.report_error(HungPeerError(reason))
        self._collectives.usable = False
        self._pg.abort()
