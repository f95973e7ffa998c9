"""The DeepSpeed config of one training engine: precision, ZeRO stage, gradient clipping, the AdamW optimizer
DeepSpeed builds (``strategy_args.optimizer``) and the learning-rate schedule. Pure config: no torch, no DeepSpeed
import."""

from __future__ import annotations

import math
from typing import Callable

from schemas.train_config import StrategyArgs, WorkerTrainConfig


def lr_lambda(kind: str, warmup: int, total: int | None) -> Callable[[int], float]:
    """Hugging Face's schedules as a multiplier of the peak LR at optimizer step ``s`` (warmup linear from 0)."""
    def factor(s: int) -> float:
        if s < warmup:
            return s / max(1, warmup)
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (s - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
    return factor


def deepspeed_config(worker: WorkerTrainConfig, on_gpu: bool) -> dict:
    """The DeepSpeed config of one engine. Micro-batches are formed by the plan and the accumulation boundary is set
    per mini-batch, so DeepSpeed's own batch size is nominal (1 x 1)."""
    t, precision = worker.training_args, worker.model_args.dtype
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.max_grad_norm or 0.0,
        "zero_optimization": {"stage": worker.strategy_args.zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": t.learning_rate, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_epsilon,
            "weight_decay": t.weight_decay, **optimizer_params(worker.strategy_args, on_gpu)}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if on_gpu and worker.strategy_args.optimizer == "torch_adamw" and worker.strategy_args.offloads():
        config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the offloaded CPU state: no build
    return _merge(config, worker.strategy_args.deepspeed_config)


def optimizer_params(strategy: StrategyArgs, on_gpu: bool) -> dict:
    """DeepSpeed's optimizer switches for ``strategy.optimizer`` (schemas/toolchain.py). torch_adamw (and every CPU
    engine): torch.optim.AdamW (``torch_adam``, decoupled decay by ``adam_w_mode``), fused on CUDA, nothing to build;
    with offload_optimizer DeepSpeed must be told a torch optimizer on CPU is meant. fused_adam: DeepSpeed's
    FusedAdam (its CPU Adam with offload_optimizer), built on first use unless prebuilt."""
    if on_gpu and strategy.optimizer == "fused_adam":
        return {"torch_adam": False, "adam_w_mode": True}
    params = {"torch_adam": True, "adam_w_mode": True}
    if on_gpu and "offload_optimizer" not in strategy.offloads():
        params["fused"] = True
    return params


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
