"""What a replica group does when the lighthouse reports the job's state lost (pure): the
operator's choice (``OnStateLoss``), what it comes to for a quorum (:func:`state_loss_action`:
train on or stop), the one line every group logs, and the exit status of a group that stops.

The lighthouse declares the loss when it issues a quorum whose members are all behind the
job's highest step after every member that held it was gone for the holder wait
(``lighthouse.decision.state_guard``); the quorum carries a ``StateLoss`` until a quorum reaches
that step again. docs/lighthouse.md, "State loss"; docs/operations.md, "State loss".
"""

from __future__ import annotations

from enum import Enum

from torchtitan_ft.lighthouse.types import StateLoss

STATE_LOST_EXIT = 3
"""Exit status of a trainer process that stopped because the job's state was lost
(``StateLossAction.STOP``); ``titan.launch`` keeps its own copy (it must not import the Manager)."""


class OnStateLoss(Enum):
    """What a replica group does when the lighthouse reports the job's state lost."""

    STOP = "stop"
    """Log one ERROR line, record a ``state_lost`` event and exit with ``STATE_LOST_EXIT``
    (the operator decides, e.g. restarts from an older checkpoint). A group restarted
    meanwhile (torchrun's restarts) gets the same report and stops again, while the lighthouse
    holds the loss."""
    FROM_SCRATCH = "from_scratch"
    """Log the ERROR line, record the event and train on from the quorum's step (step 0 when
    every member is a fresh process), the lost steps' progress gone."""
    CHECKPOINT = "checkpoint"
    """Resume from the job's newest complete disk checkpoint: a process that starts loads it
    (TorchTitan's trainer does, before its first quorum), so the quorum after the loss is at
    that checkpoint's step and every group trains on from there, the steps after it rolled
    back. Where the job has no complete checkpoint (or its Manager was given no way to find
    one), the group stops as with ``STOP``; where the quorum is below the newest checkpoint
    (one written after this process loaded its own), it stops too, and restarted it loads
    that one. Log the ERROR line and record the event either way. The default: it resumes
    where the job has checkpoints and is ``STOP`` where it has none."""


class StateLossAction(Enum):
    """What an ``OnStateLoss`` choice comes to for one quorum (:func:`state_loss_action`)."""

    TRAIN_ON = "train_on"
    """Train on from the quorum's step."""
    STOP = "stop"
    """Exit with ``STATE_LOST_EXIT``: nothing may train on."""


def state_loss_action(
    policy: OnStateLoss, quorum_step: int, checkpoint_step: int | None
) -> StateLossAction:
    """What a group does with a quorum at ``quorum_step`` (its highest member step) that
    reports the job's state lost, under ``policy``, when the job's newest complete checkpoint
    is at ``checkpoint_step`` (None: it has none).

    ``CHECKPOINT`` trains on when the quorum is at that checkpoint's step or above it (every
    group loaded it, or a member holds a later state that the others heal from) and stops
    otherwise: with no checkpoint it is ``STOP``, the safe choice."""
    if policy is OnStateLoss.FROM_SCRATCH:
        return StateLossAction.TRAIN_ON
    if policy is OnStateLoss.STOP or checkpoint_step is None:
        return StateLossAction.STOP
    return StateLossAction.TRAIN_ON if quorum_step >= checkpoint_step else StateLossAction.STOP


class StateLostError(RuntimeError):
    """The quorum of a group whose ``OnStateLoss`` is ``STOP`` reported the job's state lost;
    the quorum thread raises it (the step's collectives record it: nothing commits) and the
    Manager turns it into ``SystemExit(STATE_LOST_EXIT)`` on the training thread."""


def state_loss_line(
    loss: StateLoss, max_step: int, policy: OnStateLoss, checkpoint_step: int | None = None
) -> str:
    """The one line a group logs (at ERROR, on group rank 0) when it learns of ``loss`` with a
    quorum whose highest step is ``max_step``, the job's newest complete checkpoint being at
    ``checkpoint_step`` (None: none; only ``CHECKPOINT`` reads it)."""
    holders = ", ".join(loss.holders) or "unknown"
    action = state_loss_action(policy, max_step, checkpoint_step)
    stops = f"this group stops (exit status {STATE_LOST_EXIT})"
    if policy is OnStateLoss.STOP:
        then = stops
    elif policy is OnStateLoss.FROM_SCRATCH:
        then = f"this group trains on from step {max_step}, the steps since lost"
    elif checkpoint_step is None:
        then = f"{stops}: the job has no complete checkpoint to resume from"
    elif action is StateLossAction.STOP:
        then = (
            f"{stops}: the quorum's step {max_step} is below the newest complete checkpoint "
            f"(step {checkpoint_step}), which a restarted process loads"
        )
    else:
        then = (
            f"this group resumes from the newest complete checkpoint (step {checkpoint_step}; "
            f"the quorum's step {max_step}), steps {max_step + 1}-{loss.lost_step} rolled back"
        )
    return (
        f"the job's state is LOST: the lighthouse found no member holding step "
        f"{loss.lost_step} (the last quorum's members {holders} are gone or restarted); "
        f"{then} (on_state_loss={policy.value!r}: fault_tolerance.on_state_loss, "
        "TORCHFT_ON_STATE_LOSS)"
    )
