"""Choices that would otherwise compile code on a run's first use, made from what this host has.

A fresh GPU machine has torch's wheels but often no CUDA toolkit, and a slim image has no C compiler: a first run
must not start with a just-in-time build there. Three options are resolved when the config is validated, as
``dtype: auto`` is (schemas/precision.py), so the frozen config of a run and every stage fingerprint hold what was
chosen and a resumed run keeps it:

- ``strategy_args.optimizer``: ``auto`` is torch's AdamW (fused on CUDA, nothing to build) unless DeepSpeed's own
  kernel is already built on this host (its op installed with DeepSpeed, or left in the torch extensions folder by
  an earlier build): then ``fused_adam``. An explicit ``fused_adam`` whose kernel is not built needs a compiler,
  which the GPU pre-flight checks (stages/gpu_preflight.py). The option's default is ``torch_adamw``, not ``auto``
  (``auto`` is written in a config, as ``dtype: auto`` is): the dump leaves ``torch_adamw`` out, so a dump read
  back (a resumed run's config.json, the sections sent to the workers) must mean it, not a new choice on a host
  where the kernel has been built since.
- ``strategy_args.torch_compile: true`` needs a C compiler and Python's headers (Inductor builds its kernels'
  launchers with them); without them it becomes false with one warning.
- ``rollout.engine.flashinfer_sampler``: vLLM's FlashInfer top-k/top-p sampler builds its kernels at engine start
  unless the prebuilt kernel package (``flashinfer-jit-cache``) is installed; ``auto`` uses it only then, and the
  vLLM backend sets ``VLLM_USE_FLASHINFER_SAMPLER`` from the choice.

Every probe takes what it looks at as a parameter (a ``PATH``, an include folder, a package folder), so the
decisions are tested on any machine. This module imports torch only to ask for torch's CUDA version.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

from schemas import precision

log = logging.getLogger("rollflow.toolchain")

AUTO = "auto"
OPTIMIZERS = ("torch_adamw", "fused_adam")
C_COMPILERS = ("cc", "gcc", "clang")
FLASHINFER_KERNELS = "flashinfer_jit_cache"  # the module of the prebuilt kernel package flashinfer-jit-cache
_chosen: dict[str, str] = {}  # option -> the line saying what auto (or a fallback) chose in this process


# ---- probes: each looks only at what it is given (default: this process's environment) -----------------------------

def c_compiler(path: str | None = None, environ=None) -> str | None:
    """The C compiler a build would use: ``$CC`` if set and found, else the first of cc, gcc, clang on ``path``
    (default ``$PATH``); None when there is none."""
    environ = os.environ if environ is None else environ
    path = environ.get("PATH", os.defpath) if path is None else path
    names = [environ["CC"].split()[0]] if environ.get("CC") else []
    for name in names + list(C_COMPILERS):
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def python_headers(include_dir: str | None = None) -> Path | None:
    """``Python.h`` of this interpreter (in ``include_dir``, default sysconfig's include folder), None if absent."""
    folder = Path(include_dir if include_dir is not None else sysconfig.get_paths()["include"])
    header = folder / "Python.h"
    return header if header.is_file() else None


def compile_missing(path: str | None = None, include_dir: str | None = None, environ=None) -> str | None:
    """What a C extension build lacks here (a sentence naming it and the fix), or None when it can build."""
    missing = []
    if c_compiler(path, environ) is None:
        missing.append("no C compiler (cc, gcc or clang on PATH, or $CC)")
    if python_headers(include_dir) is None:
        folder = include_dir if include_dir is not None else sysconfig.get_paths()["include"]
        missing.append(f"no Python headers (Python.h in {folder})")
    if not missing:
        return None
    return " and ".join(missing) + "; install them (e.g. the build-essential and python3-dev packages)"


def nvcc_release(path: str | None = None) -> str | None:
    """The CUDA release of the ``nvcc`` on ``path`` (default ``$PATH``, then ``$CUDA_HOME/bin``), e.g. "13.0";
    None when there is no nvcc or it does not answer."""
    search = os.environ.get("PATH", os.defpath) if path is None else path
    if path is None and os.environ.get("CUDA_HOME"):
        search = f"{search}{os.pathsep}{Path(os.environ['CUDA_HOME']) / 'bin'}"
    nvcc = shutil.which("nvcc", path=search)
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built for ("13.0"), None for a CPU build or without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def extensions_dir(environ=None) -> Path:
    """Where torch's JIT builds (DeepSpeed's ops among them) are kept: ``$TORCH_EXTENSIONS_DIR``, else the
    rollflow cache's torch_extensions (as stages/train/distributed.py sets it)."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    return Path(environ.get("ROLLFLOW_CACHE", Path(__file__).resolve().parents[1] / ".cache")) / "torch_extensions"


def deepspeed_op_built(op: str, deepspeed_dir: Path | None = None, extensions: Path | None = None) -> bool:
    """Whether DeepSpeed's op ``op`` ("fused_adam", "cpu_adam") needs no build: installed with DeepSpeed
    (``deepspeed/ops/<kind>/<op>_op*.so``, a ``DS_BUILD_*=1`` install) or left by an earlier JIT build in the
    torch extensions folder (``<op>/<op>.so``, under any sub-folder torch names by its version)."""
    deepspeed_dir = _package_dir("deepspeed") if deepspeed_dir is None else deepspeed_dir
    extensions = extensions_dir() if extensions is None else extensions
    if deepspeed_dir is not None and any((deepspeed_dir / "ops").glob(f"*/{op}_op*.so")):
        return True
    return extensions.is_dir() and any(extensions.glob(f"**/{op}/{op}.so"))


def flashinfer_kernels_present(find=importlib.util.find_spec) -> bool:
    """Whether FlashInfer's prebuilt kernels are installed (the ``flashinfer-jit-cache`` package)."""
    return find(FLASHINFER_KERNELS) is not None


# ---- decisions: pure, given the probes' answers ---------------------------------------------------------------------

def choose_optimizer(value: str, device: str, prebuilt: bool) -> tuple[str, str]:
    """``(optimizer, why)`` for ``strategy_args.optimizer`` ``value`` on ``device`` ("cuda"/"cpu"), where
    ``prebuilt`` says DeepSpeed's kernel needs no build. On CPU DeepSpeed always runs torch's AdamW."""
    if value != AUTO:
        return value, "set in the config"
    if device != "cuda":
        return "torch_adamw", "CPU: DeepSpeed runs torch's AdamW"
    if prebuilt:
        return "fused_adam", "DeepSpeed's FusedAdam kernel is already built on this host"
    return "torch_adamw", ("torch's fused AdamW, nothing to build (DeepSpeed's FusedAdam is not built here and "
                           "would be compiled with nvcc on first use)")


def choose_torch_compile(value: bool, missing: str | None) -> tuple[bool, str | None]:
    """``(torch_compile, warning)``: true stays true only where a build can run (``missing`` is None)."""
    if value and missing is not None:
        return False, (f"strategy_args.torch_compile: true needs a C compiler and Python's headers, but this host "
                       f"has {missing}; training runs uncompiled (torch_compile: false in the run's config)")
    return value, None


def choose_flashinfer_sampler(value: bool | str, device: str, kernels: bool) -> tuple[bool, str]:
    """``(use, why)`` for ``engine.flashinfer_sampler`` on ``device`` with FlashInfer's prebuilt ``kernels`` or
    not."""
    if value != AUTO:
        return bool(value), "set in the config"
    if device != "cuda":
        return False, "CPU: vLLM samples with torch"
    if kernels:
        return True, "FlashInfer's prebuilt kernels (flashinfer-jit-cache) are installed"
    return False, ("FlashInfer's prebuilt kernels (flashinfer-jit-cache) are not installed, and its sampler would "
                   "compile them at engine start; vLLM samples with torch (VLLM_USE_FLASHINFER_SAMPLER=0)")


def choose_fused_output_layer(value: bool | str, device: str, zero_stage: int) -> tuple[bool, str]:
    """``(use, why)`` for ``fused_output_layer`` on ``device`` with the worker's ZeRO ``zero_stage`` (0 for a
    forward worker). ``auto`` fuses on CUDA only (on CPU the unfused path stays bit for bit what it was) and never
    under ZeRO-3 (its output-layer weight is gathered only inside the layer's own forward)."""
    if value != AUTO:
        return bool(value), "set in the config"
    if device != "cuda":
        return False, "CPU: the output layer forms the loss tokens' logits, as before"
    if zero_stage == 3:
        return False, "ZeRO-3 partitions the output layer's weight outside its forward"
    return True, "CUDA: log-probs and entropy from the output layer in chunks, no (tokens, vocabulary) logits"


def fused_output_layer_choice(value, zero_stage: int = 0):
    """``fused_output_layer`` resolved on this host (``auto`` becomes true or false, said once per process)."""
    if value != AUTO:
        return value
    chosen, why = choose_fused_output_layer(value, _device(), zero_stage)
    _record("fused_output_layer", f"fused_output_layer auto -> {str(chosen).lower()}: {why}")
    return chosen


def forward_fused_output_layer(value, device: str) -> bool:
    """``logprobs.fused_output_layer`` for a pass on ``device`` (the section's own ``device``, not this host: a
    forward worker runs where its section says): ``auto`` fuses on cuda only (ZeRO does not apply, a forward pass
    holds whole weights), true and false stay."""
    return choose_fused_output_layer(value, device, 0)[0]


# ---- pydantic before-validators: resolve on this host, say so once per process -------------------------------------

def _device() -> str:
    return precision.detect().device  # looked up at the call: tests pretend another host


def _record(option: str, line: str) -> None:
    if option not in _chosen:
        log.info("%s", line)
    _chosen[option] = line


def optimizer_validator(value):
    """Before-validator of ``strategy_args.optimizer``: ``auto`` becomes torch_adamw or fused_adam here."""
    if value != AUTO:
        return value
    chosen, why = choose_optimizer(value, _device(), deepspeed_op_built("fused_adam"))
    _record("optimizer", f"optimizer auto -> {chosen}: {why}")
    return chosen


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def torch_compile_validator(value):
    """Before-validator of ``strategy_args.torch_compile``: true becomes false (one warning) without a compiler."""
    if value is not True:
        return value
    chosen, warning = choose_torch_compile(True, compile_missing())
    if warning:
        _warn_once(warning)
        _record("torch_compile", "torch_compile true -> false: no C compiler or Python headers on this host")
    return chosen


def flashinfer_sampler_validator(value, info):
    """Before-validator of ``engine.flashinfer_sampler``: ``auto`` becomes true only with prebuilt kernels, and only
    for the vllm backend (the hf backend samples with transformers: auto is false there)."""
    if value != AUTO:
        return value
    if info.data.get("backend", "vllm") != "vllm":
        return False
    chosen, why = choose_flashinfer_sampler(value, _device(), flashinfer_kernels_present())
    if _device() == "cuda":
        _record("flashinfer_sampler", f"flashinfer_sampler auto -> {str(chosen).lower()}: {why}")
    return chosen


def forward_fused_output_layer_validator(value, info):
    """Before-validator of ``logprobs.fused_output_layer``: ``auto`` becomes true with ``device: cuda``, false on cpu
    (the section's device, validated before it; said once per process where it is true)."""
    if value != AUTO:
        return value
    device = info.data.get("device", "cpu")
    chosen = forward_fused_output_layer(value, device)
    if chosen:
        _record("logprobs.fused_output_layer", f"logprobs.fused_output_layer auto -> true: device {device}, "
                "log-probs and entropy from the output layer in chunks, no (tokens, vocabulary) logits")
    return chosen


def choices_line() -> str | None:
    """One line saying what this process chose for the options above and why (None if nothing was chosen)."""
    return "; ".join(line for _, line in sorted(_chosen.items())) or None
