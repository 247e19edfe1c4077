"""The status page tells the job's story: events with reasons, timeline marks, per-group
figures; readiness probes are no replicas (server-rendered HTML, no browser)."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

import pytest

from tests.lighthouse._helpers import ask_all, get, wait_until
from torchtitan_ft.lighthouse import LighthouseClient
from torchtitan_ft.lighthouse.decision import DecisionOptions
from torchtitan_ft.lighthouse.state import LighthouseState
from torchtitan_ft.lighthouse.status import render_html
from torchtitan_ft.lighthouse.summary import render
from torchtitan_ft.proto import torchft_pb2 as pb


def test_page_shows_who_left_why_and_the_probe_apart(servers) -> None:
    server = servers(min_replicas=2, status_bind="127.0.0.1:0", heartbeat_timeout_ms=300)
    ask_all(server.address(), ["r-0", "r-1"])

    def one_is_enough() -> None:  # so that r-0 can go on alone
        server.state.opts = dataclasses.replace(server.state.opts, min_replicas=1)

    server.run_in_loop(one_is_enough)
    probe = LighthouseClient(server.address())
    probe.heartbeat("local-job-probe", timedelta(seconds=5))
    probe.close()

    def lost() -> bool:  # r-1 stays silent: its heartbeat is lost
        events = server.run_in_loop(lambda: [e.kind.value for e in server.state.history])
        return "heartbeat_lost" in events

    wait_until(lost)
    ask_all(server.address(), ["r-0"])  # the round goes on without r-1
    base = server.status_address()

    code, page = get(base + "/")
    assert code == 200
    events = re.findall(
        r'<tr class="event" data-kind="([a-z_]+)" data-seq="\d+">'
        r"<td>\d+</td><td>[\d:]+</td><td>[a-z_]+</td><td>([^<]*)</td><td>([^<]*)</td>",
        page,
    )
    assert ("left", "r-1", "heartbeat lost (hung or stopped)") in events
    assert ("heartbeat_lost", "r-1", "no heartbeat for 0.3 s") in events
    marks = re.findall(r'<circle class="mark" data-kind="([a-z_]+)" data-group="([^"]*)"', page)
    assert ("left", "r-1") in marks and ("joined", "r-0") in marks
    groups = re.findall(r'<tr class="(in-quorum|away)" data-group="([^"]+)"', page)
    assert groups == [("in-quorum", "r-0"), ("away", "r-1")]
    # the probe is named apart, never a row of the heartbeat table
    heartbeats = page[page.index('id="heartbeats"') : page.index('id="other-callers"')]
    assert "local-job-probe" not in heartbeats
    assert "local-job-probe" in page[page.index('id="other-callers"') :]
    assert 'class="spell" data-group="r-1"' in page  # its time in the quorum, drawn

    assert get(base + "/?range=job")[0] == 200
    code, body = get(base + "/?range=week")
    assert code == 400 and "range" in body


@pytest.mark.parametrize(
    ("samples", "unit", "committed", "note"),
    [
        (96, "samples", "96", False),  # our Manager with samples_per_batch
        (None, "batches", "12", True),  # no batch size said (torchft's clients cannot)
    ],
)
def test_the_job_shows_committed_samples_or_says_why_batches(samples, unit, committed, note):
    state = LighthouseState(
        DecisionOptions(min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0)
    )
    state.groups.quorum(["r-0"], now=0.0)
    progress = pb.GroupProgress(batches_committed=12)
    if samples is not None:
        progress.samples_committed = samples
    state.groups.report("r-0", progress, now=1.0)
    status = state.status()

    page = render_html(status, False, list(state.history)).decode()
    job = page[page.index('<table id="job"') : page.index("</table>", page.index('id="job"'))]
    assert f'data-unit="{unit}"' in job and f"<th>committed {unit}</th>" in job
    assert f'<td class="figure">{committed}</td>' in job
    assert ('id="unit-note"' in page) is note
    row = re.search(r'data-group="r-0">(.*?)</tr>', page)[1]
    assert f"<td>{committed}</td>" in row

    text = render(status, {"events": []})
    assert f"job: {committed} {unit} committed" in text
    assert ("no replica group reports its samples per batch" in text) is note


def test_each_group_shows_its_launcher_job_on_the_page_in_json_and_in_the_summary() -> None:
    state = LighthouseState(
        DecisionOptions(min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0)
    )
    state.groups.quorum(["r-0", "r-1"], now=0.0)
    state.groups.report("r-0", pb.GroupProgress(launcher_job="slurm:4312"), now=1.0)
    state.groups.report("r-1", pb.GroupProgress(), now=1.0)  # said none
    status = state.status()
    assert {g["replica_id"]: g["launcher_job"] for g in status["groups"]} == {
        "r-0": "slurm:4312",
        "r-1": None,
    }
    page = render_html(status, False, list(state.history)).decode()
    assert "<th>launcher job</th>" in page
    rows = {g: re.search(rf'data-group="{g}">(.*?)</tr>', page)[1] for g in ("r-0", "r-1")}
    assert rows["r-0"].startswith("<td>r-0</td><td>slurm:4312</td>")
    assert rows["r-1"].startswith("<td>r-1</td><td>-</td>")
    text = render(status, {"events": []})
    lines = [line.split()[:2] for line in text.splitlines() if line.startswith("r-")]
    assert lines == [["r-0", "slurm:4312"], ["r-1", "-"]]
