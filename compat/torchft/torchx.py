"""``torchft.torchx``: torchft's TorchX component ``hsdp`` (this project's ``titan`` component
is in ``torchtitan_ft.torchx``).

As with torchft, TorchX names a component by its file: ``torchx run -s local_cwd
torchtitan_ft/torchx.py:hsdp`` from a checkout of torchtitan_ft.
"""

from torchtitan_ft.torchx import hsdp

__all__ = ["hsdp"]
