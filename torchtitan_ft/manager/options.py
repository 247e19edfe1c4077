"""The Manager's own options, beyond torchft 0.2.0's constructor arguments: one frozen
dataclass, given as ``Manager(..., options=ManagerOptions(...))`` or, field by field, as
keyword arguments of the same names (``Manager(..., auth_token="...")``); ``ManagerOptions.of``
maps the keywords onto it. torchft's own arguments stay the Manager's, in torchft's order.

The settings among them that an env var can also give (``auth_token``, ``events_dir``,
``samples_per_batch``, ``lighthouse_outage``, ``on_state_loss``, ``heal_interfaces``,
``heal_stall_timeout``) are
resolved, argument > env var > default, with the others in
``settings.resolve_manager_settings``; a field left ``None`` means "not given here".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.state_loss import OnStateLoss


@dataclass(frozen=True)
class ManagerOptions:
    """The Manager's options that torchft 0.2.0 lacks. Every field's default keeps torchft
    0.2.0's behaviour, except ``lighthouse_outage`` (see there).

    Raises:
        ValueError: ``retry_inflight_allreduce`` is not a bool (the other fields are checked
            when the Manager resolves them, ``settings.resolve_manager_settings``).
    """

    auth_token: str | None = None
    """The job token, the same in every group and the lighthouse; applies to every rank.
    With one, the group's ManagerServer answers only calls carrying it (every rank's client
    sends it; its Kill RPC is enabled), it presents it to the lighthouse and to donor groups'
    ManagerServers, and the default checkpoint transport serves and fetches state only with
    it. Argument > ``TORCHFT_AUTH_TOKEN`` > none (default ``None``: whoever reaches the
    group's ports can call its ManagerServer and fetch its state, as in torchft 0.2.0; the env
    var lets a program written for torchft, whose API has no such argument, join a job with a
    token)."""

    model_fingerprint: str | Callable[[], str] | None = None
    """What model this group trains (``model_fingerprint(model)``) or a function returning it,
    called once at the first ``start_quorum`` (on the training thread: it may need the
    model); group rank 0 sends it to the lighthouse, and a group whose fingerprint differs
    from a live group's fails its first quorum with ``ReplicaGroupMismatchError``. Default
    ``None``: not checked (a group built from another config joins and averages its gradients
    with the others'); ``model_fingerprint(model)`` reads each parameter's name, shape and
    dtype once."""

    num_replica_groups: int | None = None
    """The planned number of replica groups (TorchTitan's ``fault_tolerance.group_size``),
    checked against the live groups' at the first quorum like ``model_fingerprint``.
    Default ``None``: not checked. A replica id a live group already uses is always
    refused."""

    retry_inflight_allreduce: bool = False
    """When a step's allreduce fails because a peer group died (or dropped the group), finish
    the same step with the survivors instead of discarding it: get a new quorum, re-run the
    step's allreduces from copies of their inputs over it (averaging over its participants)
    and vote (default False: the step is discarded, as in torchft 0.2.0). Memory cost: every
    allreduce's input is copied before it is reduced, one copy of the step's allreduced bytes
    (the gradients, for ``DistributedDataParallel``) held while the Manager lives, plus that
    memcpy each step. Applies to groups of one rank with an async quorum (a sync quorum is
    refused at construction) and a process group that can wait for the collectives it
    abandoned (``pg.can_wait_abandoned()``: ``ProcessGroupGloo``, ``ProcessGroupNCCL`` and
    wrappers of them; with another group the Manager logs a warning at construction saying
    why, and never retries); not after a timeout (``decisions.inflight_retry_decision``).
    Use the same value in every group. The retried allreduces rewrite their tensors in place
    inside ``should_commit``: for code that reads the results after it
    (``DistributedDataParallel``, ``PureDistributedDataParallel``, ``OptimizerWrapper``, a
    participation vector), not for the semi-sync strategies (they judge the sync by the first
    attempt's futures). ``manager.retry``."""

    events_dir: str | os.PathLike[str] | None = None
    """The folder of the event stream (``torchtitan_ft.events``; one JSON-lines file per rank,
    docs/operations.md "The event stream"): argument > ``TORCHFT_EVENTS_DIR`` > none (the
    default: no stream, nothing written). One line per event: a few writes per step."""

    samples_per_batch: int | None = None
    """How many samples (e.g. sequences) one replica group trains per step (its batch, all
    its ranks together), for the lighthouse's committed samples per second (status page,
    ``torchft_lighthouse status``): the Manager reports ``batches_committed() *
    samples_per_batch``. Use the same value in every group (groups with different batch
    sizes would count each other's batches at their own size). Argument >
    ``TORCHFT_SAMPLES_PER_BATCH`` > none (the default: the page shows committed batches and
    says why, as for torchft's clients, which cannot send it). A trainer that learns its
    batch size after building the Manager calls ``Manager.set_samples_per_batch``."""

    lighthouse_outage: LighthouseOutage | str | None = None
    """What the group does while its lighthouse cannot be reached (applies on group rank 0):
    ``"previous_quorum"`` (``LighthouseOutage.PREVIOUS_QUORUM``, the default) goes on
    committing steps on the group's previous quorum while every member keeps taking part (a
    member that dies or fails a commit fails the step's collective; the groups then wait for
    the lighthouse), so a lighthouse restart costs no step; ``"wait"`` waits for the
    lighthouse until ``quorum_timeout``, as torchft 0.2.0 does (every group stalls for the
    outage). Healing, joining and any membership change wait for the lighthouse either way
    (docs/lighthouse.md, "A lighthouse outage"). Argument > ``TORCHFT_LIGHTHOUSE_OUTAGE`` >
    ``"previous_quorum"``."""

    on_state_loss: OnStateLoss | str | None = None
    """What the group does when the lighthouse reports the job's state lost (every member
    holding its highest step gone; docs/lighthouse.md, "State loss"): ``"checkpoint"``
    (``OnStateLoss.CHECKPOINT``, the default) resumes from the job's newest complete checkpoint
    (``Manager.set_checkpoint_step``): it trains on when the quorum is at its step or above,
    and stops as ``"stop"`` does otherwise, also where the job has none; ``"stop"`` always
    logs one ERROR line, records a ``state_lost`` event and raises
    ``SystemExit(STATE_LOST_EXIT)`` (3) from ``start_quorum``/``wait_quorum``/
    ``should_commit``, so the operator decides; ``"from_scratch"`` logs and records the same
    and trains on from the quorum's step (the lost steps are trained again). Argument >
    ``TORCHFT_ON_STATE_LOSS`` > ``"checkpoint"``."""

    heal_interfaces: str | Sequence[str] | None = None
    """The network interfaces heals may use (an operator's pin), a sequence of names or one
    comma-separated string, e.g. ``"ib0"``: with the default (HTTP) transport, every rank
    serves its state only on those interfaces' addresses and heals only over the donor's
    paths on them. Default ``None``: every interface; the donor offers all its up,
    non-loopback addresses and the healer probes each path and takes the fastest, falling
    back to the next when one fails (docs/operations.md, "The heal's network path"). An
    interface that does not exist on this host stops the Manager's construction with one
    line naming it. Argument > ``TORCHFT_HEAL_INTERFACES`` > every interface. Ignored with a
    ``checkpoint_transport`` of your own (pin it there)."""

    heal_stall_timeout: timedelta | None = None
    """How long a heal's connection to the donor may receive no byte before that path counts
    as failed and the default (HTTP) transport restarts the transfer on the donor's next path
    (a pulled cable resets nothing; docs/operations.md, "The heal's network path"). Default
    ``None``: ``TORCHFT_HEAL_STALL_TIMEOUT_SEC`` (seconds) if set, else 10 s. Lower leaves a
    dead path sooner; too low leaves a healthy path that pauses and restarts the transfer from
    its first byte. Must be below ``timeout`` (the bound of the whole heal; checked at
    construction, ``timeouts.RELATIONS``). Ignored with a ``checkpoint_transport`` of your own
    (``HTTPTransport(stall_timeout=)``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.retry_inflight_allreduce, bool):
            raise ValueError(
                f"retry_inflight_allreduce must be a bool, got {self.retry_inflight_allreduce!r}"
            )

    @classmethod
    def of(cls, options: ManagerOptions | None, keywords: Mapping[str, Any]) -> ManagerOptions:
        """The options a Manager was given: ``options``, or its fields passed as keywords.

        Raises:
            TypeError: both were given, or a keyword is no field (the message names it and
                the fields).
        """
        if not keywords:
            return cls() if options is None else options
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(
                f"Manager() got unexpected keyword arguments {unknown}: beyond torchft's "
                f"arguments it takes the ManagerOptions fields {names}"
            )
        if options is not None:
            raise TypeError(
                f"Manager() got options= and the keywords {sorted(keywords)}: pass the "
                "ManagerOptions fields one way"
            )
        return cls(**keywords)

    def settings_arguments(self) -> dict[str, Any]:
        """The fields ``settings.resolve_manager_settings`` resolves against env vars."""
        return {
            "auth_token": self.auth_token,
            "events_dir": self.events_dir,
            "samples_per_batch": self.samples_per_batch,
            "lighthouse_outage": self.lighthouse_outage,
            "on_state_loss": self.on_state_loss,
            "heal_interfaces": self.heal_interfaces,
            "heal_stall_timeout": self.heal_stall_timeout,
        }
