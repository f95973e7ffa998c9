"""``dtype: auto`` picks bf16 only where the hardware computes it natively; the frozen config holds the choice."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from schemas import precision
from schemas.config import load_config
from schemas.precision import Hardware, cpu_flags, cpu_hardware

REPO = Path(__file__).resolve().parents[2]
AVX2 = Hardware("cpu", "CPU AVX2, no native bf16", False)
AVX512_BF16 = Hardware("cpu", "CPU AVX-512, native bf16 (avx512_bf16)", True)
H100 = Hardware("cuda", "GPU NVIDIA H100, bf16 supported", True)


@pytest.fixture
def on(monkeypatch):
    """Pretend this host is the given hardware (fresh per-process state each time)."""
    def pretend(hw: Hardware) -> None:
        monkeypatch.setattr(precision, "detect", lambda: hw)
        monkeypatch.setattr(precision, "_chosen", {})
        precision._warn_emulated_bf16.cache_clear()

    yield pretend
    precision._warn_emulated_bf16.cache_clear()


@pytest.mark.parametrize("flags, native, isa", [
    ("fpu sse2 avx avx2 fma", False, "AVX2"),
    ("avx2 avx512f avx512bw avx512vl", False, "AVX-512"),  # AVX-512 without BF16: torch emulates bf16
    ("avx2 avx512f avx512_bf16 avx512_vnni", True, "AVX-512"),
    ("avx2 avx512f amx_bf16 amx_tile", True, "AVX-512"),
])
def test_cpu_flags_decide_native_bf16(flags, native, isa):
    hw = cpu_hardware(cpu_flags(f"processor\t: 0\nflags\t\t: {flags}\n"), {})
    assert hw.native_bf16 is native and hw.device == "cpu" and isa in hw.name


@pytest.mark.parametrize("environ, native", [
    ({}, True), ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False), ({"DNNL_MAX_CPU_ISA": "avx512_core"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True), ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
])
def test_a_onednn_isa_cap_without_bf16_turns_native_bf16_off(environ, native):
    """oneDNN runs torch's CPU matmuls; capped below AVX512_CORE_BF16 it emulates bf16 even on a BF16 CPU."""
    hw = cpu_hardware(cpu_flags("flags\t: avx2 avx512f avx512_bf16\n"), environ)
    assert hw.native_bf16 is native
    if not native:
        assert next(iter(environ)) in hw.name


def test_arm_bf16_feature_counts_as_native():
    assert cpu_hardware(cpu_flags("Features\t: fp asimd bf16 sve\n"), {}).native_bf16


def test_this_host_is_detected_from_its_flags():
    precision.detect.cache_clear()
    hw = precision.detect()
    if hw.device == "cpu":
        assert hw.native_bf16 == (bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
                                  and precision.onednn_isa_cap() is None)


@pytest.mark.parametrize("hw, train, engine", [(AVX2, "fp32", "float32"), (AVX512_BF16, "bf16", "bfloat16"),
                                               (H100, "bf16", "bfloat16")])
def test_shipped_configs_resolve_auto_and_freeze_the_choice(on, hw, train, engine):
    from schemas.train_flow_config import TrainFlowConfig

    on(hw)
    cfg = load_config(TrainFlowConfig, REPO / "configs/train_frozenlake_quickstart.yaml")
    assert (cfg.rollout.engine.dtype, cfg.logprobs.dtype, cfg.train.actor_train.model_args.dtype) == \
        (engine, train, train)
    frozen = cfg.model_dump(mode="json")
    assert '"auto"' not in json.dumps(frozen)  # the run folder's config.json records the concrete dtype
    assert TrainFlowConfig.model_validate(frozen) == cfg  # and resumes with it on any machine
    line = precision.choices_line()
    assert hw.name in line and all(f"{dt} for {what}" in line for dt, what in
                                   ((engine, "generation"), (train, "log-probs"), (train, "training")))


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_cpu_configs_use_auto_and_gpu_configs_say_bf16(path):
    text = path.read_text()
    if "h100" in path.name:
        assert "bf16" in text and "dtype: auto" not in text
    else:
        assert "bf16 " not in text.replace("# bf16", "") and "bfloat16 " not in text.replace("# bfloat16", "")


def test_explicit_bf16_on_an_avx2_cpu_warns_once_with_the_fix(on, caplog):
    from schemas.train_config import ForwardConfig, ModelArgs

    on(AVX2)
    with caplog.at_level(logging.WARNING, logger="rollflow.precision"):
        assert ModelArgs(dtype="bf16").dtype == "bf16"  # allowed
        ModelArgs(dtype="bf16")
        ForwardConfig(dtype="bf16")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "slower than fp32" in warnings[0] and "set the dtype to auto" in warnings[0] and "AVX2" in warnings[0]


@pytest.mark.parametrize("hw, value", [(AVX512_BF16, "bf16"), (H100, "bf16"), (AVX2, "fp32")])
def test_no_warning_where_the_dtype_is_fast(on, caplog, hw, value):
    from schemas.train_config import ModelArgs

    on(hw)
    with caplog.at_level(logging.WARNING, logger="rollflow.precision"):
        ModelArgs(dtype=value)
    assert not caplog.records


def test_auto_engine_dtype_is_the_default_and_fp16_stays_explicit(on):
    from schemas.rollout_config import EngineConfig
    from schemas.train_config import ModelArgs

    on(AVX2)
    assert EngineConfig().dtype == "float32" and EngineConfig(dtype="float16").dtype == "float16"
    assert ModelArgs(dtype="auto").dtype == "fp32"
    assert precision.choices_line() is not None
    on(AVX2)
    assert precision.choices_line() is None  # nothing was auto in a fresh process
