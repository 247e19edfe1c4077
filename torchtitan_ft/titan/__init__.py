"""The TorchTitan 0.2.2 plugin, run in every trainer process (and its torchrun agent); importing
it installs the CPU fixes (``cpu_compat``, a no-op with CUDA) for when TorchTitan is imported
(docs/titan.md)."""

from torchtitan_ft.titan import cpu_compat

cpu_compat.apply_before_torchtitan_import(strict=False)
