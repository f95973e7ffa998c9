"""The training core: DeepSpeed engines for the actor (and the critic) and one PPO training step. No Ray import.

It runs wherever torch and DeepSpeed run: inside a Ray Train worker (``stages.train.stage``), under ``torchrun`` /
``deepspeed`` on a GPU machine, or as a single process (``python -m stages.train.core``). One training step (spec §6,
§0.4 step 10): the critic's optimizer steps (gae) then the actor's, each over ``ppo_epochs`` passes of seeded
mini-batches, each mini-batch as token-budget micro-batches whose losses use the mini-batch's global normalisers
(spec §6.2), so their accumulated gradient is the gradient of the mini-batch loss.

Process-wide settings (threads, DeepSpeed's accelerator and comm op) are set in
:func:`stages.train.distributed.init_distributed`, once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from schemas.config import load_config
from schemas.errors import ConfigError, RollflowError
from schemas.train_config import TrainSection, TrainStepConfig
from stages.storage import Location, folder_fingerprint, read_table_schema
from stages.train.lora import build_actor_model, build_critic_model, lora_bases
from stages.train.checkpoint import (ACTOR_ADAPTER, ACTOR_STATE, CRITIC_ADAPTER, CRITIC_DIR, CRITIC_STATE,
                                     copy_tokenizer, read_checkpoint, replay_record, write_train_state)
from stages.train.distributed import DistInfo, gather, init_distributed
from stages.train.engine import Engine
from stages.train.objectives import Metrics
from stages.train.step import StepReport, train_step
from stages.train.train_table import read_train_table, rows_of_table

log = logging.getLogger("rollflow.train")
# ---- load, train, save ------------------------------------------------------------------------------------------

def peak_memory(dist: DistInfo) -> Metrics:
    """Peak resident memory of the busiest rank (and peak accelerator memory on GPU), in MiB."""
    mine = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            torch.cuda.max_memory_allocated() / 2 ** 20 if dist.device.type == "cuda" else 0.0]
    ranks = gather(mine, dist)
    out = {"system/peak_rss_mb": max(r[0] for r in ranks)}
    if dist.device.type == "cuda":
        out["system/peak_gpu_mb"] = max(r[1] for r in ranks)
    return out


@dataclass
class HeldEngines:
    """The engines a long-lived training worker keeps between steps, and what they equal: the checkpoint folder
    ``checkpoint`` (real path) they would load, under the training section ``section`` (its JSON dump)."""

    actor: Engine
    critic: Engine | None
    checkpoint: str
    section: dict


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


def load_weights(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors files in ``folder`` (name -> tensor)."""
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        saved.update(load_file(str(path)))
    return saved


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


def run_training(table, where: str, checkpoint: str, cfg: TrainSection, output: str, dist: DistInfo,
                 progress=None) -> StepReport:
    """Load the actor (and critic) from ``checkpoint`` (resuming DeepSpeed's state when it has one), run one
    training step over ``table``, and write the new checkpoint folder ``output`` (all but the manifest).
    ``progress``: see :func:`train_step`."""
    report, _ = train_and_save(table, where, checkpoint, cfg, output, dist, progress=progress)
    return report


def train_and_save(table, where: str, checkpoint: str, cfg: TrainSection, output: str, dist: DistInfo, *,
                   progress=None, held: HeldEngines | None = None, committed_as: str | None = None,
                   full_state: bool = True, store=None) -> tuple[StepReport, HeldEngines | None]:
    """:func:`run_training` for a worker that lives across steps: the engines of ``held`` are used when they equal
    ``checkpoint`` under this section (the step that wrote ``checkpoint`` ran here), else they are loaded from it.
    Returns the report and the engines to keep, which equal ``committed_as`` (the folder ``output`` becomes once
    committed; None: keep nothing). In-memory state and the saved DeepSpeed state are the same state, so a step on
    kept engines equals a step on engines loaded from the checkpoint (tests/trainflow: the resumed run).
    ``full_state``: write DeepSpeed's state; else the weights and a replay record only (stages/train/checkpoint.py).
    ``where``: the table's path or URI; ``store``: its filesystem, when it came with the request (an object store's,
    holding the driver's credentials), for the tables of a replay and the record's fingerprint.
    """
    info = read_checkpoint(checkpoint)
    bases = lora_bases(info, cfg)  # also refuses LoRA options other than the checkpoint's
    section = cfg.model_dump(mode="json")
    setup_start = time.perf_counter()
    kept = held is not None and held.checkpoint == os.path.realpath(info.path) and held.section == section
    actor, critic = (held.actor, held.critic) if kept else load_engines(info, cfg, dist, store)
    if kept:
        held.checkpoint = ""  # the engines move on from that checkpoint: this record of them no longer holds
    setup_s = time.perf_counter() - setup_start
    replay = None if full_state else replay_record(info, where, folder_fingerprint(Location.of(where, fs=store)),
                                                   section_dump(cfg))
    rows = rows_of_table(table, where)
    report = train_step(rows, actor, critic, cfg, dist, info.global_step, pad_token_id=0, progress=progress)
    report.metrics["time/engine_setup_s"] = setup_s
    report.metrics["train/engines_kept"] = float(kept)
    report.metrics["train/replayed_steps"] = 0.0 if kept or info.has_state else float(len(info.replay["steps"]))
    report.metrics["train/full_state_saved"] = float(full_state)

    save_start = time.perf_counter()
    out = Path(output)
    actor.save_pretrained(out, out / ACTOR_ADAPTER)  # every rank: a collective under ZeRO-3, rank 0 writes
    if critic is not None:
        critic.save_pretrained(out / CRITIC_DIR, out / CRITIC_ADAPTER)
    if dist.rank == 0:
        copy_tokenizer(info.path, str(out))
    torch.distributed.barrier()
    if full_state:
        actor.save_state(str(out / ACTOR_STATE))
        if critic is not None:
            critic.save_state(str(out / CRITIC_STATE))
        torch.distributed.barrier()
    report.metrics["time/save_s"] = time.perf_counter() - save_start
    report.metrics["time/train_s"] = report.seconds
    report.metrics.update(peak_memory(dist))
    _write_state(out, info, report, actor, dist, cfg.actor_train.strategy_args.zero_stage, replay, bases)
    keep = HeldEngines(actor, critic, os.path.realpath(committed_as), section) if committed_as else None
    return report, keep


def _write_state(out: Path, info, report: StepReport, actor: Engine, dist: DistInfo, zero_stage: int,
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


# ---- a single process without Ray ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    """``python -m stages.train.core --samples DIR --checkpoint DIR --config FILE --output DIR``: the training step
    without Ray (one process, or every rank under ``torchrun`` / ``deepspeed``). Writes the checkpoint folder
    (no manifest: that is the stage's job) and prints the metrics as JSON on rank 0."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    for name in ("samples", "checkpoint", "config", "output"):
        parser.add_argument(f"--{name}", required=name != "config")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = load_config(TrainStepConfig, args.config)
    dist = init_distributed(args.threads)
    loc = Location.of(args.samples)  # the Parquet parts only (a stage output folder also holds its manifest)
    table = read_train_table(loc, read_table_schema(loc, "advantaged").names)
    report = run_training(table, args.samples, args.checkpoint, cfg, args.output, dist)
    if dist.rank == 0:
        print(json.dumps(report.metrics, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
