"""Runtime fixes that make TorchTitan 0.2.2 run on a CPU-only torch (gloo), applied in every
trainer process as TorchTitan's modules are imported; TorchTitan stays unedited (docs/titan.md,
"TorchTitan on a CPU-only torch", fixes 1-5)."""

from __future__ import annotations

import importlib.abc
import os
import platform
import resource
import sys
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Importing this module stays cheap (no torch, no TorchTitan): ``torchtitan_ft.titan`` imports it
# first, also in processes that never train (the torchrun agent, the config-name resolver).

_DEVICE_TYPE_MODULE = "torchtitan.tools.utils"
"""Computes ``device_type`` once, at import (fix 1)."""


def cuda_available() -> bool:
    """True when torch sees a CUDA (or ROCm) device; then nothing here changes anything."""
    import torch  # load order: titan/__init__ imports this module, torch-free

    return torch.cuda.is_available()


def install() -> None:
    """Fix TorchTitan's modules as they are imported, whoever imports them (fixes 1-3 and 5, and 4
    for llama3): an import hook, so installing it imports nothing. Idempotent;
    ``torchtitan_ft.titan`` calls it on import. A module imported before it was installed is
    not fixed (see :func:`apply_before_torchtitan_import`)."""
    if not any(isinstance(finder, _FixingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FixingFinder())


def apply_before_torchtitan_import(strict: bool = True) -> None:
    """The entry point's check: :func:`install`, and make sure TorchTitan was not imported
    without the fixes.

    If it was, on a CPU-only torch its device type is frozen to ``"cuda"`` in several modules:
    with ``strict`` (the entry point) that raises ``RuntimeError``; otherwise a warning is
    issued. The memory monitor and ``set_pg_timeouts`` of modules already imported are
    replaced now.
    """
    install()
    utils = sys.modules.get(_DEVICE_TYPE_MODULE)
    if utils is None or cuda_available():
        return
    if utils.device_type != "cpu":
        message = (
            "torchtitan was imported before torchtitan_ft.titan.cpu_compat could set the "
            f"device type (it is {utils.device_type!r}); start training with "
            "`python -m torchtitan_ft.titan.train` instead of `-m torchtitan.train`"
        )
        if strict:
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    for name, fix in _FIXES.items():
        if name != _DEVICE_TYPE_MODULE and name in sys.modules:
            fix(sys.modules[name], lambda module: None)  # executed already: only the replacement


Execute = Callable[[ModuleType], None]


def _exec_with_cpu_device_type(module: ModuleType, execute: Execute) -> None:
    """Fix 1: run the module while torch reports device type ``"cpu"`` when it has no
    accelerator (torch itself is restored right after)."""
    import torch._utils as torch_utils  # load order: titan/__init__ imports this module, torch-free

    original = torch_utils._get_available_device_type

    def _cpu_when_no_accelerator() -> str:
        return original() or "cpu"

    torch_utils._get_available_device_type = _cpu_when_no_accelerator
    try:
        execute(module)
    finally:
        torch_utils._get_available_device_type = original


def _exec_with_rss_memory_monitor(module: ModuleType, execute: Execute) -> None:
    """Fix 2: ``DeviceMemoryMonitor`` (looked up at call time) becomes :class:`RSSMemoryMonitor`."""
    execute(module)
    if not cuda_available():
        module.DeviceMemoryMonitor = RSSMemoryMonitor


def _exec_with_gloo_barrier(module: ModuleType, execute: Execute) -> None:
    """Fix 3: ``set_pg_timeouts`` becomes :func:`set_pg_timeouts_cpu`."""
    execute(module)
    if not cuda_available():
        module.set_pg_timeouts = set_pg_timeouts_cpu


def _exec_with_sum_reduction(module: ModuleType, execute: Execute) -> None:
    """Fix 4 for any trainer (this project's also calls :func:`force_sum_reduction` itself):
    llama3's ``disable_fsdp_gradient_division``, which makes FSDP reduce with PREMUL_SUM, is
    followed by :func:`force_sum_reduction`. Looked up at call time by llama3's
    ``parallelize_llama``; the other models import it from this module after this fix."""
    execute(module)
    if cuda_available():
        return
    disable_division = module.disable_fsdp_gradient_division

    def disable_division_then_sum(model: torch.nn.Module) -> None:
        disable_division(model)
        force_sum_reduction([model])

    module.disable_fsdp_gradient_division = disable_division_then_sum


class _Namespace:
    """``target``'s attributes, but for the ``overrides`` given."""

    def __init__(self, target: Any, **overrides: Any) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _exec_with_cpu_profiler(module: ModuleType, execute: Execute) -> None:
    """Fix 5: TorchTitan 0.2.2's ``maybe_enable_profiling`` asks torch's profiler for the
    activities ``[CPU, None]`` when there is no GPU, which it refuses ("TypeError: Expected
    ProfilerActivity or dict, got NoneType"): the module's ``torch`` becomes torch with a
    ``profiler.profile`` that leaves the None out (torch itself is unchanged)."""
    execute(module)
    if cuda_available():
        return
    import torch  # load order: titan/__init__ imports this module, torch-free

    def profile(*args: Any, activities: Iterable[Any] | None = None, **kwargs: Any) -> Any:
        if activities is not None:
            activities = [activity for activity in activities if activity is not None]
        return torch.profiler.profile(*args, activities=activities, **kwargs)

    module.torch = _Namespace(torch, profiler=_Namespace(torch.profiler, profile=profile))


_FIXES: dict[str, Callable[[ModuleType, Execute], None]] = {
    _DEVICE_TYPE_MODULE: _exec_with_cpu_device_type,
    "torchtitan.components.metrics": _exec_with_rss_memory_monitor,
    "torchtitan.distributed.utils": _exec_with_gloo_barrier,
    "torchtitan.models.llama3.infra.parallelize": _exec_with_sum_reduction,
    "torchtitan.tools.profiling": _exec_with_cpu_profiler,
}
"""TorchTitan modules that need a fix, and how each is executed."""


class _FixingFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`_FIXES` with the finders after it, then loads them fixed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        fix = _FIXES.get(name)
        if fix is None:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(name, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _FixingLoader(spec.loader, fix)
                return spec
        return None


class _FixingLoader(importlib.abc.Loader):
    """``loader``, executing the module through ``fix``; anything else is the loader's."""

    def __init__(self, loader: Any, fix: Callable[[ModuleType, Execute], None]) -> None:
        self._loader = loader
        self._fix = fix

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._fix(module, self._loader.exec_module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def force_sum_reduction(model_parts: Iterable[torch.nn.Module]) -> int:
    """Make every FSDP module of ``model_parts`` reduce gradients with a plain SUM (fix 4).

    Needed on gloo only (it rejects PREMUL_SUM); on CUDA it returns 0 and changes nothing.
    Returns the number of FSDP modules changed. Call it after TorchTitan's parallelize step.
    """
    if cuda_available():
        return 0
    from torch.distributed.fsdp import FSDPModule  # load order: this module stays torch-free

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
    import torch  # load order: titan/__init__ imports this module, which stays torch-free
    from torchtitan.tools.logging import logger  # load order: this module patches TorchTitan

    logger.info(f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}")
    torch.distributed.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


class RSSMemoryMonitor:
    """Drop-in for TorchTitan's ``DeviceMemoryMonitor`` that reports the process's host memory.

    "Active" and "reserved" are both the peak resident set size (RSS) since the last reset;
    capacity is the machine's physical memory. The peak is reset through
    ``/proc/self/clear_refs`` where Linux allows it; otherwise it is the peak since process
    start (``getrusage``). Allocation retries and OOMs are not observable on CPU: reported as 0.
    """

    def __init__(self, device: str = "cpu") -> None:
        import torch  # load order: titan/__init__ imports this module, torch-free

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
        # load order: this module patches TorchTitan, so it imports none of it at its top
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
