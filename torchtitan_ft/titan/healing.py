"""What a healing replica group receives from a healthy one (docs/titan.md, "Healing"): the
donor side runs on the Manager's quorum thread during the forward, the receiver side on the
training thread at the Manager's safe point.

Each DTensor travels as its local shard (donor and receiver have the same group rank, hence
the same FSDP layout) and is rebuilt with the receiver's mesh and placements.
:class:`HealedState` is the Stateful pair registered with ``Manager.register_state_dict_fn``.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def to_local_tree(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (containers copied)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, Mapping):
        return {k: to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_local_tree(v) for v in value)
    return value


def like_param(value: Any, param: torch.Tensor) -> Any:
    """Rebuild ``value`` (a received local shard) as a DTensor laid out like ``param``.

    Non-tensors, scalars (e.g. Adam's ``step``) and tensors whose shape is not the local shard
    shape are returned unchanged. Raises ``ValueError`` for a tensor of the parameter's full
    rank but the wrong shard shape (the sender was sharded differently).
    """
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    local_shape = param.to_local().shape
    if value.dim() == 0 or value.dim() != len(local_shape):
        return value
    if value.shape != local_shape:
        raise ValueError(
            f"received shard of shape {tuple(value.shape)} for a parameter whose local shard "
            f"is {tuple(local_shape)}: donor and receiver are sharded differently"
        )
    return DTensor.from_local(
        value.to(param.dtype),
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with local shards (no state initialisation)."""
    return to_local_tree(optimizer.state_dict())


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a state made by :func:`optimizer_state_dict`, rebuilding DTensor states."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt = {
        index: {name: like_param(v, params[index]) for name, v in per_param.items()}
        for index, per_param in state["state"].items()
    }
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})


class HealedState:
    """Model, optimizers, lr schedulers and train state of one TorchTitan trainer rank.

    Args:
        model_parts: the trainer's (parallelized) model parts.
        optimizers: TorchTitan's OptimizersContainer (its ``.optimizers`` list is used).
        lr_schedulers: TorchTitan's LRSchedulersContainer (Stateful, plain values).
        train_state: the trainer's step and tokens seen (Stateful: the Trainer itself, or
            :class:`TrainStateAtStepStart` on the per-step path).
        data: the group's data ledger (Stateful, e.g. ``CommittedBatches``) or None.
    """

    def __init__(
        self,
        model_parts: Iterable[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        train_state: Any,
        data: Any = None,
    ) -> None:
        # The sharded tensors are captured now, on the training thread: calling
        # ``module.state_dict()`` later, on the quorum thread while FSDP's forward has swapped
        # in unsharded parameters, breaks that forward (mixed Tensor/DTensor, torchtitan PR
        # #4754). FSDP updates these sharded parameters in place, so the references stay valid.
        self._model_tensors = [_persistent_tensors(part) for part in model_parts]
        self._optimizers: list[torch.optim.Optimizer] = list(optimizers.optimizers)
        self._lr_schedulers = lr_schedulers
        self._train_state = train_state
        self._data = data

    def state_dict(self) -> dict[str, Any]:
        """Local shards of everything a healing peer needs (called on the quorum thread)."""
        state = {
            "model": [to_local_tree(tensors) for tensors in self._model_tensors],
            "optimizers": [optimizer_state_dict(o) for o in self._optimizers],
            "lr_schedulers": self._lr_schedulers.state_dict(),
            "train_state": self._train_state.state_dict(),
        }
        if self._data is not None:
            state["data"] = self._data.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a peer's :meth:`state_dict` (called by the Manager at a safe point)."""
        _check_lengths("model parts", state["model"], self._model_tensors)
        _check_lengths("optimizers", state["optimizers"], self._optimizers)
        with torch.no_grad():
            for tensors, received in zip(self._model_tensors, state["model"], strict=True):
                _copy_model_state(tensors, received)
        for optimizer, received in zip(self._optimizers, state["optimizers"], strict=True):
            load_optimizer_state_dict(optimizer, received)
        self._lr_schedulers.load_state_dict(state["lr_schedulers"])
        self._train_state.load_state_dict(state["train_state"])
        if self._data is not None:
            if "data" not in state:
                raise ValueError("healed state lacks the data ledger (donor without one?)")
            self._data.load_state_dict(state["data"])

    def train_step(self) -> int:
        """The trainer's step counter (the step being trained, once the loop has moved it)."""
        return int(self._train_state.state_dict()["step"])

    def advance_one_step(self) -> None:
        """Move the trainer step and the lr schedules one step on: a received state that a
        peer took at the *end* of its step (a semi-sync donor sends it from its sync point,
        inside the optimizer step, before its lr schedulers step) describes the step before
        the one this replica is about to train."""
        train_state = self._train_state.state_dict()
        train_state["step"] += 1
        self._train_state.load_state_dict(train_state)
        self._lr_schedulers.step()


class TrainStateAtStepStart:
    """A trainer's step and tokens seen as a per-step heal sends and applies them.

    TorchTitan counts a step's tokens when it draws the step's batch, and a donor's state is read
    on the quorum thread, before or after that draw. Sent as the trainer's own ``state_dict``,
    the count would include the donor's step in progress or not, by chance, and the healer's own
    draw of that step would be overwritten: the groups then end one batch apart. Here the count
    sent is the donor's at the start of its step in progress (what its last committed step left),
    and the healer keeps what its own step in progress drew on top of it, so both count the same
    tokens once the step commits.

    Args:
        trainer: the TorchTitan trainer; ``ntokens_at_step_start`` is set on it at the start of
            each step (``FaultTolerantTrainer.train_step``) and here by a heal.
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        return {"step": trainer.step, "ntokens_seen": trainer.ntokens_at_step_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        drawn = trainer.ntokens_seen - trainer.ntokens_at_step_start
        trainer.step = state["step"]
        trainer.ntokens_at_step_start = state["ntokens_seen"]
        trainer.ntokens_seen = state["ntokens_seen"] + drawn


def _check_lengths(what: str, received: list[Any], local: list[Any]) -> None:
    if len(received) != len(local):
        raise ValueError(f"received {len(received)} {what}, this replica has {len(local)}")


def _persistent_tensors(part: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of ``part``, by their module names, as the module
    objects themselves (sharded DTensors under FSDP, outside forward/backward).

    Chosen from the modules, not from ``part.state_dict()``'s keys: a module's state-dict hooks
    may save a tensor under other names (TorchTitan 0.3.0's llama3 saves its fused ``wqkv``
    weight as ``wq``/``wk``/``wv``), and a selection by those keys would leave that parameter
    out of every heal. Non-persistent buffers (e.g. a RoPE cache) are rebuilt by the model and
    not sent."""
    tensors: dict[str, torch.Tensor] = dict(part.named_parameters())
    for name, buffer in part.named_buffers():
        module_name, _, buffer_name = name.rpartition(".")
        if buffer_name not in part.get_submodule(module_name)._non_persistent_buffers_set:
            tensors[name] = buffer
    return tensors


def _copy_model_state(current: Mapping[str, torch.Tensor], received: Mapping[str, Any]) -> None:
    missing = current.keys() - received.keys()
    if missing:
        raise ValueError(f"healed model state lacks {sorted(missing)[:5]}")
    for name, tensor in current.items():
        local: torch.Tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        _copy(local, received[name], name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: received shape {tuple(src.shape)}, local {tuple(dst.shape)}")
    dst.copy_(src)
