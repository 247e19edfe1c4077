"""Runtime fixes that make TorchTitan 0.2.2 run on a CPU-only torch (gloo), applied in every
trainer process before TorchTitan is imported; TorchTitan stays unedited (docs/titan.md,
"TorchTitan on a CPU-only torch", fixes 1-4)."""

from __future__ import annotations

import os
import platform
import resource
import sys
import warnings
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

_TORCHTITAN_UTILS = "torchtitan.tools.utils"
_state = {"applied": False}


def cuda_available() -> bool:
    """True when torch sees a CUDA (or ROCm) device; then nothing here changes anything."""
    return torch.cuda.is_available()


def apply_before_torchtitan_import(strict: bool = True) -> None:
    """Apply the CPU fixes; call it before the first ``import torchtitan...`` of the process.

    Idempotent. If TorchTitan was already imported on a CPU-only torch, its device type is
    frozen to ``"cuda"`` in several modules: with ``strict`` (the entry point) that raises
    ``RuntimeError``; otherwise (importing ``torchtitan_ft.titan`` as a library, e.g. to parse
    configs) a warning is issued and the other fixes are still applied.
    """
    if cuda_available():
        return
    if _TORCHTITAN_UTILS in sys.modules:
        from torchtitan.tools import utils as titan_utils

        if titan_utils.device_type != "cpu":
            message = (
                "torchtitan was imported before torchtitan_ft.titan.cpu_compat could set the "
                f"device type (it is {titan_utils.device_type!r}); start training with "
                "`python -m torchtitan_ft.train` instead of `-m torchtitan.train`"
            )
            if strict:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    else:
        _import_torchtitan_utils_as_cpu()
    if _state["applied"]:
        return
    _patch_after_import()
    _state["applied"] = True


def _import_torchtitan_utils_as_cpu() -> None:
    """Import ``torchtitan.tools.utils`` while torch reports device type ``"cpu"``."""
    import torch._utils as torch_utils

    original = torch_utils._get_available_device_type

    def _cpu_when_no_accelerator() -> str:
        return original() or "cpu"

    torch_utils._get_available_device_type = _cpu_when_no_accelerator
    try:
        import torchtitan.tools.utils  # noqa: F401  (computes device_type now)
    finally:
        torch_utils._get_available_device_type = original


def _patch_after_import() -> None:
    """Replace the memory monitor and ``set_pg_timeouts`` (fixes 2 and 3)."""
    import torchtitan.components.metrics as titan_metrics
    import torchtitan.distributed.utils as titan_dist_utils

    titan_metrics.DeviceMemoryMonitor = RSSMemoryMonitor
    titan_dist_utils.set_pg_timeouts = set_pg_timeouts_cpu


def force_sum_reduction(model_parts: Iterable[torch.nn.Module]) -> int:
    """Make every FSDP module of ``model_parts`` reduce gradients with a plain SUM (fix 4).

    Needed on gloo only (it rejects PREMUL_SUM); on CUDA it returns 0 and changes nothing.
    Returns the number of FSDP modules changed. Call it after TorchTitan's parallelize step.
    """
    if cuda_available():
        return 0
    from torch.distributed.fsdp import FSDPModule

    changed = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                changed += 1
    return changed


def set_pg_timeouts_cpu(timeout: timedelta, parallel_dims: Any) -> None:
    """Like TorchTitan's ``set_pg_timeouts``, with a barrier that gloo accepts (fix 3).

    All ranks meet at a barrier first, so that no rank runs collectives under the new (shorter)
    timeout while a slower rank still finishes work permitted by the old one; then the timeout
    of every mesh group and of the default group is set.
    """
    from torch.distributed import distributed_c10d
    from torchtitan.tools.logging import logger

    logger.info(f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}")
    torch.distributed.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        distributed_c10d._set_pg_timeout(timeout, group)


class RSSMemoryMonitor:
    """Drop-in for TorchTitan's ``DeviceMemoryMonitor`` that reports the process's host memory.

    "Active" and "reserved" are both the peak resident set size (RSS) since the last reset;
    capacity is the machine's physical memory. The peak is reset through
    ``/proc/self/clear_refs`` where Linux allows it; otherwise it is the peak since process
    start (``getrusage``). Allocation retries and OOMs are not observable on CPU: reported as 0.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.device_name = f"cpu ({platform.processor() or platform.machine()})"
        self.device_index = 0
        self.device_capacity = _physical_memory_bytes()
        self.device_capacity_gib = self._to_gib(self.device_capacity)
        self.reset_peak_stats()

    @staticmethod
    def _to_gib(memory_in_bytes: float) -> float:
        return memory_in_bytes / (1024**3)

    def _to_pct(self, memory: float) -> float:
        return 100 * memory / self.device_capacity if self.device_capacity else 0.0

    def get_peak_stats(self) -> Any:
        """Peak RSS since the last reset, in TorchTitan's ``DeviceMemStats`` shape."""
        from torchtitan.components.metrics import DeviceMemStats

        peak = _peak_rss_bytes()
        gib, pct = self._to_gib(peak), self._to_pct(peak)
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        """Start a new peak window (best effort: not every kernel allows it)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _peak_rss_bytes() -> int:
    """VmHWM from ``/proc/self/status`` (resettable), else ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
