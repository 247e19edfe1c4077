"""What an ``on_state_loss`` choice comes to for one quorum, and the line a group logs (pure)."""

from __future__ import annotations

import pytest

from torchtitan_ft.lighthouse.types import StateLoss
from torchtitan_ft.manager.state_loss import (
    STATE_LOST_EXIT,
    OnStateLoss,
    StateLossAction,
    state_loss_action,
    state_loss_line,
)

STOP, TRAIN_ON = StateLossAction.STOP, StateLossAction.TRAIN_ON


@pytest.mark.parametrize(
    "policy, quorum_step, checkpoint_step, expected",
    [
        # stop stops whatever the job holds on disk
        (OnStateLoss.STOP, 0, None, STOP),
        (OnStateLoss.STOP, 20, 20, STOP),
        # from_scratch trains on from the quorum's step, checkpoint or not
        (OnStateLoss.FROM_SCRATCH, 0, None, TRAIN_ON),
        (OnStateLoss.FROM_SCRATCH, 0, 20, TRAIN_ON),
        # checkpoint: no complete checkpoint is stop, the safe choice
        (OnStateLoss.CHECKPOINT, 0, None, STOP),
        (OnStateLoss.CHECKPOINT, 7, None, STOP),
        # every group loaded the newest checkpoint at start: train on from it
        (OnStateLoss.CHECKPOINT, 20, 20, TRAIN_ON),
        # a member holds a state past the checkpoint: the others heal from it
        (OnStateLoss.CHECKPOINT, 23, 20, TRAIN_ON),
        # a checkpoint written after these processes loaded theirs: restart to load it
        (OnStateLoss.CHECKPOINT, 18, 20, STOP),
        (OnStateLoss.CHECKPOINT, 0, 20, STOP),
        (OnStateLoss.CHECKPOINT, 0, 0, TRAIN_ON),  # a seed checkpoint at step 0
    ],
)
def test_state_loss_action(policy, quorum_step, checkpoint_step, expected) -> None:
    assert state_loss_action(policy, quorum_step, checkpoint_step) is expected


LOSS = StateLoss(lost_step=27, holders=("replica_0:a", "replica_1:b"))


@pytest.mark.parametrize(
    "policy, max_step, checkpoint_step, says",
    [
        (OnStateLoss.STOP, 0, None, [f"stops (exit status {STATE_LOST_EXIT})"]),
        (OnStateLoss.FROM_SCRATCH, 0, None, ["trains on from step 0"]),
        (OnStateLoss.CHECKPOINT, 0, None, ["stops", "no complete checkpoint"]),
        (OnStateLoss.CHECKPOINT, 20, 20, ["checkpoint (step 20", "steps 21-27 rolled back"]),
        (OnStateLoss.CHECKPOINT, 18, 20, ["stops", "step 18", "(step 20)"]),
    ],
)
def test_the_line_names_the_steps_and_what_follows(policy, max_step, checkpoint_step, says):
    line = state_loss_line(LOSS, max_step, policy, checkpoint_step)
    for part in ["step 27", "replica_0:a, replica_1:b", f"on_state_loss={policy.value!r}", *says]:
        assert part in line, (part, line)
