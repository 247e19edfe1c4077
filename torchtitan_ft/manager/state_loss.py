"""What a replica group does when the lighthouse reports the job's state lost (pure): the
operator's choice (``OnStateLoss``), the one line every group logs, and the exit status of a
group that stops.

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
(``OnStateLoss.STOP``); ``titan.launch`` keeps its own copy (it must not import the Manager)."""


class OnStateLoss(Enum):
    """What a replica group does when the lighthouse reports the job's state lost."""

    STOP = "stop"
    """Log one ERROR line, record a ``state_lost`` event and exit with ``STATE_LOST_EXIT``
    (the default: the operator decides, e.g. restarts from a checkpoint). A group restarted
    meanwhile (torchrun's restarts) gets the same report and stops again, while the lighthouse
    holds the loss."""
    FROM_SCRATCH = "from_scratch"
    """Log the ERROR line, record the event and train on from the quorum's step (step 0 when
    every member is a fresh process), the lost steps' progress gone."""


class StateLostError(RuntimeError):
    """The quorum of a group whose ``OnStateLoss`` is ``STOP`` reported the job's state lost;
    the quorum thread raises it (the step's collectives record it: nothing commits) and the
    Manager turns it into ``SystemExit(STATE_LOST_EXIT)`` on the training thread."""


def state_loss_line(loss: StateLoss, max_step: int, policy: OnStateLoss) -> str:
    """The one line a group logs (at ERROR, on group rank 0) when it learns of ``loss`` with a
    quorum whose highest step is ``max_step``."""
    holders = ", ".join(loss.holders) or "unknown"
    then = (
        f"this group stops (exit status {STATE_LOST_EXIT})"
        if policy is OnStateLoss.STOP
        else f"this group trains on from step {max_step}, the steps since lost"
    )
    return (
        f"the job's state is LOST: the lighthouse found no member holding step "
        f"{loss.lost_step} (the last quorum's members {holders} are gone or restarted); "
        f"{then} (on_state_loss={policy.value!r}: fault_tolerance.on_state_loss, "
        "TORCHFT_ON_STATE_LOSS)"
    )
