"""The ``[fault_tolerance]`` config section (TorchTitan 0.2.2's, extended), the JobConfig that
holds it, and what its fields mean (docs/configuration.md, generated from the docstrings here;
how fields map onto the Manager: docs/titan.md). Only the schema: reading TOML and the command
line is :mod:`~torchtitan_ft.titan.config_cli`'s job, checking values and this machine
:mod:`~torchtitan_ft.titan.preflight`'s (TorchTitan's own split: ``config/job_config.py`` beside
``config/manager.py``).

:class:`FaultTolerance` subclasses TorchTitan's own section, which outside code reads (e.g.
TensorBoard logs go under ``replica_<id>``): its seven fields keep their names, the new ones
follow. :class:`JobConfig` is TorchTitan's with this section type; the entry point owns the
parse, so no ``--job.custom_config_module`` is needed and methods and ``isinstance`` survive
(a custom config module still merges on top). On TorchTitan 0.3.0 the two bases are an empty
section and ``Trainer.Config`` (:mod:`torchtitan_ft.titan.releases`): the section's fields and
meanings are the same. No ``from __future__ import annotations`` here:
TorchTitan's TOML loader reads ``dataclasses.Field.type`` and needs real classes there.
"""

import types
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.state_loss import OnStateLoss
from torchtitan_ft.semi_sync.config import (
    OuterOptimizerConfig,
    QuorumMode,
    SyncConfig,
    SyncMethod,
)
from torchtitan_ft.semi_sync.overlap import OuterOverlap
from torchtitan_ft.titan import releases

_release = releases.installed().module
TitanFaultTolerance = _release.FaultToleranceBase
"""TorchTitan's own ``fault_tolerance`` section on 0.2.2; an empty base on 0.3.0, which has
none outside its torchft experiment."""
TitanJobConfig = _release.JobConfigBase
"""TorchTitan's ``JobConfig`` on 0.2.2; its ``Trainer.Config`` on 0.3.0."""

SECTION = "fault_tolerance"
"""The section's name, in TOML (``[fault_tolerance]``) and on the command line."""

ProcessGroupBackend = Literal["gloo", "nccl"]
ProcessGroupKindName = Literal["rebuilt", "native"]
QuorumModeName = Literal[tuple(sorted(m.value for m in QuorumMode))]  # QuorumMode, as TOML text
WorldSizeModeName = Literal["dynamic", "fixed_with_spares"]
CheckpointTransportName = Literal["http", "pg"]
OuterOptimizerName = Literal["sgd", "adamw"]
NumericsName = Literal["torchtitan", "torchtitan_ft_trainer"]
ReplacementName = Literal["cold", "zygote"]
OuterOverlapName = Literal[tuple(m.value for m in OuterOverlap)]  # OuterOverlap, as TOML text
LighthouseOutageName = Literal[tuple(m.value for m in LighthouseOutage)]  # as TOML text
OnStateLossName = Literal[tuple(m.value for m in OnStateLoss)]  # OnStateLoss, as TOML text


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and what is expected."""


@dataclass
class FaultTolerance(TitanFaultTolerance):
    """Per-step fault tolerance across replica groups (TorchTitan's section, extended)."""

    enable: bool = False
    """
    Turn on fault tolerance. Default off: the job is then plain TorchTitan (no lighthouse, no
    Manager). When on, this torchrun job is one replica group among ``group_size``; the FT
    replica axis is managed (it may shrink and grow every step), so
    ``parallelism.data_parallel_replicate_degree`` must stay 1 (the inner mesh shards).
    """

    process_group: ProcessGroupBackend = "gloo"
    """
    Backend of the cross-replica-group process group ("gloo" or "nccl"). Default "gloo", the
    only one testable on CPU. "nccl" is faster on GPUs but its failure detection relies on
    timeouts. Applies when ``enable``.
    """

    process_group_kind: ProcessGroupKindName = "rebuilt"
    """
    How the cross-replica-group process group follows a membership change. "rebuilt" (default):
    the project's group, rebuilt over the quorum's TCPStore at each new quorum, on any torch.
    "native": torch's own reconfigurable gloo (``enable_reconfigure=True``, torch >= 2.14,
    with ``process_group = "gloo"``), reconfigured with the members' handles, which the quorum
    carries; it needs ``process_group_store``. Measured side by side (docs/performance.md,
    "torch's native reconfigure"): "native" is not faster on a membership change (about 10 ms
    slower at 3 groups) and its steady allreduce is a little faster; every member depends on
    ``process_group_store`` for every later membership change, where "rebuilt" depends on no
    single process. Both release a hung collective at once and fail fast on a dead peer.
    Applies when ``enable``.
    """

    process_group_store: str = ""
    """
    ``host:port`` of a TCPStore that serves the "native" process group's rendezvous for the
    whole job, run by a process that outlives every replica group (e.g. on the lighthouse's
    host). Every rank of every group uses it: it is created over it once, and each membership
    change rendezvouses there; while it is unreachable no new quorum can form the group (the
    steps are discarded until it is back). Default "" (unset: an error with "native").
    Applies when ``enable`` and ``process_group_kind = "native"``.
    """

    process_group_timeout_ms: int = 10000
    """
    Timeout of one cross-replica collective, in milliseconds. Default 10000. A dead peer that
    is not detected by a connection error is detected after this long, and the step is
    discarded. Lower = faster failover, but too low aborts slow healthy steps. Must not exceed
    ``step_timeout_ms`` or ``quorum_timeout_ms``, and must be below TorchTitan's
    ``comm.train_timeout_seconds`` and ``comm.init_timeout_seconds`` (docs/timeouts.md).
    Applies when ``enable``.
    """

    replica_id: int = 0
    """
    Index of this replica group, 0 <= replica_id < group_size. Default 0. Used as the Manager's
    replica id (a per-process suffix is added so a restart is a new member) and to pick this
    group's slice of the data. Applies when ``enable``.
    """

    group_size: int = 0
    """
    Number of replica groups the job is planned with (at most this many train at once).
    Default 0 = unset, which is an error when ``enable``. The dataset is split into
    ``group_size`` x (data-parallel degree inside a group) slices, so all groups must agree on it.
    """

    min_replica_size: int = 1
    """
    Minimum number of replica groups in a quorum for a step to commit. Default 1: train on as
    long as one group is alive. Higher values protect against training on too few replicas at
    the cost of stalling when more fail. 1 <= min_replica_size <= group_size when ``enable``.
    """

    semi_sync_method: str | None = None
    """
    How replica groups synchronise. None (default, also "none") = every step's gradients are
    averaged across groups and committed together (FT-HSDP); "local_sgd" = each group steps
    alone and parameters are averaged every ``sync_steps``; "diloco" = each group runs the
    inner optimizer and an outer optimizer applies averaged pseudo-gradients every
    ``sync_steps`` (Streaming DiLoCo when ``num_fragments`` > 1). Case-insensitive, as in
    TorchTitan (which lowercases it). Semi-sync trades convergence per step for far less
    communication, and implies a synchronous quorum (see ``quorum_mode``). Applies when
    ``enable``.
    """

    lighthouse_addr: str = ""
    """
    Lighthouse URL, e.g. "http://lighthouse-host:29510". Default "" = the ``TORCHFT_LIGHTHOUSE``
    env var, else "http://localhost:29510". An explicit value always wins over the env var.
    Only group rank 0 talks to the lighthouse. Applies when ``enable``.
    """

    hostname: str = ""
    """
    The host name other replica groups dial to reach this group's servers. They are the
    ManagerServer (group rank 0, advertised as ``http://<hostname>:<port>`` to the lighthouse
    and to healing peers) and, with ``checkpoint_transport = "http"``, every rank's checkpoint
    server (also the group's TCPStore host when ``MASTER_ADDR`` is unset). Default "" =
    ``socket.gethostname()``, which must resolve to an address the other machines reach. It also
    decides where the servers listen: a loopback name ("127.0.0.1", "localhost", "::1") keeps
    the ManagerServer on loopback (otherwise it listens on all interfaces); the checkpoint
    server listens on the address ``hostname`` resolves to and offers its other interfaces
    too (``heal_interfaces``). Use "127.0.0.1" for single-machine
    runs and tests; with groups on several machines, each machine's address on the network
    they share. It must be an address of this machine (checked at start-up), and a loopback
    one stops this group at its first quorum with a group on another machine (even if it
    trained before, alone or beside groups of its own machine), naming the address to set.
    Applies when ``enable``.
    """

    step_timeout_ms: int = 60000
    """
    Timeout of the Manager's per-step operations (gradient all-reduce future, commit vote,
    checkpoint send/receive when healing), in milliseconds. Default 60000 (torchft's
    ``timeout``). Unset (neither TOML nor command line), the ``TORCHFT_TIMEOUT_SEC`` env var
    (seconds) applies if set; set, this field wins and the Manager says so in one line. Must be
    >= ``process_group_timeout_ms``, and > ``heal_stall_timeout_ms`` when that is set; raise it
    when healing large states over slow links.
    Applies when ``enable``.
    """

    quorum_timeout_ms: int = 60000
    """
    How long one quorum request may wait for the lighthouse to issue a quorum, in
    milliseconds. Default 60000 (torchft's ``quorum_timeout``). Unset, the
    ``TORCHFT_QUORUM_TIMEOUT_SEC`` env var (seconds) applies if set (the field wins when set).
    It should exceed the lighthouse's ``--join_timeout_ms`` when replacements must be waited
    for. Must be >= ``connect_timeout_ms`` and ``process_group_timeout_ms``. Applies when
    ``enable``.
    """

    connect_timeout_ms: int = 60000
    """
    Timeout of the connections made at start-up and when healing, in milliseconds. They are:
    ranks > 0 waiting for group rank 0 to publish its ManagerServer address in the group's
    TCPStore, connecting to that TCPStore and to the group's ManagerServer, and, when healing,
    connecting to the donor's ManagerServer. Default 60000 (torchft's ``connect_timeout``);
    unset, the ``TORCHFT_CONNECT_TIMEOUT_SEC`` env var (seconds) applies if set. It
    does not bound a quorum request to a lighthouse that cannot be reached: that waits
    ``quorum_timeout_ms``. Lower = a group rank 0 that never comes up is reported sooner; too
    low fails a slow start-up of rank 0. Must be <= ``quorum_timeout_ms``. Applies when
    ``enable``.
    """

    quorum_mode: QuorumModeName | None = None
    """
    "async": the quorum is requested on a background thread, overlapped with the forward
    pass; "sync": the step waits for the quorum before the forward. Default None = "sync"
    with a ``semi_sync_method`` (which only asks at sync points and must heal before it
    trains, as TorchTitan's FT does), else "async" (hides the quorum latency). Setting
    "async" with a semi-sync method is an error. Applies when ``enable``.
    """

    world_size_mode: WorldSizeModeName = "dynamic"
    """
    "dynamic" (default): every healthy group in the quorum participates; "fixed_with_spares":
    exactly ``min_replica_size`` groups participate and the rest are hot spares (keeps the
    global batch size constant, wastes the spares' compute). Launch one ``./run_train.sh``
    group more than ``min_replica_size`` (and count it in ``group_size``) and the spare takes
    a dead group's slot at the next quorum, with no restart and no heal: the job is back at
    full strength within a step (docs/titan.md, "A hot spare group"). Applies when
    ``enable``.
    """

    init_sync: bool = True
    """
    At step 0, make every replica group load the weights of the primary group (default True),
    so all start identical even if initialised differently. Turn off only when every group
    initialises deterministically from the same seed, to skip the start-up transfer. Applies
    when ``enable``.
    """

    max_retries: int | None = None
    """
    Maximum number of consecutive failed commits before the Manager raises and the process
    exits. Default None = unlimited (set it on the CLI with ``None``; omit it in TOML). A limit
    turns a permanently broken group into a restart. Applies when ``enable``.
    """

    quorum_retries: int = 0
    """
    Extra attempts of a quorum request that failed with an error, within the same
    ``quorum_timeout_ms``. Group rank 0's ManagerServer asks the lighthouse again after an
    error (e.g. the lighthouse rejected the request or the call broke), after a backoff of
    0.1 s doubling up to 1 s. Default 0. All attempts share the one
    ``quorum_timeout_ms`` deadline, so retries never lengthen the wait; an unreachable
    lighthouse (down or restarting) is retried until that deadline whatever this value is.
    Unset, the ``TORCHFT_QUORUM_RETRIES`` env var applies if set (the field wins when set).
    When the quorum finally fails, ``should_commit`` raises and the process exits (torchrun
    may restart it). Raise it to ride out transient lighthouse errors. Applies when
    ``enable``.
    """

    lighthouse_outage: LighthouseOutageName = "previous_quorum"
    """
    What the replica groups do while the lighthouse cannot be reached (SIGKILLed and
    restarted, its host rebooting). "previous_quorum" (default): go on committing steps on the
    last quorum while every member of it keeps taking part, so a lighthouse restart costs no
    step; a member that dies, or a group that failed its last commit, ends that, and the groups
    then wait for the lighthouse. Joining, healing and every other membership change wait for
    the lighthouse either way (docs/lighthouse.md, "A lighthouse outage"). "wait": every group
    stalls until the lighthouse answers again (up to ``quorum_timeout_ms``), as torchft 0.2.0
    does. Unset, the ``TORCHFT_LIGHTHOUSE_OUTAGE`` env var applies if set (the field wins when
    set). Applies when ``enable``.
    """

    on_state_loss: OnStateLossName = "checkpoint"
    """
    What a replica group does when the lighthouse reports the job's state lost: every group
    that held the job's highest step is gone (e.g. two groups on one rack failed together,
    then the last holder) and none came back within three heartbeat timeouts, so the next
    quorum's groups are all behind it (docs/lighthouse.md, "State loss"). Either way the group
    logs one ERROR line and records a ``state_lost`` event. "checkpoint" (default): with
    ``checkpoint.enable``, every group resumes from the newest complete checkpoint (each
    restarted process loaded it at start) with its data position, the steps after it rolled
    back; where there is none yet, or on a semi-sync job, it stops as "stop" does (the safe
    choice). "stop": the trainer exits with status 3 (torchrun's restarts get the same report
    and stop again), and the operator decides, e.g. restarts the job from an older checkpoint.
    "from_scratch":
    train on from the quorum's step (step 0 when every group is a fresh process), the lost
    steps' progress gone. Unset, the ``TORCHFT_ON_STATE_LOSS`` env var applies if set (the
    field wins when set). Applies when ``enable``.
    """

    heal_interfaces: str = ""
    """
    The network interfaces a heal may use, comma-separated (e.g. "ib0" or "ib0,ib1"): an
    operator's pin. Default "" = every interface: each rank's checkpoint server offers all its
    up, non-loopback addresses, and a healing rank probes each of the donor's paths (4 MiB over
    all at once, the slower cut short; once per donor, kept 10 minutes), fetches over the
    fastest and falls back to the next when one fails or stalls (``heal_stall_timeout_ms``;
    torchft #329: a host name resolving to the slow network healed at its speed). Pin when the
    probe would mislead (e.g. a path that is fast but metered) or to keep heals off a network.
    An interface that does not exist on this machine stops the trainer at start with one line.
    Unset, the ``TORCHFT_HEAL_INTERFACES`` env var applies if set (the field wins when set).
    The gloo process group follows the pin when it is given by the variable (it is built
    before the Manager), else a faster link than the route's, unless ``GLOO_SOCKET_IFNAME``
    is set (docs/operations.md, "The cross-group process group's address"); NCCL's is its own
    (``NCCL_SOCKET_IFNAME``).
    Applies when ``enable`` and ``checkpoint_transport = "http"``.
    """

    heal_stall_timeout_ms: int = 10000
    """
    How long a heal's connection to the donor may receive no byte before that path counts as
    failed and the transfer restarts on the donor's next path, in milliseconds. A pulled cable
    or a dead switch resets nothing: without this bound the heal would wait out the whole
    ``step_timeout_ms`` on the dead path. Default 10000 (10 s). Lower = a dead path is left
    sooner; too low leaves a healthy path that pauses (a donor busy staging its snapshot, a
    congested link) and restarts the transfer from its first byte on a slower one. Unset, the
    ``TORCHFT_HEAL_STALL_TIMEOUT_SEC`` env var (seconds) applies if set (the field wins when
    set). Must be < ``step_timeout_ms`` (the bound of the whole heal, all paths together),
    checked at start when set; left at its default beside a ``step_timeout_ms`` of 10000 or
    less, it is not applied (docs/timeouts.md). Applies when ``enable`` and
    ``checkpoint_transport = "http"``.
    """

    retry_inflight_allreduce: bool = False
    """
    The Manager's ``retry_inflight_allreduce``: when a peer group dies mid-allreduce, finish
    the step with the survivors (a new quorum at the same step, the allreduces re-run from
    kept copies of their inputs) instead of discarding it. Default False, and True is refused
    here: the Manager re-runs the allreduces in ``should_commit``, after TorchTitan has
    clipped the gradients computed from the failed all-reduce; the ranks of a group, each
    all-reducing its own shard, may see the failure differently and would first have to agree
    to retry; and a unit whose shard FSDP casts, copies or accumulates after the hook cannot
    be rewritten (docs/titan.md, "How it plugs in"). Plain Manager users
    (``DistributedDataParallel``, 1-rank groups) can pass it to ``Manager``. Applies when
    ``enable``.
    """

    checkpoint_transport: CheckpointTransportName = "http"
    """
    How a recovering replica group receives live state from a healthy one: "http" (default) or
    "pg". Each rank receives its own FSDP shards. "http": every rank runs a checkpoint server;
    the donor snapshots its state into memory and keeps training while the healer downloads it.
    "pg": the donor sends it with send/recv on the cross-group process group (``process_group``;
    no extra server or port, fast between GPUs with "nccl"), and stalls until the healer
    received it. Each tensor must arrive within ``process_group_timeout_ms``. Applies when
    ``enable``.
    """

    auth_token: str = ""
    """
    Job-wide secret, the same in every replica group and in the lighthouse. Default "" = the
    ``TORCHFT_AUTH_TOKEN`` environment variable if set (this field wins over it), else none:
    the ManagerServer refuses every Kill request (the lighthouse's kill action cannot stop this
    group) and the HTTP checkpoint server answers anyone who reaches its port. When set, group
    rank 0 presents it to the lighthouse (a lighthouse with a token refuses groups without
    it), every call to the group's ManagerServer must carry it (each rank's quorum, vote and
    Kill, and a healing group's CheckpointMetadata; its ranks send it), and with
    ``checkpoint_transport = "http"`` so must every checkpoint request, so groups with
    different tokens cannot heal from each other (401). What it does not protect: see the
    security section of docs/operations.md. It travels in clear text (no TLS). Visible
    ASCII only (``!`` to ``~``). A token in a TOML file is visible to whoever reads the file,
    one on the command line in the process list, one in the environment only to the process's
    owner. Applies when ``enable``.
    """

    sync_steps: int = 5
    """
    Inner steps between two synchronisations, for "local_sgd" and "diloco". Default 5. More
    steps = less communication, more drift between groups. Must be >= 1.
    """

    num_fragments: int = 1
    """
    Number of model fragments synchronised in turn by "diloco" (Streaming DiLoCo when > 1).
    Default 1. More fragments spread the communication over the ``sync_steps`` window. Must be
    >= 1, divide ``sync_steps``, and be at most the number of transformer layers.
    """

    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """
    The Streaming DiLoCo fragments by module name, "diloco" only (TorchTitan's field): one
    list of module names per fragment, e.g. ``[["tok_embeddings", "layers.0"], ["layers.1",
    "norm", "output"]]``; every parameter must be in exactly one fragment. Default empty =
    ``num_fragments`` contiguous ranges of ``layers`` (embeddings with the first, norm and
    output with the last). In TOML a list of lists; on the command line fragments separated
    by ";" and names by ",", e.g. ``--fault_tolerance.module_fqns_per_model_fragment=
    "tok_embeddings,layers.0;layers.1,norm,output"``. Unknown names are an error listing the
    model's top-level modules. When set, ``num_fragments`` must be 1 or its length.
    """

    fragment_sync_delay: int = 0
    """
    Inner steps to wait before blocking on a fragment's synchronisation (tau in Streaming
    DiLoCo), "diloco" only. Default 0 = block at once. A delay overlaps communication with
    compute at some cost in model quality. Must be < ``sync_steps / num_fragments``.
    """

    fragment_update_alpha: float = 0.0
    """
    Mixing factor between the local and the synchronised parameters of a fragment, "diloco"
    only: new = alpha * local + (1 - alpha) * global. Default 0.0 = take the global parameters
    (all groups identical after a sync). In [0, 1].
    """

    outer_overlap: OuterOverlapName = "none"
    """
    Whether a "diloco" outer round overlaps the next inner steps (not in TorchTitan or
    torchft). Default "none": each round's all-reduce is waited for at its sync point (after
    ``fragment_sync_delay`` steps) and every group continues from the averaged parameters.
    "delayed": the one-step-delayed outer update: the all-reduce runs during the next
    ``sync_steps / num_fragments`` inner steps and is applied at the next sync point, one outer
    step late, with the inner progress made meanwhile kept (the math:
    torchtitan_ft/semi_sync/overlap.py). "eager": the same, but each round starts from the
    outer step taken with this group's own share of the average in flight (the eager update
    of Kale et al. 2025), which the exact average replaces when it arrives. Both hide the link
    behind compute and cost some loss from staleness, "eager" less (docs/performance.md has
    the measured differences). Both need ``fragment_sync_delay = 0`` and
    ``fragment_update_alpha = 0``. The last round in flight is applied at the last training
    step, before its checkpoint.
    """

    should_quantize: bool = False
    """
    Quantize pseudo-gradients before the cross-group all-reduce, "diloco" only. Default False.
    Less bandwidth, some precision and extra compute.
    """

    outer_optimizer: OuterOptimizerName = "sgd"
    """
    Outer optimizer of "diloco": "sgd" (default; with ``outer_momentum`` and
    ``outer_nesterov``, the DiLoCo paper's choice) or "adamw". Its state is part of the healed
    state.
    """

    outer_lr: float = 0.7
    """Learning rate of the outer optimizer ("diloco" only). Default 0.7. Must be > 0."""

    outer_momentum: float = 0.9
    """Momentum of the "sgd" outer optimizer ("diloco" only). Default 0.9. In [0, 1)."""

    outer_nesterov: bool = True
    """Use Nesterov momentum in the "sgd" outer optimizer ("diloco" only). Default True."""

    numerics: NumericsName = "torchtitan"
    """
    Whose numbers an FT job reproduces. "torchtitan" (default): those of TorchTitan's trainer
    without FT, and every batch trained once. Adam's first update equals a run without FT,
    and the batches of a replica group left out of a step that committed (healing, or a spare)
    are retried by its next step. "torchtitan_ft_trainer": those of TorchTitan's own FT
    trainer (``TRAIN_FILE=torchtitan.experiments.ft.train``), for comparing curves with it. Two
    changes. Adam's state is created with one zero-lr step when the optimizer is built, as
    TorchTitan's FT optimizer container does (its step counter runs one ahead, so the first
    real update is smaller). And a group left out of a committed step skips that step's
    batches: the data ledger records them as skipped, not trained. Trade-off: the opt-in gives
    up Adam parity with runs without FT and drops the left-out group's samples. The start-up
    log says which is in force. Applies when ``enable``; with a ``semi_sync_method`` only the
    Adam step applies (every batch is trained by its group's inner step there anyway).
    """

    replacement: ReplacementName = "cold"
    """
    How ``./run_train.sh`` replaces this replica group's workers when one of them dies
    (torchrun restarts the whole worker group: the others' in-group collectives are broken).
    "cold" (default): torchrun starts fresh interpreters, which import torch, TorchTitan and
    this package again before they build the model, join a quorum and heal; torchrun restarts
    only ``MAX_RESTARTS`` times (run_train.sh, default 0: the group then stops). "zygote": the
    launcher keeps one pre-imported process per machine that forks every worker torchrun
    starts, so a restart skips the imports (``torchtitan_ft/titan/zygote.py``); with
    ``MAX_RESTARTS`` left at 0 torchrun may then restart the group up to 100 times, and the
    launcher says so in one line. Trade-off: the zygote holds the imported modules' memory
    (a few hundred MB on CPU) while the group trains. Applies when ``enable``, to groups
    started by ``./run_train.sh``; the first start comes from the zygote too.
    """

    explicit_fields = None
    """Not a config key: the names of the fields the user set (TOML or command line), recorded
    by the parse (``config_cli.parse_job``); None when unknown (a config built in code), which
    counts every field as set. See :func:`manager_timeouts`."""


@dataclass
class JobConfig(TitanJobConfig):
    """TorchTitan's JobConfig (0.2.2) or ``Trainer.Config`` (0.3.0) with the extended
    ``fault_tolerance`` section."""

    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance, kw_only=True)


# --- what the raw fields mean ---------------------------------------------------------------------

_SEMI_SYNC_NAMES = {m.value: m for m in SyncMethod if m is not SyncMethod.PER_STEP}


def sync_method(ft: Any) -> SyncMethod:
    """The sync strategy ``ft.semi_sync_method`` names: None or "none" (any case) is per-step
    FT, else "local_sgd" or "diloco" in any case (TorchTitan lowercases the name)."""
    raw = ft.semi_sync_method
    if raw is None or str(raw).lower() == "none":
        return SyncMethod.PER_STEP
    method = _SEMI_SYNC_NAMES.get(str(raw).lower())
    if method is None:
        raise ConfigError(
            f"{SECTION}.semi_sync_method={raw!r} is invalid: expected one of "
            f"{', '.join(repr(n) for n in _SEMI_SYNC_NAMES)} (any case), or None / 'none' "
            "for per-step FT"
        )
    return method


def quorum_mode(ft: Any) -> QuorumMode:
    """``ft.quorum_mode``, or when unset the one the sync method needs: "sync" for LocalSGD
    and DiLoCo, "async" for per-step FT."""
    if ft.quorum_mode is not None:
        return QuorumMode(ft.quorum_mode)
    return QuorumMode.ASYNC if sync_method(ft) is SyncMethod.PER_STEP else QuorumMode.SYNC


def fragment_fqns(ft: Any) -> list[list[str]] | None:
    """The explicit Streaming DiLoCo fragments, or None (``num_fragments`` ranges of layers)."""
    return [list(names) for names in ft.module_fqns_per_model_fragment] or None


def num_fragments(ft: Any) -> int:
    """How many fragments DiLoCo syncs in turn: the explicit fragments', else
    ``num_fragments``."""
    fqns = fragment_fqns(ft)
    return len(fqns) if fqns else ft.num_fragments


def uses_semi_sync(job_config: Any) -> bool:
    """Whether ``job_config`` asks for FT with LocalSGD or DiLoCo."""
    ft = job_config.fault_tolerance
    return bool(ft.enable) and sync_method(ft) is not SyncMethod.PER_STEP


def sync_config(ft: Any) -> SyncConfig:
    """The ``SyncConfig`` of a ``fault_tolerance`` section (one field each, see above)."""
    return SyncConfig(
        method=sync_method(ft),
        quorum_mode=quorum_mode(ft),
        sync_every=ft.sync_steps,
        num_fragments=num_fragments(ft),
        fragment_fqns=fragment_fqns(ft),
        fragment_sync_delay=ft.fragment_sync_delay,
        fragment_update_alpha=ft.fragment_update_alpha,
        outer_overlap=OuterOverlap(ft.outer_overlap),
        should_quantize=ft.should_quantize,
        outer_optimizer=OuterOptimizerConfig(
            type=ft.outer_optimizer,
            lr=ft.outer_lr,
            momentum=ft.outer_momentum,
            nesterov=ft.outer_nesterov,
        ),
    )


# --- what a field's type takes ----------------------------------------------------------------


ENV_OVERRIDABLE = {
    "step_timeout_ms": "TORCHFT_TIMEOUT_SEC",
    "quorum_timeout_ms": "TORCHFT_QUORUM_TIMEOUT_SEC",
    "connect_timeout_ms": "TORCHFT_CONNECT_TIMEOUT_SEC",
    "quorum_retries": "TORCHFT_QUORUM_RETRIES",
    "lighthouse_outage": "TORCHFT_LIGHTHOUSE_OUTAGE",
    "on_state_loss": "TORCHFT_ON_STATE_LOSS",
    "heal_interfaces": "TORCHFT_HEAL_INTERFACES",
    "heal_stall_timeout_ms": "TORCHFT_HEAL_STALL_TIMEOUT_SEC",
}
"""Fields whose ``TORCHFT_*`` variable (torchft's name) applies when the user did not set the
field; a field the user set wins over its variable (the Manager says so in one line)."""


def is_set(ft: Any, name: str) -> bool:
    """Whether the user set field ``name`` (unknown: yes; see ``explicit_fields``)."""
    explicit = getattr(ft, "explicit_fields", None)
    return explicit is None or name in explicit


def manager_timeouts(ft: Any) -> dict[str, Any]:
    """The Manager's ``timeout``, ``quorum_timeout``, ``connect_timeout``, ``quorum_retries``,
    ``lighthouse_outage``, ``on_state_loss``, ``heal_interfaces`` and ``heal_stall_timeout``
    arguments: a field the user set, else None, so that the Manager takes the field's
    ``TORCHFT_*`` variable (:data:`ENV_OVERRIDABLE`) or its default, which equals the
    field's."""

    def given(name: str, value: Any) -> Any:
        return value if is_set(ft, name) else None

    return {
        "timeout": given("step_timeout_ms", timedelta(milliseconds=ft.step_timeout_ms)),
        "quorum_timeout": given("quorum_timeout_ms", timedelta(milliseconds=ft.quorum_timeout_ms)),
        "connect_timeout": given(
            "connect_timeout_ms", timedelta(milliseconds=ft.connect_timeout_ms)
        ),
        "quorum_retries": given("quorum_retries", ft.quorum_retries),
        "lighthouse_outage": given("lighthouse_outage", ft.lighthouse_outage),
        "on_state_loss": given("on_state_loss", ft.on_state_loss),
        "heal_interfaces": given("heal_interfaces", ft.heal_interfaces),
        "heal_stall_timeout": given(
            "heal_stall_timeout_ms", timedelta(milliseconds=ft.heal_stall_timeout_ms)
        ),
    }


def type_matches(value: Any, annotation: Any) -> tuple[bool, str]:
    """Whether ``value`` fits ``annotation`` (bool, int, float, str, ``Literal``, lists and
    unions of these; any other type fits anything), and what the type takes, in words (e.g.
    "an integer or None"), for error messages."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        return value in choices, f"one of {', '.join(repr(c) for c in choices)}"
    if origin in (typing.Union, types.UnionType):
        results = [type_matches(value, arg) for arg in typing.get_args(annotation)]
        return any(ok for ok, _ in results), " or ".join(what for _, what in results)
    if origin is list:
        (item,) = typing.get_args(annotation)
        _, item_kind = type_matches(None, item)
        ok = isinstance(value, list) and all(type_matches(v, item)[0] for v in value)
        return ok, f"a list of ({item_kind})"
    if annotation is type(None):
        return value is None, "None"
    if annotation is bool:
        return isinstance(value, bool), "a boolean"
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), "an integer"
    if annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, "a number"
    if annotation is str:
        return isinstance(value, str), "a string"
    return True, ""


def expected(annotation: Any) -> str:
    """What a field of type ``annotation`` takes, in words (see :func:`type_matches`)."""
    _, words = type_matches(None, annotation)
    return words or f"a {getattr(annotation, '__name__', annotation)}"
