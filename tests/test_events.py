"""The event stream's record, writer and reader (torchtitan_ft/events.py), without a Manager;
tests/manager/test_manager.py checks what a Manager writes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from torchtitan_ft.events import (
    EVENTS_DIR_ENV,
    Event,
    EventKind,
    EventWriter,
    HealOutcome,
    Role,
    events_file,
    open_event_writer,
    parse_events,
    process_started,
    quorum_role,
    read_events,
    this_process_started,
)


def test_writer_appends_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "a.jsonl"
    step = [3]
    writer = EventWriter(path, "replica_1:uuid", 2, lambda: step[0])
    writer.emit(EventKind.HEAL_END, outcome=HealOutcome.APPLIED, seconds=0.5, bytes=16, error="")
    step[0] = 4
    writer.emit(EventKind.COMMIT, participants=2)
    writer.close()
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    assert list(first)[:5] == ["time", "kind", "replica_id", "group_rank", "step"]
    assert first["kind"] == "heal_end" and first["outcome"] == "applied"  # enums as values
    assert (first["replica_id"], first["group_rank"], first["step"]) == ("replica_1:uuid", 2, 3)
    events = read_events(path)
    assert [e.kind for e in events] == [EventKind.HEAL_END, EventKind.COMMIT]
    assert events[1].step == 4 and events[1]["participants"] == 2
    assert events[0].replica_name == "replica_1"
    writer.emit(EventKind.COMMIT, participants=2)  # after close: nothing, no error
    assert len(path.read_text().splitlines()) == 2


def test_disabled_writer_writes_nothing(tmp_path: Path) -> None:
    writer = open_event_writer(None, "r", 0, lambda: 0)
    assert not writer.enabled and writer.path is None
    writer.emit(EventKind.COMMIT, participants=1)
    assert not open_event_writer("", "r", 0, lambda: 0).enabled


def test_one_file_per_rank(tmp_path: Path) -> None:
    writer = open_event_writer(str(tmp_path / "env"), "train_0:ab/cd", 1, lambda: 0)
    assert writer.path == tmp_path / "env" / "train_0_ab_cd.r1.jsonl"
    assert writer.path == events_file(tmp_path / "env", "train_0:ab/cd", 1)
    writer.close()


def test_the_events_folder_is_a_manager_setting(tmp_path: Path) -> None:
    from torchtitan_ft.manager.settings import Source, overridden_message, resolve_manager_settings

    env = {EVENTS_DIR_ENV: str(tmp_path / "env")}
    from_env = resolve_manager_settings(env=env)
    resolved = from_env.events_dir
    assert (resolved.value, resolved.source) == (env[EVENTS_DIR_ENV], Source.ENV)
    assert f"events_dir={env[EVENTS_DIR_ENV]!r} (env {EVENTS_DIR_ENV})" in from_env.describe()
    from_arg = resolve_manager_settings(env=env, events_dir=tmp_path / "arg")
    assert from_arg.events_dir.value == str(tmp_path / "arg")
    assert from_arg.overridden == (EVENTS_DIR_ENV,)
    assert f"{EVENTS_DIR_ENV}=" in (overridden_message(from_arg, env) or "")
    for unset in ({}, {EVENTS_DIR_ENV: ""}):
        assert resolve_manager_settings(env=unset).events_dir.value is None


def test_reader_skips_torn_and_foreign_lines_and_reads_folders(tmp_path: Path) -> None:
    a = EventWriter(tmp_path / "a.jsonl", "a:1", 0, lambda: 0)
    b = EventWriter(tmp_path / "nested" / "b.jsonl", "b:1", 0, lambda: 0)
    a.emit(EventKind.START, pid=1, group_world_size=1)
    b.emit(EventKind.START, pid=2, group_world_size=1)
    a.emit(EventKind.FAULT, error="RuntimeError", message="x", collective=False)
    a.close()
    b.close()
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write('{"time": 1.0, "kind": "commit"\n')  # torn by a SIGKILL
    assert len(parse_events(['{"not": "an event"}', "[]", "", '{"time": 1'])) == 0
    events = read_events(tmp_path)
    assert [e.replica_id for e in events] == ["a:1", "b:1", "a:1"]  # time-ordered
    assert read_events(tmp_path / "missing") == []


def test_unknown_kind_is_not_an_event() -> None:
    line = json.dumps({"time": 0, "kind": "nope", "replica_id": "", "group_rank": 0, "step": 0})
    with pytest.raises(ValueError):
        Event.from_json(line)


def test_concurrent_writers_never_interleave_lines(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path / "t.jsonl", "r", 0, lambda: 0)

    def write() -> None:
        for i in range(200):
            writer.emit(EventKind.FAULT, error="E", message="m" * 500 + str(i), collective=True)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    assert len(read_events(tmp_path / "t.jsonl")) == 800


def test_a_failing_write_ends_the_stream_not_training(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path / "full.jsonl", "r", 0, lambda: 0)

    class FullDisk:
        def write(self, line: str) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    writer._file = FullDisk()  # type: ignore[assignment]
    writer.emit(EventKind.COMMIT, participants=1)  # logged, not raised
    assert not writer.enabled
    writer.emit(EventKind.COMMIT, participants=1)


def test_quorum_role() -> None:
    assert quorum_role(0, healing=False) is Role.PARTICIPANT
    assert quorum_role(None, healing=False) is Role.SPARE
    assert quorum_role(None, healing=True) is Role.HEALING
    assert quorum_role(1, healing=True) is Role.HEALING  # a sync quorum's healer participates


# A process that began 1234.56 s after boot (123456 ticks of 100 Hz), read 2000.25 s after boot.
_STAT = "4242 (python3 (a) b) S 1 " + " ".join(["0"] * 17) + " 123456 " + " ".join(["0"] * 30)


@pytest.mark.parametrize(
    ("stat", "uptime", "expected"),
    [
        (_STAT, "2000.25 3000.00\n", 10_000.0 - (2000.25 - 1234.56)),
        (_STAT, "", None),  # unreadable uptime
        ("4242 (python3) S 1", "2000.25 0", None),  # a short stat line
        (_STAT.replace(" 123456 ", " x "), "2000.25 0", None),
    ],
)
def test_process_started_from_proc_texts(stat: str, uptime: str, expected: float | None) -> None:
    got = process_started(stat, uptime, 100, now=10_000.0)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_this_process_started_before_now() -> None:
    import time

    started = this_process_started()
    assert started is not None and started < time.time()
