"""The lighthouse's bookkeeping of a state loss (``LighthouseState``, no networking, a fake
clock): it waits the holder wait from the end of the holders' streams, declares the loss once
(history, counter, status), sends it with every quorum behind the lost step, and ends it when a
quorum reaches that step again; a holder whose stream ended and that comes back within the wait
is waited for."""

from __future__ import annotations

import asyncio

from torchtitan_ft.lighthouse.decision import HOLDER_WAIT_HEARTBEATS, DecisionOptions
from torchtitan_ft.lighthouse.history import HistoryKind
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb

OPTS = DecisionOptions(min_replicas=1, join_timeout=0.5, heartbeat_timeout=2.0)
WAIT = HOLDER_WAIT_HEARTBEATS * OPTS.heartbeat_timeout


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ask(state: LighthouseState, rid: str, step: int) -> asyncio.Future[bytes]:
    member = QuorumMember(rid, step=step)
    return state.request(member, member.to_proto())


def _holders_at_40_then_gone(state: LighthouseState, clock: Clock) -> None:
    for rid in ("a", "b"):
        state.stream_opened(rid)
    futures = [_ask(state, rid, 40) for rid in ("a", "b")]
    assert all(f.done() for f in futures)
    clock.now += 1.0
    state.stream_closed("a")
    state.stream_closed("b")


def _tick_until_issued(
    state: LighthouseState, clock: Clock, fut: asyncio.Future[bytes], asker: str
) -> float:
    """Ticks (0.25 s, the asker heartbeating) until ``fut`` has its quorum; the seconds it
    took."""
    started = clock.now
    while not fut.done():
        assert clock.now - started < 60, state.reason
        clock.now += 0.25
        state.heartbeat(asker)
        state.tick()
    return clock.now - started


def _losses(state: LighthouseState) -> list[str]:
    return [e.reason for e in state.history if e.kind is HistoryKind.STATE_LOST]


def _loss(fut: asyncio.Future[bytes]) -> int | None:
    """The lost step the quorum answer carries, or None."""
    msg = pb.LighthouseQuorumResponse.FromString(fut.result())
    return msg.state_loss.lost_step if msg.HasField("state_loss") else None


def test_a_loss_is_declared_after_the_wait_held_and_ended_at_the_lost_step() -> None:
    clock = Clock()

    async def run() -> None:
        state = LighthouseState(OPTS, clock=clock)
        _holders_at_40_then_gone(state, clock)
        state.stream_opened("c")
        first = _ask(state, "c", 0)
        waited = _tick_until_issued(state, clock, first, "c")
        # Waited from the end of the holders' streams, not issued at the join timeout.
        assert WAIT - 0.25 <= waited <= WAIT + 0.5, waited
        assert _loss(first) == 40
        assert len(_losses(state)) == 1 and "step 40" in _losses(state)[0]
        assert state.metrics.state_losses == 1
        status = state.status()["state_loss"]
        assert (status["lost_step"], status["holders"]) == (40, ["a", "b"])
        # Held: the next quorum behind step 40 carries it; declared once.
        assert _loss(_ask(state, "c", 1)) == 40
        assert state.metrics.state_losses == 1 and len(_losses(state)) == 1
        # A holder returns at step 40 after all: that quorum is at the lost step, it ends.
        state.stream_opened("a")
        back = [_ask(state, "a", 40), _ask(state, "c", 2)]
        _tick_until_issued(state, clock, back[1], "c")
        assert [_loss(f) for f in back] == [None, None]
        assert state.status()["state_loss"] is None and state.metrics.state_losses == 1

    asyncio.run(run())


def test_a_holder_whose_stream_ended_and_comes_back_within_the_wait_is_waited_for() -> None:
    """The second line that seed 2 of issue 38 saw: restarted processes trained from step 1
    while the group holding the state was away (its stream ended), and were thrown away when
    it came back."""
    clock = Clock()

    async def run() -> None:
        state = LighthouseState(OPTS, clock=clock)
        _holders_at_40_then_gone(state, clock)
        state.stream_opened("c")
        fresh = _ask(state, "c", 0)
        for _ in range(8):  # 2 s: past the join timeout, within the wait
            clock.now += 0.25
            state.heartbeat("c")
            state.tick()
        assert not fresh.done() and "state guard" in state.reason
        state.stream_opened("b")  # b reconnects with its state
        back = _ask(state, "b", 40)
        _tick_until_issued(state, clock, fresh, "c")
        assert back.done() and [_loss(f) for f in (fresh, back)] == [None, None]
        members = pb.LighthouseQuorumResponse.FromString(fresh.result()).quorum.participants
        assert sorted((m.replica_id, m.step) for m in members) == [("b", 40), ("c", 0)]
        assert state.metrics.state_losses == 0 and not _losses(state)

    asyncio.run(run())
