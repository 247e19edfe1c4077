"""TorchTitan 0.2.2's own ``Trainer`` with the FT replica axis plugged in; runs in every trainer
rank on 0.2.2 (docs/titan.md, "How it plugs in"). 0.3.0's is ``releases/v0_3/trainer.py``; both
mix in the same hooks (``trainer_hooks.ReplicaAxisHooks``)."""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torchtitan.train as titan_train
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.train import Trainer

from torchtitan_ft.titan.trainer_hooks import ReplicaAxisHooks, replica_leaf_folder

_original_specs: dict[str, Any] = {}


def original_train_spec(name: str) -> Any:
    """The TrainSpec ``name`` had before any override by this module."""
    if name not in _original_specs:
        _original_specs[name] = train_spec_module.get_train_spec(name)
    return _original_specs[name]


def register_train_spec_override(name: str, spec: Any) -> None:
    """Make TorchTitan's ``get_train_spec(name)`` return ``spec``.

    User-registered specs take priority over built-in models in TorchTitan 0.2.2; the public
    ``register_train_spec`` refuses to replace an entry, so the registry dict is set directly.
    """
    original_train_spec(name)
    train_spec_module._extra_train_specs[name] = spec


_PROFILERS = ("maybe_enable_profiling", "maybe_enable_memory_snapshot")
"""What ``torchtitan.train.Trainer.train`` opens with the dump folder and no leaf folder."""


@contextlib.contextmanager
def profiling_leaf_folder(leaf_folder: str) -> Iterator[None]:
    """While open, TorchTitan's ``Trainer.train`` writes its profiler traces and memory
    snapshots to ``<folder>/iteration_<n>/<leaf_folder>/rank<r>_...``, so that replica groups
    sharing a ``dump_folder`` do not overwrite each other's (TorchTitan's FT trainer passes
    the same ``leaf_folder``; its base loop passes none)."""
    originals = {name: getattr(titan_train, name) for name in _PROFILERS}
    for name, function in originals.items():
        setattr(titan_train, name, functools.partial(function, leaf_folder=leaf_folder))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(titan_train, name, function)


class FaultTolerantTrainer(ReplicaAxisHooks, Trainer):
    """TorchTitan 0.2.2's Trainer on CPU or GPU, one replica group of an FT job when FT is
    enabled: TorchTitan's loop with the FT replica axis plugged in by
    :class:`~torchtitan_ft.titan.trainer_hooks.ReplicaAxisHooks` (its docstring shows the
    step). It copies none of TorchTitan's loop.

    Overridden here, in the order TorchTitan calls them: ``__init__`` (wires the axis in),
    ``init_distributed`` (the model's TrainSpec reads this group's data slice), ``train``
    (profiler output per replica group); the hooks add ``batch_generator``, ``train_step`` (a
    discarded step is retried under its number) and ``close``.
    """

    def __init__(self, job_config: JobConfig) -> None:
        super().__init__(job_config)  # runs init_distributed; builds and parallelizes the model
        self.attach_replica_axis()

    def init_distributed(self) -> ParallelDims:
        """TorchTitan's init and the replica axis; with FT the model's TrainSpec is
        re-registered with this group's data slice before TorchTitan looks it up."""
        parallel_dims = super().init_distributed()
        if self.replica_axis.enabled:
            name = self.job_config.model.name
            spec = self.replica_axis.train_spec(original_train_spec(name))
            register_train_spec_override(name, spec)
        return parallel_dims

    def titan_lowers_pg_timeouts_at(self, start_step: int) -> int:
        """TorchTitan 0.2.2's loop lowers them after the step that leaves ``self.step == 1``,
        whatever step the process started from."""
        return 1

    def train(self) -> None:
        """TorchTitan's loop, with profiler traces and memory snapshots in a folder per
        replica group (:func:`profiling_leaf_folder`)."""
        with profiling_leaf_folder(replica_leaf_folder(self.replica_axis)):
            super().train()
