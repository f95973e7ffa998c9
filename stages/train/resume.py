"""The engines a training step starts from: those of a checkpoint folder, or those a long-lived worker holds.

A checkpoint with DeepSpeed's state loads it (optimizer moments, LR schedule, step counters: training resumes
exactly); a weights-only checkpoint is rebuilt by replaying its recorded steps from the checkpoint that holds a state
(stages/train/checkpoint.py), its weights compared with the checkpoint's; a LoRA engine is its base model plus the
checkpoint's adapter, checked against the merged weights the checkpoint holds. The checks refuse what cannot be read
as the engines of this run (another world size or ZeRO-3 against ZeRO 0-2) with the fix. No Ray import.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, replace

import torch

from schemas.errors import ConfigError, RollflowError
from schemas.train_config import TrainSection
from stages.storage import Location, folder_fingerprint, read_table_schema
from stages.train.checkpoint import load_weights, read_checkpoint
from stages.train.distributed import DistInfo
from stages.train.engine import Engine
from stages.train.lora import build_actor_model, build_critic_model, lora_bases
from stages.train.step import train_step
from stages.train.train_table import read_train_table, rows_of_table

log = logging.getLogger("rollflow.train")


@dataclass
class HeldEngines:
    """The engines a long-lived training worker keeps between steps, and what they equal: the checkpoint folder
    ``checkpoint`` (real path) they would load, under the training section ``section`` (its JSON dump)."""

    actor: Engine
    critic: Engine | None
    checkpoint: str
    section: dict


def load_engines(info, cfg: TrainSection, dist: DistInfo, store=None) -> tuple[Engine, Engine | None]:
    """The actor (and critic) engines of checkpoint ``info``, with DeepSpeed's state when it has one; a weights-only
    checkpoint's engines are rebuilt by replaying its steps (:func:`replay_engines`; ``store``: the filesystem of
    the step's table, for the replayed tables on an object store). With LoRA each trained role is its base model
    plus the checkpoint's adapter (:func:`lora_bases`)."""
    if not info.has_state and info.replay:
        return replay_engines(info, cfg, dist, store)
    stage = cfg.actor_train.strategy_args.zero_stage
    if info.actor_state and info.world_size not in (None, dist.world_size) and stage > 0:
        raise ConfigError(f"checkpoint {info.path} was trained by {info.world_size} workers with ZeRO stage {stage}, "
                          f"whose optimizer state is split per rank; resume with num_workers: {info.world_size}")
    check_zero_stage(info, stage)
    bases = lora_bases(info, cfg)
    actor = Engine(build_actor_model(info, cfg.actor_train, bases.get("actor")), cfg.actor_train, dist, "actor")
    if info.actor_state:
        actor.load_state(info.actor_state)
    if actor.lora and info.global_step > 0:
        check_lora_base(actor, info.path, "actor")
    critic = None
    if cfg.needs_critic:
        critic = Engine(build_critic_model(info, cfg.critic_train, bases.get("critic")), cfg.critic_train, dist,
                        "critic")
        if info.critic_state:
            critic.load_state(info.critic_state)
        if critic.lora and info.critic_dir is not None:
            check_lora_base(critic, info.critic_dir, "critic")
    return actor, critic


def check_zero_stage(info, stage: int) -> None:
    """Refuse to load the DeepSpeed state of checkpoint ``info`` into engines of ZeRO ``stage`` when one of the two
    is stage 3 and the other is not: ZeRO-3 saves each rank's slice of the parameters with its optimizer state,
    stages 0-2 whole parameters, and DeepSpeed cannot read one as the other."""
    saved = info.zero_stage
    if info.actor_state and saved is not None and (saved == 3) != (stage == 3):
        raise ConfigError(f"checkpoint {info.path} holds the DeepSpeed state of ZeRO stage {saved}, and "
                          f"strategy_args.zero_stage is {stage}: ZeRO-3's state (parameters split per rank) and that "
                          f"of stages 0-2 cannot be read as each other. Resume with zero_stage: {saved}, or start a "
                          "new run from the checkpoint's weights (a copy of the folder without deepspeed/ and "
                          "train_state.json)")


def replay_engines(info, cfg: TrainSection, dist: DistInfo, store=None) -> tuple[Engine, Engine | None]:
    """The engines of the weights-only checkpoint ``info``: those of the checkpoint its replay record starts from,
    trained again on each recorded step's table under that step's section. The same state and inputs give the same
    engines; the replayed actor's weights are compared with the checkpoint's (a difference is logged: a GPU's
    non-deterministic kernels may give one). Under a section other than the recorded one, the replayed state is
    handed over through a temporary DeepSpeed checkpoint, as a resume under a new section would load it."""
    steps = info.replay["steps"]
    sections = [TrainSection.model_validate(step["section"]) for step in steps]
    if any(s != sections[0] for s in sections):
        raise RollflowError(f"checkpoint {info.path} holds weights only, and the steps that led to it ran under "
                            "different training sections, so it cannot be replayed; train from the checkpoint its "
                            f"replay starts from ({info.replay['from']})")
    origin = read_checkpoint(info.replay["from"])
    actor, critic = load_engines(origin, sections[0], dist, store)
    for k, step in enumerate(steps):
        loc = Location.of(step["samples"], fs=store)
        if folder_fingerprint(loc) != step["fingerprint"]:
            raise RollflowError(f"checkpoint {info.path} holds weights only; replaying it needs the table "
                                f"{loc.path} as step {origin.global_step + k} trained on it, but the table changed "
                                f"since. Train from {info.replay['from']}, which holds its state")
        table = read_train_table(loc, read_table_schema(loc, "advantaged").names)
        train_step(rows_of_table(table, loc.path), actor, critic, sections[k], dist, origin.global_step + k,
                   pad_token_id=0)
    drift = weight_drift(actor, info.path)
    log.info("replayed %d training steps from %s to rebuild the state of %s (largest weight difference %.3g)",
             len(steps), origin.path, info.path, drift)
    if drift > 0:
        log.warning("the replayed weights differ from %s by up to %.3g", info.path, drift)
    if section_dump(sections[0]) == section_dump(cfg):
        return actor, critic
    check_zero_stage(replace(info, actor_state=info.path, zero_stage=sections[0].actor_train.strategy_args.zero_stage),
                     cfg.actor_train.strategy_args.zero_stage)
    with tempfile.TemporaryDirectory(prefix="rollflow-replay-") as tmp:
        actor.save_state(f"{tmp}/actor")
        if critic is not None:
            critic.save_state(f"{tmp}/critic")
        bases = lora_bases(info, cfg)
        handed = Engine(build_actor_model(info, cfg.actor_train, bases.get("actor")), cfg.actor_train, dist, "actor")
        handed.load_state(f"{tmp}/actor")
        handed_critic = None
        if cfg.needs_critic:
            handed_critic = Engine(build_critic_model(info, cfg.critic_train, bases.get("critic")), cfg.critic_train,
                                   dist, "critic")
            if critic is not None:
                handed_critic.load_state(f"{tmp}/critic")
    return handed, handed_critic


def section_dump(cfg: TrainSection) -> dict:
    """The training section's options as JSON (a :class:`TrainStepConfig` without its run-only ones)."""
    return {k: v for k, v in cfg.model_dump(mode="json").items() if k in TrainSection.model_fields}


def check_lora_base(engine: Engine, folder: str, role: str) -> None:
    """The LoRA ``engine`` rebuilt from a checkpoint (base folder + adapter + state) must give the merged weights the
    checkpoint holds in ``folder``: otherwise the base folder changed since the checkpoint was written. Equal up to
    a few units of rounding of the largest weight (the same merge of the same values, in the same dtype)."""
    saved = load_weights(folder)
    drift = _drift(engine, saved)
    largest = max((float(v.float().abs().max()) for v in saved.values() if v.numel()), default=0.0)
    eps = torch.finfo(next(engine.module.parameters()).dtype).eps
    if drift > 4 * eps * max(largest, 1.0):
        raise RollflowError(f"the LoRA {role} of checkpoint {folder}, rebuilt from its base folder and adapter, "
                            f"differs from the checkpoint's merged weights by up to {drift:.3g}: the base model "
                            "folder recorded in its train_state.json (lora) changed since. Restore that folder, or "
                            "start a new run from the checkpoint's weights")


def weight_drift(engine: Engine, folder: str) -> float:
    """The largest absolute difference between ``engine``'s weights and the safetensors weights in ``folder``."""
    return _drift(engine, load_weights(folder))


def _drift(engine: Engine, saved: dict[str, torch.Tensor]) -> float:
    """The largest absolute weight difference; every rank calls it (under ZeRO-3 the weights are gathered to rank 0,
    and the other ranks report 0)."""
    drift = 0.0
    for name, tensor in (engine.state_dict_for_save() or {}).items():
        if name in saved:
            drift = max(drift, float((tensor.detach().float().cpu() - saved[name].float()).abs().max()))
    return drift
