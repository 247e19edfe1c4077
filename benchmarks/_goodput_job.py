"""What every part of ``benchmarks.goodput`` shares: the recovery methods it compares and the
options of a run (the job, its CPU budgets, its timeouts and its faults)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from torchtitan_ft.testing.faults import Fault, FaultKind

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "debug_ft_cpu.toml"
LOCAL_BATCH = 2
"""``training.local_batch_size`` of ``CONFIG``: samples per rank per step."""


class Method(StrEnum):
    IDEAL = "ideal"
    CHECKPOINT_RESTART = "checkpoint_restart"
    TORCHFT = "torchft"
    TORCHTITAN_FT = "torchtitan_ft"
    TORCHTITAN_FT_SPARE = "torchtitan_ft_spare"
    """torchtitan_ft with one replica group more, a hot spare (``fixed_with_spares``)."""


DEFAULT_METHODS = [m for m in Method if m is not Method.TORCHTITAN_FT_SPARE]
"""The methods a run compares unless ``--methods`` names others: every one but the hot spare's,
whose extra group needs a CPU budget the default ``--cpus-per-group`` does not leave on a
2-core machine."""


@dataclass
class Options:
    """A run's settings (``benchmarks.goodput``'s flags of the same names)."""

    groups: int
    ranks: int
    duration_s: float
    mean_interval_s: float
    seed: int
    cpus_per_group: float
    cpus_lighthouse: float
    replacement: str
    heartbeat_timeout_ms: int
    process_group_timeout_ms: int
    hang_s: float
    link_down_s: float
    lighthouse_down_s: float
    checkpoint_every: int
    cap_factor: float
    startup_limit_s: float
    kinds: list[FaultKind]
    out: Path

    @property
    def samples_per_step(self) -> int:
        return self.groups * self.ranks * LOCAL_BATCH


def launched_groups(method: Method, opts: Options) -> int:
    """Replica groups ``method`` launches: ``--groups``, and for torchtitan_ft_spare one more,
    the hot spare. The groups that average their gradients in a step are ``--groups`` for every
    method (the spare's job caps them there: ``min_replica_size``)."""
    return opts.groups + 1 if method is Method.TORCHTITAN_FT_SPARE else opts.groups


def checkpoint_every(method: Method, opts: Options) -> int | None:
    """Steps between the TorchTitan checkpoints ``method`` writes: ``--checkpoint-every`` for
    every method but ideal, the fault-free baseline, which writes none (so the cost of writing
    them is part of each other method's figure); None for ideal."""
    return None if method is Method.IDEAL else opts.checkpoint_every


@dataclass
class Injected:
    """One fault as the run injected it, and (filled in by the accounting) what it cost."""

    fault: Fault
    time: float
    """Seconds after launch."""
    groups: list[int]
    effect: str = ""
    deferred_s: float = 0.0
    """How long it waited past its time for a group holding the state to survive it."""
    donor: int | None = None
    stall_s: float | None = None
    rejoin_s: float | None = None
    samples_rolled_back: int = 0
    state_lost: bool = False
    """The job lost its state after this fault (a second line of steps started before the
    next fault): not survived, and a job restart."""
