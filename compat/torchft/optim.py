"""``torchft.optim``: torchtitan_ft.optim's wrapper."""

from torchtitan_ft.optim import OptimizerWrapper

__all__ = ["OptimizerWrapper"]
