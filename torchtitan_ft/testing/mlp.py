"""The tiny-MLP harness: a replica-group rank training a tiny MLP, as its own process (the
multi-process tests, the chaos test and ``scripts/failure_demo.py --model mlp``).

A rank (:func:`torchtitan_ft.testing.mlp_rank.train_worker`) is the whole FT training loop of a
user script (Manager + DDP + OptimizerWrapper over a real lighthouse, ``ProcessGroupGloo`` and
``HTTPTransport``) configured by a :class:`WorkerConfig`; it writes its final parameters,
optimizer state and step to ``out_path`` for the parent to compare, its per-iteration records
to ``commit_log`` and its Manager's event stream to ``events_dir`` (``torchtitan_ft.events``).
``spawn_rank`` starts it from a preloaded forkserver (``mp_context``: the parent runs gRPC
threads, so forking the parent itself would be unsafe). This module imports neither torch nor
the FT stack (the rank's module does). Everything binds 127.0.0.1.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class WorkerConfig:
    lighthouse_addr: str
    replica: int
    """Replica group number (the replica id is ``replica_{replica}``)."""
    out_path: str
    group_rank: int = 0
    group_world_size: int = 1
    store_port: int = 0
    """The replica group's TCPStore port (needed when group_world_size > 1)."""
    min_replica_size: int = 1
    world_size_mode: str = "DYNAMIC"
    stop_step: int = 10
    """Stop once this step is committed and ``stop_participants`` took part in it."""
    stop_participants: int = 1
    stop_step_file: str | None = None
    """When set, ``stop_step`` is read from this file at every step (no file yet: no stop), so
    that a test can pick it once the workers it compares train together."""
    kill_at_step: int | None = None
    """SIGKILL this process right after launching the allreduce of this step, provided
    ``kill_participants`` replica groups take part (i.e. peers are in the collective)."""
    kill_participants: int = 2
    hang_at_step: int | None = None
    """SIGSTOP this process (once) right before launching the allreduce of this step, provided
    ``kill_participants`` replica groups take part: a hung peer, its connections open, its
    peers waiting in the collective for its contribution. The test sends SIGCONT."""
    hang_file: str | None = None
    """When this file appears, the rank removes it and SIGSTOPs itself right before its next
    allreduce (a hang inside the collective, at a moment the parent picks, as often as it
    writes the file). The parent sends SIGCONT."""
    fail_first_heal: bool = False
    """This rank's first checkpoint fetch fails (a donor lost mid-transfer)."""
    step_sleep_s: float = 0.0
    work: int = 0
    """Extra CPU work in each step's forward: this many 128x128 matrix products (0.3 to 1 ms
    each on one core of the test machine), so that a CPU limit slows its compute measurably."""
    max_iterations: int = 400
    seed: int | None = None
    """Model init seed; default differs per replica (init_sync makes them equal)."""
    timeout_s: float = 10.0
    shared_batches: bool = False
    """Every replica group and rank trains on the same batch at a given step (the data depends
    on the step only), so equal progress means equal samples whatever the membership."""
    process_group: str = "gloo"
    """The cross-group process group: ``"gloo"`` (``ProcessGroupGloo``) or ``"baby_gloo"``
    (``ProcessGroupBabyGloo``, collectives in a child process)."""
    ddp: str = "bucketed"
    """Which wrapper averages the gradients: ``"bucketed"`` (``DistributedDataParallel``) or
    ``"pure"`` (``PureDistributedDataParallel``)."""
    commit_log: str | None = None
    """Append one JSON line per iteration to this file (see ``_log_iteration``): the step,
    whether it committed, participants, a hash of the parameters and optimizer state, the
    training loss and the loss on a fixed evaluation batch."""
    auth_token: str | None = None
    """The job token, given to the Manager and the checkpoint transport."""
    events_dir: str | None = None
    """The Manager's event stream folder (its ``events_dir``); None: no stream."""
    host: str = "127.0.0.1"
    """The address every server of this rank binds and advertises (a test host's, from
    ``testing.netns``, when the rank runs on one)."""
    lighthouse_outage: str = "previous_quorum"
    """The Manager's ``lighthouse_outage``: ``"previous_quorum"`` or ``"wait"``."""
    on_state_loss: str = "stop"
    """The Manager's ``on_state_loss``: ``"stop"`` (exit status 3) or ``"from_scratch"``."""
    hidden: int = 32
    """Width of the model's hidden layer: ``21 * hidden + 4`` parameters, so that a wider one
    makes the cross-group all-reduce move more bytes (a link limit then slows the step)."""


HOST = "127.0.0.1"
"""Every server of the harness binds and advertises this address (``WorkerConfig.host``
by default)."""
BATCH_SIZE = 8
"""Samples in each rank's batch of a step."""

_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.optim",
    "torchtitan_ft.manager",
    "torchtitan_ft.testing.mlp_rank",
]
_context: Any = None


def mp_context() -> Any:
    """A forkserver that has imported torch (and torch._dynamo, which every optimizer imports:
    ~3 s a process) once; workers fork from it cheaply. The server itself starts no threads,
    unlike the test process (gRPC), so forking from it is safe."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def spawn_rank(cfg: WorkerConfig) -> mp.process.BaseProcess:
    """Starts one rank (:func:`torchtitan_ft.testing.mlp_rank.train_worker`) from the
    preloaded forkserver."""
    # load order: the rank's module imports torch and the FT stack, which a parent that only
    # starts ranks (a test, the failure demo) does not need
    from torchtitan_ft.testing.mlp_rank import train_worker

    # A baby process group starts a child, which a daemonic process may not do.
    daemon = cfg.process_group != "baby_gloo"
    proc = mp_context().Process(target=train_worker, args=(cfg,), daemon=daemon)
    proc.start()
    return proc


def write_stop_step(path: Path, step: int) -> None:
    """Tell workers to stop at ``step`` through the file at ``path`` (``stop_step_file``): written
    whole, then renamed into place, so a worker never reads it half-written (``int('')``)."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(str(step))
    staged.replace(path)
