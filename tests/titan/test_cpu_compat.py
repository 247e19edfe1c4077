"""CPU compatibility fixes for TorchTitan 0.2.2 (no-ops when CUDA is available)."""

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
    with pytest.raises(RuntimeError, match=r"torchtitan_ft\.train"):
        cpu_compat.apply_before_torchtitan_import(strict=True)
    with pytest.warns(RuntimeWarning):
        cpu_compat.apply_before_torchtitan_import(strict=False)
