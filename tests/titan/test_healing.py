"""The state a healing replica group receives: local shards out, DTensors rebuilt in."""

import io

import pytest
import torch
from torch.distributed.tensor import DTensor

from torchtitan_ft.titan.healing import HealedState, like_param, optimizer_state_dict
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
