"""The warnings a trainer process prints on a CPU-only torch that are not the user's to act on,
quieted or explained here and nowhere else; every other warning is left as it is.

Called by the trainer's entry points (``torchtitan_ft.titan.train``, ``run_module``) in each
trainer rank, after TorchTitan's logger is set up and before the Trainer is built. With CUDA
it does nothing: there these lines may mean something.
"""

from __future__ import annotations

import logging
import re
import warnings

from torchtitan_ft.titan import cpu_compat

HARMLESS_WARNINGS = (
    # torchdata's StatefulDataLoader calls torch.set_vital (a telemetry hook that does nothing)
    # on every loader it builds; torch deprecated the call. Nothing to change on our side.
    r"'set_vital' is deprecated",
    # TorchTitan enters torch.autocast("cpu", dtype=<compute dtype>) for a single-device or
    # DDP model. Autocast on CPU knows bf16 and fp16 only, so with float32 (the CPU default
    # where bf16 is not native, or training.mixed_precision_param = "float32") it disables
    # itself, which leaves the model in float32: what was asked for.
    r"In CPU autocast, but the target dtype is not supported",
    # TorchTitan 0.3.0 initialises a sharded model's parameters with DTensor random ops. torch
    # keeps one random stream across the ranks of a mesh on CUDA-like devices only; on a CPU
    # mesh each rank fills its shards from its own CPU generator (seeded alike). The initial
    # values then differ from a GPU run's; training is unaffected.
    r"DTensor random operators may not have complete support on cpu device mesh",
    # TorchTitan 0.3.0's LR scheduler container, loading a state (a heal or a checkpoint),
    # recomputes each scheduler's last rate with LambdaLR.get_lr(), the rate its restored step
    # gives; torch warns about any get_lr() call outside step(), meant for a user reading the
    # rate (get_last_lr() is for that). The rate TorchTitan sets is the right one.
    r"To get the last learning rate computed by the scheduler, please use `get_last_lr\(\)`",
)
"""Python warnings (regular expressions matched at the message's start) that are ignored."""

_NCCL_ENV = re.compile(r"ENV\[(TORCH_)?NCCL_\w+\] = .* will be overridden")


class KnownLogRecords(logging.Filter):
    """TorchTitan's log warnings that a CPU run always gets; each is dropped or turned into
    an explanation, every other record passes unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self._mfu_explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Error running lspci"):
            # lspci only finds an NVIDIA H100's exact name for TorchTitan's peak-FLOPS table;
            # there is no GPU to name here.
            return False
        if message.startswith("initial_load_model_only=True has no effect without"):
            # TorchTitan 0.3.0 warns about its own checkpoint defaults (initial_load_model_only
            # on, no initial_load_path) on every checkpointer it builds: with no path, nothing
            # is loaded at start but the run's own checkpoints, as asked.
            return False
        if message.startswith("model.safetensors.index.json not found"):
            # The debug model's hf_assets_path holds its tokenizer only; the index is read
            # for a checkpoint saved in HuggingFace format, which without it is one file
            # (what a debug model needs).
            return False
        if message.startswith("CUDA graph capture is only supported on NVIDIA CUDA"):
            # TorchTitan 0.3.0 captures the step in CUDA graphs unless
            # training.disable_cuda_graphs; on CPU it runs the step eagerly, as every CPU
            # run does.
            return False
        if _NCCL_ENV.match(message):
            # torchrun's agent sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 for every worker, and
            # TorchTitan replaces NCCL settings from its config; gloo never reads them.
            return False
        if message.startswith("Peak flops undefined for: cpu"):
            # TorchTitan's peak-FLOPS table is for GPUs; it falls back to an A100's. That only
            # scales the logged mfu, which then means nothing on CPU: say so once, as info.
            if self._mfu_explained:
                return False
            self._mfu_explained = True
            record.msg = (
                "mfu is computed against an A100's peak FLOPS (TorchTitan has none for "
                "CPUs): ignore it on CPU"
            )
            record.args = ()
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def quiet_known_warnings(logger: logging.Logger | None = None) -> KnownLogRecords | None:
    """On a CPU-only torch: ignore the Python warnings of :data:`HARMLESS_WARNINGS` and add a
    :class:`KnownLogRecords` filter to ``logger`` (default: the root logger, TorchTitan's).
    Returns the filter, or None with CUDA (nothing changed). Idempotent."""
    if cpu_compat.cuda_available():
        return None
    for pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    logger = logger or logging.getLogger()
    known = next((f for f in logger.filters if isinstance(f, KnownLogRecords)), None)
    if known is None:
        known = KnownLogRecords()
        logger.addFilter(known)
    return known
