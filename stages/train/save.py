"""Writing the checkpoint folder of a training step: the trained models as Hugging Face folders (with LoRA also the
adapters), the tokenizer, DeepSpeed's resumable state (a full-state step) and the step's train_state.json. Every rank
calls :func:`save_engines` (under ZeRO-3 reading whole weights is a collective); rank 0 writes the files. The folder
layout is stages/train/checkpoint.py's. No Ray import."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.train.checkpoint import (ACTOR_ADAPTER, ACTOR_STATE, CRITIC_ADAPTER, CRITIC_DIR, CRITIC_STATE,
                                     copy_tokenizer, write_train_state)
from stages.train.distributed import DistInfo
from stages.train.engine import Engine
from stages.train.step import StepReport


def save_engines(out: Path, source: str, actor: Engine, critic: Engine | None, dist: DistInfo,
                 full_state: bool) -> None:
    """The weights of ``actor`` (and ``critic``) into the checkpoint folder ``out``, with the tokenizer of the
    checkpoint folder ``source``; with ``full_state`` also DeepSpeed's state of each engine. Every rank calls it."""
    actor.save_pretrained(out, out / ACTOR_ADAPTER)  # every rank: a collective under ZeRO-3, rank 0 writes
    if critic is not None:
        critic.save_pretrained(out / CRITIC_DIR, out / CRITIC_ADAPTER)
    if dist.rank == 0:
        copy_tokenizer(source, str(out))
    torch.distributed.barrier()
    if full_state:
        actor.save_state(str(out / ACTOR_STATE))
        if critic is not None:
            critic.save_state(str(out / CRITIC_STATE))
        torch.distributed.barrier()


def write_state(out: Path, info, report: StepReport, actor: Engine, dist: DistInfo, zero_stage: int,
                replay: dict | None, bases: dict[str, dict]) -> None:
    """Rank 0 writes the step's train state (counters, metrics, the replay record of a weights-only checkpoint,
    the LoRA bases) beside the weights."""
    if dist.rank == 0:
        write_train_state(str(out), ({"lora": bases} if bases else {}) | {
            "global_step": info.global_step + 1, "optimizer_steps": actor.optimizer_steps,
            "world_size": dist.world_size, "zero_stage": zero_stage, "input_checkpoint": info.path,
            "metrics": report.metrics, "per_step": report.per_step,
            "tokens": report.tokens, "padded_tokens": report.padded_tokens, "train_seconds": report.seconds,
            "train_cpu_seconds": report.cpu_seconds, "replay": replay})
