"""The Ray side of training: the training step on the training workers (:class:`stages.train.group.TrainerGroup`),
and the log-prob and values stages on an actor group (the run's training workers, a run's kept group for these
passes, or one started for a stage run on its own). The work itself is in ``stages.train.core`` and
``stages.train.forward`` (no Ray).

* :func:`run_train_step` — advantaged table + checkpoint → a new checkpoint folder, committed by the runner's
  ``commit_folder``: fingerprint (stage, version, training section, the table's fingerprint, the input checkpoint's
  fingerprint), skip when the output's manifest matches, write into a temporary sibling, validate, manifest last,
  atomic rename; then keep the newest ``max_ckpt_to_keep`` checkpoints.
* :class:`LogProbStage` / :class:`ValuesStage` — ``samples`` → ``samples`` + ``old_log_probs`` / ``ref_log_probs``
  (/ ``entropy``) or + ``values``, run by ``stages.runner.run_stage``; each rank or worker loads its model once
  and batches rows by a token budget.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from schemas.errors import RollflowError
from schemas.tables import ADVANTAGED, FLOATS, SAMPLES, TableSpec
from schemas.train_config import (ForwardConfig, LogProbSection, TrainRuntimeConfig, TrainSection, TrainStepConfig,
                                  ValuesSection)
from stages import progress
from stages.cluster import check_group_fits, require_ray
from stages.commit import commit_folder
from stages.partials import SIDE_DIR, read_partials, sum_partials
from stages.ray_errors import unwrap_error
from stages.runner import run_stage, stage_fingerprint
from stages.stage import Stage, StageContext, StageResult
from stages.storage import Location, folder_fingerprint, is_uri, read_table_schema
from stages.train import checkpoint as ckpt
from stages.train.adapter_base import why_not_adapter_base
from stages.train.group import TrainerGroup

log = logging.getLogger("rollflow.train")

# ---- the training step on the training workers ------------------------------------------------------------

class TrainStage:
    """The training step's identity for :func:`stages.runner.stage_fingerprint`; its output is a checkpoint."""

    name = ckpt.STAGE_NAME
    version = "1"


def _step(group: TrainerGroup, samples: Location, checkpoint: str, cfg: TrainStepConfig, tmp: str, final: str,
          label: str, full_state: bool) -> None:
    """One step on ``group``: the workers read the table themselves and write the checkpoint into ``tmp``."""
    require_ray("the training step")
    names = read_table_schema(samples, "advantaged").names
    with progress.bar(label, "micro-batches") as ticker:  # rank 0 counts its micro-batches
        group.step({"samples": samples, "columns": names, "checkpoint": checkpoint, "output": tmp,
                    "committed_as": final, "section": train_section(cfg).model_dump(mode="json"),
                    "full_state": full_state, "progress": ticker}, unwrap_error)


def train_section(cfg: TrainStepConfig) -> TrainSection:
    return TrainSection.model_validate({k: getattr(cfg, k) for k in TrainSection.model_fields})


def run_train_step(samples: str, checkpoint: str, cfg: TrainStepConfig, output: str, *, force: bool = False,
                   label: str = "train", trainer: TrainerGroup | None = None, full_state: bool = True) -> StageResult:
    """Train the checkpoint one step on the advantaged table ``samples``; write the new checkpoint to ``output``.

    Skips when ``output`` already holds this exact step (same table, checkpoint and training section). ``label``
    heads the progress bar of the micro-batches (on a terminal, see :mod:`stages.progress`). ``trainer``: the
    run's kept worker group (default: a group started for this step and closed after it). ``full_state``: write
    DeepSpeed's state, else weights and a replay record (a run's steps between ``save_steps``; not part of the
    fingerprint: the state is a cache of what replay rebuilds)."""
    start = time.time()
    section = train_section(cfg)
    samples_loc = Location.of(samples)
    out = Location.of(output)
    info = ckpt.read_checkpoint(checkpoint)
    schema = read_table_schema(samples_loc, ADVANTAGED.name)
    needs = section.table_needs
    ADVANTAGED.check_schema(schema, samples_loc.path, needs)
    state_in = {"checkpoint": ckpt.checkpoint_fingerprint(info.path)}
    fp = stage_fingerprint(TrainStage, section, {"samples": samples_loc}, state_in)
    manifest, skipped = commit_folder(
        out, fp, lambda tmp: _train_into(tmp, out, samples_loc, info, cfg, state_in, start, label, trainer,
                                full_state, named=checkpoint if is_uri(checkpoint) else info.path),
        who="train_step", other="a checkpoint of another training step", force=force, local=True)
    if not skipped:
        if cfg.max_ckpt_to_keep:
            ckpt.prune_checkpoints(out.parent, cfg.max_ckpt_to_keep, protect=out)
        log.info("train_step: wrote %s (step %d) in %.1fs", out.path, manifest["state"]["global_step"],
                 time.time() - start)
    return StageResult(out.uri(), fp, skipped, manifest["rows"], time.time() - start, manifest.get("metrics", {}),
                       manifest.get("state", {}))


def _train_into(tmp: Location, out: Location, samples: Location, info: ckpt.CheckpointInfo, cfg: TrainStepConfig,
                state_in: dict, start: float, label: str, trainer: TrainerGroup | None,
                full_state: bool, named: str) -> dict[str, Any]:
    """Run the training step into ``tmp`` (the temporary folder of ``out``), check the checkpoint, and return its
    manifest (all but the fingerprint).
    ``named``: the input checkpoint as the manifest records it (a URI on an object store, not its local copy)."""
    checkpoint = info.path
    if os.path.realpath(out.path) == os.path.realpath(checkpoint):
        raise RollflowError(f"train_step: the output {out.path} is the input checkpoint; write to a new folder")
    ckpt.check_trainable(info)
    section = train_section(cfg)
    if trainer is None:  # a step on its own: refused before its group starts if the cluster cannot place it
        check_group_fits(*cfg.worker_asks())
    try:
        _step(trainer or TrainerGroup(cfg.runtime, keep=False), samples, checkpoint, cfg,
              tmp.path, out.path, label, full_state)
    except Exception as err:
        full = ckpt.disk_full_error(tmp.path, checkpoint, err)
        if full is not None:
            raise full from err
        raise
    ckpt.check_complete(tmp.path, section.needs_critic)
    state = json.loads(tmp.child(ckpt.TRAIN_STATE).read_text())
    return {
        "stage": TrainStage.name, "version": TrainStage.version, "table": "checkpoint",
        "section": section.model_dump(mode="json"),
        "inputs": {"samples": {"path": samples.uri(), "fingerprint": folder_fingerprint(samples)},
                   "checkpoint": {"path": named, "fingerprint": state_in["checkpoint"]}},
        "state_in": state_in, "rows": sum(m.num_rows for m in _parquet_meta(samples)), "metrics": state["metrics"],
        "state": {"global_step": state["global_step"], "optimizer_steps": state["optimizer_steps"],
                  "world_size": state["world_size"]},
        "created_unix": time.time(), "seconds": round(time.time() - start, 3),
    }


def _parquet_meta(loc: Location):
    for path in loc.parquet_files():
        with loc.fs.open_input_file(path) as f:
            yield pq.read_metadata(f)


# ---- forward stages: log-probs and values ----------------------------------------------------------------------

LOGPROBS = TableSpec(
    name="samples", required={**SAMPLES.required, "old_log_probs": FLOATS},
    optional={**{k: v for k, v in SAMPLES.optional.items() if k != "old_log_probs"}, "entropy": FLOATS},
    token_aligned=SAMPLES.token_aligned, next_token_aligned=SAMPLES.next_token_aligned + ("entropy",),
    finite=SAMPLES.finite + ("entropy",))
VALUES = TableSpec(
    name="samples", required={**SAMPLES.required, "values": FLOATS},
    optional={k: v for k, v in SAMPLES.optional.items() if k != "values"},
    token_aligned=SAMPLES.token_aligned, next_token_aligned=SAMPLES.next_token_aligned,
    finite=SAMPLES.finite)


@dataclass(frozen=True)
class ForwardJob:
    """One model run by a forward pass: its result ``column`` (``entropy`` too when asked) and the columns that
    receive a copy (a reference identical to the checkpoint is computed once). With ``adapter`` the model is the
    base at ``path`` plus that LoRA adapter, and ``base_column`` receives the log-probs of the same model with the
    adapter switched off (the base: a LoRA run's reference, without a second model)."""

    kind: str
    path: str
    column: str
    copies: tuple[str, ...] = ()
    entropy: bool = False
    actor_dir: str | None = None
    seed: int = 42
    fingerprint: str = ""  # the model's content fingerprint: a kept worker reuses a model only for the same one
    adapter: str | None = None
    base_column: str | None = None
    base_fingerprint: str = ""  # with adapter: the base folder's content fingerprint
    checkpoint: str | None = None  # the checkpoint whose trained role (actor; critic for values) this job runs:
    # the actor group computes it on its held engine when it holds that checkpoint (stages/train/actor_forward.py)


def forward_group(c: ForwardConfig, *, kept: bool = False, gpus_per_worker: float | None = None,
                  limits: TrainRuntimeConfig | None = None) -> TrainerGroup:
    """The actor group that computes the log-prob and values stages when no training group does: ``num_actors``
    data-parallel ranks (:meth:`ForwardConfig.group_runtime`) that load the models beside (no DeepSpeed engines: it
    trains nothing). For a stage run on its own (``rollflow logprobs`` / ``values``, a stage re-run) a group for one
    request, closed after it; ``kept``: a training run's without a kept training group (``keep_workers: false``),
    which keeps its models across iterations (a new checkpoint is loaded in place), reserves no CPU (its ranks
    compute only inside these stages) and its GPU share ``gpus_per_worker`` (the run's, stages.plan.gpu_shares;
    default: gpus_per_actor with device cuda), under the run's ``limits`` (train.runtime's timeouts)."""
    share = c.gpus_per_actor_reserved() if gpus_per_worker is None else gpus_per_worker
    return TrainerGroup(c.group_runtime(kept=kept, limits=limits), keep=kept, gpus_per_worker=share or 0.0)


class _ForwardStage(Stage):
    """Shared build/finalize of the log-prob and values stages; subclasses say which jobs run. Where the passes run
    is not part of the output (nor of the fingerprint): the run's group (``group``, a :class:`TrainerGroup`: the
    training workers, which compute the columns on the engines they hold, or a kept group of the run's own for these
    passes, :func:`forward_group`), or, for a stage run on its own, a group started for its one request (models
    loaded beside, as on the training workers when they hold no engine of the checkpoint). Each rank writes its rows
    into the stage's temporary folder, and the stage's dataset reads them back in row order."""

    input_specs = {"samples": SAMPLES}

    def __init__(self, config: ForwardConfig, fingerprints: dict[str, str] | None = None,
                 group: TrainerGroup | None = None):
        self.config, self.fingerprints, self.group = config, fingerprints or {}, group

    def jobs(self, section) -> list[ForwardJob]:
        raise NotImplementedError

    def build(self, ctx: StageContext):
        if self.group is not None:
            return self._build_on_group(ctx, self.group)
        check_group_fits(*self.config.worker_asks())  # before it starts: not for an output that is up to date
        with forward_group(self.config) as group:  # a stage run on its own: a group for its one request
            return self._build_on_group(ctx, group)

    def _build_on_group(self, ctx: StageContext, group: TrainerGroup):
        """The passes on the actor group: every rank writes its slice of the rows into ``_partials/actor`` of the
        temporary folder (removed with the counters once the output is written); the dataset reads them in rank
        order, which is row order, one block a part as :meth:`StageContext.read` does: one read-and-write task and
        one output file per rank. (Without ``override_num_blocks`` Ray Data cut a part into 4 blocks, written as 4
        files by tasks running at once, which the next stages read with 4 tasks: in a training run those parallel
        tasks started Ray worker processes of their own; benchmarks/iteration_overhead.py counts them.)"""
        import ray.data

        c, section = self.config, ctx.section
        parts = ctx.output.child(SIDE_DIR).child("actor")
        group.forward({"samples": ctx.inputs["samples"], "jobs": self.jobs(section), "dtype": section.dtype,
                       "max_tokens": section.max_tokens_per_microbatch_in_infer, "rows_per_batch": c.rows_per_batch,
                       "options": c.pass_options(), "device": c.device, "output": ctx.output, "parts": parts,
                       "spec": self.output_spec, "where": ctx.inputs["samples"].path,
                       "section": group.section if group.keep else None}, unwrap_error)
        files = parts.parquet_files() if parts.exists() else []
        if not files:  # no rows
            return ctx.read("samples")
        return ray.data.read_parquet(files, filesystem=parts.ray_filesystem(), override_num_blocks=len(files))

    def finalize(self, ctx: StageContext, written: Location) -> tuple[dict[str, float], dict[str, Any]]:
        parts = read_partials(written)
        total = sum_partials(parts)
        seconds = total.get("seconds", 0.0)
        on_group = {f"{self.name}/{k}": total[k] for k in ("jobs_on_held_engines", "jobs_on_loaded_models",
                                                          "fused_micro_batches")
                    if k in total}  # the actor group's ranks: passes on its engines, on models loaded beside them;
        # micro-batches through the fused output layer (logprobs.fused_output_layer), recorded only when it is on
        return on_group | {f"{self.name}/tokens": total.get("tokens", 0.0),
                f"{self.name}/peak_rss_mb": max((p.get("peak_rss_mb", 0.0) for p in parts), default=0.0),
                f"{self.name}/padded_tokens": total.get("padded_tokens", 0.0),
                f"{self.name}/compute_seconds": seconds,
                f"{self.name}/compute_cpu_seconds": total.get("cpu_seconds", 0.0),
                f"{self.name}/tokens_per_second": total.get("tokens", 0.0) / seconds if seconds else 0.0}, {}


class LogProbStage(_ForwardStage):
    """``old_log_probs`` under the checkpoint, ``ref_log_probs`` under the reference (when enabled; one pass when
    the reference is the checkpoint), ``entropy`` when configured (spec §1.8, §0.4 step 4).

    A LoRA checkpoint whose reference is the base its adapter was trained on (ROLL's reference, the initial policy,
    is that base in a run that started LoRA from ``pretrain``) is run as one model: the base plus the adapter for
    ``old_log_probs``, the same model with the adapter switched off for ``ref_log_probs``
    (:func:`stages.train.adapter_base.why_not_adapter_base` checks that it is that base). Any other reference (another
    model, or a base folder changed since training) is loaded as a second model, as in full training."""

    name = "logprobs"
    version = "1"
    output_spec = LOGPROBS
    section_model = LogProbSection

    def __init__(self, config: ForwardConfig, same_reference: bool = False, fingerprints: dict[str, str] | None = None,
                 group: TrainerGroup | None = None):
        super().__init__(config, fingerprints, group)
        self.same_reference = same_reference

    def jobs(self, s: LogProbSection) -> list[ForwardJob]:
        same = s.reference is not None and self.same_reference
        fp = self.fingerprints
        if s.reference is not None and not same:
            info = ckpt.read_checkpoint(s.checkpoint)
            why_not = why_not_adapter_base(info, s.reference, fp.get("reference", ""))
            if why_not is None:
                return [ForwardJob("log_probs", s.reference, "old_log_probs", entropy=s.compute_entropy,
                                   fingerprint=fp.get("checkpoint", ""),
                                   adapter=os.path.join(info.path, ckpt.ACTOR_ADAPTER), base_column="ref_log_probs",
                                   base_fingerprint=fp.get("reference", ""), checkpoint=s.checkpoint)]
            if info.lora and "actor" in info.lora:
                log.info("logprobs: the reference is loaded as a second model beside the LoRA checkpoint %s: %s",
                         info.path, why_not)
        jobs = [ForwardJob("log_probs", s.checkpoint, "old_log_probs", ("ref_log_probs",) if same else (),
                           entropy=s.compute_entropy, fingerprint=fp.get("checkpoint", ""), checkpoint=s.checkpoint)]
        if s.reference is not None and not same:
            jobs.append(ForwardJob("log_probs", s.reference, "ref_log_probs", fingerprint=fp.get("reference", "")))
        return jobs


class ValuesStage(_ForwardStage):
    """``values``: the critic's raw outputs at every next-token position (the values GAE reads, spec §4.2)."""

    name = "values"
    version = "1"
    output_spec = VALUES
    section_model = ValuesSection

    def jobs(self, s: ValuesSection) -> list[ForwardJob]:
        info = ckpt.read_checkpoint(s.critic)
        fp = self.fingerprints.get("critic", "")
        if info.critic_dir is not None:
            return [ForwardJob("values", info.critic_dir, "values", fingerprint=fp, checkpoint=info.path)]
        return [ForwardJob("values", info.path, "values", actor_dir=info.path, seed=s.seed, fingerprint=fp,
                           checkpoint=info.path)]


def run_logprobs(samples: str, checkpoint: str, config: ForwardConfig, output: str, *, reference: str | None = None,
                 force: bool = False, group: TrainerGroup | None = None) -> StageResult:
    """``samples`` + ``old_log_probs`` (+ ``ref_log_probs`` under ``reference``, default: the checkpoint, when
    ``enable_reference``; + ``entropy``) → ``output``, via the runner (skip when up to date). ``group``: the run's
    group, which then computes the columns (default: a group of ``config.num_actors`` ranks started for this stage,
    :func:`forward_group`)."""
    info = ckpt.read_checkpoint(checkpoint)
    ref_info = ckpt.read_checkpoint(reference) if (reference and config.enable_reference) else None
    if config.enable_reference and ref_info is None:
        ref_info = info
    state_in = {"checkpoint": ckpt.checkpoint_fingerprint(info.path)}
    if ref_info is not None:
        state_in["reference"] = ckpt.checkpoint_fingerprint(ref_info.path)
    section = LogProbSection(checkpoint=info.path, reference=ref_info.path if ref_info else None,
                             compute_entropy=config.compute_entropy, dtype=config.dtype,
                             max_tokens_per_microbatch_in_infer=config.max_tokens_per_microbatch_in_infer)
    require_ray("the log-prob stage")
    stage = LogProbStage(config, same_reference=state_in.get("reference") == state_in["checkpoint"],
                         fingerprints=state_in, group=group)
    return run_stage(stage, section, {"samples": samples}, output, force=force, state_in=state_in,
                     batch_rows=config.rows_per_batch)


def run_values(samples: str, checkpoint: str, config: ForwardConfig, output: str, *, force: bool = False,
               group: TrainerGroup | None = None) -> StageResult:
    """``samples`` + ``values`` under the critic of ``checkpoint`` (its ``critic/`` folder, or a new value head on
    its actor seeded with ``config.seed`` before the first training step) → ``output``. ``group``: the run's actor
    group (its held critic computes them), as in :func:`run_logprobs`."""
    info = ckpt.read_checkpoint(checkpoint)
    section = ValuesSection(critic=info.path, seed=config.seed, dtype=config.dtype,
                            max_tokens_per_microbatch_in_infer=config.max_tokens_per_microbatch_in_infer)
    require_ray("the values stage")
    state_in = {"critic": ckpt.checkpoint_fingerprint(info.path)}
    return run_stage(ValuesStage(config, state_in, group), section, {"samples": samples}, output, force=force,
                     state_in=state_in, batch_rows=config.rows_per_batch)
