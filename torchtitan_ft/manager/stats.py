"""What a rank's Manager did so far: counters written from any thread, and the ``ManagerStats``
snapshot ``Manager.stats()`` returns.

Docs: architecture.md, "Observing the Manager".
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ManagerStats:
    """What the Manager did so far, as of the last completed quorum (``Manager.stats()``).

    Counters are cumulative since the Manager was created; heal and allreduce sizes are the
    payload (tensor bytes), not the bytes on the wire.
    """

    step: int
    """Committed steps."""
    quorum_id: int
    """Id of the last quorum this rank received; -1 before the first."""
    replica_world_size: int
    """Replica groups in the last quorum, including healing ones and spares."""
    num_participants: int
    """Replica groups whose gradients were averaged in the last quorum's step."""
    participating: bool
    """Whether this group contributed its gradients in the last quorum's step."""
    commit_failures: int
    """Consecutive failed commits now (what the lighthouse is told)."""
    steps_discarded: int
    """Steps that did not commit."""
    heal_count: int
    """Healed states this rank applied."""
    last_heal_seconds: float
    """Transfer plus load time of the last applied heal (0.0 before any)."""
    heal_seconds: float
    """Transfer plus load time of every applied heal."""
    heal_bytes_received: int
    """Tensor bytes of the states this rank received from donors (also ones not applied)."""
    heal_bytes_sent: int
    """Tensor bytes of the state this rank served as donor, once per healing peer."""
    allreduce_bytes: int
    """Tensor bytes handed to the cross-group allreduce (before any quantization)."""
    steps_retried: int = 0
    """Steps whose allreduces were re-run over a new quorum after a peer died mid-step
    (``retry_inflight_allreduce``); a retried step that then commits is not discarded."""
    relative_speed: float = 0.0
    """This group's compute speed relative to the other groups' median, as the lighthouse
    judged it at the last quorum (1.0 typical, 0.25 four times slower; 0.0 not judged yet, or
    a torchft 0.2.0 lighthouse)."""
    link_relative_speed: float = 0.0
    """This group's link rate (its link probes to the lighthouse) relative to the other
    groups' median, as the lighthouse judged it at the last quorum (0.0 not judged yet)."""
    straggler: bool = False
    """Whether the lighthouse reported this group as a straggler at the last quorum (for its
    compute or its link; the trainer's log line says which)."""
    excluded: bool = False
    """Whether the lighthouse's straggler policy left this group out of the last quorum
    (it trains alone and commits nothing until taken back)."""


@dataclass
class _Totals:
    steps_discarded: int = 0
    heal_count: int = 0
    last_heal_seconds: float = 0.0
    heal_seconds: float = 0.0
    heal_bytes_received: int = 0
    heal_bytes_sent: int = 0
    allreduce_bytes: int = 0
    steps_retried: int = 0


class Counters:
    """The cumulative counters behind ``ManagerStats``, safe to update from any thread (the
    lock is held for a few additions only, never across I/O)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = _Totals()

    def add(self, **amounts: int) -> None:
        """Adds to the named counters, e.g. ``add(allreduce_bytes=1024)``."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self._totals, name, getattr(self._totals, name) + amount)

    def heal_applied(self, seconds: float) -> None:
        """Counts one applied heal that took ``seconds`` (transfer plus load)."""
        with self._lock:
            self._totals.heal_count += 1
            self._totals.last_heal_seconds = seconds
            self._totals.heal_seconds += seconds

    def snapshot(self) -> dict[str, Any]:
        """The counters now, as ``ManagerStats`` keyword arguments."""
        with self._lock:
            return asdict(self._totals)


def tensor_bytes(value: Any) -> int:
    """Total bytes of the tensors in a nested dict/list/tuple (a DTensor: its local shard)."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0
