"""``dtype: auto``: the precision of generation, log-prob passes and training chosen by the hardware.

bf16 halves memory traffic and is the right choice on GPUs that support it and on CPUs with native bf16
instructions (AVX-512 BF16, AMX). On a CPU without them (AVX2 only) torch emulates bf16 and a matmul forward +
backward runs about 40x slower than fp32 (``benchmarks/bf16_cpu.py``, BENCHMARKS.md), so there ``auto`` picks fp32.

Every dtype field of a config accepts ``auto``; it is resolved when the config is validated, so the frozen config
of a run and every stage fingerprint hold the concrete dtype (a run resumes with the dtype it started with, on any
machine). The choice is logged once per process and :func:`choices_line` gives the line a command prints. An
explicit bf16 on a CPU host without native bf16 is allowed and warns once, with the measured slowdown and the fix.

Two vocabularies exist, as in ROLL: training/forward fields say ``fp32``/``bf16``, engine fields (vLLM, HF
generate) say ``float32``/``bfloat16``. This module imports torch only when it has to look for a GPU.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationInfo

log = logging.getLogger("rollflow.precision")

AUTO = "auto"
# fp32 / bf16 speed ratio of a 512x576 @ 576x1536 matmul forward+backward, one thread, on the AVX2-only CPU of the
# project's machines: 23x with the machine loaded, about 40x quiet (benchmarks/bf16_cpu.py; BENCHMARKS.md "dtype")
BF16_EMULATED_SLOWDOWN = "20-40x"
_NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # x86-64 /proc/cpuinfo flags
_NATIVE_BF16_ARM_FEATURES = frozenset({"bf16"})                   # aarch64 /proc/cpuinfo Features
# oneDNN, which runs torch's CPU matmuls, can be capped below the CPU's ISA (ONEDNN_MAX_CPU_ISA; DNNL_MAX_CPU_ISA is its
# older name). Under a cap without bf16 dot products the CPU's avx512_bf16 goes unused and bf16 is emulated (measured
# 15x slower than fp32 on the AVX-512 BF16 machine with ONEDNN_MAX_CPU_ISA=AVX2; BENCHMARKS.md)
_ONEDNN_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                       "AVX512_CORE_VNNI"})
_BF16 = {"short": "bf16", "long": "bfloat16"}
_FP32 = {"short": "fp32", "long": "float32"}


@dataclass(frozen=True)
class Hardware:
    """Where this process computes: ``device`` "cuda" or "cpu", a readable ``name``, and whether bf16 is native."""

    device: str
    name: str
    native_bf16: bool


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU feature flags of this machine (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def onednn_isa_cap(environ=None) -> tuple[str, str] | None:
    """``(variable, value)`` of a oneDNN ISA cap that leaves out bf16 dot products, or None."""
    environ = os.environ if environ is None else environ
    for name in _ONEDNN_ISA_VARS:
        value = environ.get(name, "").strip().upper()
        if value in _ONEDNN_ISAS_WITHOUT_BF16:
            return name, value
    return None


def cpu_hardware(flags: frozenset[str], environ=None) -> Hardware:
    """The CPU as :class:`Hardware` from its feature flags (and a oneDNN ISA cap in ``environ``, default the
    process environment)."""
    native = bool(flags & (_NATIVE_BF16_CPU_FLAGS | _NATIVE_BF16_ARM_FEATURES))
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else platform.machine() or "CPU"
    detail = "native bf16 (" + ", ".join(sorted(flags & (_NATIVE_BF16_CPU_FLAGS | _NATIVE_BF16_ARM_FEATURES))) + ")" \
        if native else "no native bf16"
    cap = onednn_isa_cap(environ)
    if native and cap is not None:
        native, detail = False, f"native bf16 unused: {cap[0]}={cap[1]}"
    return Hardware("cpu", f"CPU {isa}, {detail}", native)


# Device nodes a GPU driver makes for the processes that may use a GPU: NVIDIA's (also inside a container given a
# GPU), AMD's ROCm (torch.cuda on ROCm builds) and WSL's. Without any, torch.cuda.is_available() is False.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/proc/driver/nvidia/gpus/*", "/dev/kfd", "/dev/dxg")


def gpu_device_nodes() -> list[str]:
    """The GPU driver device nodes of this host (empty: torch could see no GPU here)."""
    return [path for pattern in _GPU_DEVICE_NODES for path in glob.glob(pattern)]


@functools.lru_cache(maxsize=1)
def detect() -> Hardware:
    """This host's compute hardware: the first CUDA GPU if torch sees one, else the CPU. torch is imported only where
    a GPU driver's device node exists (or torch is loaded already): importing it takes 1-3 s on the 2-core machine,
    and every config with a dtype field is validated through here, so a config error would wait for it."""
    if "torch" not in sys.modules and not gpu_device_nodes():
        return cpu_hardware(cpu_flags())
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            native = bool(torch.cuda.is_bf16_supported())
            return Hardware("cuda", f"GPU {name}, {'bf16 supported' if native else 'no bf16'}", native)
    except ImportError:  # a config-only install: the CPU decides
        pass
    return cpu_hardware(cpu_flags())


_chosen: dict[str, str] = {}  # what (generation, log-probs, training) -> dtype resolved from auto in this process
_WHAT = {"EngineConfig": "generation", "ForwardConfig": "log-probs", "ModelArgs": "training",
         "JudgeEngineConfig": "the LLM judge"}


def resolve(value: str, vocabulary: str, info: ValidationInfo | None = None) -> str:
    """A dtype field's value with ``auto`` replaced by the hardware's choice (``vocabulary``: "short" for
    fp32/bf16, "long" for float32/bfloat16). Warns once per process for an explicit bf16 on a CPU without native
    bf16. Used as a pydantic before-validator of every dtype field."""
    if not isinstance(value, str):
        return value
    title = (info.config or {}).get("title", "") if info is not None else ""
    field = _WHAT.get(title, title or "dtype")
    hw = detect()
    if value == AUTO:
        chosen = (_BF16 if hw.native_bf16 else _FP32)[vocabulary]
        if field not in _chosen:
            log.info("dtype auto -> %s for %s: %s", chosen, field, hw.name)
        _chosen[field] = chosen
        return chosen
    if value in _BF16.values() and hw.device == "cpu" and not hw.native_bf16:
        _warn_emulated_bf16(value, hw.name)
    return value


@functools.lru_cache(maxsize=None)
def _warn_emulated_bf16(value: str, hardware: str) -> None:
    log.warning("dtype %s on this %s: bf16 is emulated here and runs %s slower than fp32 "
                "(benchmarks/bf16_cpu.py); set the dtype to auto (fp32 on this CPU) unless you need bf16 numerics",
                value, hardware, BF16_EMULATED_SLOWDOWN)


def choices_line() -> str | None:
    """One line saying which dtypes ``auto`` chose in this process and why (None if no field was auto)."""
    if not _chosen:
        return None
    parts = ", ".join(f"{dtype} for {what}" for what, dtype in sorted(_chosen.items()))
    return f"dtype auto -> {parts} ({detect().name})"


def short_validator(value, info: ValidationInfo):
    """Before-validator of a training / forward dtype field (fp32, bf16, fp16, auto)."""
    return resolve(value, "short", info)


def long_validator(value, info: ValidationInfo):
    """Before-validator of a generation engine dtype field (float32, bfloat16, float16, auto)."""
    return resolve(value, "long", info)
