"""LocalSGD, DiLoCo and Streaming DiLoCo against plain single-process references.

Replica groups run as threads over ``SimulatedReplicaGroups`` (the real Manager is tested in
tests/test_manager.py). The references below re-implement each update rule by hand on copies
of the model, with no strategy code.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
from torch import nn

from torchtitan_ft.semi_sync import (
    DiLoCo,
    LocalSGD,
    OuterOptimizerConfig,
    QuorumMode,
    split_model,
)
from torchtitan_ft.semi_sync import local_sgd as local_sgd_module
from torchtitan_ft.semi_sync.local_sgd import initial_optimizer_state

from ._helpers import loss_fn, make_model, params_of, run_threads, train_steps
from ._simulated import SimulatedReplicaGroups

INNER_LR = 0.1
OUTER = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, replica: int, step: int) -> None:
    loss_fn(model, replica, step).backward()
    opt.step()
    opt.zero_grad()


def _fragment_names(model: nn.Module, num_fragments: int) -> list[list[str]]:
    """Parameter names per fragment, as ``split_model`` assigns them (by module prefix)."""
    owner = {
        id(p): i for i, f in enumerate(split_model(model, num_fragments)) for p in f.parameters()
    }
    names: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, p in model.named_parameters():
        names[owner[id(p)]].append(name)
    return names


# ------------------------------------------------------------------ references


def reference_local_sgd(num_replicas: int, sync_every: int, steps: int) -> list[nn.Module]:
    """Plain LocalSGD: independent SGD, parameters averaged every ``sync_every`` steps."""
    models = [make_model(0) for _ in range(num_replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    for step in range(1, steps + 1):
        for r in range(num_replicas):
            _inner_step(models[r], opts[r], r, step)
        if step % sync_every == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    total = ps[0].clone()
                    for p in ps[1:]:
                        total += p
                    for p in ps:
                        p.copy_(total / num_replicas)
    return models


def reference_streaming_diloco(
    num_replicas: int,
    sync_every: int,
    steps: int,
    num_fragments: int = 1,
    tau: int = 0,
    alpha: float = 0.0,
    failed_syncs: frozenset[int] = frozenset(),
) -> tuple[list[nn.Module], dict[str, torch.Tensor], dict[str, torch.Tensor], list[Any]]:
    """Streaming DiLoCo by hand: Nesterov SGD outer step on the mean of ``global - local``.

    Returns the replicas' models, the global parameters, the momentum buffers and the schedule
    (``("prepare"|"sync", step, fragment)``). Syncs whose ordinal is in ``failed_syncs`` are
    discarded: every replica's fragment goes back to the global parameters.
    """
    models = [make_model(0) for _ in range(num_replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    frag_names = _fragment_names(models[0], num_fragments)
    global_ = params_of(models[0])
    momentum: dict[str, torch.Tensor] = {}
    cycle = sync_every // num_fragments
    commits, ordinal, pending, schedule = 0, 0, None, []
    lr, mu = OUTER.lr, OUTER.momentum
    for step in range(1, steps + 1):
        for r in range(num_replicas):
            _inner_step(models[r], opts[r], r, step)
        pos = (step - 1) % cycle + 1
        if pos == cycle - tau:
            f = commits % num_fragments
            local = [params_of(m) for m in models]
            delta = {}
            for n in frag_names[f]:
                total = global_[n] - local[0][n]
                for r in range(1, num_replicas):
                    total = total + (global_[n] - local[r][n])
                delta[n] = total / num_replicas
            pending = (f, delta)
            schedule.append(("prepare", step, f))
        if pos == cycle:
            f, delta = pending
            schedule.append(("sync", step, f))
            failed = ordinal in failed_syncs
            ordinal += 1
            with torch.no_grad():
                for n in frag_names[f]:
                    if not failed:
                        g = delta[n]
                        momentum[n] = g.clone() if n not in momentum else mu * momentum[n] + g
                        global_[n] = global_[n] - lr * (g + mu * momentum[n])
                    for m in models:
                        p = dict(m.named_parameters())[n]
                        mixed = global_[n] if failed else (1 - alpha) * global_[n] + alpha * p
                        p.copy_(mixed)
            commits += 0 if failed else 1
    return models, global_, momentum, schedule


# ------------------------------------------------------------------ runs over the simulator


class RecordingDiLoCo(DiLoCo):
    """DiLoCo that logs its schedule as ``("prepare"|"sync", step, fragment)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int, int]] = []
        self.step = 0

    def after_step(self) -> None:
        self.step += 1
        super().after_step()

    def _prepare(self, index: int) -> None:
        self.events.append(("prepare", self.step, index))
        super()._prepare(index)

    def _finish_sync(self) -> None:
        if self._pending is not None:
            self.events.append(("sync", self.step, self._pending.fragment))
        super()._finish_sync()


def run_diloco(
    num_replicas: int,
    sync_every: int,
    steps: int,
    num_fragments: int = 1,
    tau: int = 0,
    alpha: float = 0.0,
    should_quantize: bool = False,
    fail_collectives: tuple[int, ...] = (),
    dim: int = 4,
    inner_lr: float = INNER_LR,
) -> tuple[SimulatedReplicaGroups, list[nn.Module], list[RecordingDiLoCo]]:
    groups = SimulatedReplicaGroups(num_replicas)
    groups.fail_collective_at(*fail_collectives)
    models = [make_model(0, dim=dim) for _ in range(num_replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=inner_lr) for m in models]
    strategies = [
        RecordingDiLoCo(
            groups.manager(str(r)),
            split_model(models[r], num_fragments),
            opts[r],
            OUTER,
            sync_every,
            should_quantize=should_quantize,
            fragment_sync_delay=tau,
            fragment_update_alpha=alpha,
        )
        for r in range(num_replicas)
    ]
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, steps + 1))
            for r in range(num_replicas)
        ]
    )
    return groups, models, strategies


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def momentum_of(strategy: DiLoCo) -> dict[int, torch.Tensor]:
    """Momentum buffers of the outer optimizers, by parameter id."""
    out = {}
    for opt in strategy.outer_optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                if "momentum_buffer" in opt.state.get(p, {}):
                    out[id(p)] = opt.state[p]["momentum_buffer"]
    return out


# ------------------------------------------------------------------ LocalSGD


def test_local_sgd_averages_parameters_every_sync_every_steps() -> None:
    num_replicas, sync_every, steps = 3, 4, 8
    groups = SimulatedReplicaGroups(num_replicas)
    models = [make_model(0) for _ in range(num_replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    strategies = [
        LocalSGD(groups.manager(str(r)), models[r], opts[r], sync_every)
        for r in range(num_replicas)
    ]
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, steps + 1))
            for r in range(num_replicas)
        ]
    )
    reference = reference_local_sgd(num_replicas, sync_every, steps)
    for r in range(num_replicas):
        assert_params_close(params_of(models[r]), params_of(reference[r]))
        assert strategies[r].stats.syncs_committed == 2
    # fp32 ring allreduce of all parameters, 2 syncs: 2 * 2(N-1)/N * bytes; plus the one-float
    # barrier of the initial quorum.
    nbytes = sum(p.numel() * 4 for p in models[0].parameters())
    assert groups.wire_bytes("0") == 2 * (2 * 2 * nbytes // 3) + 2 * 2 * 4 // 3


def test_local_sgd_failed_sync_restores_last_average() -> None:
    groups = SimulatedReplicaGroups(2)
    groups.fail_collective_at(2)  # the second sync (collective 0: the initial quorum's)
    models = [make_model(0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    strategies = [LocalSGD(groups.manager(str(r)), models[r], opts[r], 2) for r in range(2)]
    after_first_sync: list[dict[str, torch.Tensor]] = [{}, {}]

    def replica(r: int) -> None:
        def snapshot(step: int) -> None:
            if step == 2:
                after_first_sync[r] = params_of(models[r])

        train_steps(strategies[r], models[r], opts[r], r, range(1, 5), snapshot)

    run_threads([lambda r=r: replica(r) for r in range(2)])
    for r in range(2):
        assert_params_close(params_of(models[r]), after_first_sync[r])
        assert strategies[r].stats.syncs_failed == 1
    assert_params_close(params_of(models[0]), params_of(models[1]))


def test_local_sgd_as_context_manager_drives_itself_from_optimizer_hooks() -> None:
    groups = SimulatedReplicaGroups(2)
    models = [make_model(0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]

    def replica(r: int) -> None:
        with LocalSGD(groups.manager(str(r)), models[r], opts[r], sync_every=3) as local_sgd:
            for step in range(1, 7):
                _inner_step(models[r], opts[r], r, step)
        assert local_sgd.stats.syncs_committed == 2

    run_threads([lambda r=r: replica(r) for r in range(2)])
    assert_params_close(params_of(models[0]), params_of(models[1]))


# ------------------------------------------------------------------ DiLoCo


def test_diloco_outer_step_is_nesterov_sgd_on_mean_pseudo_gradient() -> None:
    _, models, strategies = run_diloco(num_replicas=2, sync_every=3, steps=9)
    ref_models, ref_global, ref_momentum, _ = reference_streaming_diloco(2, 3, 9)
    for r in range(2):
        assert_params_close(params_of(models[r]), ref_global)
        assert_params_close(params_of(models[r]), params_of(ref_models[r]))
        assert strategies[r].stats.syncs_committed == 3
    named = dict(models[0].named_parameters())
    momentum = momentum_of(strategies[0])
    for name, buf in ref_momentum.items():
        torch.testing.assert_close(momentum[id(named[name])], buf, rtol=1e-5, atol=1e-6)


def test_diloco_first_sync_by_hand() -> None:
    """One sync, written out: global - 0.7 * (d + 0.9 * d) with d = mean(global - local)."""
    _, models, _ = run_diloco(num_replicas=2, sync_every=2, steps=2)
    start = params_of(make_model(0))
    locals_ = []
    for r in range(2):
        m = make_model(0)
        opt = torch.optim.SGD(m.parameters(), lr=INNER_LR)
        for step in (1, 2):
            _inner_step(m, opt, r, step)
        locals_.append(params_of(m))
    for name, g0 in start.items():
        d = ((g0 - locals_[0][name]) + (g0 - locals_[1][name])) / 2
        expected = g0 - 0.7 * (d + 0.9 * d)
        torch.testing.assert_close(dict(models[0].named_parameters())[name].detach(), expected)


@pytest.mark.parametrize(
    ("num_fragments", "sync_every", "tau", "alpha"),
    [(2, 4, 0, 0.0), (2, 6, 1, 0.0), (2, 6, 2, 0.5), (3, 6, 1, 0.25), (1, 4, 3, 1.0)],
)
def test_streaming_diloco_schedule_tau_alpha(
    num_fragments: int, sync_every: int, tau: int, alpha: float
) -> None:
    steps = 3 * sync_every
    _, models, strategies = run_diloco(
        2, sync_every, steps, num_fragments=num_fragments, tau=tau, alpha=alpha
    )
    ref_models, ref_global, _, ref_schedule = reference_streaming_diloco(
        2, sync_every, steps, num_fragments, tau, alpha
    )
    assert strategies[0].events == ref_schedule
    cycle = sync_every // num_fragments
    assert ref_schedule[:2] == [("prepare", cycle - tau, 0), ("sync", cycle, 0)]
    assert strategies[0].stats.syncs_committed == steps // cycle
    for r in range(2):
        assert_params_close(params_of(models[r]), params_of(ref_models[r]))
    for r in range(2):
        for fragment, names in zip(
            strategies[r]._fragments, _fragment_names(models[r], num_fragments), strict=True
        ):
            # each fragment's backup holds exactly the reference's global parameters
            got = dict(zip(names, fragment.backup.tensors, strict=True))
            assert_params_close(got, {n: ref_global[n] for n in names})


def test_diloco_failed_sync_is_discarded_and_fragment_restored() -> None:
    """Sync 2 of 4 fails on every replica: no outer step, parameters back to the global ones,
    the same fragment is retried next cycle, and the replicas stay identical."""
    _, models, strategies = run_diloco(
        2, sync_every=4, steps=16, num_fragments=2, fail_collectives=(2,)
    )
    ref_models, _, _, ref_schedule = reference_streaming_diloco(
        2, 4, 16, num_fragments=2, failed_syncs=frozenset({1})
    )
    assert strategies[0].events == ref_schedule
    # fragment 1's sync (the 2nd) failed, so the 3rd sync retries fragment 1
    assert [f for kind, _, f in ref_schedule if kind == "sync"] == [0, 1, 1, 0, 1, 0, 1, 0]
    for r in range(2):
        assert strategies[r].stats.syncs_failed == 1
        assert_params_close(params_of(models[r]), params_of(ref_models[r]))


def test_diloco_int8_pseudo_gradients_close_to_fp32_and_4x_fewer_bytes() -> None:
    kwargs: dict[str, Any] = {"sync_every": 4, "steps": 8, "dim": 64, "inner_lr": 0.005}
    groups_q, models_q, _ = run_diloco(2, should_quantize=True, **kwargs)
    groups_f, models_f, _ = run_diloco(2, **kwargs)
    for name, p in params_of(models_f[0]).items():
        torch.testing.assert_close(params_of(models_q[0])[name], p, atol=1e-3, rtol=0)
    assert_params_close(params_of(models_q[0]), params_of(models_q[1]))
    ratio = groups_q.wire_bytes("0") / groups_f.wire_bytes("0")
    assert 0.25 <= ratio < 0.27  # int8 + one fp32 scale per 256 elements, plus padding


# ------------------------------------------------------------------ failures and healing


def test_replica_killed_during_sync_survivors_stay_identical() -> None:
    groups = SimulatedReplicaGroups(3)
    models = [make_model(0) for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    managers = [groups.manager(str(r)) for r in range(3)]
    strategies = [DiLoCo(managers[r], models[r], opts[r], OUTER, 4) for r in range(3)]

    class Killed(Exception):
        pass

    # Replica 2 is in the quorum of its 2nd sync, then dies before sending its pseudo-gradient.
    real_allreduce = managers[2].allreduce
    calls = {"n": 0}

    def dying_allreduce(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            groups.kill("2")
            raise Killed()
        return real_allreduce(*args, **kwargs)

    managers[2].allreduce = dying_allreduce  # type: ignore[method-assign]

    def replica(r: int) -> None:
        try:
            train_steps(strategies[r], models[r], opts[r], r, range(1, 17))
        except Killed:
            assert r == 2

    run_threads([lambda r=r: replica(r) for r in range(3)])
    for r in (0, 1):
        assert strategies[r].stats.syncs_failed == 1
        assert strategies[r].stats.syncs_committed == 3
        assert managers[r].current_step() == 1 + 3  # the initial quorum commits too
    assert_params_close(params_of(models[0]), params_of(models[1]))
    for a, b in zip(
        strategies[0].state_dict()["global"], strategies[1].state_dict()["global"], strict=False
    ):
        assert_params_close(a, b)
    m0, m1 = momentum_of(strategies[0]), momentum_of(strategies[1])
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(m0[id(p0)], m1[id(p1)])


def test_joining_replica_receives_global_params_and_outer_optimizer_state() -> None:
    groups = SimulatedReplicaGroups(2)
    models = [make_model(0) for _ in range(2)] + [make_model(seed=123)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    managers = [groups.manager(str(r)) for r in range(2)]
    strategies = [DiLoCo(managers[r], models[r], opts[r], OUTER, 4) for r in range(2)]
    # Phase 1: two replicas, two syncs.
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, 9))
            for r in range(2)
        ]
    )
    # Phase 2: replica 2 joins; it waits in its first start_step for the next quorum.
    managers.append(groups.manager("2"))
    strategies.append(DiLoCo(managers[2], models[2], opts[2], OUTER, 4))
    joined = threading.Event()

    def joiner() -> None:
        strategies[2].start_step()  # heals at the survivors' quorum of step 12, joins the sync
        joined.set()
        train_steps(strategies[2], models[2], opts[2], 2, range(13, 17))

    def survivor(r: int) -> None:
        train_steps(strategies[r], models[r], opts[r], r, range(9, 17))

    def start_survivors_when_joiner_waits() -> None:
        while "2" not in groups._arrived:
            threading.Event().wait(0.01)
        run_threads([lambda r=r: survivor(r) for r in range(2)])

    run_threads([joiner, start_survivors_when_joiner_waits])
    assert joined.is_set()
    assert managers[2].healed_count == 1
    # initial quorum + 4 syncs (the joiner healed to step 3 and took part in sync 3)
    assert managers[2].current_step() == managers[0].current_step() == 5
    for r in (1, 2):
        assert_params_close(params_of(models[r]), params_of(models[0]))
    m0, m2 = momentum_of(strategies[0]), momentum_of(strategies[2])
    for p0, p2 in zip(models[0].parameters(), models[2].parameters(), strict=True):
        torch.testing.assert_close(m0[id(p0)], m2[id(p2)])


def test_state_dict_round_trip_restores_globals_and_outer_state() -> None:
    _, _models, strategies = run_diloco(1, sync_every=2, steps=4, num_fragments=2)
    state = strategies[0].state_dict()
    fresh = make_model(seed=7)
    groups = SimulatedReplicaGroups(1)
    restored = DiLoCo(
        groups.manager("0"),
        split_model(fresh, 2),
        torch.optim.SGD(fresh.parameters(), lr=INNER_LR),
        OUTER,
        2,
    )
    restored.load_state_dict(state)
    # The global parameters are restored, and loading resets the model to them.
    for fragment, saved in zip(restored._fragments, state["global"], strict=True):
        assert_params_close(fragment.backup.state_dict(), saved)
        for p, t in zip(fragment.params, fragment.backup.tensors, strict=True):
            torch.testing.assert_close(p.detach(), t)
    # (the last synced fragment's parameters equal the globals; the other took one more step)
    last = strategies[0]._fragments[1]
    for p, t in zip(last.params, last.backup.tensors, strict=True):
        torch.testing.assert_close(p.detach(), t)
    assert restored.local_step == strategies[0].local_step
    for a, b in zip(restored.outer_optimizers(), strategies[0].outer_optimizers(), strict=True):
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k]["momentum_buffer"], sb[k]["momentum_buffer"])


# ------------------------------------------------------------------ disk checkpoints


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    ],
    ids=["sgd-nesterov", "sgd-weight-decay", "adamw", "adam-amsgrad"],
)
def test_outer_state_created_before_the_first_step_changes_no_numerics(build: Any) -> None:
    """A checkpoint needs the outer optimizer's state before its first step (DCP loads into
    existing tensors); created early, it gives bitwise the same steps as created lazily."""
    models = [make_model(0), make_model(0)]
    opts = [build(m.parameters()) for m in models]
    for p in models[1].parameters():
        opts[1].state[p] = initial_optimizer_state(opts[1], p)
    for step in range(1, 4):
        for model, opt in zip(models, opts, strict=True):
            _inner_step(model, opt, 0, step)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), name
        sa, sb = opts[0].state[a], opts[1].state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (name, key)


def test_initial_outer_state_refuses_what_it_cannot_create_exactly() -> None:
    model = make_model(0)
    p = next(model.parameters())
    damped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(ValueError, match=r"dampening=0\.5"):
        initial_optimizer_state(damped, p)
    with pytest.raises(ValueError, match="RMSprop is not supported"):
        initial_optimizer_state(torch.optim.RMSprop(model.parameters()), p)
    with pytest.raises(ValueError, match="not in the outer optimizer"):
        initial_optimizer_state(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), p)
    assert initial_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), p) == {}


def test_checkpoint_views_share_the_strategy_tensors_and_schedule() -> None:
    """``global_parameters`` and ``outer_optimizer_state`` hand out the strategy's own tensors
    (a checkpoint loads into them in place); ``restore_global`` drops local progress."""
    _, models, strategies = run_diloco(1, sync_every=4, steps=5, num_fragments=2, tau=1)
    diloco, model = strategies[0], models[0]
    assert diloco.schedule_state() == {"local_step": 1, "syncs_committed": 2}
    pairs = diloco.global_parameters()
    assert [id(p) for p, _ in pairs] == [id(p) for p in model.parameters()]
    backups = [t for f in diloco._fragments for t in f.backup.tensors]
    assert all(t is b for (_, t), b in zip(pairs, backups, strict=True))
    outer = diloco.outer_optimizer_state()
    assert all(s["momentum_buffer"] is momentum_of(diloco)[id(p)] for p, s in outer)
    assert any(not torch.equal(p, t) for p, t in pairs)  # local progress since the last sync
    diloco.restore_global()
    assert all(torch.equal(p, t) for p, t in pairs)
    diloco.load_schedule_state({"local_step": 0, "syncs_committed": 5})
    assert diloco.schedule_state() == {"local_step": 0, "syncs_committed": 5}


# ------------------------------------------------------------------ validation


def test_diloco_requires_sync_quorum(caplog: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    groups = SimulatedReplicaGroups(1, quorum_mode=QuorumMode.ASYNC)
    with pytest.raises(ValueError, match="synchronous quorum"):
        DiLoCo(groups.manager("0"), [model], opt, OUTER, 4)
    with pytest.raises(ValueError, match="synchronous quorum"):
        LocalSGD(groups.manager("1"), model, opt, 4)

    class Opaque:  # a manager that does not say
        def register_state_dict_fn(self, *args: Any) -> None:
            pass

    # One that does not say is assumed synchronous, with one warning per process.
    monkeypatch.setattr(local_sgd_module, "_warned_unknown_mode", False)
    with caplog.at_level(logging.WARNING, logger=local_sgd_module.__name__):
        DiLoCo(Opaque(), [model], opt, OUTER, 4)  # type: ignore[arg-type]
        LocalSGD(Opaque(), model, opt, 4)  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records if "quorum mode" in r.getMessage()]
    assert len(warnings) == 1 and "assuming a synchronous quorum" in warnings[0], warnings
    DiLoCo(Opaque(), [model], opt, OUTER, 4, quorum_mode=QuorumMode.SYNC)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 3, "num_fragments": 2}, "multiple of the number of fragments"),
        ({"sync_every": 1, "num_fragments": 2}, "at most one fragment"),
        ({"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 2}, "fragment_sync_delay"),
        ({"sync_every": 4, "fragment_update_alpha": 1.5}, "fragment_update_alpha"),
    ],
)
def test_diloco_schedule_validation(kwargs: dict[str, Any], match: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    num_fragments = kwargs.pop("num_fragments", 1)
    sync_every = kwargs.pop("sync_every")
    groups = SimulatedReplicaGroups(1)
    with pytest.raises(ValueError, match=match):
        DiLoCo(
            groups.manager("0"), split_model(model, num_fragments), opt, OUTER, sync_every, **kwargs
        )


def test_outer_optimizer_is_configurable() -> None:
    model = make_model()
    groups = SimulatedReplicaGroups(1)
    cfg = OuterOptimizerConfig(type="adamw", lr=0.01, betas=(0.8, 0.9))
    diloco = DiLoCo(
        groups.manager("0"),
        split_model(model, 2),
        torch.optim.SGD(model.parameters(), lr=INNER_LR),
        cfg,
        4,
    )
    opts = diloco.outer_optimizers()
    assert len(opts) == 2 and opts[0] is not opts[1]
    assert all(isinstance(o, torch.optim.AdamW) and o.defaults["betas"] == (0.8, 0.9) for o in opts)
    with pytest.raises(ValueError, match="nesterov"):
        OuterOptimizerConfig(momentum=0.0).validate()


def test_diloco_as_context_manager_matches_explicit_calls() -> None:
    """torchft style (``with DiLoCo(...)``, hooks on the inner optimizer) gives the same result
    as driving the strategy explicitly, when all replicas start from the same parameters."""
    groups = SimulatedReplicaGroups(2, init_sync=False)
    models = [make_model(0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]

    def replica(r: int) -> None:
        with DiLoCo(groups.manager(str(r)), models[r], opts[r], OUTER, sync_every=3):
            for step in range(1, 10):
                _inner_step(models[r], opts[r], r, step)

    run_threads([lambda r=r: replica(r) for r in range(2)])
    _, ref_global, _, _ = reference_streaming_diloco(2, 3, 9)
    for r in range(2):
        assert_params_close(params_of(models[r]), ref_global)
