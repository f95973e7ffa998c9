"""The GPU pre-flight: what a GPU run needs of this host, checked before anything starts.

A fresh GPU machine fails a first run in places the resource plan cannot see: ``nvidia-smi`` lists a GPU (so the
Makefile and Ray count it) while torch, built for a newer CUDA than the driver serves, sees none; the GPU predates
bf16; another process already holds its memory; an option needs a compiler the host lacks. Each is one problem
here, with the numbers and the fix, added to the plan's problems (``rollflow plan`` exits 2 and ``start_run``
refuses the run) before any engine or worker starts.

:func:`probe` reads the host (``nvidia-smi``, torch's build, the toolchain probes of schemas/toolchain.py) into a
:class:`HostProbe`; :func:`problems` is pure: a probe and the run's :class:`GpuNeeds` in, sentences out, so every
rule is tested with a faked driver, capability or memory. No Ray import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator

from schemas import toolchain

# the oldest driver that runs a CUDA major version's builds (NVIDIA's minor-version compatibility: a CUDA X.y build
# runs on any driver of the first X.0 release series or newer)
MIN_DRIVER = {13: 580, 12: 525, 11: 450}
BF16_MIN_CAPABILITY = (8, 0)  # Ampere
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``nvidia-smi`` reports it."""

    index: int
    name: str
    capability: tuple[int, int]
    total_gib: float
    free_gib: float


@dataclass(frozen=True)
class HostProbe:
    """What this host offers a GPU run. ``driver``: the NVIDIA driver version ("570.86.15"), None without
    ``nvidia-smi``; ``torch_cuda``: the CUDA version torch was built for, None for a CPU build; ``torch_sees_cuda``:
    ``torch.cuda.is_available()``; ``nvcc``: the CUDA release of the nvcc on PATH; ``compile_missing``: what a C
    build lacks (None: it can build); ``fused_adam_built``: DeepSpeed's FusedAdam needs no build."""

    driver: str | None
    gpus: tuple[Gpu, ...]
    torch_cuda: str | None
    torch_sees_cuda: bool
    nvcc: str | None = None
    compile_missing: str | None = None
    fused_adam_built: bool = False
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF of this process (Ray's workers inherit it)


@dataclass(frozen=True)
class GpuNeeds:
    """What a run asks of the GPUs: ``gpus`` (how many the plan places), ``memory_gib`` (the plan's estimate of the
    largest amount one GPU holds at once), the config fields that ask for bf16, for DeepSpeed's FusedAdam and for
    torch.compile."""

    gpus: float
    memory_gib: float | None = None
    bf16_fields: tuple[str, ...] = ()
    fused_adam_fields: tuple[str, ...] = ()
    compile_fields: tuple[str, ...] = ()
    sleep_fields: tuple[str, ...] = ()


# ---- the rules (pure) ---------------------------------------------------------------------------------------------

def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def driver_problem(host: HostProbe) -> str | None:
    """A driver too old for torch's CUDA build, or torch without CUDA on a host whose driver lists a GPU."""
    cuda, driver = _major(host.torch_cuda), _major(host.driver)
    if host.torch_cuda is None:
        return (f"the run needs a GPU and nvidia-smi lists {len(host.gpus)}, but this torch is a CPU build (no "
                "CUDA); install the GPU set: make setup-gpu (requirements-gpu.lock), or run on CPU: make run "
                "DEVICE=cpu")
    need = MIN_DRIVER.get(cuda or 0)
    if need is not None and driver is not None and driver < need:
        return (f"torch is built for CUDA {host.torch_cuda}, which needs NVIDIA driver {need} or newer, but this "
                f"host's driver is {host.driver} (nvidia-smi lists the GPU, torch sees none); upgrade the driver to "
                f">= {need}, or install a torch built for the CUDA this driver serves (nvidia-smi's 'CUDA Version')")
    if not host.torch_sees_cuda:
        return (f"nvidia-smi lists {len(host.gpus)} GPU(s) (driver {host.driver}) but torch (CUDA "
                f"{host.torch_cuda}) sees none: check CUDA_VISIBLE_DEVICES and that the driver's libraries are "
                "visible in this container (python -c 'import torch; torch.cuda.init()' names the cause)")
    return None


def bf16_problem(host: HostProbe, needs: GpuNeeds) -> str | None:
    old = [g for g in host.gpus if g.capability < BF16_MIN_CAPABILITY]
    if not needs.bf16_fields or not old:
        return None
    g = old[0]
    return (f"{', '.join(needs.bf16_fields)} ask(s) for bf16, but GPU {g.index} ({g.name}) has compute capability "
            f"{g.capability[0]}.{g.capability[1]} and bf16 needs {BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} "
            "(Ampere) or newer; set those dtypes to auto (fp32 here) or fp16 for training")


def memory_problem(host: HostProbe, needs: GpuNeeds) -> str | None:
    """The plan's per-GPU estimate against the GPU with the most free memory (the placed units share the GPUs)."""
    if needs.memory_gib is None or not host.gpus:
        return None
    best = max(host.gpus, key=lambda g: g.free_gib)
    if needs.memory_gib <= best.free_gib:
        return None
    used = best.total_gib - best.free_gib
    others = (f"; {used:.1f} GiB of it is already in use by other processes (nvidia-smi lists them): stop them, "
              "or pick a free GPU with CUDA_VISIBLE_DEVICES") if used > 1.0 else ""
    return (f"the plan estimates ~{needs.memory_gib:.1f} GiB on one GPU, but GPU {best.index} ({best.name}) has "
            f"{best.free_gib:.1f} GiB free of {best.total_gib:.1f} GiB{others}; or lower the need: a smaller "
            "model, LoRA (lora_rank), a higher zero_stage with more workers, or offload_optimizer")


def compiler_problems(host: HostProbe, needs: GpuNeeds) -> list[str]:
    out = []
    cuda = _major(host.torch_cuda)
    if needs.fused_adam_fields and not host.fused_adam_built and (host.nvcc is None or _major(host.nvcc) != cuda):
        found = f"the nvcc on PATH is CUDA {host.nvcc}" if host.nvcc else "no nvcc is on PATH (or in $CUDA_HOME/bin)"
        out.append(f"{', '.join(needs.fused_adam_fields)}: fused_adam is compiled on first use with nvcc of torch's "
                   f"CUDA {host.torch_cuda}, but {found}; set optimizer: auto (torch's fused AdamW, nothing to "
                   f"build), or install the CUDA {cuda} toolkit")
    if needs.compile_fields and host.compile_missing:
        out.append(f"{', '.join(needs.compile_fields)}: torch.compile needs {host.compile_missing}; or set "
                   "torch_compile: false")
    return out


def allocator_problem(host: HostProbe, needs: GpuNeeds) -> str | None:
    """vLLM's sleep mode allocates the weights and KV cache through its own CUDA memory pool, which does not work
    with the caching allocator's expandable segments; an engine would fail or not free its memory when asleep."""
    if not needs.sleep_fields or "expandable_segments:true" not in (host.alloc_conf or "").replace(" ", "").lower():
        return None
    return (f"PYTORCH_CUDA_ALLOC_CONF={host.alloc_conf} is set, but {', '.join(needs.sleep_fields)} put(s) the "
            "engines to sleep, and vLLM's sleep allocator does not work with expandable_segments:True (Ray's "
            "workers inherit the variable); unset it for the run, or set sleep_level: 0 with engines on GPUs of "
            "their own")


def problems(host: HostProbe, needs: GpuNeeds) -> list[str]:
    """Every reason this host cannot run what ``needs`` asks, each a sentence with the fix (empty: it can)."""
    if needs.gpus <= 0 or (not host.gpus and not host.torch_sees_cuda):
        return []  # no GPU here to check (a what-if plan, or a cluster's GPUs elsewhere: the plan counts those)
    driver = driver_problem(host)
    if driver:
        return [driver]  # nothing else can be checked through a torch that sees no GPU
    return ([p for p in (bf16_problem(host, needs), memory_problem(host, needs), allocator_problem(host, needs)) if p]
            + compiler_problems(host, needs))


# ---- what a run needs, from its config and plan -------------------------------------------------------------------

def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}" if path else str(key))
    else:
        yield path, value


def needs_of(config, plan) -> GpuNeeds:
    """The GPU needs of a validated training ``config`` and its resource ``plan`` (stages/plan.py)."""
    fields = list(_walk(config.model_dump()))
    gpu_needs = [n for n in plan.needs if n.gpus > 0]
    memory = None
    if any(n.memory_gib is not None for n in gpu_needs):
        gpus = max(plan.gpus_needed(), 1.0)
        held = sum((n.memory_gib or 0.0) * n.count for n in gpu_needs if n.phase is None)
        phases = {n.phase for n in gpu_needs if n.phase is not None}
        phase = max((sum((n.memory_gib or 0.0) * n.count for n in gpu_needs if n.phase == p) for p in phases),
                    default=0.0)
        memory = (held + phase) / gpus if gpus > 1 else held + phase
    return GpuNeeds(
        gpus=plan.gpus_needed(), memory_gib=memory,
        bf16_fields=tuple(p for p, v in fields if p.endswith("dtype") and v in ("bf16", "bfloat16")),
        fused_adam_fields=tuple(p for p, v in fields if p.endswith("strategy_args.optimizer") and v == "fused_adam"),
        compile_fields=tuple(p for p, v in fields if p.endswith("strategy_args.torch_compile") and v is True),
        sleep_fields=tuple(f"{p} {v}" for p, v in fields if p.endswith("sleep_level") and isinstance(v, int) and v > 0))


# ---- the probe (reads the host) -----------------------------------------------------------------------------------

def parse_nvidia_smi(text: str) -> tuple[str | None, tuple[Gpu, ...]]:
    """``(driver, gpus)`` from ``nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total,
    memory.free --format=csv,noheader,nounits`` (MiB)."""
    driver, gpus = None, []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        index, name, driver, cap, total, free = parts
        major, _, minor = cap.partition(".")
        gpus.append(Gpu(int(index), name, (int(major), int(minor or 0)), float(total) / 1024, float(free) / 1024))
    return driver, tuple(gpus)


def nvidia_smi(path: str | None = None) -> str:
    exe = shutil.which("nvidia-smi", path=path)
    if exe is None:
        return ""
    query = "index,name,driver_version,compute_cap,memory.total,memory.free"
    try:
        return subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def probe(smi_output: str | None = None) -> HostProbe:
    """This host as a :class:`HostProbe` (``smi_output``: nvidia-smi's answer, default: ask it)."""
    import torch

    driver, gpus = parse_nvidia_smi(nvidia_smi() if smi_output is None else smi_output)
    return HostProbe(driver=driver, gpus=gpus, torch_cuda=torch.version.cuda,
                     torch_sees_cuda=torch.cuda.is_available(), nvcc=toolchain.nvcc_release() if gpus else None,
                     compile_missing=toolchain.compile_missing(),
                     fused_adam_built=toolchain.deepspeed_op_built("fused_adam"),
                     alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def check_run(config, plan, host: HostProbe | None = None) -> list[str]:
    """The pre-flight problems of ``config`` on this host (``host``: a probe, default: this host), added to
    ``plan.problems`` so the plan's check refuses the run; nothing is probed when the plan places no GPU."""
    needs = needs_of(config, plan)
    if needs.gpus <= 0:
        return []
    found = problems(probe() if host is None else host, needs)
    plan.problems.extend(f"GPU pre-flight: {p}" for p in found)
    return found
