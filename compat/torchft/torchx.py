"""``torchft.torchx``: the TorchX components (``hsdp``, torchft's; ``titan``, ours).

As with torchft, TorchX names a component by its file: ``torchx run -s local_cwd
torchtitan_ft/torchx.py:hsdp`` from a checkout of torchtitan_ft.
"""

from torchtitan_ft.torchx import hsdp, titan

__all__ = ["hsdp", "titan"]
