"""LocalSGD and (Streaming) DiLoCo in TorchTitan, in every trainer rank: the replica axis of a
semi-sync FT job, whose strategy drives the optimizer step (docs/titan.md, "Semi-sync")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from torchtitan_ft.semi_sync import SyncConfig, SyncStrategy, build_strategy
from torchtitan_ft.semi_sync.strategy import local_tensor, param_data
from torchtitan_ft.titan.config_schema import sync_config, uses_semi_sync
from torchtitan_ft.titan.healing import like_param
from torchtitan_ft.titan.replica_axis import (
    CommitGate,
    CommitGatedLRSchedulers,
    ManagerRuntime,
    ReplicaSlice,
    build_manager_runtime,
)


class StrategyDrivenOptimizers:
    """TorchTitan's OptimizersContainer driven by a :class:`~torchtitan_ft.semi_sync.SyncStrategy`.

    ``zero_grad`` (first call of ``train_step``, before the forward) calls ``start_step``;
    ``step`` applies the inner update only if ``before_step`` allows it and always calls
    ``after_step`` (where LocalSGD/DiLoCo count inner steps and sync); after an applied inner
    step for which ``at_last_step()`` holds, the outer round still in flight (an outer
    overlap) is applied, as the Manager path's ``DiLoCo.flush()`` (:func:`flush_last_round`).
    Everything else is delegated.
    """

    def __init__(
        self,
        optimizers: Any,
        strategy: SyncStrategy,
        gate: CommitGate,
        on_joined_sync: Callable[[], None] = lambda: None,
        at_last_step: Callable[[], bool] = lambda: False,
    ) -> None:
        self._optimizers = optimizers
        self._strategy = strategy
        self._gate = gate
        self._on_joined_sync = on_joined_sync
        self._at_last_step = at_last_step

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """``strategy.start_step()`` (the first one forms the initial quorum), then clear grads.

        A replica that healed into its peers' sync received their state at the end of their
        step: ``on_joined_sync`` (once) moves this trainer to the peers' next step."""
        joined_before = self._strategy.joined_peers_sync
        self._strategy.start_step()
        if self._strategy.joined_peers_sync and not joined_before:
            self._on_joined_sync()
        self._optimizers.zero_grad(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Inner step if the strategy allows it, then ``after_step``; returns whether stepped."""
        stepped = self._strategy.before_step()
        if stepped:
            self._optimizers.step(*args, **kwargs)
        self._gate.committed = stepped
        self._strategy.after_step()
        if stepped and self._at_last_step():
            flush_last_round(self._strategy)
        return stepped

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizers, name)


def flush_last_round(strategy: SyncStrategy) -> bool | None:
    """At the last training step: waits for the outer round still in flight (DiLoCo with an
    outer overlap), votes on it and applies it (or discards it), so that every group ends on
    the global parameters, with one line saying which. Returns ``strategy.flush()``'s answer
    (None: nothing was to be finished)."""
    fragment = strategy.in_flight_fragment
    committed = strategy.flush()
    if committed is None:
        return None
    logger.info(
        f"FT: last step: the outer round of fragment {fragment} still in flight was "
        + ("applied" if committed else "discarded (it did not commit)")
        + " before the final checkpoint"
    )
    return committed


def in_flight_note(strategy: SyncStrategy | None, step: int) -> str | None:
    """The line a checkpoint of step ``step`` taken with an outer round in flight gets (None
    when nothing is in flight): the round is not in it, and a resume from it drops the round
    in every group alike."""
    if strategy is None or strategy.in_flight_fragment is None:
        return None
    return (
        f"FT: step {step}'s checkpoint is saved with the outer round of fragment "
        f"{strategy.in_flight_fragment} in flight: a resume from it drops that round in every "
        "group; the local progress is in the saved model and goes into the next pseudo-gradient"
    )


class StrategyState:
    """The strategy's state as a Stateful for TorchTitan's DCP checkpoints (key ``ft_strategy``).

    Keyed by the model's parameter names, every tensor laid out like its parameter, so DCP
    saves and loads it under FSDP like the model itself::

        {"schedule": {"local_step", "syncs_committed" (DiLoCo)},   # int64 scalars
         "global": {fqn: global parameter},                        # DTensor like the parameter
         "outer": {fqn: {state name: tensor}}}                     # DiLoCo's outer optimizer

    ``state_dict`` hands out the strategy's own tensors (global copies wrapped as DTensors
    sharing their storage, the outer optimizer's state), so loading fills them in place; the
    outer optimizer's state is created first where it has not stepped yet
    (``initial_optimizer_state``: equal numerics), so a checkpoint always holds the same
    tensors and a load always finds them. Loading does not touch the model: the trainer's own
    model state is loaded beside it (see ``SemiSyncResume.after_load``).

    Args:
        strategy: the strategy (LocalSGD, DiLoCo: any ``SyncStrategy``; one that keeps no
            state saves empty sections).
        model: the model it syncs (the parameter names).
    """

    def __init__(self, strategy: SyncStrategy, model: torch.nn.Module) -> None:
        self._strategy = strategy
        self._names = {id(p): name for name, p in model.named_parameters()}

    def _name(self, p: torch.nn.Parameter) -> str:
        name = self._names.get(id(p))
        if name is None:
            raise ValueError("the strategy syncs a parameter that is not in the model")
        return name

    def _outer(self) -> list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]]:
        return [(p, s) for p, s in self._strategy.outer_optimizer_state() if s]

    def state_dict(self) -> dict[str, Any]:
        """The schedule position, global parameters and outer-optimizer state (see above)."""
        schedule = self._strategy.schedule_state()
        state: dict[str, Any] = {
            "schedule": {k: torch.tensor(v, dtype=torch.int64) for k, v in schedule.items()},
            "global": {
                self._name(p): _like(t.to(param_data(p).device), p)
                for p, t in self._strategy.global_parameters()
            },
        }
        outer = self._outer()
        if outer:
            state["outer"] = {
                self._name(p): {k: _like(v, p) for k, v in s.items()} for p, s in outer
            }
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copies a loaded :meth:`state_dict` into the strategy (a no-op where DCP already
        loaded in place) and restores its schedule position."""
        for p, t in self._strategy.global_parameters():
            _copy_local(t, _entry(state, "global", self._name(p)))
        for p, s in self._outer():
            loaded = _entry(state, "outer", self._name(p))
            for k, v in s.items():
                if k not in loaded:
                    raise ValueError(
                        f"checkpoint lacks outer-optimizer state {k!r} of {self._name(p)}"
                    )
                _copy_local(v, loaded[k])
        self._strategy.load_schedule_state({k: int(v) for k, v in state["schedule"].items()})


def _like(t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """``t`` laid out like ``p``: a DTensor stays, a local shard is wrapped (no copy)."""
    return t if isinstance(t, DTensor) else like_param(t, p)


def _entry(state: dict[str, Any], section: str, name: str) -> Any:
    try:
        return state[section][name]
    except KeyError:
        raise ValueError(f"checkpoint section {section!r} lacks {name!r}") from None


def _copy_local(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst_local, src_local = local_tensor(dst), local_tensor(src)
    if dst_local.data_ptr() != src_local.data_ptr():
        dst_local.copy_(src_local)


class SemiSyncReplicaAxis:
    """The FT replica axis for LocalSGD / DiLoCo. As per-step FT's
    (:class:`~torchtitan_ft.titan.replica_axis.ManagedReplicaAxis`) in its data split, 1-rank
    FSDP, healed trainer state and Manager, but: no per-step gradient average (only the
    strategy moves parameters across groups, at sync points), a synchronous quorum (a replica
    heals before it trains and joins its peers' sync), and the strategy drives the step
    (:class:`StrategyDrivenOptimizers`).

    Args:
        runtime: the Manager (synchronous quorum) and its cross-group process group.
        data: this group's slice of the data.
        config: the strategy to build (``sync_config(job_config.fault_tolerance)``), validated
            (the strategy's builder checks it again).
        last_step: the training's last step (``training.steps``): after it, the outer round
            still in flight is applied (:func:`flush_last_round`); None never does.
    """

    enabled = True

    def __init__(
        self,
        runtime: ManagerRuntime,
        data: ReplicaSlice,
        config: SyncConfig,
        last_step: int | None = None,
    ) -> None:
        self._runtime = runtime
        self._data = data
        self.config = config
        self._last_step = last_step
        self.manager = runtime.manager
        self.replica_id = data.replica_id
        self.group_size = data.group_size
        self.strategy: SyncStrategy | None = None
        self._gate = CommitGate()
        self._model_parts: list[torch.nn.Module] | None = None
        self._healed_state: Any = None

    def train_spec(self, spec: Any) -> Any:
        """The TrainSpec with this group's data slice and FSDP on 1-rank groups (as per-step)."""
        return self._data.train_spec(spec)

    def install_gradient_sync(self, model_parts: Iterable[torch.nn.Module]) -> int:
        """Installs *no* cross-group gradient hook (gradients stay in the replica group) and
        records the model the strategy will sync; returns 0 (FSDP units hooked)."""
        self._model_parts = list(model_parts)
        if len(self._model_parts) != 1:
            raise NotImplementedError(
                f"semi_sync_method={self.config.method.value!r} supports one model part, got "
                f"{len(self._model_parts)} (pipeline parallelism is not supported)"
            )
        return 0

    def register_state(self, state: Any) -> None:
        """The trainer state a healing peer receives (as per-step FT); the strategy adds its
        own (global parameters, outer optimizer, schedule position) when it is built."""
        self._runtime.register_state(state)
        self._healed_state = state

    def gate_step(self, optimizers: Any, lr_schedulers: Any) -> tuple[Any, Any]:
        """Builds the strategy over the model and the inner optimizer; returns optimizers
        driven by it and lr schedulers that advance after an applied inner step."""
        if self._model_parts is None:
            raise RuntimeError("install_gradient_sync(model_parts) must be called before gate_step")
        self.strategy = build_strategy(self.config, self.manager, self._model_parts[0], optimizers)
        driven = StrategyDrivenOptimizers(
            optimizers,
            self.strategy,
            self._gate,
            self._start_peers_next_step,
            self._at_last_step,
        )
        return driven, CommitGatedLRSchedulers(lr_schedulers, self._gate)

    def _at_last_step(self) -> bool:
        """Whether the trainer is in its last step (its step counter, healed with the rest of
        its state, has reached ``last_step``)."""
        if self._last_step is None or self._healed_state is None:
            return False
        return self._healed_state.train_step() >= self._last_step

    def _start_peers_next_step(self) -> None:
        """This replica healed into its peers' sync (in ``zero_grad``, before the forward):
        the trainer step and lr schedules it received are those of the peers' step that just
        ended, so they move on by one and this iteration trains the peers' next step."""
        if self._healed_state is not None:
            self._healed_state.advance_one_step()

    def track_data(self, dataloader: Any) -> Any:
        """The dataloader unchanged: every batch a group reads is consumed by its inner step.
        (A discarded sync rolls the parameters back, so the data of those inner steps is
        lost to the model, not replayed; per-step FT's ledger would need a quorum per step.)"""
        return dataloader

    def step_committed(self) -> bool:
        """Whether the last inner step was applied (False only for a step whose gradients
        predate a heal)."""
        return self._gate.committed

    def strategy_state(self) -> StrategyState:
        """The strategy's state as a Stateful for disk checkpoints (after :meth:`gate_step`)."""
        if self.strategy is None or self._model_parts is None:
            raise RuntimeError("the strategy is built by gate_step; call it first")
        return StrategyState(self.strategy, self._model_parts[0])

    def shutdown(self) -> None:
        """Shuts the Manager and the cross-group process group down (once)."""
        self._runtime.shutdown()


def build_semi_sync_axis(job_config: Any) -> SemiSyncReplicaAxis:
    """The replica axis of a LocalSGD / DiLoCo job: a Manager built like per-step FT's
    (:func:`~torchtitan_ft.titan.replica_axis.build_manager_runtime`: same timeouts, transport
    and process group; the method makes its quorum synchronous), wrapped in
    :class:`SemiSyncReplicaAxis`.

    ``job_config`` is validated (:func:`~torchtitan_ft.titan.preflight.validate_job_config`,
    run by the parse, checks the strategy's settings before any process group exists).

    Raises:
        ValueError: FT is off or the method is "none".
    """
    ft = job_config.fault_tolerance
    if not uses_semi_sync(job_config):
        raise ValueError(
            "build_semi_sync_axis needs fault_tolerance.enable and a semi_sync_method "
            f"(got enable={ft.enable}, semi_sync_method={ft.semi_sync_method!r})"
        )
    data = ReplicaSlice(ft.replica_id, ft.group_size)
    return SemiSyncReplicaAxis(
        build_manager_runtime(job_config), data, sync_config(ft), job_config.training.steps
    )
