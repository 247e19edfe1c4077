"""``torchft.futures``: torchtitan_ft.process_group.futures' timeouts (no CUDA stream one)."""

from torchtitan_ft.process_group.futures import context_timeout, future_timeout, future_wait

__all__ = ["context_timeout", "future_timeout", "future_wait"]
