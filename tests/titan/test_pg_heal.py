"""Healing over the cross-group process group (``checkpoint_transport = "pg"``), end to end.

Same run as ``test_ft_e2e.test_killed_replica_group_heals_to_identical_state[2ranks]``:
replica groups of 2 ranks, group 1 is SIGKILLed mid-run and started again. Here it heals from
group 0 through :class:`~torchtitan_ft.checkpoint.PGTransport`, each group rank over its own
managed gloo group (its local FSDP shards of the model and optimizer, lr schedulers, train
state and data ledger), and both groups end bitwise identical, rank by rank. No checkpoint
server is started. The replacement lowers its process-group timeouts after its first step
(``FaultTolerantTrainer.train_step``), as TorchTitan does after step 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.titan.test_ft_e2e import (
    E2E_TIMEOUT_S,
    KILL_AT_STEP,
    assert_groups_identical,
    kill_and_restart_group_1,
)

PG = ("--fault_tolerance.checkpoint_transport=pg",)
RANKS = 2


@pytest.mark.slow  # default tier: docs/development.md's table of what moved to --full
@pytest.mark.multiprocess
@pytest.mark.step_timing
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_killed_replica_group_heals_over_the_process_group(tmp_path: Path) -> None:
    job = kill_and_restart_group_1(tmp_path, RANKS, *PG)
    outputs = job.outputs
    for output in outputs:
        assert "checkpoint server listening" not in output  # no HTTP transport
    received = re.search(r"received step (\d+) from rank 0: .* over the process group", outputs[1])
    assert received and int(received.group(1)) > KILL_AT_STEP
    assert re.search(r"sent step \d+ to ranks \[1\] over the process group", outputs[0])
    assert "applied healed state" in outputs[1]
    # The replacement never ends a step at step 1, where TorchTitan lowers the process-group
    # timeouts; its first step (the heal) does it instead, once.
    lowered = "Synchronizing and adjusting timeout for all ProcessGroups"
    assert outputs[1].count(lowered) == 1
    assert outputs[1].index(lowered) > outputs[1].index("applied healed state")
    assert lowered in outputs[0]  # TorchTitan's own, after step 1
    assert_groups_identical(tmp_path, RANKS)
    job.assert_recovers_its_speed()
