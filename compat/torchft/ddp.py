"""``torchft.ddp``: torchtitan_ft.ddp's wrappers."""

from torchtitan_ft.ddp import DistributedDataParallel, PureDistributedDataParallel

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]
