"""``torchft.parameter_server``: torchtitan_ft.parameter_server."""

from torchtitan_ft.parameter_server import ParameterServer

__all__ = ["ParameterServer"]
