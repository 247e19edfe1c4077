"""The TorchTitan 0.2.2 plugin, run in every trainer process; importing it applies the CPU
fixes first (``cpu_compat``, a no-op with CUDA), before its modules import TorchTitan
(docs/titan.md)."""

from torchtitan_ft.titan import cpu_compat

cpu_compat.apply_before_torchtitan_import(strict=False)
