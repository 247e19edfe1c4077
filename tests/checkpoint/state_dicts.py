"""Helpers for checkpoint transport tests: mixed-dtype state dicts and bitwise comparison."""

from typing import Any

import torch

from torchtitan_ft.checkpoint._staging import as_bytes


def mixed_state_dict(seed: int = 0) -> dict[str, Any]:
    """A nested state dict like a model + optimizer + trainer state, with many dtypes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {
            "w": w,
            "w_t": w.t(),  # non-contiguous
            "bf16": torch.randn(33, generator=g).bfloat16(),
            "f16": torch.randn(5, 7, generator=g).half(),
            "f64": torch.randn(3, generator=g, dtype=torch.float64),
            "i8": torch.randint(-128, 127, (17,), generator=g, dtype=torch.int8),
            "i64": torch.randint(-(2**62), 2**62, (4,), generator=g, dtype=torch.int64),
            "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
            "mask": torch.rand(11, generator=g) > 0.5,
            "c64": torch.randn(6, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(float("nan")),
            "empty": torch.empty(0, 4),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(64, 32, generator=g)}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0], "foreach": None}],
        },
        "torchft": {"step": 12, "batches_committed": 48},
        "dataloader": {"dp_rank_0": b"\x80\x04opaque"},
        "name": "run-1",
    }


def assert_bitwise_equal(got: Any, want: Any, path: str = "state_dict") -> None:
    """Same structure, same plain values, tensors with equal dtype, shape and bytes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert torch.equal(as_bytes(got), as_bytes(want)), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for k in want:
            assert_bitwise_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(a, b, f"{path}[{i}]")
    else:
        assert type(got) is type(want) and got == want, path
