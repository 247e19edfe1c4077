"""``torchtitan_ft.titan.launch``: torchrun, silent after a worker's one-line config error only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan_ft.manager import state_loss
from torchtitan_ft.titan.launch import STATE_LOST_EXIT, USER_ERROR_EXIT, _explained


def _launch(tmp_path: Path, exit_code: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(
        f"import sys\nprint('worker says why', file=sys.stderr)\nsys.exit({exit_code})\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.titan.launch", "--nproc_per_node=2",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


# The default tier: tests/titan/test_user_errors.py::
# test_config_error_through_run_train_sh_is_the_workers_only_line (the same launcher under
# run_train.sh, a real worker's config error: its one line and nothing from torchrun).
@pytest.mark.slow
@pytest.mark.light
@pytest.mark.multiprocess
def test_config_error_exit_adds_nothing_to_the_workers_line(tmp_path: Path) -> None:
    result = _launch(tmp_path, USER_ERROR_EXIT)
    assert result.returncode == USER_ERROR_EXIT
    assert "worker says why" in result.stderr
    assert "Traceback" not in result.stderr
    assert "failed (exitcode" not in result.stderr


@pytest.mark.light
@pytest.mark.multiprocess
def test_other_failures_keep_torchruns_report(tmp_path: Path) -> None:
    result = _launch(tmp_path, 4)
    assert result.returncode != 0
    assert "failed (exitcode: 4)" in result.stderr
    assert "ChildFailedError" in result.stderr


def _failure(exitcode: int, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


@pytest.mark.parametrize(
    ("failures", "explained"),
    [
        ([_failure(2, 1)], 2),
        ([_failure(2, 1), _failure(2, 2)], 2),
        ([_failure(2, 1), _failure(-15, 2)], 2),  # torchrun stopped the other rank
        ([_failure(-15, 1), _failure(2, 2)], None),  # something else stopped it first
        ([_failure(2, 1), _failure(1, 2)], None),  # another rank crashed
        ([_failure(1, 1)], None),
        ([], None),
        ([_failure(3, 1), _failure(3, 2)], 3),  # the job's state was lost (on_state_loss)
        ([_failure(3, 1), _failure(-15, 2)], 3),
        ([_failure(3, 1), _failure(2, 2)], None),  # two different stories
    ],
)
def test_which_failures_count_as_explained(failures: list, explained: int | None) -> None:
    assert _explained(failures) == explained


def test_the_launcher_and_the_manager_agree_on_the_state_lost_status() -> None:
    assert STATE_LOST_EXIT == state_loss.STATE_LOST_EXIT


def test_an_empty_error_file_counts_as_none(tmp_path: Path) -> None:
    """A worker killed while writing its error file leaves it empty; torchrun's agent died of
    the JSONDecodeError instead of restarting the group."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from torchtitan_ft.titan.launch import tolerate_torn_error_files

    tolerate_torn_error_files()
    tolerate_torn_error_files()  # once is enough: a second call changes nothing
    torn = tmp_path / "torn.json"
    torn.write_text("")
    failure = ProcessFailure(local_rank=1, pid=42, exitcode=-9, error_file=str(torn))
    assert failure.pid == 42 and not torn.exists()
    whole = tmp_path / "whole.json"
    whole.write_text(
        '{"message": {"message": "RuntimeError: boom", "extraInfo": {"timestamp": "7"}}}'
    )
    assert ProcessFailure(0, 43, 1, str(whole)).timestamp == 7  # a whole file is read as before
