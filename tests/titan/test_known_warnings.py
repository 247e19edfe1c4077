"""The warnings a CPU run prints that are not the user's to act on (``titan.known_warnings``):
each is dropped or explained, and everything else passes unchanged."""

from __future__ import annotations

import logging
import warnings

import pytest

from torchtitan_ft.titan import cpu_compat, known_warnings
from torchtitan_ft.titan.known_warnings import KnownLogRecords, quiet_known_warnings


def _record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("root", level, __file__, 1, message, (), None)


@pytest.mark.parametrize(
    "message",
    [
        "Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use "
        "device_name",
        "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
        "initial_load_model_only=True has no effect without an initial_load_path.",
        "model.safetensors.index.json not found at hf_assets_path: ./tests/assets/tokenizer/"
        "model.safetensors.index.json.                     Defaulting to saving a single "
        "safetensors file if checkpoint is saved in HF format",
        "CUDA graph capture is only supported on NVIDIA CUDA; using eager execution.",
    ],
)
def test_harmless_records_are_dropped(message: str) -> None:
    assert not KnownLogRecords().filter(_record(message))


@pytest.mark.parametrize(
    "message",
    [
        "Warmup (2) + decay (2) steps exceed total steps (2). Adjusting decay steps to 0.",
        "ENV[OMP_NUM_THREADS] = 1 will be overridden to 4 based on job config",
        "Peak flops undefined for: NVIDIA L4, fallback to A100",  # a GPU: worth saying
    ],
)
def test_other_records_pass_unchanged(message: str) -> None:
    record = _record(message)
    assert KnownLogRecords().filter(record)
    assert (record.getMessage(), record.levelno) == (message, logging.WARNING)


def test_the_a100_fallback_on_cpu_is_explained_once_as_info() -> None:
    known = KnownLogRecords()
    first = _record("Peak flops undefined for: cpu (x86_64), fallback to A100")
    assert known.filter(first)
    assert (first.levelno, first.levelname) == (logging.INFO, "INFO")
    assert first.getMessage() == (
        "mfu is computed against an A100's peak FLOPS (TorchTitan has none for CPUs): "
        "ignore it on CPU"
    )
    assert not known.filter(_record("Peak flops undefined for: cpu (x86_64), fallback to A100"))


def test_quiet_known_warnings_ignores_the_harmless_python_warnings(monkeypatch) -> None:
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: False)
    logger = logging.getLogger("test_known_warnings")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        known = quiet_known_warnings(logger)
        assert quiet_known_warnings(logger) is known  # idempotent
        assert logger.filters == [known]
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=1)
        warnings.warn(
            "In CPU autocast, but the target dtype is not supported. Disabling autocast.\n"
            "CPU Autocast only supports dtypes of torch.bfloat16, torch.float16 currently.",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn(
            "DTensor random operators may not have complete support on cpu device mesh",
            stacklevel=1,
        )
        warnings.warn(
            "DTensor random operators may not have complete support on mtia device mesh",
            stacklevel=1,
        )
        warnings.warn(  # TorchTitan 0.3.0's scheduler container loading a healed state
            "To get the last learning rate computed by the scheduler, please use `get_last_lr()`.",
            UserWarning,
            stacklevel=1,
        )
    logger.removeFilter(known)
    assert [str(w.message) for w in caught] == [
        "DTensor random operators may not have complete support on mtia device mesh"
    ]


def test_nothing_changes_with_cuda(monkeypatch) -> None:
    monkeypatch.setattr(known_warnings.cpu_compat, "cuda_available", lambda: True)
    logger = logging.getLogger("test_known_warnings_cuda")
    assert quiet_known_warnings(logger) is None
    assert logger.filters == []
