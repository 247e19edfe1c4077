"""Smoke tests of the benchmarks that start processes of their own (most through the shared
worker harness, ``torchtitan_ft.testing.processes.Worker``): each at its smallest setting
prints the JSON its docstring describes. Timings are not checked (docs/performance.md has the
measured ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchtitan_ft.testing.netns import limit_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess


def _benchmark(module: str, *args: str, timeout: float) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.mark.slow  # two TorchTitan groups and a torchrun restart: minutes on 2 cores
@pytest.mark.timeout(600)
def test_recovery_titan_row_prints_the_replacement_time() -> None:
    out = _benchmark(
        "benchmarks.recovery",
        *("--sizes-mb", "--titan", "zygote", "spare", "--titan-ranks", "1"),
        *("--titan-steps", "12", "--repeats", "1"),
        timeout=570,
    )
    assert out["sizes"] == [] and out["titan"]["target_s"] == 2.0
    zygote, spare = out["titan"]["runs"]
    for run in (zygote, spare):
        assert run["replacement_s"] > 0 and run["manager_built_s"] > 0, run
        assert out["titan"]["replacement_s_median"][run["replacement"]] == run["replacement_s"]
    assert (zygote["replacement"], spare["replacement"]) == ("zygote", "spare")
    assert 0 < spare["full_quorum_s"] <= spare["replacement_s"], spare


@pytest.mark.slow  # a minute; the stall and the replacement: tests/test_chaos.py, test_spare.py
@pytest.mark.timeout(180)
def test_recovery_prints_stall_and_replacement() -> None:
    """Once it crashed at once: ``'Proc' object has no attribute 'q'``, draining the victim's
    messages after the kill."""
    out = _benchmark(
        "benchmarks.recovery",
        *("--sizes-mb", "1", "--kinds", "cold", "--impls", "ours", "--repeats", "1"),
        *("--steady", "2", "--hangs", "1", "--hang-hold-s", "2", "--heartbeat-timeout-ms", "1000"),
        timeout=150,
    )
    assert out["failed_runs"] == []
    assert {"command", "machine", "setup", "targets", "sizes", "wall_s"} <= out.keys()
    (size,) = out["sizes"]
    assert size["size_mb"] == 1.0
    (run,) = size["runs"]["ours"]
    assert run["stalls"][0]["stall_s"] >= 0  # rounded to ms: 0.0 when the kill hit between steps
    assert run["replacements"][0]["kind"] == "cold"
    assert "stall_s_median" in size["summary"]["ours"]
    (hang,) = run["hangs"]
    assert hang["stall_s"] > 0 and hang["rejoin_s"] > 0 and hang["goal_s"] > 1.0
    assert "hang_stall_over_goal_median" in size["summary"]["ours"]


@pytest.mark.slow  # two jobs of three MLP groups and a lighthouse restart: about a minute
@pytest.mark.timeout(300)
def test_lighthouse_outage_prints_both_settings() -> None:
    out = _benchmark(
        "benchmarks.lighthouse_outage",
        *("--trials", "1", "--down-s", "1", "--steady", "3", "--after", "1"),
        timeout=270,
    )
    assert {"setup", "machine", "load_avg_1m", "runs", "summary"} <= out.keys()
    assert [r["setting"] for r in out["runs"]] == ["previous_quorum", "wait"]
    assert all(r["groups_identical"] and r["stall_s"] > 0 for r in out["runs"]), out["runs"]
    assert out["stall_previous_quorum_over_wait"] > 0


@pytest.mark.slow  # 3 groups of 2 ranks, a hang past the heartbeat timeout and a kill
@pytest.mark.timeout(240)
def test_recovery_group_rank_row_prints_hang_and_kill_stalls() -> None:
    out = _benchmark(
        "benchmarks.recovery",
        *("--sizes-mb", "--rank-faults", "1", "--steady", "2"),
        *("--hang-hold-s", "2", "--heartbeat-timeout-ms", "1000"),
        timeout=210,
    )
    row = out["group_rank"]
    assert [r["fault"] for r in row["runs"]] == ["hang", "hang_in_collective", "kill"]
    hang, stuck, kill = row["runs"]
    for entry in (hang, stuck):
        assert entry["stall_s"] > 0 and entry["rejoin_s"] > 0 and entry["goal_s"] > 1.0, entry
    assert kill["stall_s"] >= 0, kill
    assert row["stall_s_median"]["hang_in_collective"] == stuck["stall_s"]
    assert row["hang_in_collective_stall_over_goal_median"] == stuck["stall_over_goal"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inflight_prints_both_settings() -> None:
    out = _benchmark(
        "benchmarks.inflight", "--size-mb", "1", "--trials", "1", "--steady", "2", timeout=210
    )
    assert {"command", "machine", "setup", "size_mb", "summary", "trials"} <= out.keys()
    assert {"on", "off", "stall_on_over_off"} <= out["summary"].keys()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_manager_step_prints_the_ratio() -> None:
    out = _benchmark(
        "benchmarks.manager_step",
        *("--sizes-mb", "1", "--rounds", "1", "--steps", "2", "--warmup", "1"),
        *("--quorum-rounds", "3", "--quorum-mixed"),
        timeout=210,
    )
    assert {"command", "machine", "setup", "sizes", "wall_s"} <= out.keys()
    (size,) = out["sizes"]
    assert size["ratio_ft_over_faster_baseline"] > 0
    quorum = out["quorum_round_trip"]
    assert quorum["ours"]["round_trip_ms"]["n"] == 3
    if "ratio_ours_over_torchft" in quorum:  # torchft 0.2.0 installed: the mixed pairs ran too
        assert quorum["torchft_groups_our_lighthouse"]["round_trip_ms"]["n"] == 3
        assert quorum["ours_groups_torchft_lighthouse"]["round_trip_ms"]["n"] == 3


@pytest.mark.slow  # three jobs of processes: 45 to 90 s under load
@pytest.mark.timeout(300)
def test_stragglers_prints_results_and_clean_run() -> None:
    out = _benchmark(
        "benchmarks.stragglers",
        *("--groups", "2", "--steps", "3", "--slowdowns", "4", "--work", "5", "--link-mbit", ""),
        timeout=270,
    )
    assert {"command", "machine", "setup", "results", "clean_run"} <= out.keys()
    (result,) = out["results"]
    assert result["model"] == "mlp" and result["slowdown"] == 4
    assert result["healthy_throughput_ratio_policy_off"] > 0
    assert result["healthy_throughput_ratio_policy_on"] > 0
    assert out["clean_run"]["exclusions"] >= 0
    assert "detection_steps" in result and result["false_reports"] >= 0
    assert {"false_reports", "exclusions"} <= out["clean_run"].keys()


@pytest.mark.slow  # four jobs of processes on test hosts: about a minute
@pytest.mark.multihost
@pytest.mark.timeout(420)
@pytest.mark.skipif(limit_unavailable_reason() is not None, reason=str(limit_unavailable_reason()))
def test_stragglers_link_row_reports_the_slow_link() -> None:
    out = _benchmark(
        "benchmarks.stragglers",
        *("--groups", "3", "--steps", "3", "--slowdowns", "", "--work", "5"),
        *("--link-mbit", "5", "--link-probe-interval-ms", "0"),
        timeout=390,
    )
    (row,) = out["results"]
    assert (row["model"], row["slowed_by"], row["link_mbit"]) == ("mlp", "link", 5.0)
    assert row["slowdown"] > 0 and row["healthy_throughput_ratio_policy_on"] > 0
    assert row["exclusions_policy_on"] == 1 and row["detected_cause"] == "link"
    assert out["link"]["healthy_throughput_ratio_probes_on_over_off"] > 0
    assert {"false_reports", "exclusions"} <= out["clean_runs"]["mlp_link"].keys()


@pytest.mark.slow  # two TorchTitan jobs: about 2 min under load
@pytest.mark.timeout(420)
def test_stragglers_titan_row_runs_its_clean_run() -> None:
    out = _benchmark(
        "benchmarks.stragglers",
        *("--models", "titan", "--groups", "2", "--titan-slowdowns", "", "--titan-steps", "2"),
        timeout=390,
    )
    assert out["results"] == [] and "titan_reduced" in out
    clean = out["clean_runs"]["titan"]
    assert clean["steps"] == 2 and clean["healthy_samples_per_s"] > 0
    assert {"false_reports", "exclusions"} <= clean.keys()


@pytest.mark.slow  # the servers' start and one flood of 136 connections: 15 to 40 s under load
@pytest.mark.timeout(240)
def test_flood_prints_guarded_and_unguarded_cases() -> None:
    out = _benchmark("benchmarks.flood", "--trials", "1", "--rounds", "2", timeout=210)
    assert {"command", "machine", "setup", "bound_ms", "summary", "guard_costs"} <= out.keys()
    assert {"guarded_quiet", "guarded_flood", "unguarded_quiet"} <= out["summary"].keys()
    assert out["guard_costs"]["look_ms_median"] > 0


@pytest.mark.slow  # three TorchTitan jobs on network-namespace hosts: 7.5 min at load 36
@pytest.mark.multihost
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    limit_unavailable_reason() is not None, reason=f"no limited links: {limit_unavailable_reason()}"
)
def test_titan_step_across_a_link_prints_both_jobs() -> None:
    out = _benchmark(
        "benchmarks.titan_step",
        *("--link-mbit", "1000", "--steps", "3", "--warmup", "1"),
        timeout=860,
    )
    assert {"command", "machine", "gradient_bytes", "links"} <= out.keys()
    (link,) = out["links"]
    assert link["link_mbit"] == 1000 and link["measured_mbit"] > 0
    assert link["native_step_s"] > 0 and link["ft_step_s"] > 0 and link["ratio"] > 0
    assert link["ideal_allreduce_s"] > 0 and link["compute_s"] > 0


@pytest.mark.slow  # 13 s under load (importing torch for the machine description)
def test_history_memory_prints_both_mixes() -> None:
    out = _benchmark(
        "benchmarks.history_memory",
        *("--events", "200", "--groups", "4", "--file_groups", "3"),
        timeout=60,
    )
    assert out["results"].keys() == {"churn", "steady"}
    assert all(r["bytes"] > 0 and r["record_us"] > 0 for r in out["results"].values())
    assert out["groups_file"]["groups"] == 3 and out["groups_file"]["bytes"] > 0


@pytest.mark.slow  # two server processes: 20 s under load
def test_lighthouse_scale_prints_the_page_row() -> None:
    out = _benchmark(
        "benchmarks.lighthouse_scale",
        *("--servers", "ours_stream,ours_stream_page", "--sizes", "2"),
        *("--rounds", "3", "--trials", "1"),
        timeout=120,
    )
    (row,) = out["results"]
    assert row["ours_stream_page"]["steady_round_ms"] > 0 and row["page_over_no_page"] > 0


@pytest.mark.slow  # two hosts, a link probe and two runs of two processes: 6 min at load 40
@pytest.mark.timeout(660)
def test_wan_prints_the_per_step_rows_and_their_goals() -> None:
    from torchtitan_ft.testing.netns import limit_unavailable_reason

    if (reason := limit_unavailable_reason()) is not None:
        pytest.skip(f"no network-namespace hosts here: {reason}")
    out = _benchmark(
        "benchmarks.wan",
        *("--links", "unlimited", "--strategies", "per_step", "per_step_ddp_overlap"),
        *("--steps", "3"),
        timeout=630,
    )
    rows = {r["strategy"]: r for r in out["results"]}
    assert set(rows) == {"per_step", "per_step_ddp_overlap"}, out["results"]
    overlap = rows["per_step_ddp_overlap"]
    assert overlap["phase_s_per_inner_step"]["backward_sync"] > 0
    assert overlap["syncs_committed"] == 3 and overlap["syncs_failed"] == [0, 0]
    assert overlap["overlap_s_per_inner_step"]["transfers"] > 0
    assert "overlap_s_per_inner_step" not in rows["per_step"]
    assert rows["per_step"]["payload_bytes_per_inner_step"] > 0
    goals = out["goals"]["per_step_exposed_sync"]
    assert set(goals) == set(rows) and "met" in goals["per_step"]["unlimited"]


@pytest.mark.slow  # three TorchTitan jobs one after the other: 4 to 15 min under load
@pytest.mark.timeout(1500)
def test_goodput_prints_every_method(tmp_path: Path) -> None:
    out = _benchmark(
        "benchmarks.goodput",
        *("--quick", "--duration", "30", "--out", str(tmp_path)),
        timeout=1450,
    )
    assert set(out["methods"]) == {"ideal", "checkpoint_restart", "torchft", "torchtitan_ft"}
    for name in ("ideal", "checkpoint_restart", "torchtitan_ft"):
        entry = out["methods"][name]
        assert {
            "goodput",
            "faults_injected",
            "faults_survived",
            "job_restarts",
            "samples_lost",
            "samples_duplicated",
            "groups_identical",
            "checkpoint_every_steps",
        } <= entry.keys(), name
        assert entry["checkpoint_every_steps"] == (None if name == "ideal" else 10), name
    assert "skipped" in out["methods"]["torchft"] or "goodput" in out["methods"]["torchft"]
    assert out["methods"]["ideal"]["goodput"] == 1.0
    assert "replacement_s" in out and "timeouts" in out and "cpu_quota" in out
    assert (tmp_path / "goodput.json").exists()
    ours = out["methods"]["torchtitan_ft"]
    assert ours["recoveries"], "no recovery recorded (every group's start-up heal is one)"
    # Every complete recovery's phases add up to its total as the workers' records measure it.
    assert ours["recoveries_within_5pct"] is True, ours["recoveries"]


@pytest.mark.slow  # six TorchTitan jobs of 3 steps, two releases: 5 to 10 min under load
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not (ROOT / ".cache/tt030/venv/bin/python").exists(),
    reason="no TorchTitan 0.3.0 venv (scripts/install_torchtitan_env.sh 0.3.0)",
)
def test_titan_step_prints_both_releases_side_by_side() -> None:
    out = _benchmark(
        "benchmarks.titan_step",
        *("--releases", "0.2.2", "0.3.0", "--steps", "3", "--warmup", "1"),
        timeout=860,
    )
    assert [(r["release"], r["dtype"]) for r in out["results"]] == [
        ("0.2.2", "float32"),
        ("0.3.0", "float32"),
    ]
    assert all(r["ratio_ft_over_native"] > 0 for r in out["results"])
    assert out["ratio_0_3_0_over_0_2_2"]["float32"] > 0


@pytest.mark.slow  # two hosts, two settings of two processes: 45 s to 3 min under load
@pytest.mark.multihost
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    limit_unavailable_reason() is not None, reason=f"no limited links: {limit_unavailable_reason()}"
)
def test_link_cpu_prints_both_bucket_settings() -> None:
    out = _benchmark("benchmarks.link_cpu", "--ops", "1", "--work", "2", "--mb", "0.5", timeout=210)
    old, new = out["settings"]
    assert old["min_burst_bytes"] == 64 * 1024 and new["min_burst_bytes"] == 128 * 1024
    for setting in (old, new):
        assert setting["allreduce_s"] > 0 and setting["compute_alone_s"] > 0
        assert setting["machine_softirq_s_per_op"] >= 0


@pytest.mark.slow  # two hosts, a donor and five healer processes: 1 to 6 min under load
@pytest.mark.multihost
@pytest.mark.timeout(660)
@pytest.mark.skipif(
    limit_unavailable_reason() is not None, reason=f"no limited links: {limit_unavailable_reason()}"
)
def test_heal_paths_takes_the_fast_link_and_finishes_on_the_slow_one_when_it_is_pulled() -> None:
    out = _benchmark("benchmarks.heal_paths", "--quick", timeout=630)
    slow, fast = out["links"]["eth0"], out["links"]["eth1"]
    assert (slow["path"]["interface"], fast["path"]["interface"]) == ("eth0", "eth1")
    assert slow["rate_mb_s"] < 100 / 8 * 1.1 < fast["rate_mb_s"]  # the tbf limit holds
    heal = out["heal"]
    assert out["heal_took_fast_link"] and heal["path"]["interface"] == "eth1", heal
    assert heal["path"]["probe_mb_s"] > 0 and heal["path"]["failures"] == []
    assert heal["rate_vs_fast_link"] == pytest.approx(heal["rate_mb_s"] / fast["rate_mb_s"], 0.01)
    fallback = out["fallback"]
    assert out["fallback_finished_on_slow_link"] and fallback["finished_on"] == "eth0", fallback
    assert fallback["bytes"] == 12_000_000
    (failure,) = fallback["path"]["failures"]
    assert failure.startswith(fast["path"]["address"]) and "stalled" in failure, failure
    assert out["cpu"]["model"] and out["cpu"]["flags"]
    torchft = out["torchft"]  # torchft 0.2.0's own transport, unconfigured: the host name's link
    if "skipped" not in torchft:
        assert torchft["interface"] == "eth0" and torchft["bytes"] == 16_000_000, torchft
        assert out["ours_over_torchft"] == pytest.approx(
            heal["rate_mb_s"] / torchft["rate_mb_s"], 0.01
        )


def _torchft_record(group: int, step: int, committed: bool, participating: bool, drawn: int):
    from benchmarks._goodput_accounts import Record

    return Record(
        group=group,
        pid=1,
        time=float(drawn),
        step=step,
        committed=committed,
        consumed=None,
        participants=None,
        loss=None,
        rss_mb=0.0,
        fds=0,
        batches_committed=0,
        participating=participating,
        drawn=drawn,
    )


def test_goodput_checks_each_recovery_against_the_records() -> None:
    """A replacement is measured from the failed process's last committed step (its own
    record, or a survivor's when the kill came before its record) to its replacement's first
    committed step with its group in it (not the healing step); a heal from its start."""
    from benchmarks._goodput_accounts import Record, recovery_checks
    from torchtitan_ft.recoveries import Noticed, Recovery, RecoveryKind

    def rec(group: int, pid: int, t: float, participants: list[int], healed: bool = False):
        return Record(group, pid, t, 0, True, None, participants, None, 0.0, 0, healed=healed)

    records = [
        rec(0, 10, 99.0, [0, 1]),  # the failed process's last record...
        rec(1, 20, 100.0, [0, 1]),  # ...a survivor's later one of a step with group 0 in it
        rec(1, 20, 102.0, [1]),
        rec(0, 11, 130.0, [0, 1], healed=True),  # the healing step
        rec(0, 11, 138.1, [0, 1]),
        rec(1, 20, 150.0, [1]),
    ]
    replaced = Recovery(
        "g0", "g0:new", RecoveryKind.REPLACEMENT, 100.0, 38.0, {"noticed": 38.0}, True,
        Noticed.QUORUM, "g0:old",
    )  # fmt: skip
    off = Recovery(
        "g0", "g0:new", RecoveryKind.REPLACEMENT, 100.0, 30.0, {"x": 30.0}, True, None, "g0:old"
    )
    healed = Recovery("g1", "g1:a", RecoveryKind.HEAL, 140.0, 9.0, {"heal": 9.0}, True)
    unfinished = Recovery("g1", "g1:a", RecoveryKind.HEAL, 140.0, 9.0, {"heal": 9.0}, False)
    starts = {"g0:old": (10, 1.0), "g0:new": (11, 110.0), "g1:a": (20, 1.0)}
    checked = recovery_checks([replaced, off, healed, unfinished], starts, records)
    assert [(c["group"], c["measured_s"], c["within"]) for c in checked] == [
        (0, 38.1, True),
        (0, 38.1, False),  # 30 s of phases for 38.1 s measured
        (1, 10.0, False),  # 9 s of phases for 10 s: 10 % off
        (1, 10.0, None),  # incomplete: not judged
    ]


def test_goodput_gathers_torchft_participants_per_step() -> None:
    """torchft's groups know how many took part in a step, not which: the benchmark gathers
    them from every group's own record."""
    from benchmarks._goodput_accounts import fill_participants

    records = [
        _torchft_record(0, 5, True, True, 5),
        _torchft_record(1, 5, True, False, 3),  # healing in step 5: committed, not in it
        _torchft_record(2, 5, True, True, 5),
        _torchft_record(1, 6, False, True, 4),  # a discarded step takes nobody's batch
    ]
    fill_participants(records)
    assert [r.participants for r in records] == [[0, 2], [0, 2], [0, 2], []]


@pytest.mark.parametrize(
    ("rows", "lost", "duplicated"),
    [
        # (group, committed, participating, drawn): one process, every batch trained once
        ([(0, True, True, 1), (0, True, True, 2)], 0, 0),
        # a discarded step's batch is read and never trained: lost
        ([(0, True, True, 1), (0, False, True, 2), (0, True, True, 3)], 1, 0),
        # healing: the batch of the step reaches no gradient
        ([(0, True, False, 1), (0, True, True, 2)], 1, 0),
        # a new process resumed behind the last trained batch: batches 0 and 1 trained twice
        ([(0, True, True, 1), (0, True, True, 2), (0, True, True, 1), (0, True, True, 2)], 0, 2),
        # a new process resumed past batches never trained: lost though no record drew them
        ([(0, True, True, 1), (0, False, True, 2), (0, True, True, 5)], 3, 0),
        # lost past the last trained batch is not counted (the run ended there)
        ([(0, True, True, 1), (0, False, True, 2)], 0, 0),
    ],
)
def test_goodput_checks_torchft_batches_exactly_once(
    rows: list[tuple[int, bool, bool, int]], lost: int, duplicated: int
) -> None:
    from benchmarks._goodput_accounts import drawn_batches_check

    records = [_torchft_record(g, 0, c, p, d) for g, c, p, d in rows]
    check = drawn_batches_check(records)
    assert (check["lost"], check["duplicated"]) == (lost, duplicated)
    assert check["exactly_once"] == (lost == duplicated == 0)


def test_goodput_says_why_torchft_batches_were_lost() -> None:
    """Each lost batch by what its records show: read in a step that did not commit, in a
    committed step the group healed in, or read by no record (a resume ahead)."""
    from benchmarks._goodput_accounts import drawn_batches_check

    rows = [(0, True, False, 1), (0, False, True, 2), (0, True, True, 3), (0, True, True, 6)]
    check = drawn_batches_check([_torchft_record(g, 0, c, p, d) for g, c, p, d in rows])
    assert check["lost_by"] == {"healing": 1, "discarded": 1, "not_read": 2}


def _summed(group: int, step: int, param_sum: float, lr: float, healed: bool = False):
    r = _torchft_record(group, step, True, not healed, step)
    r.param_sum, r.lr = param_sum, lr
    return r


def test_goodput_finds_the_step_torchft_groups_part_at() -> None:
    """The first committed step whose groups' weights differ, with each group's learning rate
    and heal: the step a healing group applied another learning rate than its donor."""
    from benchmarks._goodput_accounts import first_divergence

    together = [_summed(g, s, 10.0 + s, 8e-4) for s in (1, 2) for g in (0, 1)]
    assert first_divergence(together) is None
    parted = [
        *together,
        _summed(0, 3, 13.0, 8e-4),
        _summed(1, 3, 12.5, 4e-4, healed=True),
        _summed(0, 4, 14.0, 8e-4),
        _summed(1, 4, 13.5, 8e-4),
    ]
    assert first_divergence(parted) == {
        "step": 3,
        "groups": {0: {"lr": 8e-4, "healed": False}, 1: {"lr": 4e-4, "healed": True}},
    }
    # the job lost its state: a second line of steps numbers them again, from other weights
    again = _summed(1, 1, 99.0, 8e-4)
    again.pid, again.time = 2, 100.0
    assert first_divergence([*together, again]) is None


def test_goodput_torchft_replica_id_names_its_group() -> None:
    from benchmarks._goodput_torchft_worker import group_of

    assert group_of("torchtitan_ft_2:5f0c6a0e-1d2b") == 2
    assert group_of("torchtitan_ft_11") == 11


def test_goodput_reads_records_on_from_where_it_stopped(tmp_path: Path) -> None:
    """Whole lines only: a line being written is taken once it ends."""
    from benchmarks._goodput_accounts import RecordReader

    line = {"step": 1, "committed": True, "consumed": [1], "participants": [0]}
    line |= {"loss": 2.0, "rss_mb": 1.0, "fds": 3}
    path = tmp_path / "steps_r0_p42.jsonl"
    text = json.dumps({**line, "time": 1.0}) + "\n" + json.dumps({**line, "time": 2.0})
    path.write_text(text[:-5])  # the second line half written
    reader = RecordReader(tmp_path)
    assert [(r.group, r.pid, r.time) for r in reader.read()] == [(0, 42, 1.0)]
    path.write_text(text + "\n")
    assert [r.time for r in reader.read()] == [1.0, 2.0]
    assert [r.time for r in reader.read()] == [1.0, 2.0]


def test_goodput_names_a_process_that_trained_its_own_line() -> None:
    """A replacement that heals commits at the job's step; one that commits below it started
    a second line of steps."""
    from torchtitan_ft.testing.goodput_accounting import second_lines

    records = [_torchft_record(0, s, True, True, s) for s in (1, 2, 3)]
    healed = _torchft_record(1, 4, True, False, 10)
    healed.pid = 2
    fresh = _torchft_record(2, 1, True, True, 11)
    fresh.pid = 3
    assert second_lines([*records, healed]) == []
    assert second_lines([*records, healed, fresh]) == [
        {"group": 2, "pid": 3, "step": 1, "job_step": 4, "time": 11.0}
    ]


@pytest.mark.parametrize(
    ("method", "interval"),
    [
        ("ideal", None),
        ("torchtitan_ft", 7),
        ("torchtitan_ft_spare", 7),
        ("torchft", 7),
        ("checkpoint_restart", 7),
    ],
)
def test_goodput_every_method_but_ideal_writes_checkpoints(
    tmp_path: Path, method: str, interval: int | None
) -> None:
    """The FT methods write TorchTitan checkpoints at checkpoint-restart's interval, as users
    run them; the fault-free baseline writes none, so their cost is in the others' figures."""
    from benchmarks._goodput_job import Method, checkpoint_every
    from benchmarks._goodput_launch import Launcher
    from benchmarks.goodput import options, parse

    opts = options(parse(["--quick", "--checkpoint-every", "7", "--out", str(tmp_path)]))
    assert checkpoint_every(Method(method), opts) == interval
    flags = Launcher(Method(method), opts, tmp_path / method)._checkpoint_flags()
    if interval is None:
        assert flags == ()
    else:
        assert "--checkpoint.enable" in flags and "--checkpoint.interval=7" in flags
        assert f"--checkpoint.folder={tmp_path / method / 'checkpoint'}" in flags


def test_goodput_counts_a_state_loss_s_rolled_back_samples_and_waits_for_them(
    tmp_path: Path,
) -> None:
    """Two groups commit steps 1-4 (4 samples each), a correlated kill takes both, and their
    replacements go on from the checkpoint of step 2: steps 3 and 4 are rolled back (8
    samples), counted as such on the loss and its fault, not as trained twice, and the job
    reaches 16 samples when it commits step 4 again, not the first time."""
    from benchmarks._goodput_accounts import Accounts, Record
    from benchmarks._goodput_job import Injected, Method
    from benchmarks.goodput import options, parse
    from torchtitan_ft.testing.faults import Fault, FaultKind

    opts = options(parse(["--quick", "--groups", "2", "--out", str(tmp_path)]))

    def step(group: int, pid: int, time: float, n: int) -> Record:
        return Record(group, pid, time, n, True, [n, n], [0, 1], 1.0, 100.0, 10)

    records = [step(g, 1 + g, float(n), n) for n in (1, 2, 3, 4) for g in (0, 1)]
    records += [step(g, 3 + g, float(n + 3), n) for n in (3, 4, 5) for g in (0, 1)]
    accounts = Accounts(Method.TORCHTITAN_FT, opts, started=0.0)
    accounts.t0 = 0.0
    fault = Injected(Fault(4.5, FaultKind.CORRELATED, (0, 1), 0), 4.5, [0, 1], effect="kill")
    out = accounts.summary(records, {}, [fault], job_restarts=0, target=16)
    assert [
        (x["job_step"], x["to_step"], x["samples_rolled_back"]) for x in out["state_losses"]
    ] == [(4, 3, 8)]
    assert out["samples_rolled_back"] == 8 and out["job_restarts"] == 1
    assert out["faults"][0]["samples_rolled_back"] == 8 and out["faults"][0]["state_lost"]
    assert out["faults_survived"] == 0
    assert out["time_to_target_s"] == 7.0  # step 4 committed again (not 4.0, the first time)
    assert accounts.samples_now(records) == 20


def test_goodput_stops_only_after_every_group_trained_together_again(tmp_path: Path) -> None:
    """The run stops once every group took part in a commit after the stop began: a fault that
    struck as the target was reached (two groups killed just after a step of all three) must
    not let the survivor stop alone while the others come back, which then find no holder."""
    from benchmarks._goodput_accounts import Accounts, Record
    from benchmarks._goodput_job import Method
    from benchmarks.goodput import options, parse

    opts = options(parse(["--quick", "--out", str(tmp_path)]))
    accounts = Accounts(Method.TORCHTITAN_FT, opts, started=0.0)

    def step(time: float, participants: list[int], committed: bool = True) -> Record:
        return Record(2, 9, time, 1, committed, [1, 1, 1], participants, 1.0, 100.0, 10)

    before = [step(1.0, [0, 1, 2])]
    assert not accounts.trained_together_since(before, since=2.0)
    assert not accounts.trained_together_since([*before, step(3.0, [2])], since=2.0)
    assert not accounts.trained_together_since([*before, step(3.0, [0, 1, 2], False)], 2.0)
    assert accounts.trained_together_since([*before, step(4.0, [0, 1, 2])], since=2.0)


@pytest.mark.slow  # tests/manager/test_rounds.py and test_security.py test the restart itself
@pytest.mark.timeout(300)
def test_group_restart_prints_how_long_a_restarted_group_took() -> None:
    out = _benchmark("benchmarks.group_restart", "--trials", "1", timeout=270)
    assert out["world_size"] == 2 and len(out["back_s"]) == 1
    assert out["back_s"][0] > 0 and out["back_s_max"] == out["back_s"][0]


@pytest.mark.slow  # tests/launchers/test_slurm.py tests the runner; job starts take minutes
@pytest.mark.timeout(900)
def test_slurm_kill_loop_prints_the_groups_back_and_their_times() -> None:
    from torchtitan_ft.testing.slurm_cluster import missing_daemons

    if missing := missing_daemons():
        pytest.skip(f"{', '.join(missing)} missing: scripts/install_slurm.sh")
    out = _benchmark(
        "benchmarks.slurm_kill_loop",
        *("--groups", "2", "--kills", "1", "--mtbf_secs", "0.5", "--budget_s", "300"),
        *("--standbys", "1"),
        timeout=880,
    )
    assert out["kills"] == out["groups_back"] == 1 and len(out["back_s"]["all"]) == 1
    assert out["replaced_by_standby"] == 1 and out["standby_warmup_s"]["count"] >= 1
    assert out["runner_outcome"] == "done" and out["whole_job_restarts"] == 0
    assert out["identical_end"] is True


@pytest.mark.timeout(400)
def test_native_pg_prints_both_group_types_or_why_not() -> None:
    import torch
    import torch.distributed as dist

    if not hasattr(dist.ProcessGroup, "reconfigure"):  # torch 2.13: one line and exit 2
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks.native_pg"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2
        assert torch.__version__ in result.stdout  # the line names the installed torch
        return
    out = _benchmark("benchmarks.native_pg", "--trials", "1", "--numel", "1024", timeout=360)
    figures = {
        "membership_ms",
        "membership_form_ms",
        "steady_allreduce_ms",
        "hung_release_ms",
        "hung_usable_ms",
        "kill_detect_ms",
        "kill_usable_ms",
    }
    assert set(out["results"]) == {"ours", "native"}
    assert all(set(r) == figures for r in out["results"].values()), out["results"]
    assert out["faster_membership"] in out["results"]


@pytest.mark.parametrize(
    ("method", "flags"),
    [
        (
            "torchtitan_ft",
            ["--fault_tolerance.group_size=3", "--fault_tolerance.min_replica_size=1"],
        ),
        (
            "torchtitan_ft_spare",
            [
                "--fault_tolerance.group_size=4",
                "--fault_tolerance.min_replica_size=3",
                "--fault_tolerance.world_size_mode=fixed_with_spares",
            ],
        ),
    ],
)
def test_goodput_spare_method_launches_a_hot_spare_group(
    tmp_path: Path, method: str, flags: list[str]
) -> None:
    """torchtitan_ft_spare launches ``--groups`` + 1 groups, every one with
    ``fixed_with_spares`` and ``min_replica_size = --groups`` (as benchmarks.recovery's spare
    row): ``--groups`` of them average each step, the last launched is the spare."""
    from types import SimpleNamespace

    from benchmarks._goodput_job import Method, launched_groups
    from benchmarks._goodput_launch import Launcher
    from benchmarks.goodput import options, parse

    opts = options(parse(["--quick", "--methods", "ideal", method, "--out", str(tmp_path)]))
    launcher = Launcher(Method(method), opts, tmp_path / method)
    last = launched_groups(Method(method), opts) - 1
    assert last == (3 if method == "torchtitan_ft_spare" else 2)
    launch = launcher._group_launch(last, SimpleNamespace(address="http://127.0.0.1:1"), None)
    try:
        assert set(flags) <= set(launch.argv), launch.argv
        assert f"--fault_tolerance.replica_id={last}" in launch.argv
        if method == "torchtitan_ft":
            assert not any("world_size_mode" in a for a in launch.argv)
    finally:
        launch.limits[0].close()


def test_goodput_runs_the_spare_method_only_when_named(tmp_path: Path) -> None:
    from benchmarks.goodput import parse

    assert "torchtitan_ft_spare" not in parse(["--out", str(tmp_path)]).methods
    named = parse(["--methods", "ideal", "torchtitan_ft_spare", "--out", str(tmp_path)])
    assert named.methods == ["ideal", "torchtitan_ft_spare"]


def test_goodput_spare_schedule_keeps_the_faults_and_draws_victims_among_every_group() -> None:
    """The spare's run has the schedule's times, kinds and ranks; its victims are drawn over
    the launched groups, the spare included (it is hit as often as any group), the same for
    the same seed; the correlated kind takes all of them."""
    from benchmarks._goodput_inject import spare_schedule
    from torchtitan_ft.testing.faults import DEFAULT_KINDS, Fault, FaultKind, fault_schedule

    schedule = fault_schedule(
        5, start_s=0, end_s=3000, mean_interval_s=10, min_interval_s=1, groups=3, ranks=2,
        kinds=DEFAULT_KINDS,
    )  # fmt: skip
    spare = spare_schedule(schedule, 5, 4)
    assert [(f.at_s, f.kind, f.rank, len(f.groups)) for f in spare] == [
        (f.at_s, f.kind, f.rank, len(f.groups)) for f in schedule
    ]
    assert all(set(f.groups) <= {0, 1, 2, 3} and len(set(f.groups)) == len(f.groups) for f in spare)
    hits = [g for f in spare for g in f.groups]
    assert all(hits.count(g) > len(hits) / 8 for g in range(4)), hits  # each about 1/4
    assert spare_schedule(schedule, 5, 4) == spare
    assert spare_schedule(schedule, 6, 4) != spare
    correlated = Fault(1.0, FaultKind.CORRELATED, (0, 1, 2), 0)
    assert spare_schedule([correlated], 5, 4)[0].groups == (0, 1, 2, 3)


def _spare_record(
    group: int, time: float, step: int, consumed: list[int], participants: list[int], **kw: Any
):
    from benchmarks._goodput_accounts import Record

    return Record(group, 100 + group, time, step, True, consumed, participants, 1.0, 0.0, 0, **kw)


@pytest.mark.parametrize(
    ("spare_records", "running", "struck", "expected"),
    [
        # the spare (group 2) took the latest step's update without a slot: it holds the state
        ([_spare_record(2, 5.1, 5, [5, 5, 0], [0, 1])], [0, 1, 2], {}, [0, 1, 2]),
        # one step behind (its record of step 5 not yet written): still in step
        ([_spare_record(2, 4.1, 4, [4, 4, 0], [0, 1])], [0, 1, 2], {}, [0, 1, 2]),
        # two steps behind: not in step
        ([_spare_record(2, 3.1, 3, [3, 3, 0], [0, 1])], [0, 1, 2], {}, [0, 1]),
        # its newest record is its healing step: it holds what it healed to only from the next
        ([_spare_record(2, 5.1, 5, [5, 5, 0], [], healed=True)], [0, 1, 2], {}, [0, 1]),
        # not every rank of it runs
        ([_spare_record(2, 5.1, 5, [5, 5, 0], [0, 1])], [0, 1], {}, [0, 1]),
        # struck after its last record: not a holder until it is in step again
        ([_spare_record(2, 5.1, 5, [5, 5, 0], [0, 1])], [0, 1, 2], {2: 5.2}, [0, 1]),
    ],
)
def test_goodput_counts_an_in_step_hot_spare_among_the_state_s_holders(
    spare_records: list, running: list[int], struck: dict[int, float], expected: list[int]
) -> None:
    """Groups 0 and 1 hold the slots and committed step 5; group 2 is the spare, which no
    step's participants name. Without a spare job the same records give the participants only."""
    from benchmarks._goodput_inject import state_holders

    slots = [_spare_record(g, 5.0, 5, [5, 5, 0], [0, 1]) for g in (0, 1)]
    records = sorted([*slots, *spare_records], key=lambda r: r.time)
    assert state_holders(records, running, struck, spare=True) == expected
    assert state_holders(records, running, struck, spare=False) == [0, 1]


def test_goodput_spare_s_steps_without_a_slot_are_not_trained_samples(tmp_path: Path) -> None:
    """``--groups 2``, one rank each, and a spare (group 2). Steps 1-3: groups 0 and 1 train
    (2 samples each per step), the spare takes the update without a slot and its own slice
    stays unread. Group 1 is killed after step 3; the spare takes its slot at step 4 (its slice
    is read from then on); group 1's replacement heals at step 5 and is in step at step 6. The
    job's samples are the ledger's: 4 per step whoever trains, none for the spare's steps
    without a slot; group 1 is back when it is in step again; every launched group's quota is
    paid for."""
    from benchmarks._goodput_accounts import Accounts
    from benchmarks._goodput_job import Injected, Method
    from benchmarks.goodput import options, parse, per_cpu_goodput
    from torchtitan_ft.testing.faults import Fault, FaultKind

    opts = options(
        parse(["--quick", "--groups", "2", "--methods", "ideal", "torchtitan_ft_spare",
               "--cpus-per-group", "0.25", "--out", str(tmp_path)])
    )  # fmt: skip
    accounts = Accounts(Method.TORCHTITAN_FT_SPARE, opts, started=0.0)
    accounts.t0 = 0.0
    rec = _spare_record
    records = []
    for n in (1, 2, 3):
        records += [rec(g, n + g / 10, n, [n, n, 0], [0, 1]) for g in (0, 1, 2)]
    assert accounts.training_started(records)
    assert not accounts.training_started([r for r in records if r.group != 2])
    assert accounts.samples_now(records) == 12  # 3 steps x 2 groups x 2 samples
    records += [rec(g, 4 + g / 10, 4, [4, 3, 1], [0, 2]) for g in (0, 2)]
    records += [rec(1, 5.0, 5, [5, 3, 2], [], healed=True)]  # group 1's replacement heals
    records[-1].pid = 201
    records += [rec(g, 5 + g / 10, 5, [5, 3, 2], [0, 2]) for g in (0, 2)]
    for g in (0, 1, 2):
        records += [rec(g, 6 + g / 10, 6, [6, 3, 3], [0, 2])]
    records[-2].pid = 201
    records.sort(key=lambda r: r.time)
    assert accounts.samples_now(records) == 24  # 6 steps x 4: none for the spare's 1-3
    assert accounts.trained_together_since(records, since=5.5)
    assert not accounts.trained_together_since(records[:-1], since=5.5)  # the spare not yet
    kill = Injected(Fault(3.5, FaultKind.SIGKILL, (1,), 0), 3.5, [1], effect="kill")
    out = accounts.summary(records, {}, [kill], job_restarts=0, target=24)
    assert out["time_to_target_s"] == 6.0
    assert out["faults"][0]["stall_s"] == 0.5  # the spare's step 4 passed the samples at 3.5
    assert out["faults"][0]["rejoin_s"] == 2.6  # group 1 in step again at step 6
    assert out["faults_survived"] == 1
    assert out["launched_groups"] == 3 and out["cpus_quota"] == 0.75
    assert out["cpu_s_to_target"] == 4.5 and out["samples_per_cpu_s"] == pytest.approx(
        24 / 4.5, 1e-3
    )
    # ideal's two groups took the same 6 s: the same goodput, two thirds of it per CPU-second
    ideal = {"target_samples": 24, "time_to_target_s": 6.0, "cpus_quota": 0.5}
    assert per_cpu_goodput(out, ideal) == pytest.approx(0.667)
    assert per_cpu_goodput({**out, "time_to_target_s": None}, ideal) is None


def test_goodput_a_spare_victim_is_back_when_it_is_in_step_again(tmp_path: Path) -> None:
    """A spare never takes part in a step while the slots are full: it is back once its
    replacement commits a step it did not heal in."""
    from benchmarks._goodput_accounts import Accounts
    from benchmarks._goodput_job import Injected, Method
    from benchmarks.goodput import options, parse
    from torchtitan_ft.testing.faults import Fault, FaultKind

    opts = options(parse(["--quick", "--groups", "2", "--out", str(tmp_path)]))
    accounts = Accounts(Method.TORCHTITAN_FT_SPARE, opts, started=0.0)
    accounts.t0 = 0.0
    rec = _spare_record
    records = [rec(g, 1 + g / 10, 1, [1, 1, 0], [0, 1]) for g in (0, 1, 2)]
    records += [rec(g, 2 + g / 10, 2, [2, 2, 0], [0, 1]) for g in (0, 1)]
    healing = rec(2, 3.2, 3, [3, 3, 0], [], healed=True)
    back = rec(2, 4.2, 4, [4, 4, 0], [0, 1])
    healing.pid = back.pid = 302
    records += [
        healing,
        *(rec(g, n + g / 10, n, [n, n, 0], [0, 1]) for n in (3, 4) for g in (0, 1)),
    ]
    records = sorted([*records, back], key=lambda r: r.time)
    kill = Injected(Fault(1.5, FaultKind.SIGKILL, (2,), 0), 1.5, [2], effect="kill")
    out = accounts.summary(records, {}, [kill], job_restarts=0, target=16)
    assert out["faults"][0]["rejoin_s"] == 2.7 and out["faults_survived"] == 1
    # the same records in a job without a spare: the group never took part, never back
    plain = Accounts(Method.TORCHTITAN_FT, opts, started=0.0)
    plain.t0 = 0.0
    kill = Injected(Fault(1.5, FaultKind.SIGKILL, (2,), 0), 1.5, [2], effect="kill")
    out = plain.summary(records, {}, [kill], job_restarts=0, target=16)
    assert out["faults"][0]["rejoin_s"] is None and out["faults_survived"] == 0
