"""CPU compatibility fixes for TorchTitan 0.2.2 (no-ops when CUDA is available)."""

import subprocess
import sys

import pytest
import torch

from torchtitan_ft.titan import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only fixes")


def test_torchtitan_sees_cpu() -> None:
    from torchtitan.tools import utils

    assert utils.device_type == "cpu"
    assert utils.device_module is torch.cpu


def test_torch_device_detection_is_restored() -> None:
    import torch._utils

    assert torch._utils._get_available_device_type() is None


def test_memory_monitor_is_replaced_and_reports_rss() -> None:
    import torchtitan.components.metrics as metrics

    assert metrics.DeviceMemoryMonitor is cpu_compat.RSSMemoryMonitor
    monitor = metrics.build_device_memory_monitor()
    stats = monitor.get_peak_stats()
    assert 0 < stats.max_reserved_gib < monitor.device_capacity_gib
    assert stats.num_ooms == 0
    monitor.reset_peak_stats()


def test_set_pg_timeouts_is_replaced() -> None:
    import torchtitan.distributed.utils as dist_utils

    assert dist_utils.set_pg_timeouts is cpu_compat.set_pg_timeouts_cpu


def test_strict_apply_refuses_a_cuda_frozen_torchtitan(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.tools import utils

    monkeypatch.setattr(utils, "device_type", "cuda")
    with pytest.raises(RuntimeError, match=r"torchtitan_ft\.titan\.train"):
        cpu_compat.apply_before_torchtitan_import(strict=True)
    with pytest.warns(RuntimeWarning):
        cpu_compat.apply_before_torchtitan_import(strict=False)


def test_importing_the_plugin_is_cheap_and_torchtitan_imported_later_is_fixed() -> None:
    """In a fresh process: the torchrun agent and the config-name resolver import
    ``torchtitan_ft.titan`` without loading torch or TorchTitan, and TorchTitan imported after
    it gets fixes 1-3, and 4 for llama3's parallelize, wherever it is imported from."""
    code = """
import sys
import torchtitan_ft.titan.launch, torchtitan_ft.titan.named_configs
print(sorted(m for m in ("torch", "torchtitan") if m in sys.modules))
import torchtitan.components.metrics as metrics
import torchtitan.distributed.utils as dist_utils
from torchtitan.tools import utils
import torchtitan.models.llama3.infra.parallelize as llama3_parallelize
from torchtitan_ft.titan import cpu_compat
print(
    utils.device_type,
    metrics.DeviceMemoryMonitor is cpu_compat.RSSMemoryMonitor,
    dist_utils.set_pg_timeouts is cpu_compat.set_pg_timeouts_cpu,
    llama3_parallelize.disable_fsdp_gradient_division.__module__ == cpu_compat.__name__,
)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[]", "cpu True True True"], result.stdout
