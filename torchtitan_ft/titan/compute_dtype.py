"""Which dtype TorchTitan computes in (``training.mixed_precision_param``) by what the CPU can
do, decided when the entry point parses the config (docs/titan.md, "Compute dtype on CPU").

:func:`choose_param_dtype` is the decision, a pure function of the device, the CPU's bf16
support and the explicit setting; :func:`probe_cpu` reads the CPU and :func:`describe_cpu` is
the record every benchmark stores beside its figures.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from typing import Literal

import torch

ParamDtype = Literal["bfloat16", "float32"]

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""``/proc/cpuinfo`` flags of native bf16 arithmetic: x86 AVX-512 BF16 and AMX-BF16, Arm
``bf16`` (FEAT_BF16, in the ``Features`` line)."""


@dataclass(frozen=True)
class CpuInfo:
    """What decides bf16 speed on this CPU."""

    model: str
    """``model name`` from ``/proc/cpuinfo`` (or ``platform.processor()``)."""
    torch_capability: str
    """``torch.backends.cpu.get_cpu_capability()``, e.g. "AVX2", "AVX512"."""
    onednn_bf16: bool
    """Whether torch routes bf16 matmuls to oneDNN on this CPU (else a generic kernel)."""
    bf16_flags: tuple[str, ...]
    """The native bf16 flags this CPU reports (a subset of :data:`NATIVE_BF16_FLAGS`)."""

    @property
    def native_bf16(self) -> bool:
        """bf16 is fast here: torch uses oneDNN for it and the CPU has bf16 instructions."""
        return self.onednn_bf16 and bool(self.bf16_flags)

    def summary(self) -> str:
        flags = ", ".join(self.bf16_flags) or "none"
        return (
            f"{self.model} (torch capability {self.torch_capability}, bf16 flags: {flags}, "
            f"oneDNN bf16: {'yes' if self.onednn_bf16 else 'no'})"
        )


@dataclass(frozen=True)
class DtypeChoice:
    """The value for ``training.mixed_precision_param`` and why."""

    param_dtype: ParamDtype
    reason: str
    changed: bool
    """True when the choice differs from TorchTitan's default ("bfloat16")."""


TITAN_DEFAULT: ParamDtype = "bfloat16"


def choose_param_dtype(
    device_type: str, cpu: CpuInfo | None, explicit: ParamDtype | None
) -> DtypeChoice:
    """The compute dtype for a run on ``device_type`` ("cpu", "cuda", ...).

    ``explicit`` is ``mixed_precision_param`` when the config or the command line sets it (it
    always wins); ``cpu`` is this machine's CPU (only read for ``device_type == "cpu"``).
    """
    if explicit is not None:
        return DtypeChoice(explicit, f"training.mixed_precision_param={explicit} is set", False)
    if device_type != "cpu":
        return DtypeChoice(
            TITAN_DEFAULT, f"{device_type}: TorchTitan's default {TITAN_DEFAULT}", False
        )
    if cpu is None:
        raise ValueError("choose_param_dtype: device_type 'cpu' needs the CpuInfo")
    if cpu.native_bf16:
        return DtypeChoice(
            TITAN_DEFAULT, f"CPU runs bf16 natively: {cpu.summary()}; training in bfloat16", False
        )
    return DtypeChoice(
        "float32",
        f"CPU has no native bf16, where a bf16 matmul is 15-50x slower than fp32: "
        f"{cpu.summary()}; training in float32 (set training.mixed_precision_param=bfloat16 to "
        "override)",
        True,
    )


def bf16_flags(cpuinfo_text: str) -> tuple[str, ...]:
    """The native bf16 flags in a ``/proc/cpuinfo`` text (``flags`` or ``Features`` lines)."""
    found: set[str] = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            found.update(NATIVE_BF16_FLAGS.intersection(value.split()))
    return tuple(sorted(found))


def _model_name(cpuinfo_text: str) -> str:
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return platform.processor() or platform.machine()


def _onednn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def probe_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's :class:`CpuInfo`."""
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    return CpuInfo(
        model=_model_name(text),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        onednn_bf16=_onednn_bf16(),
        bf16_flags=bf16_flags(text),
    )


def describe_cpu(cpu: CpuInfo | None = None) -> dict[str, object]:
    """JSON-ready record of the CPU a figure was measured on."""
    cpu = cpu or probe_cpu()
    return {**asdict(cpu), "native_bf16": cpu.native_bf16, "bf16_flags": list(cpu.bf16_flags)}
