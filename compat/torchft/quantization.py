"""``torchft.quantization``: torchft's fp8 Triton kernels for GPUs, not provided (no GPU
here); torchtitan_ft quantizes to int8 blocks in plain torch (``torchft.collectives``)."""

__all__: list[str] = []
