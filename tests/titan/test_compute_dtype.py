"""The compute dtype follows the hardware unless the config names it."""

import pytest

from torchtitan_ft.titan import compute_dtype
from torchtitan_ft.titan.compute_dtype import (
    CpuInfo,
    bf16_flags,
    choose_param_dtype,
)

EPYC_AVX2 = CpuInfo("AMD EPYC", "AVX2", onednn_bf16=False, bf16_flags=())
SAPPHIRE_RAPIDS = CpuInfo("Intel Xeon 8480", "AVX512", onednn_bf16=True, bf16_flags=("amx_bf16",))
SKYLAKE = CpuInfo("Intel Xeon 8175M", "AVX512", onednn_bf16=True, bf16_flags=())


def test_cpu_without_native_bf16_trains_in_float32() -> None:
    choice = choose_param_dtype("cpu", EPYC_AVX2, None)
    assert choice.param_dtype == "float32" and choice.changed
    assert "no native bf16" in choice.reason and "AMD EPYC" in choice.reason


def test_cpu_with_native_bf16_keeps_bfloat16() -> None:
    choice = choose_param_dtype("cpu", SAPPHIRE_RAPIDS, None)
    assert choice.param_dtype == "bfloat16" and not choice.changed
    assert "natively" in choice.reason and "amx_bf16" in choice.reason


def test_onednn_without_bf16_instructions_is_not_native() -> None:
    """AVX-512 without BF16 emulates bf16 through conversions: not native."""
    assert choose_param_dtype("cpu", SKYLAKE, None).param_dtype == "float32"


def test_bf16_flags_without_onednn_is_not_native() -> None:
    cpu = CpuInfo("odd", "DEFAULT", onednn_bf16=False, bf16_flags=("avx512_bf16",))
    assert choose_param_dtype("cpu", cpu, None).param_dtype == "float32"


@pytest.mark.parametrize("cpu", [EPYC_AVX2, SAPPHIRE_RAPIDS])
@pytest.mark.parametrize("explicit", ["bfloat16", "float32"])
def test_explicit_setting_always_wins(cpu: CpuInfo, explicit: str) -> None:
    choice = choose_param_dtype("cpu", cpu, explicit)
    assert choice.param_dtype == explicit and not choice.changed
    assert "is set" in choice.reason


def test_gpu_keeps_torchtitans_default() -> None:
    choice = choose_param_dtype("cuda", None, None)
    assert choice.param_dtype == "bfloat16" and "cuda" in choice.reason


def test_cpu_decision_needs_the_cpu_info() -> None:
    with pytest.raises(ValueError, match="CpuInfo"):
        choose_param_dtype("cpu", None, None)


def test_bf16_flags_are_read_from_x86_and_arm_cpuinfo() -> None:
    x86 = "model name\t: Intel Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert bf16_flags(x86) == ("amx_bf16", "avx512_bf16")
    assert bf16_flags(arm) == ("bf16",)
    assert bf16_flags("flags\t\t: fpu avx2 fma\n") == ()


def test_probe_reads_a_cpuinfo_file(tmp_path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Test CPU 9000\nflags\t\t: avx2 avx512_bf16\n")
    cpu = compute_dtype.probe_cpu(str(path))
    assert cpu.model == "Test CPU 9000" and cpu.bf16_flags == ("avx512_bf16",)
    record = compute_dtype.describe_cpu(cpu)
    assert record["model"] == "Test CPU 9000" and "native_bf16" in record


@pytest.mark.parametrize(
    ("toml", "args", "expected"),
    [
        ({}, [], False),
        ({"training": {"steps": 3}}, ["--training.steps=3"], False),
        ({"training": {"mixed_precision_param": "float32"}}, [], True),
        ({}, ["--training.mixed_precision_param", "bfloat16"], True),
        ({}, ["--training.mixed-precision-param=float32"], True),
    ],
)
def test_an_explicit_setting_is_recognised(toml: dict, args: list[str], expected: bool) -> None:
    from torchtitan_ft.titan.config_cli import explicit_fields

    assert ("mixed_precision_param" in explicit_fields("training", toml, args)) is expected


def test_the_trainer_is_given_the_choice_unless_set(monkeypatch, tmp_path) -> None:
    """The parsed config keeps what the user wrote; the trainer's config has the choice."""
    from torchtitan_ft.titan import preflight
    from torchtitan_ft.titan.config_cli import parse_job

    def trainer_dtype(*args: str) -> str:
        job = parse_job(["--job.config_file", str(path), *args])
        trainer = preflight.trainer_job_config(
            job.config, explicit_param_dtype=job.explicit_param_dtype, world_size=1
        )
        assert job.config.training.mixed_precision_param == "bfloat16"  # TorchTitan's default
        return trainer.training.mixed_precision_param

    monkeypatch.setattr(preflight, "probe_cpu", lambda: EPYC_AVX2)
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "llama3"\n')
    assert trainer_dtype() == "float32"
    assert trainer_dtype("--training.mixed_precision_param=bfloat16") == "bfloat16"
    path.write_text('[training]\nmixed_precision_param = "bfloat16"\n')
    assert trainer_dtype() == "bfloat16"
    monkeypatch.setattr(preflight, "probe_cpu", lambda: SAPPHIRE_RAPIDS)
    path.write_text("")
    assert trainer_dtype() == "bfloat16"
