"""Every command of TorchTitan's FT doc, quoted unedited in docs/titan.md ("TorchTitan's FT
doc, command by command"), is read from that table and run, and does what the doc says:
Example 2 trains DiLoCo (over one fragment under the doc's TorchTitan FT trainer, which it
says at start), Example 1 keeps committing after one of its 2 groups is
killed, and both train with the doc's ``TRAIN_FILE=torchtitan.experiments.ft.train``.

What the test edits, and why (each edit is printed at run time, and the same list is in the
doc):

* adds the compat package on ``PYTHONPATH`` (the doc's prerequisite, "install TorchFT": as
  scripts/install_torchft_compat.sh would), ``TORCHFT_LIGHTHOUSE`` and the lighthouse's
  ``--bind``/``--status_bind`` (a free port on 127.0.0.1: tests run beside others),
  ``TORCHFT_EVENTS_DIR`` (the events the checks read), ``--job.dump_folder`` and
  ``--training.steps N``, and what every test run gets (:class:`TrainRun`: ``LOG_RANK``,
  ``PYTHON``, ``OMP_NUM_THREADS=1``);
* scales the doc's 4 ranks per group to the 2 shared CPU cores: ``NGPU=4`` becomes ``NGPU=2``
  (Example 2) or ``NGPU=1`` (Example 1, which trains 40 steps and kills a group), and the
  doc's ``--parallelism.data_parallel_shard_degree=4`` the same number, in place;
  ``CUDA_VISIBLE_DEVICES`` is kept (without CUDA it changes nothing);
* Example 1 only: :data:`CPU_8B`, which scales TorchTitan's ``llama3_8B`` to what a CPU
  trains (the debugmodel, the local corpus and tokenizer, fp32, gloo, no compile, no
  checkpoint).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_jobs import ROOT, TrainRun, finish_all, remaining
from torchtitan_ft.titan.config import parse_job_config
from torchtitan_ft.titan.named_configs import TITAN_CONFIGS, UnknownConfigName, resolve, resolve_env

DOC = ROOT / "docs" / "titan.md"
MARKER = "<!-- doc-commands:"
COMPAT = ROOT / "compat"

SHARD_FLAG = "--parallelism.data_parallel_shard_degree"
DOC_RANKS = {"example 1": 1, "example 2": 2}
"""Ranks per group each example runs with here, instead of the doc's 4 (see the docstring)."""

CPU_8B = (
    "--model.flavor=debugmodel",
    "--model.hf_assets_path=./torchtitan_ft/assets/tokenizer",
    "--training.dataset=ft_corpus",
    "--training.seq_len=256",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--compile.no-enable",
    "--checkpoint.no-enable",
    "--fault_tolerance.process_group=gloo",
)
"""Example 1 names TorchTitan's ``llama3_8B`` (configs/llama3_8b_ft.toml: 8B on GPUs, NCCL,
c4 from the hub, torch.compile): what it takes to train its fault tolerance on 2 CPU cores."""


def doc_rows() -> dict[str, str]:
    """``{row name: TorchTitan's command}`` from the table after ``MARKER``."""
    lines = DOC.read_text().split(MARKER, 1)[1].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("#", "---"):
            continue
        command = re.fullmatch(r"`(.*)`", cells[1])
        assert command, f"the command of row {cells[0]!r} is not one command in backticks"
        rows[cells[0]] = command.group(1)
    return rows


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """Leading ``VAR=value`` assignments and the command's words."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def test_the_table_has_every_command_of_the_doc() -> None:
    rows = doc_rows()
    assert list(rows) == [
        "lighthouse",
        "example 1, group 0",
        "example 1, group 1",
        "example 2, group 0",
        "example 2, group 1",
        "options",
    ]
    for name, command in rows.items():
        env, words = split_command(command)
        if name.startswith("example"):
            assert env["TRAIN_FILE"] == "torchtitan.experiments.ft.train", name
            assert words[0] == "./run_train.sh" and "--fault_tolerance.enable" in words, name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_lighthouse(command: str) -> tuple[subprocess.Popen, str]:
    env, words = split_command(command)
    port = _free_port()
    added = ["--bind", f"127.0.0.1:{port}", "--status_bind", "127.0.0.1:0"]
    print(f"doc row 'lighthouse': + {' '.join(added)} (a free port: tests run beside others)")
    proc = subprocess.Popen(
        [*words, *added],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + remaining(60)
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            raise AssertionError(f"the lighthouse exited: {proc.communicate()[0]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the lighthouse did not listen within 60 s")


def scaled_to_ranks(
    env: dict[str, str], words: list[str], ranks: int
) -> tuple[dict[str, str], list[str], list[str]]:
    """The doc's command with ``ranks`` ranks per group instead of its ``NGPU``: ``NGPU`` and
    the doc's own shard-degree flag changed in place. Also returns the edits, in words."""
    edits = [f"NGPU={env['NGPU']} -> NGPU={ranks} (ranks per group, on 2 shared CPU cores)"]
    env = {**env, "NGPU": str(ranks)}
    shard = [i for i, w in enumerate(words) if w.startswith(f"{SHARD_FLAG}=")]
    if len(shard) != 1:
        raise AssertionError(f"expected one {SHARD_FLAG}=N in the doc's command: {words}")
    (i,) = shard
    edits.append(f"{words[i]} -> {SHARD_FLAG}={ranks} (as NGPU)")
    words = [*words[:i], f"{SHARD_FLAG}={ranks}", *words[i + 1 :]]
    return env, words, edits


def _doc_run(tmp_path: Path, name: str, steps: int, lighthouse: str, *extra: str) -> TrainRun:
    """The doc's row ``name``, started as written but for the edits the module docstring
    lists; each edit is printed."""
    env, words = split_command(doc_rows()[name])
    assert words[0] == "./run_train.sh", name
    ranks = DOC_RANKS[name.partition(",")[0]]
    env, words, edits = scaled_to_ranks(env, words, ranks)
    path = os.pathsep.join([str(COMPAT), str(ROOT), os.environ.get("PYTHONPATH", "")])
    dump = tmp_path / name.replace(" ", "_").replace(",", "")
    edits += [
        f"+ PYTHONPATH={COMPAT}:... (the torchft compat package, as installed)",
        f"+ TORCHFT_LIGHTHOUSE={lighthouse} (this test's lighthouse)",
        "+ TORCHFT_EVENTS_DIR, LOG_RANK=0, PYTHON, OMP_NUM_THREADS=1 (every test run)",
        f"+ --training.steps {steps} --job.dump_folder {dump}",
    ]
    if extra:
        edits.append(f"+ {' '.join(extra)}")
    for edit in edits:
        print(f"doc row {name!r}: {edit}")
    return TrainRun(
        name,
        steps,
        dump,
        *words[1:],
        *extra,
        ngpu=ranks,
        env={**env, "TORCHFT_LIGHTHOUSE": lighthouse, "PYTHONPATH": path},
    )


def test_scaling_edits_ngpu_and_the_shard_flag_in_place() -> None:
    env, words = split_command(doc_rows()["example 2, group 1"])
    scaled_env, scaled, edits = scaled_to_ranks(env, words, 2)
    assert scaled_env == {**env, "NGPU": "2"} and len(scaled) == len(words)
    assert [w for w in scaled if w not in words] == [f"{SHARD_FLAG}=2"]
    assert edits == [
        "NGPU=4 -> NGPU=2 (ranks per group, on 2 shared CPU cores)",
        f"{SHARD_FLAG}=4 -> {SHARD_FLAG}=2 (as NGPU)",
    ]


@pytest.fixture
def doc_lighthouse() -> str:
    proc, address = _start_lighthouse(doc_rows()["lighthouse"])
    yield address
    proc.kill()
    proc.wait()


@pytest.mark.slow  # the two examples: 2 to 4 min of TorchTitan runs; their names and
@pytest.mark.multiprocess  # settings are checked in the default tier (below)
@pytest.mark.timeout(420)
def test_example_2_trains_diloco_as_one_fragment_and_says_so(
    tmp_path: Path, doc_lighthouse: str
) -> None:
    """Under the doc's TRAIN_FILE (TorchTitan's FT trainer) the config's model, llama3, has no
    fragment_fn in its train spec, so num_fragments = 2 cannot apply: the run says so in one
    line, and trains DiLoCo over the whole model. A quorum forms, and the Manager commits, only
    at the initial sync and at the one fragment's sync (sync_steps 10: step 10), with both
    groups; two fragments would also sync at step 5, per-step FT at every step."""
    steps = 10
    runs = [_doc_run(tmp_path, f"example 2, group {r}", steps, doc_lighthouse) for r in range(2)]
    outputs = finish_all(runs)
    for run, output in zip(runs, outputs, strict=True):
        assert "-> configs/llama3_ft_debug_cpu.toml" in output  # the config the name selects
        (said,) = [line for line in output.splitlines() if "as one fragment" in line]
        assert "'llama3'" in said and "num_fragments=2" in said, said
        commits = run.events(EventKind.COMMIT)
        assert len(commits) == 2, commits  # the initial sync and step 10
        assert all(e.data["participants"] == 2 for e in commits), commits
        assert run.step_lines()[-1][0] == steps


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_example_1_keeps_committing_after_a_group_is_killed(
    tmp_path: Path, doc_lighthouse: str
) -> None:
    # min_replica_size 1: a group that starts first trains alone. Enough steps (about 0.3 s
    # each here) that it is still training when the other, started a few seconds later under
    # load (12 steps were over before it began once), joins it.
    steps = 40
    survivor, victim = (
        _doc_run(tmp_path, f"example 1, group {r}", steps, doc_lighthouse, *CPU_8B)
        for r in range(2)
    )
    deadline = time.monotonic() + remaining(240)
    while not any(e.data["participants"] == 2 for e in victim.events(EventKind.COMMIT)):
        assert time.monotonic() < deadline, "the 2 groups never committed a step together"
        assert victim.returncode is None and survivor.returncode is None
        time.sleep(0.2)
    victim.sigkill()
    output = finish_all([survivor])[0]
    assert "-> configs/llama3_8b_ft.toml" in output
    commits = survivor.events(EventKind.COMMIT)
    alone = [e for e in commits if e.data["participants"] == 1]
    assert alone and alone[-1].step == commits[-1].step, commits  # committing to the end
    assert commits[-1].step == steps


def test_options_lists_the_ft_flags() -> None:
    env, words = split_command(doc_rows()["options"])
    help_run = subprocess.run(
        words,
        cwd=ROOT,
        env={**os.environ, **env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=remaining(120),
    )
    assert help_run.returncode == 0, help_run.stderr[-2000:]
    for flag in ("semi-sync-method", "sync-steps", "num-fragments", "min-replica-size"):
        assert f"--fault-tolerance.{flag}" in help_run.stdout


# --- naming a config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "config", "file"),
    [
        ("llama3", "llama3_8B", "llama3_8b_ft.toml"),
        ("llama3", "llama3_debugmodel", "debug_cpu.toml"),
        ("llama3_ft", "llama3_ft_debugmodel", "llama3_ft_debug_cpu.toml"),
        ("torchft.llama3", "llama3_torchft_debugmodel", "llama3_ft_debug_cpu.toml"),
        ("llama3", "debug_ft_diloco_cpu", "debug_ft_diloco_cpu.toml"),
        (None, "DEBUG_FT_CPU", "debug_ft_cpu.toml"),
        ("ft.llama3", None, "llama3_ft_debug_cpu.toml"),
    ],
)
def test_a_config_name_selects_a_file(model: str | None, config: str | None, file: str) -> None:
    path, line = resolve(model, config)
    assert path == ROOT / "configs" / file and path.exists()
    assert line.endswith(f"-> configs/{file}")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MODULE": "torchft.llama3"}, "MODULE=torchft.llama3 ->"),
        ({"MODEL": "llama3", "CONFIG": "llama3_debugmodel"}, "MODEL=llama3 CONFIG="),
        ({"MODEL": "ft.llama3", "MODULE": "FT.llama3"}, "MODEL=ft.llama3 ->"),
    ],
)
def test_the_line_names_the_variable_the_user_set(env: dict[str, str], named: str) -> None:
    assert named in resolve_env(env)[1]


@pytest.mark.parametrize(
    ("model", "config", "method", "min_replica_size"),
    [
        ("llama3_ft", "llama3_ft_debugmodel", "diloco", 1),
        ("torchft.llama3", "llama3_torchft_debugmodel", "diloco", 1),
        ("llama3", "llama3_8B", None, 1),
    ],
)
def test_titans_names_parse_to_titans_ft_settings(
    model: str, config: str, method: str | None, min_replica_size: int
) -> None:
    """With this project's trainer too (``TRAIN_FILE`` unset): upstream's config of each name
    is Streaming DiLoCo with sync_steps 10 over 2 fragments, or per-step FT tolerating all but
    one group (``min_replica_size`` 1)."""
    path, _ = resolve(model, config)
    args = ["--job.config_file", str(path), "--fault_tolerance.group_size=2"]  # as the doc
    ft = parse_job_config(args).fault_tolerance
    assert (ft.semi_sync_method, ft.min_replica_size) == (method, min_replica_size)
    if method:
        assert (ft.sync_steps, ft.num_fragments) == (10, 2)


def test_every_titan_name_has_a_config() -> None:
    for file in TITAN_CONFIGS.values():
        assert (ROOT / "configs" / file).exists(), file


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODEL": "llama4", "CONFIG": "llama3_8b"}, r"MODEL/MODULE='llama4'.*known: llama3, "),
        ({"MODEL": "llama3", "CONFIG": "llama3_70b"}, r"'llama3_70b'.*llama3_8b.*debug_ft_cpu"),
        ({"MODEL": "llama3", "MODULE": "ft.llama3"}, "disagree"),
    ],
)
def test_unknown_names_list_the_known_ones(env: dict[str, str], message: str) -> None:
    with pytest.raises(UnknownConfigName, match=message):
        resolve_env(env)


def _run_train_sh(
    env: dict[str, str], *args: str, timeout_s: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=remaining(timeout_s),
    )


def test_unknown_name_stops_run_train_sh_with_one_line() -> None:
    result = _run_train_sh({"MODEL": "llama3", "CONFIG": "llama3_405b"})
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("torchtitan_ft: config error: CONFIG='llama3_405b' is not a known")


@pytest.mark.light
@pytest.mark.multiprocess
def test_config_file_wins_over_a_name_and_says_so(tmp_path: Path) -> None:
    """The one-step run has TorchTitan 0.2.2's profiler on too (no other process start for
    it): on a CPU-only torch it stopped as training started ("Expected ProfilerActivity or
    dict, got NoneType") until CPU fix 5; now it writes the step's trace."""
    env = {"CONFIG_FILE": "configs/debug_cpu.toml", "CONFIG": "llama3_8b"}
    result = _run_train_sh(
        env,
        "--training.steps=1",
        f"--job.dump_folder={tmp_path}",
        *PROFILE_STEP_1,
        timeout_s=280,  # torchrun, the imports and a traced step: 52 s alone, past 120 at load 30
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CONFIG_FILE=configs/debug_cpu.toml is set, so MODEL/MODULE/CONFIG are not used" in (
        result.stderr
    )
    assert "step:  1" in result.stdout + result.stderr  # debug_cpu.toml trained, not 8B
    traces = tmp_path / "profile_traces" / "iteration_1"
    assert [p.name for p in traces.glob("*.json")] == ["rank0_trace.json"]


PROFILE_STEP_1 = (
    "--profiling.enable_profiling",
    "--profiling.profile_freq=1",
    "--profiling.profiler_warmup=0",
    "--profiling.profiler_active=1",
)
"""TorchTitan 0.2.2's profiler, tracing step 1."""
