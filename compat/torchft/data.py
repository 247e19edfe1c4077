"""``torchft.data``: torchtitan_ft.data's sampler."""

from torchtitan_ft.data import DistributedSampler

__all__ = ["DistributedSampler"]
