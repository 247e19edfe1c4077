"""The table of timeouts and their relations (``torchtitan_ft.timeouts``): each wrong order,
set through the ``fault_tolerance`` config, through ``TORCHFT_*`` variables or through the
Manager's arguments, stops at start with one line naming the relation, the values and values
that satisfy it; the defaults satisfy every relation; a timeout far above the measured step is
reported once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from torchtitan_ft import timeouts
from torchtitan_ft.manager.settings import resolve_manager_settings, timeout_values
from torchtitan_ft.timeouts import (
    BY_KEY,
    RELATIONS,
    TIMEOUTS,
    Key,
    OversizeWatch,
    check_order,
    defaults,
    oversized,
    violations,
)
from torchtitan_ft.titan.config import ConfigError, parse_job
from torchtitan_ft.titan.preflight import check_manager_env, check_timeout_order

FT_ON = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]


def _relation(lower: Key, upper: Key) -> timeouts.Relation:
    (found,) = [r for r in RELATIONS if (r.lower, r.upper) == (lower, upper)]
    return found


def test_the_defaults_satisfy_every_relation() -> None:
    assert violations(defaults()) == []
    # ... and so do the config's defaults, with TorchTitan's comm defaults.
    job = parse_job(FT_ON).config
    check_timeout_order(job.fault_tolerance, job)
    check_manager_env(job, {})


def test_every_relation_names_timeouts_of_the_table() -> None:
    for r in RELATIONS:
        assert r.lower in BY_KEY and r.upper in BY_KEY and r.lower != r.upper
        assert r.why and r.factor >= 1
    assert len({t.key for t in TIMEOUTS}) == len(TIMEOUTS) == len(Key)


def test_a_relation_holds_at_its_bound_unless_strict() -> None:
    plain = _relation(Key.PROCESS_GROUP, Key.STEP)
    assert plain.holds(10, 10) and plain.holds(10, 11) and not plain.holds(10, 9.999)
    strict = _relation(Key.PROCESS_GROUP, Key.TITAN_TRAIN)
    assert not strict.holds(10, 10) and strict.holds(10, 10.001)
    tenfold = _relation(Key.HEARTBEAT_INTERVAL, Key.HEARTBEAT)
    assert tenfold.holds(0.5, 5) and not tenfold.holds(0.6, 5)


# (arguments, the relation broken first, the values the message must name, fixes it names)
CONFIG_CASES = [
    (
        [
            "--fault_tolerance.process_group_timeout_ms=30000",
            "--fault_tolerance.step_timeout_ms=20000",
        ],
        (Key.PROCESS_GROUP, Key.STEP),
        ["fault_tolerance.step_timeout_ms=20000", "process_group_timeout_ms=30000"],
        ["step_timeout_ms to at least 30000", "process_group_timeout_ms to at most 20000"],
    ),
    (
        ["--fault_tolerance.connect_timeout_ms=90000"],
        (Key.CONNECT, Key.QUORUM),
        ["fault_tolerance.quorum_timeout_ms=60000", "fault_tolerance.connect_timeout_ms=90000"],
        ["quorum_timeout_ms to at least 90000", "connect_timeout_ms to at most 60000"],
    ),
    (  # the example: it started, and failed later as "no quorum from the lighthouse"
        [
            "--fault_tolerance.process_group_timeout_ms=30000",
            "--fault_tolerance.quorum_timeout_ms=5000",
            "--fault_tolerance.connect_timeout_ms=5000",
        ],
        (Key.PROCESS_GROUP, Key.QUORUM),
        ["fault_tolerance.quorum_timeout_ms=5000", "process_group_timeout_ms=30000"],
        ["quorum_timeout_ms to at least 30000", "process_group_timeout_ms to at most 5000"],
    ),
    (
        [
            "--fault_tolerance.step_timeout_ms=15000",
            "--fault_tolerance.heal_stall_timeout_ms=15000",
        ],
        (Key.HEAL_STALL, Key.STEP),
        ["fault_tolerance.step_timeout_ms=15000", "fault_tolerance.heal_stall_timeout_ms=15000"],
        ["step_timeout_ms to above 15000", "heal_stall_timeout_ms to below 15000"],
    ),
    (
        ["--fault_tolerance.process_group_timeout_ms=30000", "--comm.train_timeout_seconds=20"],
        (Key.PROCESS_GROUP, Key.TITAN_TRAIN),
        ["comm.train_timeout_seconds=20", "fault_tolerance.process_group_timeout_ms=30000"],
        ["train_timeout_seconds to above 30", "process_group_timeout_ms to below 20000"],
    ),
    (
        ["--fault_tolerance.process_group_timeout_ms=30000", "--comm.init_timeout_seconds=30"],
        (Key.PROCESS_GROUP, Key.TITAN_INIT),
        ["comm.init_timeout_seconds=30", "fault_tolerance.process_group_timeout_ms=30000"],
        ["init_timeout_seconds to above 30", "process_group_timeout_ms to below 30000"],
    ),
]


def _one_line(error: BaseException, names: list[str]) -> str:
    message = str(error)
    assert "\n" not in message, message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    return message


@pytest.mark.parametrize(("args", "relation", "values", "fixes"), CONFIG_CASES)
def test_each_wrong_order_through_the_config_stops_the_parse(
    args: list[str], relation: tuple[Key, Key], values: list[str], fixes: list[str]
) -> None:
    """The parse (``validate_job_config``) runs the check; the message's formula names the
    relation broken first."""
    with pytest.raises(ConfigError) as error:
        parse_job([*FT_ON, *args])
    _one_line(error.value, [*values, *fixes, f"({_relation(*relation).formula()})"])


def test_every_relation_checked_at_start_has_a_config_case() -> None:
    nowhere = timeouts.CheckedAt.NOWHERE
    checked = {(r.lower, r.upper) for r in RELATIONS if r.checked_at is not nowhere}
    assert checked == {relation for _, relation, _, _ in CONFIG_CASES}


# Relations with a side a TORCHFT_* variable sets (the fields left unset).
ENV_CASES = [
    (
        {"TORCHFT_TIMEOUT_SEC": "5"},
        (Key.PROCESS_GROUP, Key.STEP),
        ["env TORCHFT_TIMEOUT_SEC=5 (as fault_tolerance.step_timeout_ms is not set)"],
        ["TORCHFT_TIMEOUT_SEC to at least 10"],
    ),
    (
        {"TORCHFT_CONNECT_TIMEOUT_SEC": "120"},
        (Key.CONNECT, Key.QUORUM),
        ["env TORCHFT_CONNECT_TIMEOUT_SEC=120", "fault_tolerance.quorum_timeout_ms=60000"],
        ["TORCHFT_CONNECT_TIMEOUT_SEC to at most 60"],
    ),
    (
        {"TORCHFT_QUORUM_TIMEOUT_SEC": "5", "TORCHFT_CONNECT_TIMEOUT_SEC": "5"},
        (Key.PROCESS_GROUP, Key.QUORUM),
        ["env TORCHFT_QUORUM_TIMEOUT_SEC=5", "fault_tolerance.process_group_timeout_ms=10000"],
        ["TORCHFT_QUORUM_TIMEOUT_SEC to at least 10"],
    ),
    (
        {"TORCHFT_HEAL_STALL_TIMEOUT_SEC": "60"},
        (Key.HEAL_STALL, Key.STEP),
        [
            "env TORCHFT_HEAL_STALL_TIMEOUT_SEC=60 (as fault_tolerance.heal_stall_timeout_ms is "
            "not set)",
            "fault_tolerance.step_timeout_ms=60000",
        ],
        ["TORCHFT_HEAL_STALL_TIMEOUT_SEC to below 60"],
    ),
]


@pytest.mark.parametrize(("env", "relation", "values", "fixes"), ENV_CASES)
def test_each_wrong_order_through_variables_stops_at_start(
    env: dict[str, str], relation: tuple[Key, Key], values: list[str], fixes: list[str]
) -> None:
    job = parse_job(FT_ON).config
    with pytest.raises(ConfigError) as error:
        check_manager_env(job, env)
    _one_line(error.value, [*values, *fixes, _relation(*relation).formula()])
    # A field the user set wins over its variable, which then cannot break the order.
    fields = [f"--fault_tolerance.{f}=60000" for f in ("step_timeout_ms", "quorum_timeout_ms")]
    fields += ["--fault_tolerance.connect_timeout_ms=60000"]
    fields += ["--fault_tolerance.heal_stall_timeout_ms=10000"]
    check_manager_env(parse_job([*FT_ON, *fields]).config, env)


@pytest.mark.parametrize(
    ("env", "args", "pg_s", "relation", "names"),
    [
        (
            {"TORCHFT_TIMEOUT_SEC": "10"},
            {},
            30.0,
            (Key.PROCESS_GROUP, Key.STEP),
            ["env TORCHFT_TIMEOUT_SEC=10", "the process group's timeout=30"],
        ),
        (
            {},
            {"connect_timeout": timedelta(seconds=90)},
            None,
            (Key.CONNECT, Key.QUORUM),
            ["Manager(quorum_timeout)=60 (default)", "Manager(connect_timeout)=90"],
        ),
        (
            {"TORCHFT_QUORUM_TIMEOUT_SEC": "5"},
            {"connect_timeout": timedelta(seconds=5)},
            30.0,
            (Key.PROCESS_GROUP, Key.QUORUM),
            ["env TORCHFT_QUORUM_TIMEOUT_SEC=5", "TORCHFT_QUORUM_TIMEOUT_SEC to at least 30"],
        ),
        (
            {"TORCHFT_HEAL_STALL_TIMEOUT_SEC": "5"},
            {"timeout": timedelta(seconds=5)},
            None,
            (Key.HEAL_STALL, Key.STEP),
            ["env TORCHFT_HEAL_STALL_TIMEOUT_SEC=5", "Manager(timeout)=5"],
        ),
        (
            {},
            {"timeout": timedelta(seconds=20), "heal_stall_timeout": timedelta(seconds=30)},
            None,
            (Key.HEAL_STALL, Key.STEP),
            ["Manager(heal_stall_timeout)=30", "Manager(heal_stall_timeout) to below 20"],
        ),
    ],
)
def test_each_wrong_order_of_a_plain_manager_is_refused(
    env: dict[str, str],
    args: dict[str, Any],
    pg_s: float | None,
    relation: tuple[Key, Key],
    names: list[str],
) -> None:
    settings = resolve_manager_settings(env=env, **args)
    values = timeout_values(settings, None if pg_s is None else timedelta(seconds=pg_s))
    (first, *_) = violations(values)
    assert (first.relation.lower, first.relation.upper) == relation
    with pytest.raises(ValueError) as error:
        check_order(values)
    _one_line(error.value, names)


def test_the_stall_timeout_at_its_default_yields_to_a_short_step_timeout() -> None:
    """Only a stall timeout that was set is held to the relation: at its default (10 s) beside
    a step timeout of 10 s or less the transport does not apply it, as before it existed."""
    settings = resolve_manager_settings(env={}, timeout=timedelta(seconds=5))
    assert Key.HEAL_STALL not in timeout_values(settings, None)
    check_order(timeout_values(settings, None))
    short = ["--fault_tolerance.step_timeout_ms=10000"]
    job = parse_job([*FT_ON, *short]).config
    check_manager_env(job, {})
    with pytest.raises(ConfigError, match=r"heal_stall_timeout_ms=10000 "):
        parse_job([*FT_ON, *short, "--fault_tolerance.heal_stall_timeout_ms=10000"])


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (
            ["--fault_tolerance.heal_stall_timeout_ms=0"],
            {},
            ["fault_tolerance.heal_stall_timeout_ms=0 must be > 0"],
        ),
        (
            [],
            {"TORCHFT_HEAL_STALL_TIMEOUT_SEC": "ten"},
            ["env var TORCHFT_HEAL_STALL_TIMEOUT_SEC must be a number of seconds", "'ten'"],
        ),
        (
            [],
            {"TORCHFT_HEAL_STALL_TIMEOUT_SEC": "-1"},
            ["env var TORCHFT_HEAL_STALL_TIMEOUT_SEC must be positive", "'-1'"],
        ),
    ],
)
def test_a_bad_stall_timeout_stops_at_start_with_one_line(
    args: list[str], env: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as error:
        check_manager_env(parse_job([*FT_ON, *args]).config, env)
    _one_line(error.value, names)


def test_a_manager_with_timeouts_out_of_order_stops_before_any_server() -> None:
    """The issue's example on a plain Manager: it raised nothing and failed at its first
    quorum. Nothing listens at the lighthouse address: the check comes first."""
    from torchtitan_ft.manager import Manager
    from torchtitan_ft.process_group import ProcessGroupGloo

    with pytest.raises(ValueError, match=r"quorum_timeout.*process group's timeout=30"):
        Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            quorum_timeout=timedelta(seconds=5),
            connect_timeout=timedelta(seconds=5),
            lighthouse_addr="http://127.0.0.1:9",
            rank=0,
            world_size=1,
            hostname="127.0.0.1",
        )


def test_the_managers_stall_timeout_reaches_its_transport() -> None:
    from torchtitan_ft.manager import Manager
    from torchtitan_ft.process_group import ProcessGroupGloo

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        lighthouse_addr="http://127.0.0.1:9",  # nothing listens: no quorum is asked here
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=20),
        heal_stall_timeout=timedelta(seconds=3),
    )
    try:
        assert manager._checkpoint_transport._stall_s == 3.0
    finally:
        manager.shutdown(wait=False)


def test_the_entry_point_stops_on_a_variable_out_of_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main

    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "5")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "5")
    with pytest.raises(SystemExit) as stop:
        main([*FT_ON, "--fault_tolerance.process_group_timeout_ms=30000",
              "--fault_tolerance.lighthouse_addr=http://127.0.0.1:29510",
              "--fault_tolerance.hostname=127.0.0.1"])  # fmt: skip
    assert stop.value.code == 2
    err = capsys.readouterr().err.removesuffix("\n")
    assert err.startswith("torchtitan_ft: config error: timeouts out of order: "), err
    _one_line(ValueError(err), ["env TORCHFT_QUORUM_TIMEOUT_SEC=5", "=30000"])
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------ oversized


def test_a_timeout_far_above_the_step_and_the_floor_is_oversized() -> None:
    values = {Key.STEP: 3000.0, Key.QUORUM: 6000.0, Key.CONNECT: 60.0, Key.JOIN: 9000.0}
    found = oversized(values, step_s=2.0)
    # connect is below the floor; join bounds no wait on a hung peer (not judged)
    assert [(o.key, o.seconds) for o in found] == [(Key.STEP, 3000.0), (Key.QUORUM, 6000.0)]
    assert "1500x the measured step" in found[0].message()
    # A slow job's step makes the same values reasonable.
    assert oversized(values, step_s=700.0) == []
    # The defaults are never oversized, however short the step.
    assert oversized({t.key: t.default_s for t in TIMEOUTS}, step_s=0.001) == []
    with pytest.raises(ValueError, match="step_s must be > 0"):
        oversized(values, step_s=0)


def test_the_watch_judges_once_on_the_median_after_the_first_step() -> None:
    watch = OversizeWatch({Key.STEP: 700.0})
    answers = [watch.step(s) for s in (500.0, 1.0, 1.0, 100.0, 1.0, 1.0, 1.0, 1.0)]
    # the first step (start-up, heal) does not count; the fifth measured one decides
    assert answers[:5] == [None] * 5
    assert [o.key for o in answers[5] or []] == [Key.STEP]
    assert answers[6:] == [None, None]
    slow = OversizeWatch({Key.STEP: 700.0})
    decided = [slow.step(s) for s in (1.0, 80.0, 80.0, 80.0, 80.0, 80.0)]
    assert decided[-1] == []
