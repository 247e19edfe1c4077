"""``torchft.local_sgd``: torchtitan_ft.semi_sync's LocalSGD and DiLoCo."""

from torchtitan_ft.semi_sync import DiLoCo, LocalSGD, extract_local_tensor

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]
