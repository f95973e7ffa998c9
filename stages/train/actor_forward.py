"""Forward passes on the training workers (issue 44: one kept worker group per model role). No Ray import.

The actor group that trains also computes the log-prob and values stages' columns: old log-probs (+ entropy) on the
DeepSpeed engine it holds when that engine is the requested checkpoint's, the reference with the LoRA adapter switched
off when the run trains LoRA (the same module), and the critic's values on the held critic. A job the held engines
cannot serve (another checkpoint, another dtype, ZeRO-3's partitioned weights, a compiled module, a reference model
of its own) runs on a model loaded beside them and kept for the next request (:class:`stages.train.forward.ForwardModels`),
so a run with a separate reference holds that model in the actor's processes instead of a group of its own.

Both kinds of model run the same pass, :func:`stages.train.forward.forward_batch` on the module itself (the held
engine's module, not :meth:`stages.train.engine.Engine.forward`), so the log-prob section's options decide it
whichever serves the job: ``logprobs.fused_output_layer`` (not ``actor_train``'s, which is the training step's), and
the columns are the same bit for bit on either. ZeRO-3's partitioned weights never run a pass (:func:`why_not_held`:
a model loaded beside holds them whole), so the fused output layer needs no ZeRO rule here.

Each data-parallel rank takes a contiguous slice of the rows (rank r of W: rows ``n r / W`` to ``n (r + 1) / W``),
runs it in batches of ``rows_per_batch`` rows with the token budget of the log-prob stage
(:func:`stages.train.forward.forward_batch`, the same code as an in-process pass), and writes its rows, in order, as
``part-<rank>.parquet`` into the request's folder; the stage reads the parts in rank order, which is row order.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from schemas.train_config import TrainSection
from stages.parquet_parts import parquet_write_options
from stages.partials import write_partials
from stages.storage import Location
from stages.train.checkpoint import read_checkpoint
from stages.train.distributed import DistInfo
from stages.train.engine import DTYPES, Engine
from stages.train.forward import ForwardModels, forward_batch, require_device
from stages.train.resume import HeldEngines, load_engines

log = logging.getLogger("rollflow.train")


def rank_rows(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous slice ``[start, stop)`` of ``num_rows`` rows that ``rank`` of ``world_size`` computes."""
    return num_rows * rank // world_size, num_rows * (rank + 1) // world_size


def part_name(rank: int) -> str:
    return f"part-{rank:05d}.parquet"


def why_not_held(engine: Engine | None, job, dtype: str) -> str | None:
    """Why the held ``engine`` (None: none holds the job's checkpoint) cannot compute ``job`` (a
    :class:`stages.train.stage.ForwardJob`) exactly as a model loaded for it would; None when it can."""
    if engine is None:
        return "the training workers hold no engine of that checkpoint"
    if engine.partitioned:
        return "ZeRO-3 splits the held weights over the ranks"
    if engine.worker.strategy_args.torch_compile:
        return "the held module is compiled for training"
    held_dtype = next(engine.module.parameters()).dtype
    if held_dtype != DTYPES[dtype]:
        return f"the held engine is {held_dtype}, the pass asks {dtype}"
    if engine.lora != (job.adapter is not None):
        return "the held engine and the pass differ in LoRA (adapter vs merged weights)"
    if job.kind == "values" and job.actor_dir is not None and job.seed != engine.worker.training_args.seed:
        return (f"the new value head is seeded {job.seed} for the pass and {engine.worker.training_args.seed} for "
                "training")
    return None


def held_engine(held: HeldEngines | None, job) -> Engine | None:
    """The held engine of ``job``'s checkpoint and role (the critic for values, else the actor), or None."""
    if held is None or job.checkpoint is None or held.checkpoint != os.path.realpath(job.checkpoint):
        return None
    return held.critic if job.kind == "values" else held.actor


def engines_for(jobs: list, held: HeldEngines | None, section: dict, dist: DistInfo, store=None) -> HeldEngines | None:
    """The engines to hold for ``jobs``: ``held`` when it is the checkpoint of the first job that names one, else
    that checkpoint's engines built under the training ``section`` (the next training step starts from them; every
    rank decides the same, so the collective set-up is entered by all). ``store``: the filesystem of the run's
    tables (a weights-only checkpoint is rebuilt by replaying its steps' tables; on an object store the worker has
    only the driver's filesystem object, not its endpoint variables)."""
    wanted = next((j.checkpoint for j in jobs if j.checkpoint is not None), None)
    cfg = TrainSection.model_validate(section)
    dump = cfg.model_dump(mode="json")
    if wanted is None or (held is not None and held.checkpoint == os.path.realpath(wanted) and held.section == dump):
        return held
    held = None  # free the engines of the previous checkpoint before building the next
    info = read_checkpoint(wanted)
    actor, critic = load_engines(info, cfg, dist, store)
    log.info("training workers: engines of %s built for its forward passes (kept for its training step)", info.path)
    return HeldEngines(actor, critic, os.path.realpath(info.path), dump)


@contextlib.contextmanager
def evaluating(modules: list[torch.nn.Module]):
    """The held engines' modules in eval mode (no dropout, no gradient checkpointing) for a pass; back to train
    mode after (training sets it once, when the engine is made)."""
    training = [m for m in modules if m.training]
    for m in training:
        m.eval()
    try:
        yield
    finally:
        for m in training:
            m.train()


def read_rows(samples: Location) -> pa.Table:
    """Every Parquet part of the stage folder ``samples``, in file order (the order the stage's output keeps)."""
    parts = [pq.read_table(p, filesystem=samples.fs) for p in samples.parquet_files()]
    return pa.concat_tables(parts, promote_options="default") if parts else pa.table({})


def forward_on_rank(request: dict[str, Any], dist: DistInfo, held: HeldEngines | None,
                    models: ForwardModels) -> HeldEngines | None:
    """Run a forward request on this rank (``request``: samples Location, jobs, dtype, max_tokens, rows_per_batch,
    options (the pass's :class:`schemas.train_config.PassOptions`), device (the section's: cuda is refused where
    this rank sees no CUDA device), output Location (the stage's temporary folder: the
    batches' counters), parts Location, spec, where, section: the training section to build missing engines under, or
    None) and write this rank's part. Returns the engines to hold."""
    jobs, dtype = request["jobs"], request["dtype"]
    require_device(request.get("device", "cpu"))
    if request.get("section") is not None:
        held = engines_for(jobs, held, request["section"], dist, store=request["samples"].fs)
    device = str(dist.device)
    chosen, engines = [], []
    for job in jobs:
        engine = held_engine(held, job)
        why_not = why_not_held(engine, job, dtype)
        if why_not is None:
            chosen.append(engine.module)
            engines.append(engine.module)
            continue
        if dist.rank == 0:
            log.info("forward pass %s of %s: a model loaded beside the engines (%s)", job.column, job.path, why_not)
        chosen.append(models.get(job.column, job.path, job.kind, dtype, fingerprint=job.fingerprint,
                                 actor_dir=job.actor_dir, seed=job.seed, device=device, adapter=job.adapter,
                                 base_fingerprint=job.base_fingerprint))
    table = read_rows(request["samples"])
    start, stop = rank_rows(table.num_rows, dist.rank, dist.world_size)
    step = max(1, int(request["rows_per_batch"]))
    with evaluating(engines):
        batches = [forward_batch(chosen, jobs, table.slice(i, min(step, stop - i)), request["max_tokens"],
                                 request["output"], request["spec"], request["where"], device, request["options"])
                   for i in range(start, stop, step)]
    write_partials(request["output"], f"actor-rank-{dist.rank}",
                   {"jobs_on_held_engines": float(len(engines)), "jobs_on_loaded_models": float(len(jobs) - len(engines))})
    if batches:
        part = pa.concat_tables(batches)
        parts: Location = request["parts"]
        parts.fs.create_dir(parts.path, recursive=True)
        with parts.fs.open_output_stream(f"{parts.path}/{part_name(dist.rank)}") as f:
            pq.write_table(part, f, **parquet_write_options(part.schema))
    return held
