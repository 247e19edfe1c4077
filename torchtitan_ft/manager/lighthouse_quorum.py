"""Group rank 0's quorum requests to the lighthouse, on the ManagerServer's event loop: one
request for the whole group, retried as ``retry_delay`` says (pure, table-tested in
``tests/manager/test_lighthouse_quorum.py``), answered on the group's previous quorum during a
lighthouse outage (``outage.py``), and checked before the group's ranks get it (identities,
addresses: ``decisions.QuorumGate``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc

from torchtitan_ft.addresses import AddressProblem, Advertised, QuorumAddressCheck
from torchtitan_ft.lighthouse.client import AsyncLighthouseClient
from torchtitan_ft.lighthouse.types import GroupSpeed, Quorum
from torchtitan_ft.manager.decisions import QuorumGate, QuorumResult, compute_quorum_results
from torchtitan_ft.manager.identity import GroupIdentity, identity_conflict
from torchtitan_ft.manager.linkprobe import LinkProber
from torchtitan_ft.manager.outage import (
    OUTAGE_GRACE_S,
    LighthouseOutage,
    OutageRound,
    OutageState,
    go_on_without_lighthouse,
)
from torchtitan_ft.manager.rounds import Ask, Joined
from torchtitan_ft.manager.steptimes import group_progress, with_link_probes
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.rpc_server import DaemonThreads

logger = logging.getLogger(__name__)

ERROR_MARGIN_S = 1.0
ERROR_MARGIN_SHARE = 0.25
"""A round's lighthouse budget ends ``ERROR_MARGIN_S`` (at most ``ERROR_MARGIN_SHARE`` of the
time left) before the waiting ranks' deadline, so that they receive the server's explanation
rather than a bare client-side deadline. The answer crosses the server's event loop and the
rank's, which a busy trainer thread holding the GIL can delay by hundreds of milliseconds (0.2 s
was not enough beside a loaded TorchTitan rank: "DEADLINE_EXCEEDED: Stream removed")."""
RETRY_BACKOFF_S = (0.1, 1.0)
"""The pause before the first retry of a failed lighthouse quorum request, and the longest
pause (each retry doubles it)."""


def lighthouse_budget(remaining_s: float) -> float:
    """The seconds a round's lighthouse request may take when its ranks wait ``remaining_s``
    more (see ``ERROR_MARGIN_S``)."""
    return max(remaining_s - min(ERROR_MARGIN_S, ERROR_MARGIN_SHARE * remaining_s), 0.0)


def retry_delay(
    attempts: int,
    retries: int,
    left_s: float,
    backoff_s: tuple[float, float] = RETRY_BACKOFF_S,
) -> float | None:
    """How long to pause before asking the lighthouse again after ``attempts`` failed attempts,
    with ``retries`` allowed and ``left_s`` seconds left of the round's budget; None: give up
    (the retries are spent, or the pause would not leave time for another attempt). The pause
    starts at ``backoff_s[0]`` and doubles per attempt up to ``backoff_s[1]``."""
    first, longest = backoff_s
    delay = min(first * 2 ** (attempts - 1), longest)
    if attempts > retries or left_s <= delay:
        return None
    return delay


class RpcFailure(Exception):
    """A failure to report to waiting callers as a gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclasses.dataclass(frozen=True)
class QuorumOutcome:
    """What a quorum round's waiting calls get: the lighthouse's quorum, and the answer (or
    why there is none) of each call the round counted."""

    replica_id: str
    quorum: Quorum
    answers: dict[Joined, QuorumResult | ValueError]
    sessions: dict[Joined, str]
    """The session of each call that succeeded and takes sessions."""
    speed: GroupSpeed | None = None
    """This group's speed as the lighthouse judged it with the quorum."""

    def answer(self, call: Joined) -> QuorumResult | ValueError:
        """``call``'s answer: the round's, or, for a call the round did not count (a
        same-connection retry replaced it), its own view of the quorum."""
        if (answer := self.answers.get(call)) is not None:
            return answer
        return _answer(self.replica_id, call.group_rank, self.quorum, call.init_sync, self.speed)


def _answer(
    replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool, speed: GroupSpeed | None
) -> QuorumResult | ValueError:
    """``group_rank``'s view of ``quorum`` (with the group's ``speed``), or why there is none
    (answered as INTERNAL)."""
    try:
        result = compute_quorum_results(replica_id, group_rank, quorum, init_sync)
    except ValueError as e:
        return e
    return dataclasses.replace(result, speed=speed)


class LighthouseQuorums:
    """The group's lighthouse quorum requests: ``open``, ``ask`` and ``close`` them on the
    server's event loop.

    Args:
        replica_id, store_addr, world_size: what the group tells the lighthouse (and its
            server's address, given to ``open``).
        lighthouse_addr, auth_token: the lighthouse and the job token.
        quorum_retries: as ``ManagerServer``'s.
        outage: the group's ``lighthouse_outage`` setting.
        prober: the group's link prober (its probes go with each request; kicked after each).
        blocking: threads for the address check's name lookups.
        breaks: how many times the group's heartbeat stream has broken so far.
    """

    def __init__(
        self,
        replica_id: str,
        store_addr: str,
        world_size: int,
        lighthouse_addr: str,
        auth_token: str | None,
        quorum_retries: int,
        outage: LighthouseOutage,
        prober: LinkProber,
        blocking: DaemonThreads,
        breaks: Callable[[], int],
    ) -> None:
        self._replica_id = replica_id
        self._address = ""
        self._store_addr = store_addr
        self._world_size = world_size
        self._lighthouse_addr = lighthouse_addr
        self._retries = quorum_retries
        self._auth_token = auth_token
        self._client: AsyncLighthouseClient | None = None
        self._outage = OutageState(outage)
        self._prober = prober
        self._blocking = blocking
        self._breaks = breaks
        self._gate = QuorumGate()
        self._address_check = QuorumAddressCheck()
        self.identity: GroupIdentity | None = None
        """What this group sends in ``QuorumMember.data`` and checks the others against."""

    def open(self, address: str) -> None:
        """Opens the lighthouse client on the running event loop; ``address``: this group's
        ManagerServer."""
        self._address = address
        self._client = AsyncLighthouseClient(self._lighthouse_addr, self._auth_token)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def ask(self, ask: Ask, budget_s: float) -> QuorumOutcome:
        """The quorum for round ``ask`` within ``budget_s``, checked (``_admit``), with this
        group's speed as the lighthouse judged it (None: not judged, or torchft's), and the
        answer of each call of the round (no sessions yet). Raises ``RpcFailure`` with the
        status the ranks get."""
        outage = self._outage.round(
            self._replica_id,
            [call.step for call in ask.calls.values()],
            ask.commit_failures,
            datetime.now(UTC),
        )
        progress = with_link_probes(
            group_progress(call.progress for call in ask.calls.values()), self._prober.take()
        )
        quorum, speed = await self._quorum(ask, progress, budget_s, outage)
        if quorum is not outage.quorum:  # an outage round's members were checked before
            await self._admit(quorum)
        self._outage.answered_with(quorum, speed is not None and speed.excluded)
        answers = {
            call: _answer(self._replica_id, call.group_rank, quorum, call.init_sync, speed)
            for call in ask.calls.values()
        }
        return QuorumOutcome(self._replica_id, quorum, answers, sessions={}, speed=speed)

    async def _quorum(
        self, ask: Ask, progress: pb.GroupProgress | None, budget_s: float, outage: OutageRound
    ) -> tuple[Quorum, GroupSpeed | None]:
        """One lighthouse quorum for the whole group, retried (``retry_delay``). With an
        ``outage.quorum``, that quorum itself (speed None) once the round may go on without
        the lighthouse (``_ask_or_go_on``)."""
        deadline = time.monotonic() + budget_s
        attempts = 0
        logger.info(
            "replica %s: all %d group ranks joined; asking lighthouse for a quorum at step %d",
            self._replica_id,
            self._world_size,
            ask.step,
        )
        data = self.identity.to_data() if self.identity is not None else None
        while True:
            attempts += 1
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                asked = self._client.quorum_with_speeds(
                    replica_id=self._replica_id,
                    timeout=timedelta(seconds=remaining),
                    address=self._address,
                    store_address=self._store_addr,
                    step=ask.step,
                    world_size=self._world_size,
                    shrink_only=ask.shrink_only,
                    data=data,
                    commit_failures=ask.commit_failures,
                    progress=progress,
                    reconfigure_handles=ask.reconfigure_handles,
                )
                if outage.quorum is None:
                    quorum, speeds = await asked
                elif (answer := await self._ask_or_go_on(asked)) is not None:
                    quorum, speeds = answer
                else:
                    self._went_on(outage)
                    return outage.quorum, None
            except TimeoutError as e:
                code, error = grpc.StatusCode.DEADLINE_EXCEEDED, e
            except (OSError, RuntimeError, ValueError, grpc.RpcError) as e:
                code, error = grpc.StatusCode.UNAVAILABLE, e
            else:
                logger.info(
                    "replica %s: lighthouse issued quorum %d with %d members",
                    self._replica_id,
                    quorum.quorum_id,
                    len(quorum.participants),
                )
                self._lighthouse_answered()
                return quorum, speeds.get(self._replica_id)
            delay = retry_delay(attempts, self._retries, deadline - time.monotonic())
            if delay is None:
                raise RpcFailure(
                    code,
                    f"lighthouse quorum at {self._lighthouse_addr} failed after {attempts} "
                    f"attempt(s) within {budget_s:.3f} s: {type(error).__name__}: {error}",
                )
            logger.warning(
                "replica %s: lighthouse quorum attempt %d failed (%s); retrying in %.2f s",
                self._replica_id,
                attempts,
                error,
                delay,
            )
            await asyncio.sleep(delay)

    async def _ask_or_go_on(
        self, asked: Coroutine[Any, Any, tuple[Quorum, dict[str, GroupSpeed]]]
    ) -> tuple[Quorum, dict[str, GroupSpeed]] | None:
        """The lighthouse's answer to ``asked``, or None (the request cancelled) once the
        round may go on without it (``outage.go_on_without_lighthouse``)."""
        loop = asyncio.get_running_loop()
        request = asyncio.ensure_future(asked)
        request.add_done_callback(lambda f: f.cancelled() or f.exception())
        unreachable = asyncio.ensure_future(self._client.wait_unreachable())
        unreachable.add_done_callback(lambda f: f.cancelled() or f.exception())
        started = loop.time()
        try:
            while not request.done():
                outage_known = self._outage.known(self._breaks())
                waited = loop.time() - started
                if go_on_without_lighthouse(unreachable.done(), outage_known, waited):
                    self._outage.cause = (
                        "cannot connect to it"
                        if unreachable.done()
                        else f"it did not answer within {OUTAGE_GRACE_S} s"
                    )
                    return None
                await asyncio.wait(
                    [request, unreachable],
                    timeout=max(OUTAGE_GRACE_S - waited, 0.0) if outage_known else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            return request.result()
        finally:
            unreachable.cancel()
            request.cancel()

    def _went_on(self, outage: OutageRound) -> None:
        """Notes a round answered without the lighthouse; says so when an outage starts."""
        if self._outage.went_on():
            logger.warning(
                "replica %s: the lighthouse at %s does not answer (%s); %s without it (not "
                "torchft 0.2.0's behaviour, which waits for the lighthouse: "
                "lighthouse_outage='wait')",
                self._replica_id,
                self._lighthouse_addr,
                self._outage.cause,
                outage.reason,
            )

    def _lighthouse_answered(self) -> None:
        """Ends a known outage (says how many rounds went on without the lighthouse)."""
        if (steps := self._outage.lighthouse_answered(self._breaks())) is not None:
            logger.warning(
                "replica %s: the lighthouse answers again after %d round(s) on the previous quorum",
                self._replica_id,
                steps,
            )

    async def _admit(self, quorum: Quorum) -> None:
        """Checks a quorum from the lighthouse before the ranks get it (``_check_identities``);
        starts the link probes for the next one."""
        self._prober.kick()  # while the group computes, before its cross-group traffic
        members = [
            Advertised(m.replica_id, m.address, m.store_address) for m in quorum.participants
        ]
        me = Advertised(self._replica_id, self._address, self._store_addr)
        if self._address_check.known(me, members):  # the same members: no name lookups
            addresses = self._address_check(me, members)
        else:
            addresses = await self._blocking.call(lambda: self._address_check(me, members))
        self._check_identities(quorum, addresses)

    def _check_identities(self, quorum: Quorum, addresses: AddressProblem | None) -> None:
        """Fails this group's round when the gate refuses the quorum (``QuorumGate``: an
        identity conflict of a newcomer, or this group advertising loopback beside a member on
        another host); logs a conflict it carries on with, and an address warning, once."""
        admission = self._gate.admit(identity_conflict(self._replica_id, quorum), addresses)
        if admission.warning is not None:
            logger.warning("replica %s: %s", self._replica_id, admission.warning)
        if admission.refusal is not None:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, admission.refusal)
        if admission.error is not None:
            logger.error(
                "replica %s: quorum %d: %s (this group carries on; the step may be discarded)",
                self._replica_id,
                quorum.quorum_id,
                admission.error,
            )
