"""The lighthouse's event history: pure reducers (table tests), the bounded ring, persistence
across a restart, and what the state records as rounds, heartbeats and streams change."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.lighthouse._helpers import ask_all, get
from torchtitan_ft.lighthouse.decision import DecisionOptions, RoundKind
from torchtitan_ft.lighthouse.history import (
    EVENTS_FILE,
    History,
    HistoryKind,
    LeftBecause,
    heartbeat_events,
    membership_events,
    why_left,
)
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.types import QuorumMember
from torchtitan_ft.proto import torchft_pb2 as pb

K = HistoryKind


@pytest.mark.parametrize(
    ("rid", "ended", "healthy", "excluded", "kind", "expected"),
    [
        ("a", {"a"}, set(), set(), RoundKind.FAST, LeftBecause.STREAM_ENDED),
        ("a", {"a"}, {"a"}, {"a"}, RoundKind.FULL, LeftBecause.STREAM_ENDED),
        ("a", set(), {"a"}, {"a"}, RoundKind.FULL, LeftBecause.EXCLUDED),
        ("a", set(), set(), set(), RoundKind.FULL, LeftBecause.HEARTBEAT_LOST),
        ("a", set(), {"a"}, set(), RoundKind.JOIN_TIMEOUT, LeftBecause.JOIN_TIMEOUT),
        ("a", set(), {"a"}, set(), RoundKind.FULL, LeftBecause.NOT_ASKED),
    ],
)
def test_why_left(rid, ended, healthy, excluded, kind, expected) -> None:
    assert why_left(rid, ended, healthy, excluded, kind) is expected


@pytest.mark.parametrize(
    ("previous", "members", "because", "expected"),
    [
        (
            [],
            ["a", "b"],
            {},
            [
                (K.QUORUM, "", "quorum 7: 2 member(s), full round; joined a, b"),
                (K.JOINED, "a", "first quorum"),
                (K.JOINED, "b", "first quorum"),
            ],
        ),
        (
            ["a", "b", "c"],
            ["a", "c"],
            {"b": LeftBecause.HEARTBEAT_LOST},
            [
                (
                    K.QUORUM,
                    "",
                    "quorum 7: 2 member(s), full round; left b (heartbeat lost (hung or stopped))",
                ),
                (K.LEFT, "b", "heartbeat lost (hung or stopped)"),
            ],
        ),
        (
            ["a", "c"],
            ["a", "b", "c"],
            {},
            [
                (K.QUORUM, "", "quorum 7: 3 member(s), full round; joined b"),
                (K.JOINED, "b", "back in the quorum"),
            ],
        ),
        (["a"], ["a"], {}, [(K.QUORUM, "", "quorum 7: 1 member(s), full round")]),
    ],
)
def test_membership_events(previous, members, because, expected) -> None:
    were = set(previous) | ({"b"} if previous else set())  # b: a member before the previous
    assert membership_events(previous, members, 7, RoundKind.FULL, because, were) == expected


def test_a_group_joining_late_is_in_its_first_quorum() -> None:
    events = membership_events(["a"], ["a", "n"], 8, RoundKind.FAST, {}, {"a"})
    assert events[-1] == (K.JOINED, "n", "first quorum")


@pytest.mark.parametrize(
    ("was", "now", "lost_before", "expected"),
    [
        ({"a", "b"}, {"a", "b"}, set(), []),
        ({"a", "b"}, {"a"}, set(), [(K.HEARTBEAT_LOST, "b", "no heartbeat for 5 s")]),
        ({"a"}, {"a", "b"}, {"b"}, [(K.HEARTBEAT_REGAINED, "b", "heard from again")]),
        ({"a"}, {"a", "b"}, set(), []),  # a newcomer is no regained heartbeat
    ],
)
def test_heartbeat_events(was, now, lost_before, expected) -> None:
    assert heartbeat_events(was, now, lost_before, 5.0) == expected


def test_ring_keeps_the_newest_events_and_their_sequence_numbers() -> None:
    h = History(3, None, lambda: 100.0)
    for i in range(5):
        h.record(K.JOINED, f"g{i}", "x")
    assert [e.seq for e in h] == [4, 5, 6]  # seq 1 is the lighthouse's start
    assert [e.group for e in h.since(4)] == ["g3", "g4"]
    assert [e.seq for e in h.since(0, limit=2)] == [4, 5]
    assert h.since(6) == []


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="history capacity must be >= 1, got 0"):
        History(0, None, lambda: 0.0)


def test_state_dir_survives_a_restart_and_stays_bounded(tmp_path) -> None:
    h = History(4, str(tmp_path), lambda: 5.0)
    for i in range(10):
        h.record(K.LEFT, f"g{i}", "heartbeat lost (hung or stopped)")
    h.close()
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) < 2 * 4  # rewritten with the newest ones at twice the capacity
    assert json.loads(lines[-1])["group"] == "g9"
    again = History(4, str(tmp_path), lambda: 6.0)
    events = list(again)
    assert [e.kind for e in events][-1] is K.LIGHTHOUSE_RESTART
    assert events[-1].seq == 12  # continues the earlier run's numbering
    assert [e.group for e in events[:-1]] == ["g7", "g8", "g9"]
    again.close()


def test_a_torn_last_line_is_skipped(tmp_path) -> None:
    h = History(10, str(tmp_path), lambda: 5.0)
    h.record(K.JOINED, "a", "first quorum")
    h.close()
    with (tmp_path / EVENTS_FILE).open("a") as f:
        f.write('{"seq": 3, "ti')
    again = History(10, str(tmp_path), lambda: 6.0)
    assert [e.kind for e in again] == [K.LIGHTHOUSE_START, K.JOINED, K.LIGHTHOUSE_RESTART]
    again.close()


def test_unwritable_state_dir_names_it(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"cannot keep the event history in .*file/events\.jsonl"):
        History(10, str(blocker), lambda: 0.0)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_state_records_a_jobs_story() -> None:
    """Two groups form a quorum; b hangs (heartbeat lost, left), comes back (regained,
    joined); a's stream ends (left: stream ended)."""
    clock = _Clock()
    opts = DecisionOptions(min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0)

    async def story() -> LighthouseState:
        state = LighthouseState(opts, clock=clock, wall_us=lambda: int(clock.now * 1e6))

        def ask(rid: str, step: int, failures: int = 0) -> asyncio.Future[bytes]:
            member = QuorumMember(rid, step=step, commit_failures=failures)
            return state.request(member, member.to_proto(), pb.GroupProgress())

        async def answered(*futs: asyncio.Future[bytes]) -> None:
            state.tick()  # decides rounds that wait on time
            await asyncio.wait_for(asyncio.gather(*futs), 5)

        state.stream_opened("a")
        state.stream_opened("b")
        await answered(ask("a", 0), ask("b", 0))
        clock.now += 6  # b is silent: lost
        state.heartbeat("a")
        state.tick()
        await answered(ask("a", 1))  # without b: it is not healthy
        clock.now += 1
        state.heartbeat("b")
        state.tick()
        await answered(ask("b", 0), ask("a", 2, failures=1))
        state.stream_closed("a")
        await answered(ask("b", 3))
        return state

    state = asyncio.run(story())
    got = [(e.kind, e.group) for e in state.history]
    assert got == [
        (K.LIGHTHOUSE_START, ""),
        (K.QUORUM, ""),
        (K.JOINED, "a"),
        (K.JOINED, "b"),
        (K.HEARTBEAT_LOST, "b"),
        (K.QUORUM, ""),
        (K.LEFT, "b"),
        (K.HEARTBEAT_REGAINED, "b"),
        (K.QUORUM, ""),
        (K.JOINED, "b"),
        (K.COMMIT_FAILURES, "a"),
        (K.STREAM_ENDED, "a"),
        (K.QUORUM, ""),
        (K.LEFT, "a"),
    ]
    left = {e.group: e.reason for e in state.history if e.kind is K.LEFT}
    assert left == {
        "b": LeftBecause.HEARTBEAT_LOST.value,
        "a": LeftBecause.STREAM_ENDED.value,
    }
    assert state.history.counts[K.LEFT, LeftBecause.STREAM_ENDED.value] == 1


def test_a_probe_that_only_heartbeats_is_no_group() -> None:
    clock = _Clock()
    opts = DecisionOptions(min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0)
    state = LighthouseState(opts, clock=clock)
    state.heartbeat("local-job-probe")
    state.tick()
    clock.now += 10
    state.tick()
    assert [e.kind for e in state.history] == [K.LIGHTHOUSE_START]


def test_events_endpoint_metrics_and_a_restart_on_the_same_state_dir(servers, tmp_path) -> None:
    server = servers(min_replicas=2, status_bind="127.0.0.1:0", state_dir=str(tmp_path))
    ask_all(server.address(), ["r-0", "r-1"])
    base = server.status_address()

    code, body = get(base + "/events")
    assert code == 200
    page = json.loads(body)
    kinds = [(e["kind"], e["group"]) for e in page["events"]]
    assert kinds == [("lighthouse_start", ""), ("quorum", ""), ("joined", "r-0"), ("joined", "r-1")]
    assert page["last_seq"] == page["newest_seq"] == 4
    code, body = get(base + "/events?since=2")
    assert [e["seq"] for e in json.loads(body)["events"]] == [3, 4]

    for bad in ("since=-1", "since=abc", "since=1&since=2", "until=3"):
        code, body = get(base + "/events?" + bad)
        assert code == 400, bad
        assert "/events" in body and "since" in body
    assert get(base + "/status.json")[0] == 200  # still serving after bad requests

    code, metrics = get(base + "/metrics")
    assert 'torchft_lighthouse_events_total{kind="joined",reason=""} 2' in metrics.splitlines()
    server.shutdown()

    again = servers(min_replicas=2, status_bind="127.0.0.1:0", state_dir=str(tmp_path))
    code, body = get(again.status_address() + "/events?since=3")
    events = json.loads(body)["events"]
    assert [(e["seq"], e["kind"]) for e in events] == [(4, "joined"), (5, "lighthouse_restart")]
