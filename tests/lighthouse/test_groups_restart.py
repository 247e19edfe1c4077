"""A real ``torchft_lighthouse`` process with ``--state_dir``, SIGKILLed and started again:
its status page shows the same per-group and job figures as before (issue 23)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.lighthouse._helpers import T, ask_all, free_port, get, wait_until
from torchtitan_ft.lighthouse import LighthouseClient
from torchtitan_ft.lighthouse.groups import GROUPS_FILE
from torchtitan_ft.proto import torchft_pb2 as pb
from torchtitan_ft.testing.processes import LighthouseProcess

pytestmark = pytest.mark.multiprocess


def _progress(batches: int, discarded: int, heal_bytes: int = 0) -> pb.GroupProgress:
    progress = pb.GroupProgress(
        batches_committed=batches, samples_committed=8 * batches, discarded_steps=discarded
    )
    if heal_bytes:
        progress.heals.append(
            pb.HealReport(
                to_step=2, source_address="http://b:1", bytes=heal_bytes, seconds=0.5,
                outcome="applied",
            )
        )  # fmt: skip
    return progress


def _status(base: str) -> dict:
    def answers() -> bool:
        try:
            return get(base + "status.json")[0] == 200
        except OSError:  # the status server is not listening yet
            return False

    wait_until(answers, timeout=30)
    return json.loads(get(base + "status.json")[1])


def _events(base: str) -> list[dict]:
    return json.loads(get(base + "events")[1])["events"]


def _figures(status: dict) -> dict:
    return {
        g["replica_id"]: {
            k: g[k]
            for k in ("in_quorum", "heal_count", "heals", "discarded_steps", "samples_committed")
        }
        for g in status["groups"]
    }


@pytest.mark.timeout(120)
def test_a_restarted_lighthouse_shows_the_same_group_figures(tmp_path: Path) -> None:
    lighthouse = LighthouseProcess(
        1,
        heartbeat_timeout_ms=1000,
        status_port=free_port(),
        state_dir=str(tmp_path),
        log=(tmp_path / "lighthouse.log").open("w"),
    )
    base = str(lighthouse.status_address)
    lighthouse.start()
    try:
        client = LighthouseClient(lighthouse.address)
        for rid in ("a", "b"):  # both known: the first quorum waits for both
            client.heartbeat(rid, T)
        client.close()
        progress = {"a": _progress(2, 1, heal_bytes=640), "b": _progress(2, 0)}
        ask_all(lighthouse.address, list(progress), progress=progress)

        def b_lost() -> bool:  # b stays silent
            return any(e["kind"] == "heartbeat_lost" for e in _events(base))

        wait_until(b_lost, timeout=30)
        ask_all(lighthouse.address, ["a"], progress={"a": _progress(3, 2)})  # b is away from here
        before = _status(base)
        saved = tmp_path / GROUPS_FILE

        def saved_after_reading() -> bool:  # the figures read are all in groups.json
            try:
                return json.loads(saved.read_text())["saved_at"] >= before["now"]
            except (OSError, ValueError):  # not written yet, or mid-replace
                return False

        wait_until(saved_after_reading, timeout=30)
        lighthouse.kill()
        read_at = time.time()
        lighthouse.start()
        after = _status(base)
        log = (tmp_path / "lighthouse.log").read_text()[-3000:]

        assert _figures(after) == _figures(before), log
        assert (_figures(after)["a"]["heal_count"], _figures(after)["b"]["in_quorum"]) == (1, False)
        views = {g["replica_id"]: g for g in after["groups"]}
        for rid, was in ((g["replica_id"], g) for g in before["groups"]):
            now = views[rid]
            # Time counted up to the last save (after ``before`` was read), not while down.
            for key in ("in_quorum_s", "away_s"):
                assert was[key] <= now[key] <= was[key] + (time.time() - read_at) + 2, (
                    rid, key, was, now, log,
                )  # fmt: skip
        job = after["job"]
        assert (job["unit"], job["samples_committed"], job["discarded_steps"]) == (
            "samples",
            24,
            2,
        ), job
        assert job["best_samples_per_s"] == before["job"]["best_samples_per_s"]
        events = _events(base)
        assert events[-1]["kind"] == "lighthouse_restart", events
    finally:
        lighthouse.stop()
