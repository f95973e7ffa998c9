"""The process group of a training process: joining the one the training workers (stages.train.group) or torchrun
set up (or a world of one), this rank's place in it, and gathering a value from every rank. No Ray import.

Process-wide settings (threads, DeepSpeed's accelerator and comm op) are set in :func:`init_distributed`, once.
DeepSpeed is imported through :func:`import_deepspeed` only (without the MLflow its autotuner would load).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from stages.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(threads: int | None = None) -> DistInfo:
    """Join the process group that the training group / torchrun set up, or make a world of one; return this rank.

    On CPU: gloo, DeepSpeed's CPU accelerator, and no shared-memory comm op (it JIT-compiles C++ for 20-170 s and
    only serves inference all-reduce, which training never calls). ``threads``: torch intra-op threads.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get("ROLLFLOW_CACHE", REPO / ".cache"))
                                                     / "torch_extensions"))
    if threads:
        torch.set_num_threads(max(1, int(threads)))
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    if not torch.distributed.is_initialized():
        defaults = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    deepspeed = import_deepspeed()
    if not on_gpu:
        no_shm_comm_op(deepspeed.ops)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


# what DeepSpeed's import must not load, because only the parts of it that we never run use it
NOT_FOR_DEEPSPEED = ("mlflow",)


def import_deepspeed() -> ModuleType:
    """``deepspeed`` (with ``deepspeed.ops``), imported without MLflow: every use of DeepSpeed goes through here.

    ``import deepspeed`` reaches ``deepspeed.autotuning.autotuner`` (through ``runtime.config``), which tries
    ``import mlflow`` at module level to log the experiments of DeepSpeed's autotuner (the ``deepspeed --autotuning``
    launcher, which rollflow never runs; ``has_mlflow`` is read nowhere else in DeepSpeed 0.19). With mlflow-skinny
    installed for our MLflow tracker that costs 1.1-1.6 CPU-s in every training process. For the length of the import
    ``sys.modules["mlflow"]`` is None, so that ``import mlflow`` raises ImportError (the import system's documented
    way to block a module), which the autotuner catches; afterwards ``sys.modules`` holds exactly what it held, so
    a later ``import mlflow`` in this process (stages/trackers.py's MLflow tracker) loads it in full. Where mlflow
    is already loaded, or deepspeed is, nothing is blocked. Not for threads that import mlflow meanwhile.

    Its Muon optimizer's module is imported here too, with its kernels compiled on first call (:func:`import_muon`),
    because ZeRO's optimizer check imports it whatever the optimizer."""
    blocked = [] if "deepspeed" in sys.modules else [name for name in NOT_FOR_DEEPSPEED if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import deepspeed
        import deepspeed.ops
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    import_muon()
    return deepspeed


MUON = "deepspeed.runtime.zero.muon.muon_optimizer"  # and the module it wraps, .original_muon


def import_muon() -> None:
    """DeepSpeed's Muon optimizer module, its ``@compiler.compile()`` kernels made lazy: compiled on first call.

    ZeRO's optimizer check (``is_zero_supported_optimizer``, every ZeRO stage) and the ZeRO-1/2 gradient reduction
    import this module whatever the optimizer (ours is AdamW: engine_config.py). Its three kernels are decorated
    ``torch.compile(fn)`` at module level, and building that wrapper imports ``torch._inductor`` and Dynamo's repro
    tools: 1.1 CPU-s per training process, to compile nothing. For the length of this import ``compiler.compile``
    (``deepspeed.runtime.compiler``, read by the decorators only) gives :func:`compile_on_first_call`, so a Muon run
    compiles the same functions with the same default options at its first call; then it is restored. A DeepSpeed
    without that module or that decorator (another version than the lock's) is left as it is: only the saving goes."""
    if MUON in sys.modules or importlib.util.find_spec(MUON) is None:
        return
    compiler = importlib.import_module("deepspeed.runtime.compiler")
    eager = getattr(compiler, "compile", None)
    if eager is None:
        return
    compiler.compile = lambda: compile_on_first_call
    try:
        importlib.import_module(MUON)
    finally:
        compiler.compile = eager


def compile_on_first_call(fn: Callable) -> Callable:
    """``torch.compile(fn)``, made when the returned function is first called rather than now."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def first_call_compiles(*args, **kwargs):
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0](*args, **kwargs)

    return first_call_compiles


def no_shm_comm_op(ops: Any) -> None:
    """Tell DeepSpeed's CPU comm backend (``deepspeed.ops``, passed in) not to build its shared-memory op, WITHOUT
    probing every op. ``ops.__compatible_ops__`` is computed on first read by probing all of DeepSpeed's op builders,
    and the async-I/O one test-compiles and links a C file against libaio with gcc (cc1, as, ld): about 0.05-0.3 s
    wall and 0.05 CPU-s per training process on CPU, for ops nobody builds. Its one reader,
    ``deepspeed.comm.torch.build_shm_op``, asks ``.get(name, False)``, so a dict holding only this entry answers it
    the same; a dict already probed keeps its other entries."""
    vars(ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder can read it. Its JIT build of FusedAdam parses every entry
    as numbers, so an architecture-specific entry such as ``9.0a`` (set by Hopper images) stops the build with
    "invalid literal for int()"; the optimizer kernels need only the base architecture: ``9.0a`` -> ``9.0``."""
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


def gather(obj: Any, dist: DistInfo) -> list[Any]:
    """``obj`` of every rank, in rank order (all ranks call it; a world of one returns ``[obj]``)."""
    if dist.world_size == 1:
        return [obj]
    out: list[Any] = [None] * dist.world_size
    torch.distributed.all_gather_object(out, obj)
    return out
