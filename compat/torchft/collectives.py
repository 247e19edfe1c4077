"""``torchft.collectives``: quantized allreduce (int8 blocks in plain torch; torchft's fp8
reduce-scatter and its helpers are GPU-only and not provided)."""

from torchtitan_ft.process_group.quantized import quantized_allreduce as allreduce_quantized

__all__ = ["allreduce_quantized"]
