"""LocalSGD and (Streaming) DiLoCo, in the trainer of every rank: replica groups step alone and
sync every few steps.

Names and arguments follow torchft 0.2.0 (``torchft.local_sgd``), so
``from torchtitan_ft.semi_sync import LocalSGD, DiLoCo`` is a drop-in import.

**LocalSGD** (https://arxiv.org/abs/1805.09767): every ``sync_every`` inner steps the
parameters are averaged across replica groups.

**DiLoCo** (https://arxiv.org/abs/2311.08105): every ``sync_every`` inner steps each group
computes the pseudo-gradient ``global - local`` (``global`` = the parameters agreed at the last
sync, kept in a backup), the pseudo-gradients are averaged, and the outer optimizer steps the
global parameters with it; every group continues from the new global parameters.

**Streaming DiLoCo** (https://arxiv.org/abs/2501.18512): the model is split into F fragments,
synced in turn, one every ``sync_every / F`` steps (so each fragment still every
``sync_every`` steps); with tau = ``fragment_sync_delay``, a fragment's allreduce overlaps
the tau inner steps before it is applied. When the quorum is formed and which fragment starts
or applies its sync is decided by ``schedule.SyncSchedule`` (one pure function, the overlap
below included); the strategies here carry it out. After applying, the fragment's parameters are
``(1 - alpha) * global + alpha * local`` with alpha = ``fragment_update_alpha`` (``local`` =
the parameters just before the sync, including the tau inner steps taken while the allreduce
was in flight).

**Overlap.** With ``outer_overlap=OuterOverlap.DELAYED`` or ``EAGER`` (DiLoCo and Streaming
DiLoCo) a sync's allreduce runs during the whole next cycle and is applied at the next sync
point, one outer step late, keeping the inner progress made meanwhile (``EAGER`` starts each
round from the outer step with this group's own share of the average in flight):
``overlap.py`` defines the math; the schedule orders the steps (finish the sync in flight,
quorum, start the next).

**Failures.** A sync commits only if the allreduce succeeded and ``Manager.should_commit()``
agrees. Otherwise the sync is discarded: the fragment is restored from its backup (the last
global parameters), the outer optimizer does not step, and every replica group, having voted
the same, stays at the same global parameters.

**Healing.** The strategy state (global parameters, outer-optimizer state, position in the
schedule) is registered with the Manager (``register_state_dict_fn``, key ``"diloco"`` or
``"local_sgd"``), so a replica that heals receives it from a healthy peer, and checkpoints that
save ``state_dict()`` carry it; loading it also resets the model's parameters to the global
ones. Disk checkpoints that load in place (DCP) use the same state by parameter instead:
``global_parameters()``, DiLoCo's ``outer_optimizer_state()`` (created before the first outer
step where needed, with equal numerics: ``outer_optimizer.initial_optimizer_state``) and
``schedule_state()``; see ``torchtitan_ft.titan.semi_sync_axis.StrategyState``.

Quorums are formed only at sync points, plus once before the first inner step (the first
``start_step``, or the first optimizer step in context-manager mode), so a new replica heals
before it trains:

- at the very start, that first quorum is committed (after a one-float allreduce, so a peer
  that serves a heal does not stop serving before the transfer is done); the Manager's step
  thus leaves 0 and ``init_sync`` does not heal everyone again at the first sync;
- a replica that joins later waits in that first quorum until its peers reach their next sync
  point, heals there, and takes part in that sync at once. It brings no progress of its own
  (DiLoCo: a zero pseudo-gradient; LocalSGD: the last average), and the average is over all
  participants, so that one sync's update is scaled by (N-1)/N.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn, optim

from torchtitan_ft.process_group.quantized import DEFAULT_BLOCK_SIZE, quantized_nbytes
from torchtitan_ft.semi_sync.backup import ParameterBackup, dtype_groups, flatten, unflatten
from torchtitan_ft.semi_sync.config import (
    QuorumMode,
    SyncMethod,
    check_fragment_update_alpha,
    check_quorum_mode,
)
from torchtitan_ft.semi_sync.outer_optimizer import (
    OuterOptimizerArg,
    build_outer_optimizers,
    initial_optimizer_state,
    local_copy,
    shard_like_params,
)
from torchtitan_ft.semi_sync.overlap import (
    OuterOverlap,
    check_outer_overlap,
    delayed_parameters,
    own_share,
)
from torchtitan_ft.semi_sync.schedule import SyncActions, SyncSchedule
from torchtitan_ft.semi_sync.strategy import (
    CommStats,
    ManagerLike,
    SyncStrategy,
    _OptimizerHooks,
    param_data,
    quorum_mode_of,
    wait_future,
)

logger: logging.Logger = logging.getLogger(__name__)


@dataclass
class _PendingSync:
    """A sync whose allreduce has been started (LocalSGD: of the parameters, fragment 0;
    DiLoCo: of one fragment's pseudo-gradients)."""

    fragment: int
    buffers: list[tuple[list[int], torch.Tensor]]
    futures: list[torch.futures.Future[torch.Tensor]] = field(default_factory=list)
    sent: list[torch.Tensor] | None = None
    """DiLoCo with an outer overlap: the fragment's local parameters when the sync started
    (``S`` in ``overlap.py``: with ``EAGER``, after the eager step); None otherwise."""


class _SemiSync(SyncStrategy, _OptimizerHooks):
    """What LocalSGD and DiLoCo share: the step counter, carrying out the sync schedule
    (``SyncSchedule``) and healing.

    Subclasses implement ``_prepare`` (start a fragment's sync) and ``_finish_sync`` (apply or
    discard the sync in flight), ``state_dict``/``_load_state`` and ``_backups`` (the global
    copies).
    """

    _state_key = "semi_sync"
    _method: SyncMethod
    _syncs_committed = 0
    """Committed fragment syncs, which pick the next fragment (DiLoCo counts them; LocalSGD's
    one fragment needs no count)."""

    def __init__(
        self,
        manager: ManagerLike,
        optimizer: optim.Optimizer,
        params: Iterable[nn.Parameter],
        quorum_mode: QuorumMode | None,
        schedule: SyncSchedule,
    ) -> None:
        _check_sync_quorum(type(self).__name__, self._method, manager, quorum_mode)
        _OptimizerHooks.__init__(self, optimizer, params)
        self._manager = manager
        self._schedule = schedule
        self._local_step = 0
        self._started = False
        self._healed = False
        self._pending: _PendingSync | None = None
        self.stats = CommStats()

    def _register(self) -> None:
        self._manager.register_state_dict_fn(self._state_key, self.load_state_dict, self.state_dict)

    @property
    def local_step(self) -> int:
        """Inner steps since the last sync point (the position in the sync schedule)."""
        return self._local_step

    def start_step(self) -> None:
        """On the first call, forms a quorum (healing this replica if it is behind)."""
        if not self._started:
            self._initial_quorum()

    def before_step(self) -> bool:
        """Returns False only on a first step whose gradients predate healing."""
        if self._started:
            return True
        return not self._initial_quorum()

    def after_step(self) -> None:
        """Counts the inner step and does what the sync schedule says at it."""
        self._local_step += 1
        actions = self._actions()
        if actions.finish_fragment is not None:
            self._finish_sync()
        if actions.form_quorum:
            self._quorum()
        self._sync()

    def _actions(self) -> SyncActions:
        return self._schedule.actions(
            self._local_step, self._syncs_committed, self.in_flight_fragment
        )

    def _sync(self) -> None:
        """Starts and applies the syncs the schedule names at the current position. Runs
        after any finish and quorum, so it sees the position that they (a commit, a heal's
        loaded state) left."""
        actions = self._actions()
        if actions.start_fragment is not None:
            self._prepare(actions.start_fragment)
        if actions.end_cycle:
            self._local_step = 0
        if actions.apply_fragment is not None:
            self._finish_sync()

    @property
    def in_flight_fragment(self) -> int | None:
        """The fragment whose sync is on the wire between two inner steps (an outer overlap,
        or a ``fragment_sync_delay``); None when none is."""
        return None if self._pending is None else self._pending.fragment

    def _quorum(self) -> None:
        self._healed = False
        self._manager.start_quorum()
        self._manager.wait_quorum()

    def _initial_quorum(self) -> bool:
        """Forms the first quorum; returns whether this replica healed in it.

        Retried until it commits. A replica that heals while its peers are at a sync point
        takes part in the rest of that sync (which commits). Otherwise the quorum itself is
        committed (an empty step): the Manager's step then leaves 0, so that ``init_sync`` does
        not heal every replica again at the first sync, wiping its local progress.
        """
        self._started = True
        healed = False
        while True:
            self._quorum()
            healed, self._healed = healed or self._healed, False
            if healed and self._actions().form_quorum:
                # The peers are at a sync point: take part in the rest of that sync.
                self._sync()
                self.joined_peers_sync = True
                return healed
            # A collective before the vote: a peer serving our heal (or healing from us) must
            # not commit, and stop serving its checkpoint, before the transfer is done.
            wait_future(self._manager, self._manager.allreduce(torch.zeros(1)))
            if self._manager.should_commit():
                return healed
            logger.warning("initial quorum did not commit (%s); retrying", self._manager.errored())

    def _prepare(self, index: int) -> None:
        """Starts the sync of fragment ``index`` (sets ``_pending``)."""
        raise NotImplementedError

    def _finish_sync(self) -> bool | None:
        """Waits for the sync in flight (``_pending``) and applies it, or discards it unless
        it committed; returns whether it committed."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the strategy state and resets the model's parameters to the global ones."""
        self._load_state(state_dict)
        self._local_step = int(state_dict["local_step"])
        self._healed = True

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError

    # Disk checkpoints: the same state, by parameter, in tensors a checkpoint can fill in place.

    def _backups(self) -> list[ParameterBackup]:
        raise NotImplementedError

    def global_parameters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each synced parameter with its global copy: the backup tensor itself (the
        parameter's local shard, on ``backup_device``), so a checkpoint can load into it."""
        return [(p, t) for b in self._backups() for p, t in zip(b.params, b.tensors, strict=True)]

    def restore_global(self) -> None:
        """Sets every synced parameter to its global value (drops local progress)."""
        for backup in self._backups():
            backup.restore()

    def schedule_state(self) -> dict[str, int]:
        """The position in the sync schedule (``local_step``; DiLoCo adds
        ``syncs_committed``, which picks the next fragment)."""
        return {"local_step": self._local_step}

    def load_schedule_state(self, state: dict[str, int]) -> None:
        """Restores :meth:`schedule_state` output."""
        self._local_step = int(state["local_step"])


class LocalSGD(_SemiSync):
    """Averages the parameters across replica groups every ``sync_every`` inner steps.

    Requires a synchronous quorum (``QuorumMode.SYNC``): a replica that joins must heal and
    join the sync its peers are in before it trains, which an asynchronous quorum (healing
    applied later, at ``should_commit``) cannot guarantee. Keeps a backup of the last averaged
    parameters (on ``backup_device``) so that a failed sync can be undone.

    Args:
        manager: the replica group's Manager.
        model: the model whose parameters are averaged.
        optimizer: the inner (local) optimizer; its hooks drive the strategy in
            context-manager mode.
        sync_every: inner steps between two averages (>= 1).
        backup_device: where the backup lives (default cpu).
        quorum_mode: ``QuorumMode.SYNC``, when the Manager does not say (its
            ``use_async_quorum``, or torchft's ``_use_async_quorum``); checked against it
            when it does. A Manager-like object that does not say (e.g. a mock) is assumed
            synchronous, with a warning.
    """

    _state_key = "local_sgd"
    _method = SyncMethod.LOCAL_SGD

    def __init__(
        self,
        manager: ManagerLike,
        model: nn.Module,
        optimizer: optim.Optimizer,
        sync_every: int,
        backup_device: torch.device | None = None,
        *,
        quorum_mode: QuorumMode | None = None,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        super().__init__(
            manager, optimizer, model.parameters(), quorum_mode, SyncSchedule(sync_every)
        )
        self._model = model
        self._backup = ParameterBackup(list(model.named_parameters()), backup_device)
        self._register()

    def _prepare(self, index: int) -> None:
        """Starts the allreduce of the parameters (``index`` is 0: one fragment)."""
        params = self._backup.params
        pending = _PendingSync(index, [])
        for group in dtype_groups(params):
            flat = flatten([param_data(params[i]) for i in group]).clone()
            pending.futures.append(self._manager.allreduce(flat))
            pending.buffers.append((group, flat))
            self.stats.allreduce_calls += 1
            self.stats.payload_bytes += flat.numel() * flat.element_size()
        self._pending = pending

    def _finish_sync(self) -> bool:
        """Sets the parameters to their average if the sync commits, else restores the last
        average; returns whether it committed."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("no LocalSGD sync in flight to finish")
        params = self._backup.params
        ok = all([wait_future(self._manager, fut) for fut in pending.futures])
        committed = self._manager.should_commit() and ok
        with torch.no_grad():
            if committed:
                for group, flat in pending.buffers:
                    datas = [param_data(params[i]) for i in group]
                    for data, avg in zip(datas, unflatten(flat, datas), strict=True):
                        data.copy_(avg)
                self._backup.save()
                self.stats.syncs_committed += 1
            else:
                self._backup.restore()
                self.stats.syncs_failed += 1
                logger.warning("LocalSGD sync failed; parameters restored to the last average")
        return committed

    def state_dict(self) -> dict[str, Any]:
        """``{"local_step", "global"}``: the step counter and the last averaged parameters."""
        return {"local_step": self._local_step, "global": self._backup.state_dict()}

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._backup.load_state_dict(state_dict["global"])
        self._backup.restore()

    def _backups(self) -> list[ParameterBackup]:
        return [self._backup]


class _Fragment:
    """One DiLoCo fragment: its parameters, their global backup, and its outer optimizer."""

    def __init__(
        self,
        module: nn.Module,
        outer_optimizer: optim.Optimizer,
        backup_device: torch.device | None,
    ) -> None:
        self.module = module
        self.backup = ParameterBackup(list(module.named_parameters()), backup_device)
        self.params = self.backup.params
        self.groups = dtype_groups(self.params)
        self.outer_optimizer = outer_optimizer

    def pseudo_gradients(self) -> list[tuple[list[int], torch.Tensor]]:
        """Flat ``global - local`` per dtype group."""
        out = []
        with torch.no_grad():
            for group in self.groups:
                deltas = [
                    self.backup.tensors[i].to(param_data(self.params[i]).device)
                    - param_data(self.params[i])
                    for i in group
                ]
                out.append((group, flatten(deltas)))
        return out

    def outer_step(self, buffers: list[tuple[list[int], torch.Tensor]]) -> None:
        """Sets the averaged pseudo-gradients as grads and steps the outer optimizer.

        Only this fragment's parameters have a gradient during the step (others' are stashed),
        so an outer optimizer shared by several fragments moves just this one.
        """
        own = {id(p) for p in self.params}
        stashed = {}
        for group in self.outer_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in own and p.grad is not None:
                    stashed[p] = p.grad
                    p.grad = None
        for group_idx, flat in buffers:
            datas = [param_data(self.params[i]) for i in group_idx]
            for i, grad in zip(group_idx, unflatten(flat, datas), strict=True):
                p = self.params[i]
                p.grad = _as_param_grad(p, grad.to(param_data(p).dtype))
        self.outer_optimizer.step()
        for p in self.params:
            p.grad = None
        for p, grad in stashed.items():
            p.grad = grad

    def eager_step(self, shares: list[tuple[list[int], torch.Tensor]]) -> None:
        """Sets the parameters to where an outer step with ``shares`` as gradients takes the
        global parameters, leaving the outer optimizer's state as it was (the eager update's
        starting point, ``overlap.py``); the global backup is not touched."""
        opt = self.outer_optimizer
        saved = {p: _copy_state(opt.state[p]) for p in self.params if opt.state.get(p)}
        self.backup.restore()
        self.outer_step(shares)
        for p in self.params:
            if p in saved:
                opt.state[p] = saved[p]
            else:
                opt.state.pop(p, None)


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's per-parameter state with its tensors copied."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _as_param_grad(p: nn.Parameter, local_grad: torch.Tensor) -> torch.Tensor:
    """``local_grad`` shaped as ``p``'s gradient (a DTensor for a DTensor parameter)."""
    from torch.distributed.tensor import DTensor  # only a DTensor parameter needs it (cost)

    if isinstance(p, DTensor):
        return DTensor.from_local(
            local_grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    return local_grad


class DiLoCo(_SemiSync):
    """DiLoCo and Streaming DiLoCo (see the module docstring for the algorithm and schedule).

    Requires a synchronous quorum (``QuorumMode.SYNC``, i.e. ``Manager(use_async_quorum=False)``).

    Args:
        manager: the replica group's Manager.
        model_fragments: the fragments (``nn.Module`` s sharing the model's parameters, e.g. from
            ``split_model``); a single module means plain DiLoCo.
        inner_optimizer: the local optimizer stepped every inner step.
        outer_optimizer: an optimizer over all fragments' parameters, one per fragment, or an
            ``OuterOptimizerConfig`` (one optimizer per fragment is built from it). Its state is
            part of ``state_dict`` and is healed.
        sync_every: inner steps between two syncs of the same fragment (H); a multiple of the
            number of fragments F.
        backup_device: where the global parameters are kept (default cpu).
        should_quantize: allreduce pseudo-gradients as int8 with per-block scales.
        fragment_sync_delay: tau, inner steps between starting a fragment's allreduce and
            applying it; ``0 <= tau < sync_every / F``.
        fragment_update_alpha: alpha in [0, 1]; weight of the local parameters when mixing
            them with the new global ones after a sync.
        outer_overlap: ``OuterOverlap.NONE`` (default, as torchft), ``DELAYED`` or ``EAGER``:
            each sync's allreduce overlaps the whole next cycle and is applied one outer step
            late with the inner progress kept; ``EAGER`` starts each round from the outer step
            with this group's own share of the average in flight (``overlap.py``). Call
            :meth:`flush` after the last inner step. Both need ``fragment_sync_delay = 0`` and
            ``fragment_update_alpha = 0``.
        quorum_mode: ``QuorumMode.SYNC``, when the Manager does not say (its
            ``use_async_quorum``, or torchft's ``_use_async_quorum``); checked against it
            when it does. A Manager-like object that does not say (e.g. a mock) is assumed
            synchronous, with a warning.
        pin_memory, use_bucketization, bucket_cap_mb: accepted for torchft compatibility;
            pinning is automatic when CUDA is present and each fragment is always sent as one
            buffer per dtype.
    """

    _state_key = "diloco"
    _method = SyncMethod.DILOCO

    def __init__(
        self,
        manager: ManagerLike,
        model_fragments: Sequence[nn.Module] | nn.Module,
        inner_optimizer: optim.Optimizer,
        outer_optimizer: OuterOptimizerArg,
        sync_every: int,
        backup_device: torch.device | None = None,
        *,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        outer_overlap: OuterOverlap | str = OuterOverlap.NONE,
        quorum_mode: QuorumMode | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
    ) -> None:
        del pin_memory, use_bucketization, bucket_cap_mb  # see the docstring
        fragments = (
            [model_fragments] if isinstance(model_fragments, nn.Module) else list(model_fragments)
        )
        schedule = SyncSchedule(sync_every, len(fragments), fragment_sync_delay)
        check_fragment_update_alpha(fragment_update_alpha)
        self._overlap = check_outer_overlap(
            outer_overlap, fragment_sync_delay, fragment_update_alpha
        )
        schedule = replace(schedule, overlap=self._overlap)
        all_params = [p for f in fragments for p in f.parameters()]
        super().__init__(manager, inner_optimizer, all_params, quorum_mode, schedule)
        self._alpha = fragment_update_alpha
        self._should_quantize = should_quantize
        optimizers = build_outer_optimizers(outer_optimizer, fragments)
        self._fragments = [
            _Fragment(module, opt, backup_device)
            for module, opt in zip(fragments, optimizers, strict=True)
        ]
        # Committed fragment syncs; picks the next fragment (healed with the state, so every
        # replica picks the same one).
        self._syncs_committed = 0
        self._register()
        if self._overlap.overlapped:
            logger.info(
                "DiLoCo outer_overlap=%r (not in torchft or TorchTitan): each outer round is "
                "applied one round late, on top of the inner progress made meanwhile%s",
                self._overlap.value,
                ", each round starting from the outer step with this group's own share"
                if self._overlap is OuterOverlap.EAGER
                else "",
            )

    @property
    def num_fragments(self) -> int:
        """F, the number of fragments."""
        return len(self._fragments)

    @property
    def outer_overlap(self) -> OuterOverlap:
        """Whether an outer round overlaps the next inner steps."""
        return self._overlap

    def outer_optimizers(self) -> list[optim.Optimizer]:
        """The outer optimizer of each fragment (the same object when shared)."""
        return [f.outer_optimizer for f in self._fragments]

    def flush(self) -> bool | None:
        """Waits for the sync in flight, votes on it and applies it (or discards it), as the
        next sync point would; nothing without an outer overlap or with no sync in flight.
        Call once after the last inner step, in every group, so that the last round's progress
        is averaged (the parameters are then the global ones).

        Returns:
            Whether the sync committed; None when none was in flight.
        """
        if self._pending is not None and self._overlap.overlapped:
            return self._finish_sync()
        return None

    def _prepare(self, index: int) -> None:
        """Computes fragment ``index``'s pseudo-gradients and starts their allreduce."""
        if self._pending is not None:
            raise RuntimeError("a fragment sync is already in flight")
        fragment = self._fragments[index]
        pending = _PendingSync(index, fragment.pseudo_gradients())
        shares = None
        if self._overlap is OuterOverlap.EAGER:  # taken before the allreduce overwrites them
            participants = self._manager.num_participants()
            shares = [(group, own_share(flat, participants)) for group, flat in pending.buffers]
        for _, flat in pending.buffers:
            pending.futures.append(
                self._manager.allreduce(flat, should_quantize=self._should_quantize)
            )
            self.stats.allreduce_calls += 1
            self.stats.payload_bytes += (
                quantized_nbytes(flat.numel(), DEFAULT_BLOCK_SIZE)
                if self._should_quantize
                else flat.numel() * flat.element_size()
            )
        if shares is not None:
            fragment.eager_step(shares)
        if self._overlap.overlapped:
            pending.sent = [param_data(p).detach().clone() for p in fragment.params]
        self._pending = pending

    def _finish_sync(self) -> bool | None:
        """Waits for the pending allreduce and applies it (or discards it); returns whether it
        committed (None: nothing was in flight)."""
        pending, self._pending = self._pending, None
        if pending is None:
            # Only after loading a checkpoint taken while a sync was in flight: every replica
            # resumed from it is in the same position, so all skip this sync alike.
            logger.warning("no fragment sync in flight at the end of a cycle; skipping it")
            return None
        fragment = self._fragments[pending.fragment]
        ok = all([wait_future(self._manager, fut) for fut in pending.futures])
        delayed = pending.sent is not None
        keep = delayed or self._alpha > 0
        local = [param_data(p).clone() for p in fragment.params] if keep else None
        fragment.backup.restore()
        committed = self._manager.should_commit() and ok
        if committed:
            fragment.outer_step(pending.buffers)
            fragment.backup.save()
            self.stats.syncs_committed += 1
            self._syncs_committed += 1
        else:
            self.stats.syncs_failed += 1
            logger.warning(
                "DiLoCo sync of fragment %d failed; fragment restored to its global parameters%s",
                pending.fragment,
                " plus the inner progress made since the sync started" if delayed else "",
            )
        if local is None or not (committed or delayed):
            return committed
        with torch.no_grad():
            for i, p in enumerate(fragment.params):
                data = param_data(p)
                if pending.sent is not None:
                    data.copy_(delayed_parameters(data, local[i], pending.sent[i]))
                else:
                    data.lerp_(local[i], self._alpha)
        return committed

    def state_dict(self) -> dict[str, Any]:
        """``{"local_step", "syncs_committed", "global", "outer_optimizers"}``.

        ``global`` holds each fragment's global parameters by name; ``outer_optimizers`` the
        state dict of each distinct outer optimizer.
        """
        return {
            "local_step": self._local_step,
            "syncs_committed": self._syncs_committed,
            "global": [f.backup.state_dict() for f in self._fragments],
            # Copies of the local shards: a transport may serialize after later outer steps
            # mutate the state, and a healing peer rebuilds sharded state like its own params.
            "outer_optimizers": [
                local_copy(opt.state_dict()) for opt in self._distinct_optimizers()
            ],
        }

    def _distinct_optimizers(self) -> list[optim.Optimizer]:
        seen: dict[int, optim.Optimizer] = {}
        for f in self._fragments:
            seen.setdefault(id(f.outer_optimizer), f.outer_optimizer)
        return list(seen.values())

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        globals_ = state_dict["global"]
        optimizers = self._distinct_optimizers()
        if len(globals_) != len(self._fragments):
            raise ValueError(
                f"state_dict has {len(globals_)} fragments, this DiLoCo has {len(self._fragments)}"
            )
        if len(state_dict["outer_optimizers"]) != len(optimizers):
            raise ValueError(
                f"state_dict has {len(state_dict['outer_optimizers'])} outer optimizers, "
                f"expected {len(optimizers)}"
            )
        for fragment, sd in zip(self._fragments, globals_, strict=True):
            fragment.backup.load_state_dict(sd)
            fragment.backup.restore()
        for opt, sd in zip(optimizers, state_dict["outer_optimizers"], strict=True):
            opt.load_state_dict(sd)
            shard_like_params(opt)
        self._syncs_committed = int(state_dict["syncs_committed"])
        self._pending = None

    def _backups(self) -> list[ParameterBackup]:
        return [f.backup for f in self._fragments]

    def schedule_state(self) -> dict[str, int]:
        """``local_step`` and ``syncs_committed`` (the next fragment is ``syncs_committed % F``)."""
        return {"local_step": self._local_step, "syncs_committed": self._syncs_committed}

    def load_schedule_state(self, state: dict[str, int]) -> None:
        """Restores :meth:`schedule_state` output; a sync in flight is dropped (see
        ``_finish_sync``: every replica resumed from the same state skips it alike)."""
        self._local_step = int(state["local_step"])
        self._syncs_committed = int(state["syncs_committed"])
        self._pending = None

    def outer_optimizer_state(self) -> list[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
        """Each synced parameter with its outer-optimizer state: the optimizer's own tensors
        (so a checkpoint can load into them), created first where the optimizer has not
        stepped yet (:func:`initial_optimizer_state`), so that saved and loaded checkpoints
        always hold the same tensors."""
        out = []
        for f in self._fragments:
            opt = f.outer_optimizer
            for p in f.params:
                if not opt.state.get(p):
                    opt.state[p] = initial_optimizer_state(opt, p)
                out.append((p, opt.state[p]))
        return out


_warned_unknown_mode = False


def _check_sync_quorum(
    strategy: str, method: SyncMethod, manager: ManagerLike, quorum_mode: QuorumMode | None
) -> None:
    """Refuses a Manager with an asynchronous quorum. One that does not say (any object with
    the Manager's interface, e.g. a mock) is assumed synchronous, as torchft assumes, with a
    warning once per process."""
    global _warned_unknown_mode
    mode = quorum_mode_of(manager, quorum_mode)
    if mode is None:
        if not _warned_unknown_mode:
            _warned_unknown_mode = True
            logger.warning(
                "%s cannot tell the quorum mode of %s (no use_async_quorum or "
                "_use_async_quorum bool): assuming a synchronous quorum, which it requires; "
                "pass quorum_mode=QuorumMode.SYNC to say so",
                strategy,
                type(manager).__name__,
            )
        mode = QuorumMode.SYNC
    check_quorum_mode(method, mode, name=strategy)
