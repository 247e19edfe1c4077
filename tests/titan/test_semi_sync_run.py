"""LocalSGD and Streaming DiLoCo in TorchTitan through run_train.sh, and the shipped configs.

The multi-process tests run 2 replica groups x 1 rank of the llama3 debugmodel (small shape)
with a real lighthouse. Each group's trainer is this module run as ``TRAIN_FILE``: the plugin's
own entry point with a trainer that, at exit, saves its parameters and the strategy's global
parameters, so the test can compare the groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan_ft.events import EventKind
from torchtitan_ft.testing.titan_jobs import (
    CONFIGS,
    group_events,
    lighthouse,
    run_ft_groups,
    step_metrics,
)

TRAIN_MODULE = "tests.titan.test_semi_sync_run"


def _parse(config: str, *args: str):
    from torchtitan_ft.titan.config import parse_job_config

    return parse_job_config(["--job.config_file", str(CONFIGS / config), *args])


# --- the shipped configs parse (no training) ---------------------------------------------------


def test_debug_localsgd_config_parses() -> None:
    from torchtitan_ft.titan.config import quorum_mode

    ft = _parse("debug_ft_localsgd_cpu.toml").fault_tolerance
    assert (ft.enable, ft.semi_sync_method, quorum_mode(ft)) == (True, "local_sgd", "sync")
    assert ft.process_group == "gloo" and ft.hostname == "127.0.0.1"


def test_debug_diloco_config_is_streaming() -> None:
    from torchtitan_ft.titan.config import quorum_mode

    ft = _parse("debug_ft_diloco_cpu.toml").fault_tolerance
    assert (ft.semi_sync_method, quorum_mode(ft)) == ("diloco", "sync")
    assert (ft.num_fragments, ft.fragment_sync_delay) == (2, 1)
    assert ft.fragment_sync_delay < ft.sync_steps // ft.num_fragments


@pytest.mark.parametrize("config", ["llama3_8b_ft.toml", "llama3_8b_ft_diloco.toml"])
def test_llama3_8b_configs_parse(config: str) -> None:
    job = _parse(config)
    ft = job.fault_tolerance
    assert (job.model.name, job.model.flavor) == ("llama3", "8B")
    assert ft.enable and ft.process_group == "nccl" and ft.group_size >= 2
    assert job.parallelism.data_parallel_replicate_degree == 1
    assert ft.process_group_timeout_ms <= ft.step_timeout_ms
    assert ft.connect_timeout_ms <= ft.quorum_timeout_ms


def test_llama3_8b_diloco_config_fragments_fit_the_model() -> None:
    from torchtitan.models.llama3 import llama3_args

    from torchtitan_ft.titan.config import quorum_mode

    ft = _parse("llama3_8b_ft_diloco.toml").fault_tolerance
    assert (ft.semi_sync_method, quorum_mode(ft)) == ("diloco", "sync")
    assert ft.num_fragments <= llama3_args["8B"].n_layers


def test_streaming_schedule_is_checked_like_the_strategies() -> None:
    """fragment_sync_delay must be < sync_steps / num_fragments (not just < sync_steps)."""
    from torchtitan_ft.titan.config import ConfigError

    with pytest.raises(ConfigError, match=r"fragment_sync_delay must be in \[0, .* = 2\)"):
        _parse("debug_ft_diloco_cpu.toml", "--fault_tolerance.fragment_sync_delay=3")
    with pytest.raises(ConfigError, match="multiple of the number of fragments"):
        _parse("debug_ft_diloco_cpu.toml", "--fault_tolerance.sync_steps=5")


def test_semi_sync_needs_a_sync_quorum() -> None:
    from torchtitan_ft.titan.config import ConfigError

    with pytest.raises(ConfigError, match="quorum_mode='sync'"):
        _parse("debug_ft_localsgd_cpu.toml", "--fault_tolerance.quorum_mode=async")


@pytest.mark.parametrize(
    ("overlap", "in_flight"), [("none", False), ("delayed", True), ("eager", True)]
)
def test_last_round_is_flushed_and_a_save_with_it_in_flight_is_noted(
    overlap: str, in_flight: bool
) -> None:
    """After a sync point an overlapped DiLoCo has a round on the wire: a checkpoint of that
    step is noted, and the last step applies the round (committed) and leaves nothing in
    flight; without overlap there is nothing to note or flush."""
    import torch

    from tests.semi_sync._helpers import make_model, train_steps
    from tests.semi_sync._simulated import SimulatedReplicaGroups
    from torchtitan_ft.semi_sync import DiLoCo, OuterOptimizerConfig
    from torchtitan_ft.titan.semi_sync_axis import flush_last_round, in_flight_note

    model = make_model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = SimulatedReplicaGroups(1).manager("0")
    diloco = DiLoCo(manager, model, inner, OuterOptimizerConfig(), 2, outer_overlap=overlap)
    train_steps(diloco, model, inner, 0, range(1, 5))  # sync points at steps 2 and 4
    note = in_flight_note(diloco, 4)
    assert (note is not None and "fragment 0" in note and "step 4" in note) is in_flight
    committed = diloco.stats.syncs_committed
    assert flush_last_round(diloco) is (True if in_flight else None)
    assert diloco.stats.syncs_committed == committed + in_flight
    assert diloco.in_flight_fragment is None and in_flight_note(diloco, 4) is None


# --- training runs ----------------------------------------------------------------------------


def _run_groups(tmp_path: Path, config: str, steps: int, *args: str) -> list[str]:
    outputs = run_ft_groups(
        tmp_path, 1, steps, CONFIGS / config, *args, env={"TRAIN_FILE": TRAIN_MODULE}
    )
    for output in outputs:
        assert "cross-replica gradient all-reduce hooked" not in output
    return outputs


def _losses(output: str, steps: int) -> list[float]:
    metrics = step_metrics(output)
    assert sorted(metrics) == list(range(1, steps + 1)), output[-4000:]
    return [metrics[s][0] for s in range(1, steps + 1)]


def _dump(tmp_path: Path, replica: int) -> dict:
    import torch

    outputs = tmp_path / f"replica{replica}" / "outputs"
    return torch.load(outputs / f"params_replica{replica}_rank0.pt")


def _commits(tmp_path: Path, replica: int) -> int:
    return len(group_events(tmp_path, replica, EventKind.COMMIT))


def _assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow  # the default tier: the streaming DiLoCo run below + tests/semi_sync
@pytest.mark.multiprocess
def test_local_sgd_run_trains_and_ends_identical(tmp_path: Path) -> None:
    """LocalSGD (sync_steps 3), 6 steps: groups train apart (different grad norms: no per-step
    gradient average), quorums only at the start and at the 2 syncs, identical at the end."""
    steps = 6
    outputs = _run_groups(tmp_path, "debug_ft_localsgd_cpu.toml", steps)
    for replica, output in enumerate(outputs):
        losses = _losses(output, steps)
        assert losses[-1] < losses[0] - 0.5, losses
        assert _commits(tmp_path, replica) == 1 + steps // 3, output[-4000:]
    grad_norms = [step_metrics(o)[1][1] for o in outputs]
    assert grad_norms[0] != grad_norms[1]
    dumps = [_dump(tmp_path, r) for r in range(2)]
    _assert_same(dumps[0]["model"], dumps[1]["model"])
    _assert_same(dumps[0]["global"][0], dumps[1]["global"][0])


@pytest.mark.multiprocess
def test_streaming_diloco_run_trains_and_agrees_on_global_parameters(tmp_path: Path) -> None:
    """Streaming DiLoCo (sync_steps 4, 2 fragments, tau 1), 8 steps: 4 fragment syncs (steps
    2, 4, 6, 8), identical global parameters and outer-optimizer state at the end; the
    fragment synced at the last step is identical in the models too (alpha = 0)."""
    steps = 8
    outputs = _run_groups(tmp_path, "debug_ft_diloco_cpu.toml", steps)
    for replica, output in enumerate(outputs):
        losses = _losses(output, steps)
        assert losses[-1] < losses[0] - 0.5, losses
        assert _commits(tmp_path, replica) == 1 + steps // 2, output[-4000:]
    dumps = [_dump(tmp_path, r) for r in range(2)]
    for fragment in range(2):
        _assert_same(dumps[0]["global"][fragment], dumps[1]["global"][fragment])
    outer = [d["outer"] for d in dumps]
    for a, b in zip(outer[0], outer[1], strict=True):
        _assert_same(
            {f"{k}.{n}": v for k, s in a["state"].items() for n, v in s.items()},
            {f"{k}.{n}": v for k, s in b["state"].items() for n, v in s.items()},
        )
    # Fragment 1 holds the last layers, norm and output; synced at step 8.
    last = {n: t for n, t in dumps[0]["model"].items() if n.startswith(("norm", "output"))}
    assert last
    _assert_same(last, {n: dumps[1]["model"][n] for n in last})
    first = [n for n in dumps[0]["model"] if n.startswith("tok_embeddings")]
    import torch

    assert not all(torch.equal(dumps[0]["model"][n], dumps[1]["model"][n]) for n in first)


@pytest.mark.slow  # the default tier: test_last_round_is_flushed_...[eager] above
@pytest.mark.multiprocess
def test_eager_diloco_applies_the_round_in_flight_at_the_last_step(tmp_path: Path) -> None:
    """DiLoCo (sync_steps 4, one fragment) with ``outer_overlap = "eager"``, 8 steps: the
    round started at step 8 is still on the wire when the loop ends, and the last step applies
    it (as ``DiLoCo.flush`` on the Manager path): 1 + 2 commits (the initial quorum, the round
    of step 4 applied at step 8, the round of step 8 at the end), and both groups end with
    their models equal to the same global parameters. Without it the second round is never
    voted on and each model keeps its own eager starting point."""
    steps = 8
    overlap = ("--fault_tolerance.num_fragments=1", "--fault_tolerance.fragment_sync_delay=0")
    outputs = _run_groups(
        tmp_path,
        "debug_ft_diloco_cpu.toml",
        steps,
        *overlap,
        "--fault_tolerance.outer_overlap=eager",
    )
    for replica, output in enumerate(outputs):
        losses = _losses(output, steps)
        assert losses[-1] < losses[0] - 0.5, losses
        assert _commits(tmp_path, replica) == 1 + 2, output[-4000:]
    dumps = [_dump(tmp_path, r) for r in range(2)]
    _assert_same(dumps[0]["global_by_name"], dumps[1]["global_by_name"])
    for dump in dumps:
        _assert_same(dump["model"], dump["global_by_name"])


def _outer_tensors(dump: dict) -> dict:
    return {
        f"{i}.{k}.{n}": v
        for i, o in enumerate(dump["outer"])
        for k, s in o["state"].items()
        for n, v in s.items()
    }


@pytest.mark.slow  # the default tier: test_checkpointing.py's resume and DCP round trip
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_streaming_diloco_resumes_from_a_single_writer_checkpoint(tmp_path: Path) -> None:
    """Streaming DiLoCo (sync_steps 4, 2 fragments, tau 1), two groups sharing a dump folder,
    checkpoints every 2 steps: only group 0 writes the full checkpoint, both write reader
    files. After every process exited, the job resumes from step 4: both groups hold the
    strategy's global parameters, outer-optimizer momentum and schedule position bitwise as
    group 0 had them at step 4; group 0 continues with its own local model, so steps 5 and 6
    log the losses of the uninterrupted run; group 1 starts from the global parameters; each
    group's reader resumes from its own position at step 4."""
    import torch

    from tests.titan.test_checkpointing import run_groups_sharing
    from torchtitan_ft.titan.checkpointing import reader_dir, reader_files

    job = tmp_path / "job"
    env = {"TRAIN_FILE": TRAIN_MODULE, "FT_TEST_DUMP_STEPS": "4"}

    def run(*args: str) -> list[str]:
        with lighthouse(min_replicas=2) as address:
            return run_groups_sharing(
                job, address, 6, *args, config="debug_ft_diloco_cpu.toml", env=env
            )

    whole = run()
    folder = job / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-4", "step-6"]
    for replica in (0, 1):
        assert sorted(reader_files(reader_dir(folder, replica, 0))) == [4, 6]
    assert whole[0].count("Saving the checkpoint") == 3, whole[0][-4000:]
    assert "Saving" not in whole[1] and whole[1].count("leaves step") == 3, whole[1][-4000:]
    saved = torch.load(job / "step4_replica0_rank0.pt")
    assert saved["schedule"] == {"local_step": 0, "syncs_committed": 2}
    assert _outer_tensors(saved)  # both fragments have stepped: momentum exists

    resumed = run("--checkpoint.load_step=4", "--checkpoint.load_only")
    for replica in (0, 1):
        assert "Training starts at step 5" in resumed[replica], resumed[replica][-4000:]
        first = torch.load(job / f"first_replica{replica}_rank0.pt")
        assert first["schedule"] == saved["schedule"]
        _assert_same(_outer_tensors(first), _outer_tensors(saved))
        for fragment in range(2):
            _assert_same(first["global"][fragment], saved["global"][fragment])
        # Each group's reader resumes where its own reader stood after step 4.
        assert first["loader"] == torch.load(job / f"step4_replica{replica}_rank0.pt")["loader"]
    _assert_same(torch.load(job / "first_replica0_rank0.pt")["model"], saved["model"])
    group1 = torch.load(job / "first_replica1_rank0.pt")
    _assert_same(group1["model"], saved["global_by_name"])
    for replica in (0, 1):
        assert "Saving" not in resumed[replica]  # load_only
    expected = step_metrics(whole[0])
    assert {s: step_metrics(resumed[0])[s] for s in (5, 6)} == {s: expected[s] for s in (5, 6)}


# --- TRAIN_FILE entry point of the runs above -------------------------------------------------


def _main() -> None:
    import os

    import torch
    import torch.distributed as dist

    from torchtitan_ft.titan.train import main
    from torchtitan_ft.titan.trainer import FaultTolerantTrainer  # CPU fixes first (titan/)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local().detach().clone() if hasattr(t, "to_local") else t.detach().clone()

    dump_steps = {int(s) for s in os.environ.get("FT_TEST_DUMP_STEPS", "").split(",") if s}

    class DumpingTrainer(FaultTolerantTrainer):
        """Saves the model, the strategy's global parameters, outer-optimizer state and
        schedule position: at exit (``params``), before the first step of the run (``first``: what a
        resumed run loaded) and after the steps listed in ``FT_TEST_DUMP_STEPS``
        (``step<N>``), as ``<dump_folder>/<name>_replica<id>_rank<r>.pt``."""

        _dumped_first = False

        def _dump(self, name: str) -> None:
            strategy = getattr(self.replica_axis, "strategy", None)
            state = strategy.state_dict() if strategy is not None else {}
            global_ = state.get("global", [])
            outer = [
                {"state": {k: {n: local(v) for n, v in s.items()} for k, s in o["state"].items()}}
                for o in state.get("outer_optimizers", [])
            ]
            model = self.model_parts[0]
            names = {id(p): n for n, p in model.named_parameters()}
            dump = {
                "model": {n: local(p) for n, p in model.named_parameters()},
                "global": global_ if isinstance(global_, list) else [global_],
                "global_by_name": (
                    {names[id(p)]: t.clone() for p, t in strategy.global_parameters()}
                    if strategy is not None
                    else {}
                ),
                "schedule": strategy.schedule_state() if strategy is not None else {},
                "outer": outer,
                "loader": self.dataloader.state_dict(),
            }
            replica = self.replica_axis.replica_id
            path = (
                Path(self.job_config.job.dump_folder)
                / f"{name}_replica{replica}_rank{dist.get_rank()}.pt"
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(dump, path)

        def train_step(self, data_iterator):
            if not self._dumped_first:
                self._dumped_first = True
                self._dump("first")
            super().train_step(data_iterator)
            if self.step in dump_steps and self.replica_axis.step_committed():
                self._dump(f"step{self.step}")

        def close(self) -> None:
            self._dump("params")
            super().close()

    main(trainer_class=DumpingTrainer)


if __name__ == "__main__":
    _main()
