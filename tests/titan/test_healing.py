"""The state a healing replica group receives: local shards out, DTensors rebuilt in."""

import io

import pytest
import torch
from torch.distributed.tensor import DTensor

from torchtitan_ft.titan.healing import (
    HealedState,
    TrainStateAtStepStart,
    like_param,
    optimizer_state_dict,
)
from torchtitan_ft.titan.replica_axis import shard_on_single_rank


class _Stateful:
    def __init__(self, **state):
        self.state = state

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


class _Container:
    """Stands in for TorchTitan's OptimizersContainer (only ``.optimizers`` is used)."""

    def __init__(self, optimizer):
        self.optimizers = [optimizer]


def _replica(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = shard_on_single_rank(model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = HealedState(
        [model], _Container(optimizer), _Stateful(lr_step=0), _Stateful(step=0, ntokens_seen=0)
    )
    return model, optimizer, state


def _over_the_wire(state):
    """A copy as a transport would deliver it (no storage shared with the donor)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _train_step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(4, 8)).square().sum().backward()
    optimizer.step()


@pytest.mark.usefixtures("single_rank_group")
def test_heal_copies_model_optimizer_and_counters_without_adam_skew() -> None:
    donor_model, donor_opt, donor_state = _replica(seed=0)
    _train_step(donor_model, donor_opt)
    donor_state._lr_schedulers.state["lr_step"] = 1
    donor_state._train_state.state.update(step=1, ntokens_seen=32)

    model, optimizer, state = _replica(seed=1)  # different init, never stepped
    sent = donor_state.state_dict()
    assert not any(isinstance(v, DTensor) for v in sent["model"][0].values())
    state.load_state_dict(_over_the_wire(sent))

    for got, want in zip(model.parameters(), donor_model.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want.full_tensor())
    donor_states = list(donor_opt.state.values())
    for got, want in zip(optimizer.state.values(), donor_states, strict=True):
        assert int(got["step"]) == int(want["step"]) == 1
        assert type(got["exp_avg"]) is type(want["exp_avg"])  # DTensor rebuilt
        torch.testing.assert_close(got["exp_avg"].full_tensor(), want["exp_avg"].full_tensor())
    assert state._train_state.state == {"step": 1, "ntokens_seen": 32}
    assert state._lr_schedulers.state == {"lr_step": 1}

    # Both now take the same step to the same parameters.
    _train_step(model, optimizer)
    _train_step(donor_model, donor_opt)
    for got, want in zip(model.parameters(), donor_model.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want.full_tensor())


class _FusedPair(torch.nn.Module):
    """One fused weight saved as two (``wa``, ``wb``) by state-dict hooks, as TorchTitan 0.3.0's
    ``FusedQKVLinear`` saves ``wqkv`` as ``wq``/``wk``/``wv``; a persistent and a
    non-persistent buffer beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Linear(8, 8, bias=False)
        self.register_buffer("counts", torch.zeros(2))
        self.register_buffer("cache", torch.arange(3.0), persistent=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        state_dict[f"{prefix}wa"], state_dict[f"{prefix}wb"] = state_dict.pop(
            f"{prefix}fused.weight"
        ).chunk(2)

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        parts = state_dict.pop(f"{prefix}wa"), state_dict.pop(f"{prefix}wb")
        state_dict[f"{prefix}fused.weight"] = torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _fused_replica(seed: int):
    torch.manual_seed(seed)
    model = shard_on_single_rank(torch.nn.Sequential(_FusedPair(), torch.nn.Linear(8, 2)), "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = HealedState(
        [model], _Container(optimizer), _Stateful(lr_step=0), _Stateful(step=0, ntokens_seen=0)
    )
    return model, optimizer, state


@pytest.mark.usefixtures("single_rank_group")
def test_a_parameter_saved_under_other_names_is_healed() -> None:
    """A parameter that the model's state-dict hooks save under other names (TorchTitan
    0.3.0's llama3 fuses its QKV weights and saves them split) is sent and received like any
    other, with the persistent buffers; the non-persistent ones stay the receiver's own."""
    donor_model, donor_opt, donor_state = _fused_replica(seed=0)
    _train_step(donor_model, donor_opt)
    donor_model[0].counts.fill_(5.0)
    model, _, state = _fused_replica(seed=1)
    model[0].cache.fill_(-1.0)

    sent = donor_state.state_dict()
    assert set(sent["model"][0]) == {"0.fused.weight", "0.counts", "1.weight", "1.bias"}
    state.load_state_dict(_over_the_wire(sent))

    got, want = model.state_dict(), donor_model.state_dict()  # what a checkpoint would save
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(_full(got[name]), _full(want[name]), msg=name)
    assert model[0].cache.tolist() == [-1.0, -1.0, -1.0]


@pytest.mark.usefixtures("single_rank_group")
def test_offering_state_does_not_initialise_an_empty_optimizer() -> None:
    _, optimizer, state = _replica(seed=0)
    state.state_dict()
    assert optimizer_state_dict(optimizer)["state"] == {}
    assert not optimizer.state  # no zero-lr warm-up step (Adam's counter stays at 0)


@pytest.mark.usefixtures("single_rank_group")
def test_mismatched_shard_is_refused() -> None:
    model, _, _ = _replica(seed=0)
    weight = next(model.parameters())
    with pytest.raises(ValueError, match="sharded differently"):
        like_param(torch.zeros(3, 3), weight)
    assert like_param(torch.tensor(5.0), weight).dim() == 0  # scalars stay plain


def _sharded_diloco(seed: int):
    from tests.semi_sync._helpers import loss_fn, make_model
    from tests.semi_sync._simulated import SimulatedReplicaGroups
    from torchtitan_ft.semi_sync import DiLoCo, OuterOptimizerConfig, split_model

    model = shard_on_single_rank(make_model(seed), "cpu")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: nothing else to heal
    outer = OuterOptimizerConfig(type="sgd", lr=0.7, momentum=0.9, nesterov=True)
    manager = SimulatedReplicaGroups(1, init_sync=False).manager("0")
    diloco = DiLoCo(manager, split_model(model, 1), inner, outer, 2)

    def step(n: int) -> None:
        diloco.start_step()
        loss_fn(model, 0, n).backward()
        if diloco.before_step():
            inner.step()
        diloco.after_step()
        inner.zero_grad()

    return model, diloco, step


@pytest.mark.usefixtures("single_rank_group")
def test_diloco_outer_state_of_a_sharded_model_heals_as_local_shards() -> None:
    """The DiLoCo state a donor offers holds local shards only (the transports send plain
    tensors); the receiver rebuilds its outer-optimizer state as DTensors laid out like its
    parameters, and both then take the same outer step."""
    donor_model, donor, donor_step = _sharded_diloco(seed=0)
    for n in range(1, 3):  # one sync: the outer momentum exists
        donor_step(n)
    sent = donor.state_dict()
    tensors = [
        v for sd in sent["outer_optimizers"] for s in sd["state"].values() for v in s.values()
    ]
    assert tensors and not any(isinstance(t, DTensor) for t in tensors)

    model, healed, step = _sharded_diloco(seed=1)
    healed.load_state_dict(_over_the_wire(sent))
    (outer,) = healed.outer_optimizers()
    for p in outer.param_groups[0]["params"]:
        assert type(outer.state[p]["momentum_buffer"]) is DTensor
    for n in range(3, 5):  # the next sync uses the healed momentum
        donor_step(n)
        step(n)
    for got, want in zip(model.parameters(), donor_model.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want.full_tensor())


def test_advance_one_step_moves_trainer_step_and_lr_schedules() -> None:
    """A semi-sync donor's state describes the end of its step: the receiver moves on by one."""

    class _Schedulers(_Stateful):
        def step(self):
            self.state["lr_step"] += 1

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_state, schedulers = _Stateful(step=15, ntokens_seen=7), _Schedulers(lr_step=14)
    state = HealedState([model], _Container(optimizer), schedulers, train_state)
    state.advance_one_step()
    assert train_state.state == {"step": 16, "ntokens_seen": 7}
    assert schedulers.state == {"lr_step": 15}


class _Trainer:
    """TorchTitan's count: a step's tokens are added when its batch is drawn."""

    def __init__(self, step: int, ntokens_seen: int) -> None:
        self.step, self.ntokens_seen = step, ntokens_seen

    def start_step(self) -> None:  # what FaultTolerantTrainer.train_step and TorchTitan do
        self.step += 1
        self.ntokens_at_step_start = self.ntokens_seen

    def draw(self, tokens: int) -> None:
        self.ntokens_seen += tokens


@pytest.mark.parametrize("donor_drew_first", [False, True])
def test_a_per_step_heal_counts_the_steps_tokens_once_whenever_the_donor_is_read(
    donor_drew_first: bool,
) -> None:
    """The donor's state is read on the quorum thread before or after its step's batch is drawn;
    either way the healer, which drew its own batch, ends the step with the donor's count."""
    donor, healer = _Trainer(step=9, ntokens_seen=900), _Trainer(step=0, ntokens_seen=0)
    donor.start_step()
    healer.start_step()
    healer.draw(100)
    if donor_drew_first:
        donor.draw(100)
    sent = TrainStateAtStepStart(donor).state_dict()
    if not donor_drew_first:
        donor.draw(100)
    TrainStateAtStepStart(healer).load_state_dict(sent)
    assert (healer.step, healer.ntokens_seen) == (donor.step, donor.ntokens_seen) == (10, 1000)
    assert healer.ntokens_at_step_start == 900  # a discarded step goes back to the healed count
