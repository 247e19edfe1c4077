"""End to end on TorchTitan 0.3.0, the TorchTitan way: ``./run_train.sh`` with ``MODULE=llama3
CONFIG=llama3_debugmodel`` and ``--fault_tolerance.*`` flags; replica group 1 is SIGKILLed
mid-run, restarts, heals from group 0, and both groups end with bitwise-identical state (the
same run and checks as tests/titan/test_ft_e2e.py on 0.2.2)."""

from pathlib import Path

import pytest

from tests.titan.test_ft_e2e import (
    E2E_TIMEOUT_S,
    KILL_AT_STEP,
    assert_groups_identical,
    kill_and_restart_group_1,
)

SMALL_CPU = (
    "--training.seq_len=256",
    "--training.local_batch_size=2",
    "--training.mixed_precision_param=float32",
    "--debug.seed=42",
    "--validator.no-enable",
    "--metrics.disable_color_printing",
)
"""debug_ft_cpu.toml's shape on top of the registry's llama3_debugmodel (batch 8 x 2048)."""

FT = (
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size=2",
    "--fault_tolerance.hostname=127.0.0.1",
    "--fault_tolerance.process_group_timeout_ms=10000",
    "--fault_tolerance.step_timeout_ms=30000",
    "--fault_tolerance.connect_timeout_ms=10000",
)
"""debug_ft_cpu.toml's ``[fault_tolerance]`` section as flags."""

NO_ACTIVATION_CHECKPOINTING = "activation-checkpoint:none"
"""tyro's subcommand for TorchTitan 0.3.0's ``activation_checkpoint`` (a union of configs)."""


@pytest.mark.multiprocess
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_killed_replica_group_heals_to_identical_state(tmp_path: Path) -> None:
    job = kill_and_restart_group_1(
        tmp_path,
        1,
        *SMALL_CPU,
        *FT,
        NO_ACTIVATION_CHECKPOINTING,
        config_env={"MODULE": "llama3", "CONFIG": "llama3_debugmodel"},
    )
    job.assert_healed_and_survived()
    assert job.healed_to > KILL_AT_STEP
    assert_groups_identical(tmp_path, 1)
