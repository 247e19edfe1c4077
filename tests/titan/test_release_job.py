"""``torchtitan_ft.titan.releases.job``: one job description spelled as each release's
``run_train.sh`` command, without starting a process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchtitan_ft.titan.releases import Release, installed
from torchtitan_ft.titan.releases.job import RUN_TRAIN, FtGroup, TitanJob, command

TOML = Path("/configs/debug_ft_cpu.toml")
FT = FtGroup(
    replica_id=1,
    group_size=3,
    lighthouse="http://127.0.0.1:4000",
    min_replica_size=2,
    quorum_timeout_ms=9000,
)


@pytest.mark.parametrize(
    ("release", "dump_flag"),
    [(Release.V0_2, "--job.dump_folder"), (Release.V0_3, "--dump_folder")],
)
def test_a_replica_group_on_each_release(release: Release, dump_flag: str) -> None:
    job = TitanJob(
        dump_folder=Path("/out/dump"),
        steps=30,
        config_file=TOML,
        ft=FT,
        events_dir=Path("/out/events"),
        python="/venv/bin/python",
        flags=("--metrics.log_freq=1",),
    )
    cmd = command(job, release)
    assert cmd.release is release
    assert cmd.argv == (
        str(RUN_TRAIN),
        *("--training.steps", "30", dump_flag, "/out/dump"),
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id=1",
        "--fault_tolerance.group_size=3",
        "--fault_tolerance.min_replica_size=2",
        "--fault_tolerance.quorum_timeout_ms=9000",
        "--metrics.log_freq=1",
    )
    assert cmd.env == {
        "NGPU": "1",
        "PYTHON": "/venv/bin/python",
        "OMP_NUM_THREADS": "1",
        "CONFIG_FILE": str(TOML),
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:4000",
        "TORCHFT_EVENTS_DIR": "/out/events",
    }


@pytest.mark.parametrize(
    ("release", "config_file", "expected"),
    [
        # 0.3.0: the registry config, the TOML file over it
        (
            Release.V0_3,
            TOML,
            {"CONFIG_FILE": str(TOML), "MODULE": "llama3", "CONFIG": "llama3_debugmodel"},
        ),
        (Release.V0_3, None, {"MODULE": "llama3", "CONFIG": "llama3_debugmodel"}),
        # 0.2.2: the TOML file is the whole config; the names pick one of configs/ without it
        (Release.V0_2, TOML, {"CONFIG_FILE": str(TOML)}),
        (Release.V0_2, None, {"MODULE": "llama3", "CONFIG": "llama3_debugmodel"}),
    ],
)
def test_the_config_as_each_release_names_it(
    release: Release, config_file: Path | None, expected: dict[str, str]
) -> None:
    job = TitanJob(
        config_file=config_file, module="llama3", config="llama3_debugmodel", python="/py"
    )
    env = dict(command(job, release).env)
    assert {k: env.pop(k) for k in ("NGPU", "PYTHON", "OMP_NUM_THREADS")} == {
        "NGPU": "1",
        "PYTHON": "/py",
        "OMP_NUM_THREADS": "1",
    }
    assert env == expected
    assert command(job, release).argv == (str(RUN_TRAIN),)  # nothing else was asked for


def test_the_job_s_own_environment_wins_and_the_prefix_goes_first() -> None:
    job = TitanJob(
        ngpu=2,
        ft=FtGroup(replica_id=0),
        train_file="torchtitan_ft.testing.titan_dump",
        env={"OMP_NUM_THREADS": "4", "NGPU": "3"},
        prefix=("ip", "netns", "exec", "h0"),
    )
    cmd = command(job)
    assert cmd.release is installed()
    assert cmd.env["NGPU"] == "3" and cmd.env["OMP_NUM_THREADS"] == "4"
    assert cmd.env["PYTHON"] == sys.executable
    assert cmd.env["TRAIN_FILE"] == "torchtitan_ft.testing.titan_dump"
    assert "TORCHFT_LIGHTHOUSE" not in cmd.env  # the caller's, else run_train.sh's default
    assert cmd.argv == (
        *("ip", "netns", "exec", "h0"),
        str(RUN_TRAIN),
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id=0",
    )
    assert cmd.environ({"HOME": "/h", "NGPU": "9"}) == {"HOME": "/h", **cmd.env}


def test_another_release_needs_its_python() -> None:
    other = next(r for r in Release if r is not installed())
    with pytest.raises(ValueError, match=rf"TorchTitan {other.value} job.*TitanJob.python"):
        command(TitanJob(steps=1), other)
    assert command(TitanJob(steps=1, python="/other/python"), other).release is other
