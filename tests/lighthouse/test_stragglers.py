"""The straggler report: table tests of the pure judgement, the lighthouse's history of it, and
the report on a real lighthouse's quorum responses, status page and /metrics."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import pytest

from tests.lighthouse._helpers import T, get
from torchtitan_ft.lighthouse import LighthouseClient
from torchtitan_ft.lighthouse.stragglers import (
    Change,
    Speed,
    SpeedBook,
    StragglerOptions,
    judge,
)
from torchtitan_ft.proto import torchft_pb2 as pb

OPTS = StragglerOptions(factor=1.5, steps=3, window=3)
FAST = [1.0, 1.0, 1.0]
OTHERS = {"b": FAST, "c": FAST}


@dataclass
class Case:
    name: str
    samples: list[float]
    others: dict[str, list[float]]
    prior: Speed
    relative: float  # expected relative speed (0.0: not judged)
    slow_streak: int
    change: Change | None
    since_step: int | None


CASES = [
    Case("too few own samples: not judged", [4.0, 4.0], OTHERS, Speed(), 0.0, 0, None, None),
    Case("no other group judged: not judged", [4.0] * 3, {"b": [1.0]}, Speed(), 0.0, 0, None, None),
    Case("as fast as the others", FAST, OTHERS, Speed(), 1.0, 0, None, None),
    Case("one slow sample in the window: the median holds", [1.0, 1.0, 9.0], OTHERS, Speed(),
         1.0, 0, None, None),
    Case("slow, first of the streak", [4.0] * 3, OTHERS, Speed(), 0.25, 1, None, None),
    Case("slow just below the factor", [1.4] * 3, OTHERS, Speed(), 1 / 1.4, 0, None, None),
    Case("slow at exactly the factor", [1.5] * 3, OTHERS, Speed(), 1 / 1.5, 1, None, None),
    Case("streak reaches steps: report starts since the streak's first step", [4.0] * 3,
         OTHERS, Speed(0.25, slow_streak=2), 0.25, 3, Change.STARTED, 8),
    Case("straggler stays while slow", [4.0] * 3, OTHERS,
         Speed(0.25, slow_streak=5, since_step=3, since=1.0), 0.25, 6, None, 3),
    Case("straggler fast once: not yet ended", FAST, OTHERS,
         Speed(0.25, slow_streak=5, since_step=3, since=1.0), 1.0, 0, None, 3),
    Case("straggler fast for steps: ends", FAST, OTHERS,
         Speed(1.0, fast_streak=2, since_step=3, since=1.0), 1.0, 0, Change.ENDED, None),
    Case("a slow sample resets the fast streak", [4.0] * 3, OTHERS,
         Speed(1.0, fast_streak=2, since_step=3, since=1.0), 0.25, 1, None, 3),
    Case("streak's first step kept from the prior (link probes: not one a step)", [4.0] * 3,
         OTHERS, Speed(0.25, slow_streak=2, slow_from=4), 0.25, 3, Change.STARTED, 4),
    Case("reference is the others' median, not their mean", [3.0] * 3,
         {"b": FAST, "c": FAST, "d": [30.0] * 3}, Speed(), 1 / 3, 1, None, None),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_judge(case: Case) -> None:
    speed, change = judge(case.samples, case.others, case.prior, step=10, now=50.0, opts=OPTS)
    assert speed.relative_speed == pytest.approx(case.relative)
    assert speed.slow_streak == case.slow_streak
    assert change is case.change
    assert speed.since_step == case.since_step
    if change is Change.STARTED:
        assert speed.since == 50.0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"factor": 1.0}, "straggler factor must be > 1.0, got 1.0"),
        ({"steps": 0}, "straggler steps must be >= 1, got 0"),
        ({"window": 0}, "straggler window must be >= 1, got 0"),
        ({"link_factor": 0.5}, "straggler link_factor must be > 1.0, got 0.5"),
        ({"link_probes": 0}, "straggler link_probes must be >= 1, got 0"),
        ({"link_window": 0}, "straggler link_window must be >= 1, got 0"),
        ({"link_probe_bytes": -1}, r"straggler link_probe_bytes must be in \[0, 524288\]"),
        ({"link_probe_bytes": 524289}, "got 524289"),
        ({"link_probe_interval_s": -1.0}, "link_probe_interval_s must be >= 0, got -1.0"),
    ],
)
def test_bad_options_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerOptions(**kw)


def timings(first_step: int, compute: list[float]) -> list[pb.StepTiming]:
    return [
        pb.StepTiming(step=first_step + i, step_seconds=c + 0.1, compute_seconds=c)
        for i, c in enumerate(compute)
    ]


def test_book_reports_start_and_end_once_and_detection_delay() -> None:
    """A group slowed 4x from step 10 is reported after ``steps + window // 2`` slow steps,
    once; the report ends, once, ``steps + window // 2`` steps after it is fast again."""
    book = SpeedBook(StragglerOptions(factor=1.5, steps=5, window=5))
    lines: list[tuple[int, str]] = []
    for step in range(40):
        for rid in ("a", "b", "c"):
            book.report(rid, timings(step, [0.01]), now=step)
        slow = 10 <= step < 25
        for change, line in book.report("d", timings(step, [0.04 if slow else 0.01]), now=step):
            lines.append((step, line, change))
    started, ended = lines
    assert (started[2], ended[2]) == (Change.STARTED, Change.ENDED)
    assert started[0] == 10 + 5 + 5 // 2 - 1  # the 7th slow step
    assert "'d' computes at 0.25x the others' speed since its step 12" in started[1]
    assert ended[0] == 25 + 5 + 5 // 2 - 1
    assert "since its step 12" in ended[1]
    assert book.reports_started == 1
    assert [v.replica_id for v in book.views()] == ["a", "b", "c", "d"]
    assert not any(v.straggler for v in book.views())


def test_book_skips_unmeasured_steps_and_forgets_gone_groups() -> None:
    book = SpeedBook(StragglerOptions(window=1, steps=1))
    book.report("a", [pb.StepTiming(step=1, step_seconds=1.0)], now=0)  # no compute: skipped
    assert "a" not in book.samples
    book.report("a", timings(2, [1.0]), now=0)
    book.report("b", timings(2, [1.0]), now=0)
    book.forget("a")
    assert list(book.samples) == ["b"] and list(book.speeds) == ["b"]


def test_book_takes_a_retried_requests_timing_once_and_a_rerun_step_again() -> None:
    """A retried quorum request repeats the group's last timing: one sample. A step run again
    (discarded: left out, or a failed commit) reports the same step with its own seconds: a
    sample of its own."""
    book = SpeedBook(StragglerOptions(window=1, steps=1))
    book.report("a", timings(7, [0.5]), now=0)
    book.report("a", timings(7, [0.5]), now=1)  # the retry
    assert list(book.samples["a"]) == [0.5]
    book.report("a", timings(7, [0.25]), now=2)  # step 7 again, discarded the first time
    assert list(book.samples["a"]) == [0.5, 0.25]
    book.forget("a")
    book.report("a", timings(7, [0.25]), now=3)  # a new process of the same id
    assert list(book.samples["a"]) == [0.25]


def test_lighthouse_reports_a_straggler_on_responses_status_and_metrics(servers) -> None:
    """Two real clients ask for quorums with their timings; a group 4x slower is reported in
    every member's quorum response, on the status JSON and page, and in /metrics."""
    server = servers(
        min_replicas=2,
        status_bind="127.0.0.1:0",
        stragglers=StragglerOptions(factor=1.5, steps=2, window=1),
    )
    responses: dict[str, dict] = {}
    # The fast group has a history already: the slow one is judged from its first report,
    # whichever of them asks first in a round.
    server.run_in_loop(lambda: server.state.speeds.report("fast", timings(-1, [0.01]), 0.0))

    def run(rid: str, compute: float) -> None:
        client = LighthouseClient(server.address())
        try:
            for step in range(4):
                progress = pb.GroupProgress(steps=timings(step - 1, [compute])) if step else None
                _, responses[rid] = client.quorum_with_speeds(rid, T, step=step, progress=progress)
        finally:
            client.close()

    threads = [
        threading.Thread(target=run, args=("fast", 0.01)),
        threading.Thread(target=run, args=("slow", 0.04)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Step 2's request carries step 1's timing: the second slow sample, the report's start.
    for speeds in responses.values():
        assert speeds["slow"].straggler and speeds["slow"].straggler_since_step == 0
        assert speeds["slow"].relative_speed == pytest.approx(0.25)
        assert not speeds["fast"].straggler and speeds["fast"].relative_speed == 4.0
    base = server.status_address()
    _, body = get(base + "/status.json")
    by_id = {s["replica_id"]: s for s in json.loads(body)["speeds"]}
    assert by_id["slow"] == {
        "replica_id": "slow",
        "relative_speed": 0.25,
        "straggler": True,
        "straggler_since_step": 0,
        "excluded": False,
        "link_relative_speed": 0.0,
        "cause": "compute",
    }
    _, page = get(base + "/")
    row = (
        '<tr class="straggler"><td>slow</td><td>0.25x</td><td>not judged yet</td><td>0</td>'
        "<td>compute</td><td>yes</td></tr>"
    )
    assert row in page
    _, metrics = get(base + "/metrics")
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert float(values['torchft_lighthouse_relative_speed{replica_id="slow"}']) == 0.25
    assert values['torchft_lighthouse_straggler{replica_id="slow"}'] == "1"
    assert values['torchft_lighthouse_straggler{replica_id="fast"}'] == "0"
    assert values["torchft_lighthouse_straggler_reports_total"] == "1"
    assert values['torchft_lighthouse_excluded{replica_id="slow"}'] == "0"  # policy off
    assert values["torchft_lighthouse_straggler_exclusions_total"] == "0"


def probes(first_seq: int, seconds: list[float], size: int = 1000) -> list[pb.LinkProbeResult]:
    return [
        pb.LinkProbeResult(seq=first_seq + i, bytes=size, seconds=t) for i, t in enumerate(seconds)
    ]


LINK = StragglerOptions(link_factor=4.0, link_probes=3, link_window=3)


def test_a_slow_link_is_reported_after_probes_and_ends_when_fast_again() -> None:
    """Probes are judged like compute times, with the link thresholds: a group whose probes
    take 10x the others' is reported after ``link_probes + link_window // 2`` probes, with the
    step of its first slow probe; the report ends as many probes after its link is fast again.
    Its compute stays judged apart (not slow here)."""
    book = SpeedBook(LINK)
    changes: list[tuple[int, Change, str]] = []
    for i in range(30):
        step = 2 * i  # a probe every other step
        for rid in ("a", "b", "c", "d"):
            book.report(rid, timings(step, [0.01]), now=i)
        for rid in ("a", "b", "c"):
            book.report_link(rid, probes(i + 1, [0.01]), step, now=i)
        slow = 5 <= i < 15
        for change, line in book.report_link("d", probes(i + 1, [0.1 if slow else 0.01]), step, i):
            changes.append((i, change, line))
    (at, change, line), (end_at, end, _) = changes
    assert (at, change) == (5 + 3 + 3 // 2 - 1, Change.STARTED)
    assert line == (
        "straggler (link): replica group 'd' has a link at 0.10x the others' rate (link probes) "
        "since its step 12"
    )
    assert (end_at, end) == (15 + 3 + 3 // 2 - 1, Change.ENDED)
    assert book.reports_started == 1
    d = {v.replica_id: v for v in book.views()}["d"]
    assert (d.straggler, d.cause, d.relative_speed) == (False, "", 1.0)


def test_views_name_the_cause_and_the_earliest_since_step() -> None:
    book = SpeedBook(StragglerOptions(window=1, steps=1, link_window=1, link_probes=1))
    for rid in ("a", "b"):
        book.report(rid, timings(0, [0.01]), now=0)
        book.report_link(rid, probes(1, [0.01]), 0, now=0)
    book.report_link("c", probes(1, [0.1]), 3, now=0)
    assert book.straggler("c") and not book.straggler("a")
    c = book.views()[-1]
    assert (c.replica_id, c.straggler, c.cause, c.straggler_since_step) == ("c", True, "link", 3)
    assert c.link_relative_speed == pytest.approx(0.1)
    assert c.relative_speed == 0.0  # its compute is not judged yet
    book.report("c", timings(2, [0.1]), now=0)
    c = book.views()[-1]
    assert (c.cause, c.straggler_since_step) == ("compute,link", 2)


def test_link_probes_taken_once_by_seq_and_empty_ones_skipped() -> None:
    """A retried quorum request carries its probes again: taken once (by ``seq``); a probe
    that moved nothing or took no time is no sample; a new process (forgotten id) starts its
    numbering again."""
    book = SpeedBook(LINK)
    book.report_link("a", probes(1, [0.5, 0.25]), 0, now=0)
    book.report_link("a", probes(2, [0.25]), 0, now=1)  # the retry
    book.report_link("a", [pb.LinkProbeResult(seq=3, bytes=0, seconds=1.0)], 0, now=1)
    book.report_link("a", [pb.LinkProbeResult(seq=4, bytes=10, seconds=0.0)], 0, now=1)
    assert list(book.link_samples["a"]) == [0.5 / 1000, 0.25 / 1000]
    book.forget("a")
    book.report_link("a", probes(1, [0.5]), 0, now=2)
    assert list(book.link_samples["a"]) == [0.5 / 1000]
