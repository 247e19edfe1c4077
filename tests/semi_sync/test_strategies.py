"""Per-step sync, fragments, config validation and ``build_strategy``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from torchtitan_ft.semi_sync import (
    DiLoCo,
    LocalSGD,
    OuterOptimizerConfig,
    PerStepSync,
    QuorumMode,
    SyncConfig,
    SyncMethod,
    build_strategy,
    fragments_from_fqns,
    split_model,
)
from torchtitan_ft.semi_sync.per_step import gradient_buckets

from ._helpers import loss_fn, make_model, params_of, run_threads, train_steps
from ._simulated import SimulatedReplicaGroups


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-7])  # one bucket; one per gradient
def test_per_step_averages_gradients_every_step(bucket_cap_mb: float) -> None:
    """Two replicas with different data stay identical and equal a reference that steps on the
    mean gradient."""
    groups = SimulatedReplicaGroups(2, quorum_mode=QuorumMode.ASYNC)
    models = [make_model(0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    strategies = [
        PerStepSync(groups.manager(str(r)), models[r].parameters(), bucket_cap_mb=bucket_cap_mb)
        for r in range(2)
    ]
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, 4))
            for r in range(2)
        ]
    )
    ref = make_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(1, 4):
        grads = []
        for r in range(2):
            ref.zero_grad()
            loss_fn(ref, r, step).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        ref_opt.step()
    for r in range(2):
        for name, p in params_of(models[r]).items():
            torch.testing.assert_close(p, params_of(ref)[name])
        assert strategies[r].stats.syncs_committed == 3
    params = len(list(models[0].parameters()))
    assert strategies[0].stats.allreduce_calls == 3 * (1 if bucket_cap_mb == 25.0 else params)


def test_per_step_failed_allreduce_skips_the_step() -> None:
    groups = SimulatedReplicaGroups(2, quorum_mode=QuorumMode.ASYNC)
    groups.fail_next_collective()
    models = [make_model(0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    strategies = [PerStepSync(groups.manager(str(r)), models[r].parameters()) for r in range(2)]
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, 2))
            for r in range(2)
        ]
    )
    for r in range(2):
        assert strategies[r].stats.syncs_failed == 1
        for name, p in params_of(models[r]).items():
            torch.testing.assert_close(p, params_of(make_model(0))[name])


def test_split_model_by_layers() -> None:
    model = make_model(num_layers=5)
    fragments = split_model(model, 2)
    assert [f.fqns for f in fragments] == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "norm", "output"],
    ]
    # fragments share the model's parameters
    assert {id(p) for f in fragments for p in f.parameters()} == {id(p) for p in model.parameters()}
    assert split_model(model, 1) == [model]
    with pytest.raises(ValueError, match="cannot split 5 layers into 6"):
        split_model(model, 6)
    with pytest.raises(ValueError, match="`layers`"):
        split_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2)


def test_fragments_from_fqns_must_partition_the_parameters() -> None:
    model = make_model(num_layers=2)
    fragments = fragments_from_fqns(
        model, [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    )
    assert len(fragments) == 2
    with pytest.raises(ValueError, match="in no fragment"):
        fragments_from_fqns(model, [["tok_embeddings"], ["layers"]])
    with pytest.raises(ValueError, match="fragments 0 and 1"):
        fragments_from_fqns(model, [["layers", "tok_embeddings"], ["layers.0", "norm", "output"]])
    with pytest.raises(ValueError, match="no module named 'nope'"):
        fragments_from_fqns(model, [["nope"]])


def test_config_validation() -> None:
    SyncConfig().validate()
    with pytest.raises(ValueError, match="diloco needs a synchronous quorum \\(quorum_mode='sync'"):
        SyncConfig(method=SyncMethod.DILOCO).validate()
    with pytest.raises(ValueError, match="local_sgd needs a synchronous quorum"):
        SyncConfig(method="local_sgd").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a valid"):
        SyncConfig(method="diloko").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        SyncConfig(
            method=SyncMethod.DILOCO,
            quorum_mode=QuorumMode.SYNC,
            sync_every=8,
            num_fragments=2,
            fragment_sync_delay=4,
        ).validate()
    with pytest.raises(ValueError, match="lr must be > 0"):
        SyncConfig(
            method=SyncMethod.DILOCO,
            quorum_mode=QuorumMode.SYNC,
            outer_optimizer=OuterOptimizerConfig(lr=0.0),
        ).validate()
    for bad in (
        OuterOptimizerConfig(lr=float("inf")),
        OuterOptimizerConfig(lr=float("nan")),
        OuterOptimizerConfig(momentum=float("inf")),
        OuterOptimizerConfig(type="adamw", betas=(0.9, float("nan"))),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match="must be a finite number, got"):
            bad.validate()


def test_a_sync_config_is_checked_once_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Construction checks the config (an invalid one never exists); ``build_strategy`` does
    not check it again, and the config cannot be changed into an invalid one afterwards."""
    calls: list[SyncConfig] = []
    check = SyncConfig.validate

    def counted(self: SyncConfig) -> None:
        calls.append(self)
        check(self)

    monkeypatch.setattr(SyncConfig, "validate", counted)
    config = SyncConfig(
        method=SyncMethod.DILOCO, quorum_mode=QuorumMode.SYNC, sync_every=4, num_fragments=2
    )
    assert calls == [config]
    model = make_model(num_layers=4)
    manager = SimulatedReplicaGroups(1, quorum_mode=QuorumMode.SYNC).manager("a")
    build_strategy(config, manager, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert calls == [config]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sync_every = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        dataclasses.replace(config, sync_every=3)


def test_build_strategy_picks_the_configured_one() -> None:
    model = make_model(num_layers=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = SimulatedReplicaGroups(1, quorum_mode=QuorumMode.SYNC)
    async_ = SimulatedReplicaGroups(1, quorum_mode=QuorumMode.ASYNC)
    assert isinstance(build_strategy(SyncConfig(), async_.manager("a"), model, opt), PerStepSync)
    sync_cfg = SyncConfig(method=SyncMethod.LOCAL_SGD, quorum_mode=QuorumMode.SYNC)
    assert isinstance(build_strategy(sync_cfg, sync.manager("b"), model, opt), LocalSGD)
    diloco = build_strategy(
        SyncConfig(
            method=SyncMethod.DILOCO, quorum_mode=QuorumMode.SYNC, sync_every=4, num_fragments=2
        ),
        sync.manager("c"),
        model,
        opt,
    )
    assert isinstance(diloco, DiLoCo) and diloco.num_fragments == 2
    with pytest.raises(ValueError, match="Manager uses 'async' quorums"):
        build_strategy(sync_cfg, async_.manager("d"), model, opt)


@pytest.mark.parametrize(
    ("sizes", "dtypes", "cap", "expected"),
    [
        ([4, 4, 4], ["f", "f", "f"], 32, [[0, 1], [2]]),  # 16 bytes each, 2 fit in 32
        ([4, 4, 4], ["f", "f", "f"], 1 << 20, [[0, 1, 2]]),
        ([100, 1, 1], ["f", "f", "f"], 8, [[0], [1, 2]]),  # larger than the cap: alone
        ([1, 1, 1], ["f", "d", "d"], 1 << 20, [[0], [1, 2]]),  # a new dtype starts a bucket
        ([1, 1, 1], ["f", "d", "f"], 1 << 20, [[0], [1], [2]]),  # order kept, no regrouping
        ([], [], 8, []),
    ],
)
def test_gradient_buckets(
    sizes: list[int], dtypes: list[str], cap: int, expected: list[list[int]]
) -> None:
    kinds = {"f": torch.float32, "d": torch.float64}
    grads = [torch.zeros(n, dtype=kinds[d]) for n, d in zip(sizes, dtypes, strict=True)]
    buckets = gradient_buckets(grads, cap)
    index = {id(g): i for i, g in enumerate(grads)}
    assert [[index[id(g)] for g in bucket] for bucket in buckets] == expected


def test_per_step_refuses_a_bucket_cap_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        PerStepSync(SimulatedReplicaGroups(1).manager("a"), bucket_cap_mb=0)
