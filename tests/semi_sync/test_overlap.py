"""DiLoCo's overlapped outer updates, one-step-delayed (``OuterOverlap.DELAYED``) and eager
(``OuterOverlap.EAGER``): the pure math as tables (when each step happens is in
test_schedule.py), then DiLoCo and Streaming DiLoCo over ``SimulatedReplicaGroups`` against a
reference written by hand from the math in ``torchtitan_ft/semi_sync/overlap.py`` (no strategy
code), a failed overlapped round, and a group that heals mid-run.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from torchtitan_ft.semi_sync import DiLoCo, OuterOverlap, SyncConfig, split_model
from torchtitan_ft.semi_sync.overlap import check_outer_overlap, delayed_parameters, own_share

from ._helpers import loss_fn, make_model, params_of, run_threads, train_steps
from ._simulated import SimulatedReplicaGroups
from .test_local_sgd import INNER_LR, OUTER, _fragment_names, assert_params_close, momentum_of

# ------------------------------------------------------------------ pure decisions


@pytest.mark.parametrize(
    ("new_global", "local", "sent", "expected"),
    [
        (1.0, 5.0, 5.0, 1.0),  # no inner step since the send: exactly the new global
        (1.0, 5.5, 5.0, 1.5),  # the progress made while in flight is kept
        (2.0, 4.0, 5.0, 1.0),  # progress may be negative
        (0.1, 0.3, 0.3, 0.1),  # bitwise the global when local == sent (0.1 + 0.0 == 0.1)
    ],
)
def test_delayed_parameters(new_global: float, local: float, sent: float, expected: float) -> None:
    out = delayed_parameters(torch.tensor(new_global), torch.tensor(local), torch.tensor(sent))
    assert out.item() == pytest.approx(expected, abs=1e-6)
    if local == sent:
        assert torch.equal(out, torch.tensor(new_global))


@pytest.mark.parametrize(
    ("overlap", "delay", "alpha", "error"),
    [
        ("none", 0, 0.0, None),
        ("none", 2, 0.5, None),  # tau and alpha are the non-overlapped knobs
        ("delayed", 0, 0.0, None),
        (OuterOverlap.DELAYED, 0, 0.0, None),
        ("delayed", 1, 0.0, "fragment_sync_delay must be 0 with it, got 1"),
        ("delayed", 0, 0.5, "fragment_update_alpha must be 0 with it, got 0.5"),
        ("eager", 0, 0.0, None),
        ("eager", 2, 0.0, "outer_overlap='eager' keeps every sync in flight for a whole cycle"),
        ("eager", 0, 1.0, "fragment_update_alpha must be 0 with it, got 1.0"),
        ("lazy", 0, 0.0, "outer_overlap must be one of 'none', 'delayed', 'eager', got 'lazy'"),
    ],
)
def test_check_outer_overlap(overlap: str, delay: int, alpha: float, error: str | None) -> None:
    if error is None:
        assert check_outer_overlap(overlap, delay, alpha) is OuterOverlap(overlap)
        return
    with pytest.raises(ValueError, match=error):
        check_outer_overlap(overlap, delay, alpha)


@pytest.mark.parametrize(
    ("shares", "participants", "expected"),
    [([2.0, -4.0], 2, [1.0, -2.0]), ([3.0], 1, [3.0]), ([0.0], 3, [0.0])],
)
def test_own_share(shares: list[float], participants: int, expected: list[float]) -> None:
    assert own_share(torch.tensor(shares), participants).tolist() == expected


def test_own_share_refuses_no_participants() -> None:
    with pytest.raises(ValueError, match="at least 1 participant, got 0"):
        own_share(torch.ones(2), 0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"method": "local_sgd"}, "outer_overlap='delayed' is for DiLoCo only"),
        ({"method": "diloco", "fragment_sync_delay": 1, "num_fragments": 2, "sync_every": 4}, "0"),
        ({"method": "diloco", "fragment_update_alpha": 0.25}, "fragment_update_alpha"),
    ],
)
def test_sync_config_refuses_delayed_overlap_with(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        SyncConfig(quorum_mode="sync", outer_overlap="delayed", **kwargs)


# ------------------------------------------------------------------ reference, by hand


def reference_delayed_diloco(
    num_replicas: int,
    sync_every: int,
    steps: int,
    num_fragments: int = 1,
    failed_syncs: frozenset[int] = frozenset(),
    eager: bool = False,
) -> tuple[list[nn.Module], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Delayed (Streaming) DiLoCo by hand, flushed after the last step: at every sync point
    the sync in flight is applied as ``theta = G' + (theta - S)``, then the next fragment's
    ``G - theta`` is averaged and kept in flight. Syncs whose ordinal is in ``failed_syncs``
    leave ``G`` unchanged. ``eager``: each group then moves the fragment to the outer step
    from ``G`` with its own ``(G - theta) / N`` (Nesterov SGD from the current momentum, which
    it does not keep), and that point is ``S``. Returns the models, the global parameters and
    the momentum."""
    models = [make_model(0) for _ in range(num_replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    frag_names = _fragment_names(models[0], num_fragments)
    global_ = params_of(models[0])
    momentum: dict[str, torch.Tensor] = {}
    cycle = sync_every // num_fragments
    lr, mu = OUTER.lr, OUTER.momentum
    state = {"commits": 0, "ordinal": 0}
    pending: list[Any] = []

    def finish() -> None:
        f, delta, sent = pending.pop()
        failed = state["ordinal"] in failed_syncs
        state["ordinal"] += 1
        with torch.no_grad():
            for n in frag_names[f]:
                if not failed:
                    g = delta[n]
                    momentum[n] = g.clone() if n not in momentum else mu * momentum[n] + g
                    global_[n] = global_[n] - lr * (g + mu * momentum[n])
                for r, m in enumerate(models):
                    p = dict(m.named_parameters())[n]
                    p.copy_(global_[n] + (p - sent[r][n]))
        state["commits"] += 0 if failed else 1

    for step in range(1, steps + 1):
        for r in range(num_replicas):
            loss_fn(models[r], r, step).backward()
            opts[r].step()
            opts[r].zero_grad()
        if step % cycle:
            continue
        if pending:
            finish()
        f = state["commits"] % num_fragments
        local = [params_of(m) for m in models]
        delta = {}
        for n in frag_names[f]:
            total = global_[n] - local[0][n]
            for r in range(1, num_replicas):
                total = total + (global_[n] - local[r][n])
            delta[n] = total / num_replicas
        if eager:
            with torch.no_grad():
                for r, m in enumerate(models):
                    named = dict(m.named_parameters())
                    for n in frag_names[f]:
                        own = (global_[n] - local[r][n]) / num_replicas
                        buf = own if n not in momentum else mu * momentum[n] + own
                        named[n].copy_(global_[n] - lr * (own + mu * buf))
                        local[r][n] = named[n].detach().clone()
        pending.append((f, delta, local))
    if pending:
        finish()
    return models, global_, momentum


def _delayed(groups: SimulatedReplicaGroups, r: int, model: nn.Module, opt: Any, **kw: Any) -> Any:
    return DiLoCo(
        groups.manager(str(r)),
        split_model(model, kw.pop("num_fragments", 1)),
        opt,
        OUTER,
        kw.pop("sync_every"),
        outer_overlap=kw.pop("overlap", OuterOverlap.DELAYED),
        **kw,
    )


def run_delayed(
    num_replicas: int, steps: int, fail_collectives: tuple[int, ...] = (), **kwargs: Any
) -> tuple[list[nn.Module], list[DiLoCo]]:
    groups = SimulatedReplicaGroups(num_replicas)
    groups.fail_collective_at(*fail_collectives)
    models = [make_model(0) for _ in range(num_replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    strategies = [
        _delayed(groups, r, models[r], opts[r], **dict(kwargs)) for r in range(num_replicas)
    ]

    def replica(r: int) -> None:
        train_steps(strategies[r], models[r], opts[r], r, range(1, steps + 1))
        strategies[r].flush()

    run_threads([lambda r=r: replica(r) for r in range(num_replicas)])
    return models, strategies


def _globals(strategy: DiLoCo, model: nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: t for p, t in strategy.global_parameters()}


OVERLAPS = [OuterOverlap.DELAYED, OuterOverlap.EAGER]


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize(
    ("num_fragments", "sync_every", "failed"),
    [(1, 3, ()), (2, 4, ()), (1, 3, (1,)), (2, 4, (1,))],
)
def test_delayed_diloco_matches_the_reference(
    num_fragments: int, sync_every: int, failed: tuple[int, ...], overlap: OuterOverlap
) -> None:
    """Plain and Streaming DiLoCo with the delayed update, optionally with one overlapped round
    failing on every group (collective ``1 + k`` is sync ``k``: collective 0 is the initial
    quorum's barrier): the groups' models, global parameters and outer momentum follow the
    hand-written reference, and the global parameters are bitwise identical across groups.
    Plain DiLoCo's models are, after ``flush``, exactly the global parameters (Streaming
    DiLoCo's other fragments keep the progress made since their last sync, as without
    overlap)."""
    steps = 4 * sync_every
    models, strategies = run_delayed(
        2,
        steps,
        fail_collectives=tuple(1 + k for k in failed),
        num_fragments=num_fragments,
        sync_every=sync_every,
        overlap=overlap,
    )
    ref_models, ref_global, ref_momentum = reference_delayed_diloco(
        2,
        sync_every,
        steps,
        num_fragments,
        failed_syncs=frozenset(failed),
        eager=overlap is OuterOverlap.EAGER,
    )
    cycle = sync_every // num_fragments
    globals_ = [_globals(strategies[r], models[r]) for r in range(2)]
    for r in range(2):
        assert strategies[r].stats.syncs_failed == len(failed)
        assert strategies[r].stats.syncs_committed == steps // cycle - len(failed)
        assert_params_close(params_of(models[r]), params_of(ref_models[r]))
        assert_params_close(globals_[r], ref_global)
    assert all(torch.equal(globals_[0][n], globals_[1][n]) for n in ref_global)
    if num_fragments == 1:
        for r in range(2):
            for name, p in models[r].named_parameters():
                assert torch.equal(p.detach(), globals_[r][name])
    named = dict(models[0].named_parameters())
    for name, buf in ref_momentum.items():
        torch.testing.assert_close(momentum_of(strategies[0])[id(named[name])], buf)


def test_inner_progress_made_while_in_flight_is_kept() -> None:
    """Without ``flush`` the model after the last sync point is ``G + (theta - S)``: each
    group keeps its own progress since its pseudo-gradient left (the groups differ, the global
    parameters do not)."""
    groups = SimulatedReplicaGroups(2)
    models = [make_model(0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    strategies = [_delayed(groups, r, models[r], opts[r], sync_every=2) for r in range(2)]
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, 6))
            for r in range(2)
        ]
    )  # syncs started at steps 2 and 4, the first applied at 4; step 5 ran after
    g0, g1 = _globals(strategies[0], models[0]), _globals(strategies[1], models[1])
    for name in g0:
        assert torch.equal(g0[name], g1[name])
    p0, p1 = params_of(models[0]), params_of(models[1])
    assert any(not torch.equal(p0[n], p1[n]) for n in p0)
    assert any(not torch.equal(p0[n], g0[n]) for n in p0)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_healer_joins_the_overlapped_round_and_ends_bitwise_identical(
    overlap: OuterOverlap,
) -> None:
    """A third group joins mid-run at the others' sync point: it heals there (global
    parameters, outer momentum, position; nothing is in flight at that moment), starts the
    next round with a zero pseudo-gradient, and after ``flush`` its model, global parameters
    and outer momentum equal the donors' bitwise."""
    groups = SimulatedReplicaGroups(2)
    models = [make_model(0) for _ in range(2)] + [make_model(seed=123)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    strategies = [
        _delayed(groups, r, models[r], opts[r], sync_every=4, overlap=overlap) for r in range(2)
    ]
    run_threads(
        [
            lambda r=r: train_steps(strategies[r], models[r], opts[r], r, range(1, 9))
            for r in range(2)
        ]
    )  # the round started at step 8 is in flight
    strategies.append(_delayed(groups, 2, models[2], opts[2], sync_every=4, overlap=overlap))
    manager = strategies[2]._manager

    def joiner() -> None:
        strategies[2].start_step()  # heals at the others' quorum of step 12
        train_steps(strategies[2], models[2], opts[2], 2, range(13, 21))
        strategies[2].flush()

    def survivor(r: int) -> None:
        train_steps(strategies[r], models[r], opts[r], r, range(9, 21))
        strategies[r].flush()

    def start_survivors_when_joiner_waits() -> None:
        while "2" not in groups._arrived:
            threading.Event().wait(0.01)
        run_threads([lambda r=r: survivor(r) for r in range(2)])

    run_threads([joiner, start_survivors_when_joiner_waits])
    assert manager.healed_count == 1
    assert all(s.stats.syncs_failed == 0 for s in strategies)
    # initial quorum + the syncs started at 4, 8, 12, 16 and 20 (flushed)
    assert {s._manager.current_step() for s in strategies} == {6}
    for r in (1, 2):
        for a, b in zip(models[0].parameters(), models[r].parameters(), strict=True):
            assert torch.equal(a, b)
        g0, gr = _globals(strategies[0], models[0]), _globals(strategies[r], models[r])
        assert all(torch.equal(g0[n], gr[n]) for n in g0)
        m0, mr = momentum_of(strategies[0]), momentum_of(strategies[r])
        for p0, pr in zip(models[0].parameters(), models[r].parameters(), strict=True):
            assert torch.equal(m0[id(p0)], mr[id(pr)])


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_loading_a_state_drops_the_sync_in_flight(overlap: OuterOverlap) -> None:
    """A state loaded mid-round (a checkpoint) holds no sync in flight: the next sync point
    finishes nothing and starts the next round; ``flush`` then has nothing to do."""
    groups = SimulatedReplicaGroups(1)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    strategy = _delayed(groups, 0, model, opt, sync_every=2, overlap=overlap)
    train_steps(strategy, model, opt, 0, range(1, 4))  # a sync started at step 2
    state = strategy.state_dict()
    assert strategy._pending is not None
    strategy.load_state_dict(state)
    assert strategy._pending is None
    committed = strategy.stats.syncs_committed
    train_steps(strategy, model, opt, 0, range(4, 5))  # sync point: starts one, finishes none
    assert strategy.stats.syncs_committed == committed
    assert strategy._pending is not None
    strategy.flush()
    assert strategy.stats.syncs_committed == committed + 1
