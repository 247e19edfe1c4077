"""The status page tells the job's story: events with reasons, timeline marks, per-group
figures; readiness probes are no replicas (server-rendered HTML, no browser)."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

from tests.lighthouse._helpers import ask_all, get, wait_until
from torchtitan_ft.lighthouse import LighthouseClient


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
