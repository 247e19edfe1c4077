"""What the groups report and the job's figures made from it (pure, no processes)."""

from __future__ import annotations

import json
from collections import deque

import pytest

from torchtitan_ft.launcher_job import LAUNCHER_JOB_MAX
from torchtitan_ft.lighthouse.groups import (
    GROUPS_FILE,
    SAVE_CHANGED_S,
    SAVE_EVERY_S,
    GroupBook,
    GroupsFile,
    Rate,
    availability,
    discarded_total,
    save_due,
    window_rate,
)
from torchtitan_ft.lighthouse.history import HistoryKind
from torchtitan_ft.proto import torchft_pb2 as pb


@pytest.mark.parametrize(
    ("total", "last", "reported", "expected"),
    [
        (0, 0, 0, (0, 0)),
        (3, 3, 5, (5, 5)),
        (5, 5, 1, (6, 1)),  # the process restarted: its count began again at 0
    ],
)
def test_discarded_total(total, last, reported, expected) -> None:
    assert discarded_total(total, last, reported) == expected


def test_window_rate_spans_the_window_before_it_answers() -> None:
    window: deque[tuple[float, int]] = deque()
    got = [window_rate(window, (t, b), 10.0) for t, b in [(0, 0), (5, 10), (10, 20), (20, 20)]]
    assert got == [None, None, 2.0, 0.0]
    assert window[0][0] == 10  # samples older than the window's start are dropped


@pytest.mark.parametrize(
    ("changes", "full", "now", "expected"),
    [
        ([], 2, 10.0, None),
        ([(0.0, 2)], 2, 10.0, 1.0),
        ([(0.0, 2), (4.0, 1), (6.0, 2)], 2, 10.0, 0.8),
        ([(0.0, 1), (5.0, 2)], 2, 10.0, 0.5),
    ],
)
def test_availability(changes, full, now, expected) -> None:
    assert availability(changes, full, now) == expected


def test_book_keeps_steps_heals_and_time_in_and_out_of_the_quorum() -> None:
    book = GroupBook()
    book.quorum(["a", "b"], now=100.0)
    progress = pb.GroupProgress(
        steps=[pb.StepTiming(step=3, step_seconds=0.5)],
        batches_committed=8,
        heals=[
            pb.HealReport(
                to_step=3, source_address="http://b:1", bytes=64, seconds=0.25, outcome="applied"
            )
        ],
    )
    events = book.report("a", progress, now=101.0)
    assert events == [
        (
            HistoryKind.HEAL,
            "a",
            "healed to step 3 from http://b:1: 64 bytes in 0.250 s, applied",
        )
    ]
    book.quorum(["b"], now=110.0)
    book.quorum(["a", "b"], now=115.0)
    a = {v["replica_id"]: v for v in book.views(now=120.0)}["a"]
    assert (a["in_quorum_s"], a["away_s"], a["steps_per_s"], a["heal_count"]) == (15, 5, 2.0, 1)
    job = book.job(now=120.0)
    assert (job["full_membership"], job["batches_committed"]) == (2, 8)
    assert job["availability"] == 0.75


def _progress(batches: int, samples: int | None = None, discarded: int = 0) -> pb.GroupProgress:
    progress = pb.GroupProgress(batches_committed=batches, discarded_steps=discarded)
    if samples is not None:
        progress.samples_committed = samples
    return progress


def test_rate_samples_at_most_once_a_second_and_keeps_its_best() -> None:
    rate = Rate()
    for t, count in [(0.0, 0), (0.5, 99), (10.0, 100), (30.0, 300), (60.0, 360)]:
        rate.sample(t, count)
    assert rate.count == 360
    assert [t for t, _ in rate.window] == [30.0, 60.0]  # (0.5, 99): too soon after (0, 0)
    assert (rate.rate, rate.best) == (2.0, 10.0)  # 360-300 over the last 30 s; best 300/30


def test_the_rate_window_goes_on_across_a_restart_and_counts_the_downtime() -> None:
    rate = Rate()
    for t in range(21):  # 10 samples a second: 200 over the first 20 s
        rate.sample(float(t), 10 * t)
    restored = Rate.from_json(json.loads(json.dumps(rate.to_json())))
    assert (restored.count, restored.rate, restored.best) == (200, None, None)
    restored.sample(40.0, 300)  # down from 20 to 35 s; 100 more by 40 s
    # over the last 30 s: 100 at 10 s to 300 at 40 s
    assert restored.rate == restored.best == (300 - 100) / 30


@pytest.mark.parametrize(
    ("since", "changed", "last_save", "due"),
    [
        (0.5, False, 0.001, False),  # nothing changed: once a second
        (SAVE_EVERY_S, False, 0.001, True),
        (SAVE_CHANGED_S, True, 0.001, True),  # a heal, a discard, a membership change: sooner
        (SAVE_CHANGED_S / 2, True, 0.001, False),
        (2.0, True, 0.1, False),  # a save that took 0.1 s waits 5 s (2% of the loop)
        (5.0, False, 0.1, True),
    ],
)
def test_save_due(since, changed, last_save, due) -> None:
    assert save_due(since, changed, last_save) is due


@pytest.mark.parametrize(
    ("reports", "unit", "committed", "reason"),
    [
        # Our Manager with samples_per_batch: samples, the highest count of any group.
        ({"a": _progress(10, 80), "b": _progress(12, 96)}, "samples", 96, False),
        # Without it (or a torchft program on our Manager): batches, and the page says why.
        ({"a": _progress(10), "b": _progress(12)}, "batches", 12, True),
        # One group that says its batch size is enough (they count the same job).
        ({"a": _progress(10), "b": _progress(12, 96)}, "samples", 96, False),
        # torchft 0.2.0's clients send no progress at all: batches, none committed yet.
        ({}, "batches", 0, True),
    ],
)
def test_job_counts_samples_when_a_group_reports_them_else_batches(
    reports, unit, committed, reason
) -> None:
    book = GroupBook()
    book.quorum(["a", "b"], now=0.0)
    for rid, progress in reports.items():
        book.report(rid, progress, now=1.0)
    job = book.job(now=2.0)
    assert (job["unit"], job[f"{unit}_committed"] or 0, "unit_reason" in job) == (
        unit,
        committed,
        reason,
    )
    if unit == "samples":
        assert job["batches_committed"] == 12  # batches are always there too


def _story() -> GroupBook:
    """a and b in the quorum from 100; a heals at 101 and discards 2 steps; b leaves at 110."""
    book = GroupBook()
    book.quorum(["a", "b"], now=100.0)
    progress = _progress(8, 64, discarded=2)
    progress.heals.append(
        pb.HealReport(
            to_step=3, source_address="http://b:1", bytes=64, seconds=0.25, outcome="applied",
            started=100.5,
        )
    )  # fmt: skip
    events = book.report("a", progress, now=101.0)
    assert events[0][2] == (
        "healed to step 3 from http://b:1 (started 00:01:40): 64 bytes in 0.250 s, applied"
    )
    book.report("b", _progress(8, 64), now=101.0)
    book.quorum(["a"], now=110.0)
    return book


def _figures(views: list[dict]) -> dict:
    return {
        v["replica_id"]: (
            v["in_quorum"], v["in_quorum_s"], v["away_s"], v["heal_count"], v["discarded_steps"],
            v["samples_committed"], [(h["bytes"], h["started"]) for h in v["heals"]],
        )
        for v in views
    }  # fmt: skip


def test_figures_survive_a_restart_and_the_downtime_counts_neither_in_nor_away() -> None:
    book = _story()
    saved = json.loads(json.dumps(book.to_json(now=120.0)))  # as written to groups.json
    assert not book.changed
    restored = GroupBook.from_json(saved, now=150.0)  # the lighthouse was down 120..150
    assert _figures(restored.views(now=150.0)) == _figures(book.views(now=120.0))
    assert _figures(restored.views(now=150.0)) == {
        "a": (True, 20.0, 0.0, 1, 2, 64, [(64, 100.5)]),
        "b": (False, 10.0, 10.0, 0, 0, 64, []),
    }
    # Ten seconds after the restart: a in the quorum, b away, ten more seconds each.
    later = _figures(restored.views(now=160.0))
    assert (later["a"][1], later["b"][2]) == (30.0, 20.0)
    # The job: same counts and best rate; no quorum while the lighthouse was down.
    job, before = restored.job(now=150.0), book.job(now=120.0)
    for key in ("unit", "samples_committed", "batches_committed", "best_samples_per_s"):
        assert job[key] == before[key], key
    assert before["availability"] == 0.5  # 2 of 2 for 10 s, then 1 of 2 for 10 s
    assert job["availability"] == 0.2  # the 30 s down count as not at full membership
    # a's process still counts its 2 discarded steps: no double count after the restart.
    restored.report("a", _progress(9, 72, discarded=3), now=151.0)
    assert restored.job(now=151.0)["discarded_steps"] == 3
    # a restored member is one that was in a quorum before: "back in the quorum"
    assert restored.were_members(["a", "b", "c"]) == {"a", "b"}


@pytest.mark.parametrize(
    ("mangle", "error"),
    [
        (lambda d: d.update(version=2), ValueError),
        (lambda d: d["groups"]["a"].pop("in_quorum_s"), KeyError),
        (lambda d: d["groups"]["a"].update(spell="sideways"), ValueError),
        (lambda d: d["groups"]["a"].update(heals=[[1, 2]]), ValueError),
    ],
)
def test_from_json_refuses_what_to_json_does_not_write(mangle, error) -> None:
    saved = json.loads(json.dumps(_story().to_json(now=120.0)))
    mangle(saved)
    with pytest.raises(error):
        GroupBook.from_json(saved, now=150.0)


def test_groups_file_saves_every_second_sooner_after_a_change_and_restores(tmp_path) -> None:
    store = GroupsFile(str(tmp_path / "state"), timer=lambda: 0.0)  # every save instant
    assert store.load(now=0.0).groups == {}  # nothing saved yet
    book = _story()
    store.save_due(book, now=120.0)
    assert store.path.exists() and not book.changed
    saved_at = lambda: json.loads(store.path.read_text())["saved_at"]  # noqa: E731
    store.save_due(book, now=120.5)  # nothing changed, under SAVE_EVERY_S
    assert saved_at() == 120.0
    book.report("a", _progress(9, 72, discarded=3), now=120.5)  # one more discarded step
    store.save_due(book, now=120.1 + SAVE_CHANGED_S)
    assert saved_at() == 120.1 + SAVE_CHANGED_S
    store.save_due(book, now=121.0 + SAVE_EVERY_S)
    assert saved_at() == 121.0 + SAVE_EVERY_S
    restored = GroupsFile(str(tmp_path / "state")).load(now=130.0)
    assert restored.job(now=130.0)["discarded_steps"] == 3


def test_an_unreadable_groups_file_starts_from_zero_and_says_so(tmp_path, caplog) -> None:
    (tmp_path / GROUPS_FILE).write_text('{"version": 1, "groups": {"a": ')  # torn
    assert GroupsFile(str(tmp_path)).load(now=0.0).groups == {}
    assert "cannot restore the groups' figures" in caplog.text


def test_launcher_job_is_kept_cut_to_its_bound_and_survives_a_restart() -> None:
    book = GroupBook()
    book.report("a", pb.GroupProgress(launcher_job="slurm:17"), now=1.0)
    book.report("a", pb.GroupProgress(), now=2.0)  # a report without it keeps the last one
    book.report("b", pb.GroupProgress(launcher_job="x" * (LAUNCHER_JOB_MAX + 5)), now=2.0)
    views = {v["replica_id"]: v["launcher_job"] for v in book.views(now=3.0)}
    assert views == {"a": "slurm:17", "b": "x" * LAUNCHER_JOB_MAX}
    saved = json.loads(json.dumps(book.to_json(now=3.0)))
    restored = GroupBook.from_json(saved, now=4.0)
    assert {v["replica_id"]: v["launcher_job"] for v in restored.views(now=4.0)} == views
    del saved["groups"]["a"]["launcher_job"]  # a file from before launcher jobs
    assert GroupBook.from_json(saved, now=4.0).groups["a"].launcher_job is None
