"""TorchTitan's FT doc commands on TorchTitan 0.3.0 (docs/titan.md, "TorchTitan's FT doc,
command by command"), read from the doc's tables: the lighthouse and ``--help`` work as
written; each example (``TRAIN_FILE=torchtitan.experiments.ft.train``, a module 0.3.0 does not
have) stops before torchrun with one line giving its 0.3.0 form, which is 0.3.0's own FT doc
command (the second table; Example 1 keeps its per-step FT); and that form trains (``--full``:
Example 2's, 2 groups of TorchTitan's FaultTolerantTrainer on the compat package)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.titan.test_titan_doc_commands import (
    DOC,
    _start_lighthouse,
    doc_rows,
    scaled_to_ranks,
    split_command,
)
from tests.titan030.test_torchtitan_ft_trainer import (
    NO_ACTIVATION_CHECKPOINTING,
    SMALL_CPU,
    with_compat,
)
from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_jobs import ROOT, TrainRun, finish_all, remaining

MARKER_0_3 = "<!-- doc-commands-0.3.0:"
PER_STEP = ["--fault_tolerance.semi_sync_method", "None"]
FORM = re.compile(r"the 0\.3\.0 form of this command is `(.*)`$")


def doc_rows_0_3() -> dict[str, str]:
    """``{row name: TorchTitan 0.3.0's FT doc command}`` from the table after ``MARKER_0_3``."""
    rows = {}
    for line in DOC.read_text().split(MARKER_0_3, 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] not in ("#", "---"):
            rows[cells[0]] = re.fullmatch(r"`(.*)`", cells[1]).group(1)
    return rows


def run_doc_row(name: str, **env: str) -> subprocess.CompletedProcess:
    """The doc's row ``name`` as written, with this venv's Python."""
    row_env, words = split_command(doc_rows()[name])
    return subprocess.run(
        words,
        cwd=ROOT,
        env={**os.environ, **row_env, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=remaining(180),
    )


def test_the_lighthouse_row_works_as_written() -> None:
    proc, _ = _start_lighthouse(doc_rows()["lighthouse"])
    try:
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_the_options_row_lists_the_ft_fields() -> None:
    result = run_doc_row("options")
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("semi-sync-method", "sync-steps", "num-fragments", "min-replica-size"):
        assert f"--fault-tolerance.{flag}" in result.stdout or (
            f"--fault_tolerance.{flag.replace('-', '_')}" in result.stdout
        ), flag


@pytest.mark.parametrize(
    "name", ["example 1, group 0", "example 1, group 1", "example 2, group 0", "example 2, group 1"]
)
def test_each_example_stops_with_one_line_giving_0_3_0_s_own_command(name: str) -> None:
    result = run_doc_row(name)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    form = FORM.search(line)
    assert form, line
    env, words = split_command(form.group(1))
    titan_env, titan_words = split_command(doc_rows_0_3()[name])
    assert env == titan_env
    # Example 1 keeps 0.2.x's per-step FT; 0.3.0's doc runs its registry config (DiLoCo).
    assert words == titan_words + (PER_STEP if name.startswith("example 1") else [])


@pytest.mark.slow  # 2 groups of TorchTitan's trainer, 10 steps: 1 to 3 min
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_example_2_in_its_0_3_0_form_trains_diloco_in_both_groups(tmp_path: Path) -> None:
    """The refusal's command for Example 2, run as TorchTitan 0.3.0's doc writes it but for
    the edits printed here: 2 ranks per group instead of 4 (NGPU and the shard flag), the
    compat package, a lighthouse of the test's own (the doc's flags, a free port),
    :data:`SMALL_CPU` (batch 2 x 256, no profiler or validator) and no activation
    checkpointing (on this CPU the trainer itself takes ``spmd_backend`` partial_dtensor, one
    line). The registry's sync_steps 10 over 2 fragments: a fragment sync
    at steps 5 and 10, after the initial sync, each with both groups."""
    steps = 10
    proc, address = _start_lighthouse(doc_rows()["lighthouse"])
    try:
        runs = []
        for r in range(2):
            name = f"example 2, group {r}"
            line = run_doc_row(name).stderr.strip()
            env, words = split_command(FORM.search(line).group(1))
            env, words, edits = scaled_to_ranks(env, words, 2)
            extra = [*SMALL_CPU, NO_ACTIVATION_CHECKPOINTING]
            for edit in [*edits, "+ PYTHONPATH with compat/", f"+ {' '.join(extra)}"]:
                print(f"0.3.0 form of {name!r}: {edit}")
            runs.append(
                TrainRun(
                    name,
                    steps,
                    tmp_path / f"group{r}",
                    *words[1:],
                    *extra,
                    ngpu=2,
                    env={**env, "TORCHFT_LIGHTHOUSE": address, "PYTHONPATH": with_compat()},
                )
            )
        finish_all(runs)
    finally:
        proc.kill()
        proc.wait()
    for run in runs:
        commits = run.events(EventKind.COMMIT)
        assert [e.data["participants"] for e in commits] == [2, 2, 2], commits
        assert run.step_lines()[-1][0] == steps
