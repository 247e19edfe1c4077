"""The interface the trainer drives on every rank, and what every sync strategy shares.

A training step with any strategy::

    strategy.start_step()            # before the forward: per-step starts the quorum here
    loss = model(batch); loss.backward()
    if strategy.before_step():       # after backward: per-step averages grads and votes
        optimizer.step()
    strategy.after_step()            # always: LocalSGD/DiLoCo count steps and sync here
    optimizer.zero_grad()

``state_dict``/``load_state_dict`` carry what the strategy owns (for DiLoCo: the global
parameters, outer-optimizer state and step counter); the semi-sync strategies also register
them with the Manager so that a healing replica receives them.

A trainer also reads, without knowing the strategy: ``in_flight_fragment`` and ``flush`` (the
outer round still on the wire at the last step), and the same state by parameter for disk
checkpoints that load in place (``schedule_state``, ``global_parameters``,
``outer_optimizer_state``). Each has a default for a strategy that keeps none of it.

For torchft users, the strategies are also context managers: ``with LocalSGD(...)`` /
``with DiLoCo(...)`` registers optimizer step hooks that call ``before_step``/``after_step``
(do not also call them by hand then).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import torch
from torch import nn, optim
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from torchtitan_ft.semi_sync.config import QuorumMode

logger: logging.Logger = logging.getLogger(__name__)


class ManagerLike(Protocol):
    """The part of ``torchtitan_ft.manager.Manager`` (torchft 0.2.0 names) the strategies use."""

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: Any = None
    ) -> None: ...

    def wait_quorum(self) -> None: ...

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    ) -> torch.futures.Future[torch.Tensor]: ...

    def should_commit(self, timeout: Any = None) -> bool: ...

    def report_error(self, e: Exception) -> None: ...

    def errored(self) -> Exception | None: ...

    def current_step(self) -> int: ...

    def num_participants(self) -> int: ...

    def is_participating(self) -> bool: ...

    def register_state_dict_fn(
        self,
        key: str,
        load_state_dict: Callable[[Any], None],
        state_dict: Callable[[], Any],
    ) -> None: ...


def quorum_mode_of(manager: object, declared: QuorumMode | str | None = None) -> QuorumMode | None:
    """The quorum mode a strategy runs with: ``declared`` if given, else the Manager's; None
    when neither says.

    The Manager says through its public ``use_async_quorum`` bool or, for an object with
    torchft's Manager interface (e.g. ``create_autospec(Manager)`` in torchft's tests), through
    torchft's ``_use_async_quorum`` bool, which torchft's own DiLoCo reads. Anything else (a
    mock's attribute, a missing one) says nothing.

    Raises:
        ValueError: ``declared`` disagrees with the Manager.
    """
    says = getattr(manager, "use_async_quorum", None)
    if not isinstance(says, bool):
        says = getattr(manager, "_use_async_quorum", None)
    actual = QuorumMode.of(says) if isinstance(says, bool) else None
    if declared is None:
        return actual
    mode = QuorumMode(declared)
    if actual is not None and actual is not mode:
        raise ValueError(
            f"quorum_mode is {mode.value!r} but the Manager uses {actual.value!r} quorums "
            f"(use_async_quorum={says})"
        )
    return mode


@dataclass
class CommStats:
    """What a strategy sent across replica groups, as seen from this replica.

    ``payload_bytes`` is the size of the tensors handed to ``Manager.allreduce`` (the quantized
    size when ``should_quantize``); the bytes a ring allreduce puts on the wire per rank are
    ``2 (N-1)/N`` times that.
    """

    allreduce_calls: int = 0
    payload_bytes: int = 0
    syncs_committed: int = 0
    syncs_failed: int = 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of ``t`` (a view sharing storage for DTensors, ``t`` itself otherwise)."""
    if isinstance(t, DTensor):
        return t._local_tensor
    return t


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``'s local shard (``t`` itself when it is not a DTensor), with no
    ``grad``: the backup a sync strategy restores from. torchft's name for it."""
    local = t.to_local() if isinstance(t, DTensor) else t
    copy = local.detach().clone()
    copy.grad = None
    return copy


def param_data(p: nn.Parameter) -> torch.Tensor:
    """The local storage of parameter ``p`` (no autograd), for in-place copies."""
    return local_tensor(p.data)


def wait_future(manager: ManagerLike, fut: torch.futures.Future[torch.Tensor]) -> bool:
    """Waits for an allreduce future; a failure is reported to the manager, not raised.

    Returns True when the future completed without error.
    """
    try:
        fut.wait()
    except RuntimeError as e:  # c10d and future errors surface as RuntimeError
        manager.report_error(e)
        return False
    return True


class SyncStrategy(ABC):
    """A way of keeping replica groups in agreement, driven by four calls per step.

    Subclasses: ``PerStepSync``, ``LocalSGD``, ``DiLoCo``. See the module docstring for the
    training-loop contract.
    """

    stats: CommStats

    def start_step(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called at the top of each iteration, before the forward pass."""

    @abstractmethod
    def before_step(self) -> bool:
        """Called after backward, before the inner optimizer step.

        Returns:
            whether the inner optimizer step may be applied (False: skip it; the step's
            gradients are discarded).
        """

    def after_step(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called after the inner optimizer step (also when ``before_step`` said skip)."""

    joined_peers_sync = False
    """Set by ``start_step`` when this replica healed while its peers were at a sync point
    and took part in the rest of that sync: the state it received is the peers' state at the
    *end* of their step, so this iteration is their next step (a trainer moves its step
    counter and lr schedule on by one to match)."""

    def state_dict(self) -> dict[str, Any]:
        """What this strategy owns, for checkpoints and healing (tensors are copies)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: B027
        """Restores ``state_dict`` from ``state_dict()`` (of this or another replica)."""

    # What a trainer's last step and its disk checkpoints need (titan/semi_sync_axis.py), with
    # the answers of a strategy that keeps nothing between steps.

    @property
    def in_flight_fragment(self) -> int | None:
        """The fragment whose sync is on the wire between two inner steps (DiLoCo with an
        outer overlap or a ``fragment_sync_delay``); None when none is."""
        return None

    def flush(self) -> bool | None:
        """Finishes the outer round still in flight after the last inner step (waits, votes,
        applies or discards it), so that every group ends on the global parameters.

        Returns:
            whether it committed; None when nothing was to be finished.
        """
        return None

    def schedule_state(self) -> dict[str, int]:
        """The position in the sync schedule, as named integers (empty: no schedule)."""
        return {}

    def load_schedule_state(self, state: dict[str, int]) -> None:  # noqa: B027
        """Restores :meth:`schedule_state` output."""

    def global_parameters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each synced parameter with its global copy, a tensor a checkpoint can load into in
        place (empty: the strategy keeps no global copy)."""
        return []

    def outer_optimizer_state(self) -> list[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
        """Each synced parameter with its outer-optimizer state, the optimizer's own tensors
        so a checkpoint can load into them in place (empty: no outer optimizer)."""
        return []


class _OptimizerHooks:
    """Context-manager support (torchft style): optimizer hooks drive a strategy's steps."""

    def __init__(self, optimizer: optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
        self._hook_optimizer = optimizer
        self._hook_params = list(params)
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> Any:
        self._handles.append(self._hook_optimizer.register_step_pre_hook(self._pre_hook))
        self._handles.append(self._hook_optimizer.register_step_post_hook(self._post_hook))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    def _pre_hook(self, *_args: Any) -> None:
        # An optimizer pre-hook cannot cancel the step; dropping the grads makes it a no-op.
        if not self.before_step():  # type: ignore[attr-defined]
            for p in self._hook_params:
                p.grad = None

    def _post_hook(self, *_args: Any) -> None:
        self.after_step()  # type: ignore[attr-defined]
