"""One training step from a checkpoint folder to the next, the training core's entry point. No Ray import.

:func:`train_and_save` takes the engines of the input checkpoint (or those a long-lived worker holds when they equal
it: stages/train/resume.py), runs one PPO training step over the advantaged table (stages/train/step.py), and writes
the new checkpoint folder, all but the manifest (stages/train/save.py). It runs wherever torch and DeepSpeed run:
inside a training worker (a Ray actor, ``stages.train.group``), under ``torchrun`` / ``deepspeed`` on a GPU machine,
or as a single process (``python -m stages.train.core``).

The rest of the training core, one job per module: the process group (``distributed``), an engine's DeepSpeed config
(``engine_config``), the engine of one model (``engine``), the models and their compilation (``models``), LoRA
(``lora``), the per-micro-batch losses (``objectives``), the batching plan (``batching``), the rows a step reads
(``train_table``) and the checkpoint folder's layout (``checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from schemas.config import load_config
from schemas.train_config import TrainSection, TrainStepConfig
from stages.storage import Location, folder_fingerprint, read_table_schema
from stages.train.checkpoint import read_checkpoint, replay_record
from stages.train.distributed import DistInfo, gather, init_distributed
from stages.train.lora import lora_bases
from stages.train.objectives import Metrics
from stages.train.resume import HeldEngines, load_engines, section_dump
from stages.train.save import save_engines, write_state
from stages.train.step import StepReport, train_step
from stages.train.train_table import read_train_table, rows_of_table


def peak_memory(dist: DistInfo) -> Metrics:
    """Peak resident memory of the busiest rank (and peak accelerator memory on GPU), in MiB."""
    mine = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            torch.cuda.max_memory_allocated() / 2 ** 20 if dist.device.type == "cuda" else 0.0]
    ranks = gather(mine, dist)
    out = {"system/peak_rss_mb": max(r[0] for r in ranks)}
    if dist.device.type == "cuda":
        out["system/peak_gpu_mb"] = max(r[1] for r in ranks)
    return out


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
    save_engines(out, info.path, actor, critic, dist, full_state)
    report.metrics["time/save_s"] = time.perf_counter() - save_start
    report.metrics["time/train_s"] = report.seconds
    report.metrics.update(peak_memory(dist))
    write_state(out, info, report, actor, dist, cfg.actor_train.strategy_args.zero_stage, replay, bases)
    keep = HeldEngines(actor, critic, os.path.realpath(committed_as), section) if committed_as else None
    return report, keep


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
