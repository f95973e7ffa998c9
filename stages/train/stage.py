"""The Ray side of training: the training step on the training workers (:class:`stages.train.group.TrainerGroup`),
and the log-prob and values stages on an actor group (the run's, or one started for a stage run on its own) or on
kept forward workers. The work itself is in ``stages.train.core`` and ``stages.train.forward`` (no Ray).

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
import socket
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import ConfigError, RollflowError
from schemas.tables import ADVANTAGED, FLOATS, SAMPLES, TableSpec
from schemas.train_config import (ForwardConfig, LogProbSection, PassOptions, TrainRuntimeConfig, TrainSection,
                                  TrainStepConfig, ValuesSection)
from stages import progress
from stages.cluster import require_ray
from stages.commit import commit_folder
from stages.partials import SIDE_DIR, read_partials, sum_partials
from stages.ray_errors import unplaced_hint, unwrap_error
from stages.runner import run_stage, stage_fingerprint
from stages.stage import Stage, StageContext, StageResult
from stages.storage import Location, folder_fingerprint, is_uri, read_table_schema
from stages.train import checkpoint as ckpt
from stages.train.group import Limits, TrainerGroup

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


class ForwardStalled(RollflowError):
    """A forward worker was not placed, or stalled in a call, past its limit (train.runtime.*_timeout_s)."""


class ForwardServer:
    """A forward worker that a training flow keeps across iterations (a Ray actor of :class:`ForwardWorkers`): its
    models stay loaded and take each new checkpoint in place (:class:`stages.train.forward.ForwardModels`)."""

    def __init__(self, threads: int):
        import torch

        from stages.train.forward import ForwardModels

        torch.set_num_threads(max(1, threads))
        self.models = ForwardModels()

    def run(self, jobs: list[ForwardJob], dtype: str, batch: pa.Table, max_tokens: int, output: Location,
            spec: TableSpec, where: str, device: str = "cpu", options: PassOptions = PassOptions()) -> pa.Table:
        from stages.train.forward import forward_batch

        models = [self.models.get(j.column, j.path, j.kind, dtype, fingerprint=j.fingerprint, actor_dir=j.actor_dir,
                                  seed=j.seed, device=device, adapter=j.adapter, base_fingerprint=j.base_fingerprint)
                  for j in jobs]
        result = forward_batch(models, jobs, batch, max_tokens, output, spec, where, device, options)
        if device == "cuda":  # the activations' cached blocks go back to the GPU a colocated engine wakes into
            import torch

            torch.cuda.empty_cache()
        return result

    def loads(self) -> dict[str, int]:
        return dict(self.models.loads)

    def where(self) -> tuple[int, str]:
        """This worker's process id and host."""
        return os.getpid(), socket.gethostname()


class ForwardWorkers:
    """The forward workers of a training run (``num_actors`` :class:`ForwardServer` actors), started on first use and
    kept until :meth:`close`. Like a kept trainer, they reserve no Ray CPUs: they compute only inside the log-prob
    and values stages, whose Ray Data tasks hand them the batches and wait.

    Nothing waits forever, under the limits of the run's training workers (``train.runtime``, which bound the same
    passes where the training workers compute them): workers Ray does not place within ``placement_timeout_s`` fail
    with what each asks and what the cluster has free; a worker that does not answer a batch within
    ``step_timeout_s`` fails the stage naming its process and host (:class:`ForwardStalled`)."""

    server_class: ClassVar[type] = ForwardServer  # what each worker runs (tests stand a stalling one in)

    def __init__(self, config: ForwardConfig, gpus_per_actor: float | None = None, limits: Limits | None = None):
        """``gpus_per_actor``: the Ray GPU share of each worker when the run decides it (colocation,
        stages.plan.gpu_shares); default: the section's own (gpus_per_actor with device cuda). ``limits``: the run's
        ``Limits.of(train.runtime)`` (default: those of a default training runtime)."""
        self.config = config
        self.gpus = config.gpus_per_actor_reserved() if gpus_per_actor is None else (gpus_per_actor or None)
        self.limits = limits or Limits.of(TrainRuntimeConfig())
        self._actors: list = []
        self.placed: list[tuple[int, str]] = []  # (pid, host) of each worker, once placed

    def asks(self) -> dict[str, float]:
        """What each worker reserves in Ray."""
        return {"CPU": 0.0, **({"GPU": self.gpus} if self.gpus else {}),
                **self.config.runtime.resources_for("logprobs")}

    def actors(self) -> list:
        """The workers, started (and waited for, up to the placement limit) on first use."""
        import ray

        if not self._actors:
            server = ray.remote(num_cpus=0, num_gpus=self.gpus, max_restarts=0,
                                resources=self.config.runtime.resources_for("logprobs"))(self.server_class)
            actors = [server.remote(self.config.torch_threads()) for _ in range(self.config.num_actors)]
            try:
                self.placed = self._placed(actors)
            except BaseException:
                for actor in actors:
                    ray.kill(actor)
                raise
            self._actors = actors
        return self._actors

    def _placed(self, actors: list) -> list[tuple[int, str]]:
        """Each worker's (pid, host) once Ray has started it; :class:`ForwardStalled` past the placement limit."""
        import ray

        refs = [a.where.remote() for a in actors]
        limit = self.limits.placement
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if pending:
            late = [i for i, ref in enumerate(refs) if ref in pending]
            raise ForwardStalled(f"{len(late)} of {len(refs)} forward workers (worker(s) {late}) were not placed by "
                                 f"Ray within train.runtime.placement_timeout_s ({limit:g} s): "
                                 f"{unplaced_hint(self.asks())}")
        return ray.get(refs)

    def loads(self) -> dict[str, int]:
        """Model loads so far, summed over the workers: fresh, in place, kept."""
        import ray

        total: dict[str, int] = {}
        for counts in ray.get([a.loads.remote() for a in self._actors]):
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        import ray

        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone with its owner
                pass
        self._actors = []


def _forward_on_worker(batch: pa.Table, actors: list, placed: list[tuple[int, str]], limit: float | None,
                       **kwargs) -> pa.Table:
    """A Ray Data map task: hand ``batch`` to one kept forward worker (chosen by the batch's first row id, so the
    assignment is deterministic) and return its result; :class:`ForwardStalled` naming the worker (``placed``: each
    one's pid and host) when it has not answered within ``limit`` seconds (None: no limit)."""
    import ray

    key = batch.column("row_id")[0].as_py() if batch.num_rows else 0
    index = zlib.crc32(str(key).encode()) % len(actors)
    ref = actors[index].run.remote(batch=batch, **kwargs)
    ready, _ = ray.wait([ref], timeout=limit)
    if not ready:
        pid, host = placed[index]
        raise ForwardStalled(f"forward worker {index} (pid {pid} on {host}) has not answered a batch of "
                             f"{batch.num_rows} rows of {kwargs.get('where')} within train.runtime.step_timeout_s "
                             f"({limit:g} s); py-spy dump --pid {pid} shows where it waits, or raise "
                             "train.runtime.step_timeout_s (null: no limit)")
    return ray.get(ref)


def _cluster_cpus_gpus() -> tuple[float, float]:
    import ray

    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def check_workers_fit(c: ForwardConfig) -> None:
    """:class:`ConfigError` before kept forward workers start where the cluster cannot run them: device cuda without
    the GPUs, or ``cpus_per_actor`` leaving no CPU for the stage's read and write tasks."""
    cpus, gpus = _cluster_cpus_gpus()
    if c.device == "cuda" and gpus < c.gpus_per_actor:
        raise ConfigError(f"device: cuda reserves gpus_per_actor={c.gpus_per_actor:g} GPU per forward actor, and "
                          f"the Ray cluster has {gpus:g} GPUs; set device: cpu, or run on a cluster with a GPU "
                          "(RAY_ADDRESS), or lower gpus_per_actor to share one")
    if cpus - c.cpus_per_actor < 1:  # the actor would hold every CPU and the read tasks would wait forever
        raise ConfigError(f"cpus_per_actor ({c.cpus_per_actor}) leaves less than 1 of the cluster's {cpus:g} CPUs "
                          "for reading and writing the table, so the stage would wait forever; set "
                          f"cpus_per_actor to at most {max(cpus - 1, 0.5):g} (threads per actor follow it)")


def forward_group(c: ForwardConfig) -> TrainerGroup:
    """The actor group of a log-prob or values stage run on its own (``rollflow logprobs`` / ``values``, a stage
    re-run): ``num_actors`` data-parallel ranks (:meth:`ForwardConfig.group_runtime`) for one request, closed after
    it, which load the models beside (no DeepSpeed engines: it trains nothing). Refused with a
    :class:`ConfigError` before anything starts when the cluster cannot place every rank at once (device cuda
    without the GPUs; more CPUs than the cluster has), where the ranks would otherwise wait for their placement."""
    cpus, gpus = _cluster_cpus_gpus()
    ranks = c.num_actors
    if c.device == "cuda" and gpus < ranks * c.gpus_per_actor:
        raise ConfigError(f"device: cuda reserves gpus_per_actor={c.gpus_per_actor:g} GPU for each of num_actors="
                          f"{ranks} ranks, and the Ray cluster has {gpus:g} GPUs; set device: cpu, or run on a "
                          "cluster with a GPU (RAY_ADDRESS), or lower gpus_per_actor to share one")
    if ranks * c.cpus_per_actor > cpus:
        raise ConfigError(f"num_actors ({ranks}) x cpus_per_actor ({c.cpus_per_actor:g}) is "
                          f"{ranks * c.cpus_per_actor:g} CPUs for ranks that start together, and the Ray cluster has "
                          f"{cpus:g}, so the stage would wait for them until it times out; set cpus_per_actor to at "
                          f"most {cpus / ranks:g} (threads per rank follow it), or lower num_actors")
    return TrainerGroup(c.group_runtime(), keep=False, gpus_per_worker=c.gpus_per_actor_reserved() or 0.0)


class _ForwardStage(Stage):
    """Shared build/finalize of the log-prob and values stages; subclasses say which jobs run. Where the passes run
    is not part of the output (nor of the fingerprint): the run's actor group (``group``, a :class:`TrainerGroup`:
    the training workers compute the columns on the engines they hold), the run's kept forward workers
    (``workers``), or, for a stage run on its own, a group started for its one request (:func:`forward_group`:
    models loaded beside, as on the run's group when it holds no engine of the checkpoint). On a group each rank
    writes its rows into the stage's temporary folder, and the stage's dataset reads them back in row order."""

    input_specs = {"samples": SAMPLES}

    def __init__(self, config: ForwardConfig, fingerprints: dict[str, str] | None = None,
                 workers: ForwardWorkers | None = None, group: TrainerGroup | None = None):
        self.config, self.fingerprints, self.workers, self.group = config, fingerprints or {}, workers, group

    def jobs(self, section) -> list[ForwardJob]:
        raise NotImplementedError

    def build(self, ctx: StageContext):
        c = self.config
        if self.group is not None:
            return self._build_on_group(ctx, self.group)
        if self.workers is not None:  # the run's kept workers; the map tasks hand them the batches
            check_workers_fit(c)
            actors = self.workers.actors()
            # a task waiting in ray.get gives its CPU back: without a cap, Ray Data would start a task (and a worker
            # process) per batch while the forward workers are busy. The cap is an upper bound, so Ray Data's
            # warning that a table of fewer blocks cannot use all of it says nothing here.
            warnings.filterwarnings("ignore", category=UserWarning, message=r"The maximum number of concurrent tasks "
                                    r"for 'MapBatches\(_forward_on_worker\)'")
            work = {"jobs": self.jobs(ctx.section), "max_tokens": ctx.section.max_tokens_per_microbatch_in_infer,
                    "output": ctx.output, "spec": self.output_spec, "where": ctx.inputs["samples"].path,
                    "device": c.device, "options": c.pass_options()}
            return ctx.read("samples").map_batches(
                _forward_on_worker, batch_size=c.rows_per_batch, batch_format="pyarrow", concurrency=len(actors),
                fn_kwargs={"actors": actors, "placed": self.workers.placed, "limit": self.workers.limits.step,
                           "dtype": ctx.section.dtype, **work})
        with forward_group(c) as group:  # a stage run on its own: a group for its one request, closed after it
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
    (:func:`stages.train.lora.why_not_adapter_base` checks that it is that base). Any other reference (another
    model, or a base folder changed since training) is loaded as a second model, as in full training."""

    name = "logprobs"
    version = "1"
    output_spec = LOGPROBS
    section_model = LogProbSection

    def __init__(self, config: ForwardConfig, same_reference: bool = False, fingerprints: dict[str, str] | None = None,
                 workers: ForwardWorkers | None = None, group: TrainerGroup | None = None):
        super().__init__(config, fingerprints, workers, group)
        self.same_reference = same_reference

    def jobs(self, s: LogProbSection) -> list[ForwardJob]:
        same = s.reference is not None and self.same_reference
        fp = self.fingerprints
        if s.reference is not None and not same:
            from stages.train.lora import why_not_adapter_base

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
                 force: bool = False, workers: ForwardWorkers | None = None,
                 group: TrainerGroup | None = None) -> StageResult:
    """``samples`` + ``old_log_probs`` (+ ``ref_log_probs`` under ``reference``, default: the checkpoint, when
    ``enable_reference``; + ``entropy``) → ``output``, via the runner (skip when up to date). ``group``: the run's
    actor group, which then computes the columns (default: ``workers``, or a group of ``config.num_actors`` ranks
    started for this stage, :func:`forward_group`)."""
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
                         fingerprints=state_in, workers=workers, group=group)
    return run_stage(stage, section, {"samples": samples}, output, force=force, state_in=state_in,
                     batch_rows=config.rows_per_batch)


def run_values(samples: str, checkpoint: str, config: ForwardConfig, output: str, *, force: bool = False,
               workers: ForwardWorkers | None = None, group: TrainerGroup | None = None) -> StageResult:
    """``samples`` + ``values`` under the critic of ``checkpoint`` (its ``critic/`` folder, or a new value head on
    its actor seeded with ``config.seed`` before the first training step) → ``output``. ``group``: the run's actor
    group (its held critic computes them), as in :func:`run_logprobs`."""
    info = ckpt.read_checkpoint(checkpoint)
    section = ValuesSection(critic=info.path, seed=config.seed, dtype=config.dtype,
                            max_tokens_per_microbatch_in_infer=config.max_tokens_per_microbatch_in_infer)
    require_ray("the values stage")
    state_in = {"critic": ckpt.checkpoint_fingerprint(info.path)}
    return run_stage(ValuesStage(config, state_in, workers, group), section, {"samples": samples}, output, force=force,
                     state_in=state_in, batch_rows=config.rows_per_batch)
