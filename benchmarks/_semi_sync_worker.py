"""One replica group of ``benchmarks.semi_sync``: its own process, the real Manager, gloo.

``replica_group(job)`` is the target of a process started from a forkserver (the benchmark's
main process runs the lighthouse's gRPC threads, so it must not fork itself), or of
``python -m benchmarks._semi_sync_worker JOB.pickle`` (``benchmarks.wan`` starts it on a host
of a ``torchtitan_ft.testing.netns.HostNetwork``). The process builds the model from the run's
seed (the same in every group), a ``torchtitan_ft.manager.Manager`` (sync quorum, talking to
the lighthouse at ``job.lighthouse``, its servers on ``job.host``) over a
``CountingProcessGroupGloo``, and the run's sync strategy; trains ``job.setup.steps`` inner
steps on its shard of the batches; and writes a JSON result (bytes handed to the cross-group
process group, losses, a hash of the final parameters, where the time of the steps went) to
``job.out_path``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.distributed_c10d import Work

from torchtitan_ft.process_group import ProcessGroupGloo
from torchtitan_ft.process_group.collectives import Args, Collective
from torchtitan_ft.semi_sync import OuterOptimizerConfig

HOST = "127.0.0.1"


# ------------------------------------------------------------------ model


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True, bias=False)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = nn.Sequential(
            nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False)
        )

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(h)
        h = h + self.attention(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLM(nn.Module):
    """A small llama-shaped LM (``tok_embeddings``, ``layers``, ``norm``, ``output``)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens) + self.pos_embeddings.weight[:t]
        for layer in self.layers.values():
            h = layer(h, self.mask[:t, :t])
        return self.output(self.norm(h))


def lm_loss(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over ``seqs`` [batch, seq_len + 1]."""
    logits = model(seqs[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1)
    )


# ------------------------------------------------------------------ run description


@dataclass(frozen=True)
class Setup:
    """Model and training sizes (the same for every strategy)."""

    vocab: int = 2000
    """Embedding rows: at least the corpus's largest token id + 1."""
    dim: int = 96
    """Model width."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads per block."""
    seq_len: int = 64
    """Tokens per training sequence (each window holds ``seq_len + 1`` for the targets)."""
    batch: int = 8
    """Sequences per replica group per inner step."""
    inner_lr: float = 3e-3
    """AdamW learning rate of the inner (local) optimizer."""
    steps: int = 600
    """Inner steps per run."""
    seed: int = 0
    """Model init seed, the same in every replica group."""


@dataclass(frozen=True)
class StrategySpec:
    """Which sync strategy a run uses (built inside the replica group's process)."""

    kind: Literal["per_step", "diloco"]
    """``per_step``: ``PerStepSync`` (gradients averaged every step); ``diloco``: ``DiLoCo``."""
    sync_every: int = 1
    """DiLoCo's H: inner steps between syncs of each fragment."""
    quantize: bool = False
    """DiLoCo: int8 pseudo-gradients (``should_quantize``)."""
    fragments: int = 1
    """DiLoCo: model fragments (> 1: Streaming DiLoCo)."""
    fragment_sync_delay: int = 0
    """Streaming DiLoCo's tau."""
    overlap: str = "none"
    """DiLoCo's ``outer_overlap``: ``none``, ``delayed`` or ``eager`` (the outer round
    overlaps the next cycle, applied one outer step late; the run ends with ``flush``)."""
    outer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    """DiLoCo's outer optimizer."""
    bucket_cap_mb: float = 25.0
    """per_step without overlap: ``PerStepSync``'s bucket size in MiB (tiny: one allreduce per
    gradient, as before it bucketed)."""
    overlap_bucket_cap_mb: float | None = None
    """per_step: ``None`` averages the gradients after the backward (``PerStepSync``, sync
    quorum); a size in MiB wraps the model in ``torchtitan_ft.ddp.DistributedDataParallel``
    with buckets of that size, each bucket's allreduce started during the backward, and
    starts the quorum asynchronously (overlapped with the forward)."""


@dataclass(frozen=True)
class ReplicaJob:
    """Everything one replica-group process needs."""

    replica: int
    """Replica group number (the replica id is ``replica_{replica}``)."""
    replica_groups: int
    """Replica groups in the run: the lighthouse's and the Manager's ``min_replica_size``."""
    lighthouse: str
    setup: Setup
    strategy: StrategySpec
    data_path: str
    """``torch.save``d ``{"train": [steps, replicas, batch, seq_len + 1], "validation": ...}``."""
    out_path: str
    threads: int
    """torch intra-op threads."""
    timeout_s: float
    """The Manager's collective timeout; its quorum timeout is twice that."""
    host: str = HOST
    """The address this group's servers listen on and advertise (its host's address when the
    groups run on different hosts)."""
    tx_bytes_path: str | None = None
    """A counter of the bytes this group's host has sent (e.g.
    ``/sys/class/net/eth0/statistics/tx_bytes`` inside its network namespace), read before and
    after the first step and at the end; ``None``: not read."""


# ------------------------------------------------------------------ byte counting


@dataclass
class OpBytes:
    """What one kind of collective was handed on this rank."""

    calls: int = 0
    payload_bytes: int = 0
    """Bytes of the input tensors."""
    sent_bytes_estimate: int = 0
    """Bytes this rank sends to the others under the collective's usual algorithm."""


_SENT_PER_PAYLOAD: dict[str, Callable[[int], tuple[int, int]]] = {
    "allreduce": lambda n: (2 * (n - 1), n),
    "alltoall_base": lambda n: (n - 1, n),
    "allgather": lambda n: (n - 1, 1),
}
"""Bytes a rank sends per byte of its input, as a fraction, for N ranks, by collective."""


class CountingProcessGroupGloo(ProcessGroupGloo):
    """``ProcessGroupGloo`` that adds up the bytes of the tensors handed to its collectives.

    The Manager's cross-group collectives are ``allreduce`` (full precision) and, with
    ``should_quantize``, ``alltoall_base`` + ``allgather``
    (``torchtitan_ft.process_group.quantized``). The payload is the collective's input
    argument (``Collective.input`` in ``torchtitan_ft.process_group.collectives``).
    ``sent_bytes_estimate`` applies each algorithm's bytes per rank to the measured payload,
    for N ranks: ring allreduce ``2 (N-1)/N`` of it; alltoall with equal splits ``(N-1)/N``
    of its input (the rest stays here); allgather ``N-1`` times its input. Framing and
    transport headers are not counted.
    """

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.ops = {op: OpBytes() for op in _SENT_PER_PAYLOAD}

    def _collective(self, collective: Collective, args: Args) -> Work:
        sent = _SENT_PER_PAYLOAD.get(collective.name)
        if sent is not None:
            if collective.name == "alltoall_base" and collective.arg(args, "input_split_sizes"):
                # the quantized allreduce always splits evenly
                raise NotImplementedError("counting supports equal alltoall splits only")
            nbytes = sum(t.numel() * t.element_size() for t in collective.input_tensors(args))
            num, den = sent(self.size())
            counts = self.ops[collective.name]
            counts.calls += 1
            counts.payload_bytes += nbytes
            counts.sent_bytes_estimate += nbytes * num // den
        return super()._collective(collective, args)


# ------------------------------------------------------------------ the replica group


def _build_strategy(spec: StrategySpec, manager: Any, model: nn.Module, opt: Any) -> Any:
    from torchtitan_ft.semi_sync import DiLoCo, PerStepSync, QuorumMode, split_model

    if spec.kind == "per_step":
        return PerStepSync(
            manager,
            model.parameters(),
            allreduce_gradients=spec.overlap_bucket_cap_mb is None,
            bucket_cap_mb=spec.bucket_cap_mb,
        )
    return DiLoCo(
        manager,
        split_model(model, spec.fragments),
        opt,
        spec.outer,
        spec.sync_every,
        should_quantize=spec.quantize,
        fragment_sync_delay=spec.fragment_sync_delay,
        outer_overlap=spec.overlap,
        quorum_mode=QuorumMode.SYNC,
    )


PHASES = ("start_step", "forward_backward", "before_step", "optimizer", "after_step")
"""Where a step's time goes, in loop order; ``forward_backward`` + ``optimizer`` is compute,
the others the sync strategy's (quorum, allreduce, commit vote, outer step). With an
overlapped per-step run, the time the backward spends in the DDP wrapper's bucket launches
and end-of-backward wait is moved from ``forward_backward`` to ``backward_sync``."""
BACKWARD_SYNC = "backward_sync"


def _read_counter(path: str | None) -> int | None:
    if path is None:
        return None
    with open(path) as f:
        return int(f.read())


def _params_sha1(model: nn.Module) -> str:
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


OVERLAP_MARKS = ("first_launch", "backward_end", "reduced")
"""An overlapped step's timeline (``time.perf_counter``): its first bucket launched, its
backward's end (the DDP wrapper's end-of-backward callback starts) and every bucket reduced
(that callback's wait ends)."""


def _timed_ddp(
    manager: Any, model: nn.Module, bucket_cap_mb: float, spent: list[float], marks: dict
) -> nn.Module:
    """``model`` in ``DistributedDataParallel``; the time its bucket launches (quorum wait
    included) and its end-of-backward wait take is added to ``spent[0]`` (once: the wait
    launches the buckets that got no gradient), and the step's ``OVERLAP_MARKS`` are set in
    ``marks`` (the caller clears it before each step)."""
    from torchtitan_ft.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=bucket_cap_mb)
    depth = [0]

    def timed(fn: Callable[..., Any], start_mark: str, end_mark: str | None) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            t = time.perf_counter()
            marks.setdefault(start_mark, t)
            depth[0] += 1
            try:
                return fn(*args)
            finally:
                depth[0] -= 1
                end = time.perf_counter()
                if depth[0] == 0:
                    spent[0] += end - t
                if end_mark is not None:
                    marks[end_mark] = end

        return wrapper

    ddp._launch = timed(ddp._launch, "first_launch", None)  # type: ignore[method-assign]
    ddp._finish_backward = timed(  # type: ignore[method-assign]
        ddp._finish_backward, "backward_end", "reduced"
    )
    return ddp


OVERLAP_SPANS = ("to_first_bucket", "transfers", "after_backward")
"""An overlapped step's spans (seconds): the backward's start to its first bucket's launch
(no gradient is ready before it, so nothing can be on the wire), the first launch to every
bucket reduced (the link's busy span when the transfers follow each other), and the
backward's end to every bucket reduced (what the end-of-backward wait exposes)."""


def _overlap_spans(backward_start: float, marks: dict[str, float]) -> dict[str, float]:
    return {
        "to_first_bucket": marks["first_launch"] - backward_start,
        "transfers": marks["reduced"] - marks["first_launch"],
        "after_backward": marks["reduced"] - marks["backward_end"],
    }


def _group_manager(job: ReplicaJob, pg: Any, model: nn.Module, opt: Any) -> Any:
    """The replica group's Manager over ``pg``, healing ``model`` and its optimizer ``opt``."""
    from torchtitan_ft.manager import Manager

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=job.timeout_s)
    return Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=job.replica_groups,
        use_async_quorum=job.strategy.overlap_bucket_cap_mb is not None,
        timeout=timeout,
        quorum_timeout=2 * timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=job.host,
        store_port=0,
        lighthouse_addr=job.lighthouse,
        replica_id=f"replica_{job.replica}",
        hostname=job.host,
    )


def replica_group(job: ReplicaJob) -> None:
    """Trains one replica group for the run and writes its result to ``job.out_path``."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s r{job.replica} %(message)s")
    torch.set_num_threads(job.threads)
    setup = job.setup
    data = torch.load(job.data_path)
    train, validation = data["train"][:, job.replica], data["validation"]

    torch.manual_seed(setup.seed)
    model = TinyLM(setup.vocab, setup.dim, setup.layers, setup.heads, setup.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.inner_lr, weight_decay=0.0)

    timeout = timedelta(seconds=job.timeout_s)
    pg = CountingProcessGroupGloo(timeout)
    manager = _group_manager(job, pg, model, opt)
    strategy = _build_strategy(job.strategy, manager, model, opt)
    backward_sync = [0.0]  # seconds inside the DDP wrapper's launches and wait, this step
    marks: dict[str, float] = {}  # this step's OVERLAP_MARKS (overlapped runs)
    overlap = dict.fromkeys(OVERLAP_SPANS, 0.0)
    forward: nn.Module = model
    if job.strategy.overlap_bucket_cap_mb is not None:
        forward = _timed_ddp(
            manager, model, job.strategy.overlap_bucket_cap_mb, backward_sync, marks
        )

    losses = []
    tx_bytes = [_read_counter(job.tx_bytes_path)]
    phases = dict.fromkeys((*PHASES, BACKWARD_SYNC), 0.0)
    backward_s = 0.0  # the backward's compute (inside forward_backward)
    clock = time.perf_counter
    start = clock()
    first_step_s, steady_start = 0.0, start
    for step in range(setup.steps):
        t0 = clock()
        strategy.start_step()
        backward_sync[0] = 0.0
        marks.clear()
        t1 = clock()
        loss = lm_loss(forward, train[step])
        tb = clock()
        loss.backward()
        t2 = clock()
        commit = strategy.before_step()
        t3 = clock()
        if commit:
            opt.step()
        t4 = clock()
        strategy.after_step()
        opt.zero_grad()
        t5 = clock()
        losses.append(loss.item())
        if step == 0:  # the first quorum and the init_sync heal: not a steady step
            first_step_s = t5 - t0
            steady_start = t5
            tx_bytes.append(_read_counter(job.tx_bytes_path))
            continue
        times = (t0, t1, t2, t3, t4, t5)
        for i, phase in enumerate(PHASES):
            phases[phase] += times[i + 1] - times[i]
        phases["forward_backward"] -= backward_sync[0]
        phases[BACKWARD_SYNC] += backward_sync[0]
        backward_s += t2 - tb - backward_sync[0]
        if marks:
            for span, value in _overlap_spans(tb, marks).items():
                overlap[span] += value

    flush = getattr(strategy, "flush", None)
    if flush is not None:  # the delayed update's last round: waited for, counted as sync time
        t0 = clock()
        flush()
        phases["after_step"] += clock() - t0
    end = clock()
    train_s = end - start
    tx_bytes.append(_read_counter(job.tx_bytes_path))

    with torch.no_grad():
        validation_loss = lm_loss(model, validation).item()
    tail = max(1, setup.steps // 10)
    result = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "collectives": {op: asdict(counts) for op, counts in pg.ops.items()},
        "syncs_committed": strategy.stats.syncs_committed,
        "syncs_failed": strategy.stats.syncs_failed,
        "manager_step": manager.current_step(),
        "validation_loss": validation_loss,
        "train_loss_last_10pct": sum(losses[-tail:]) / tail,
        "params_sha1": _params_sha1(model),
        "train_seconds": train_s,
        "first_step_seconds": first_step_s,
        "steady_steps": setup.steps - 1,
        "steady_seconds": end - steady_start,
        "phase_seconds": phases,
        "backward_seconds": backward_s,
        "overlap_seconds": overlap if marks else None,
        "host_tx_bytes": tx_bytes,
    }
    with open(job.out_path, "w") as f:
        json.dump(result, f)
    manager.shutdown()


if __name__ == "__main__":
    import pickle
    import sys

    with open(sys.argv[1], "rb") as f:
        replica_group(pickle.load(f))
