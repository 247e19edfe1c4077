"""The TorchTitan plugin, for the release that is installed (0.3.0 or 0.2.2: ``releases``), run
in every trainer process (and its torchrun agent). Importing it installs the import hook of the
CPU fixes (``cpu_compat``, a no-op with CUDA), which patches TorchTitan's modules as they are
imported, by whoever imports them; the hook itself imports nothing (docs/titan.md)."""

from torchtitan_ft.titan import cpu_compat

cpu_compat.apply_before_torchtitan_import(strict=False)
