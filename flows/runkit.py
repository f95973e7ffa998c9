"""The run kit both training flows (flows/agentic.py, flows/rlvr.py) and the recompute flow share: the run's log,
the CPU budget, the kept workers, the stage tasks they have in common (log-probs, values,
response-level rewards, advantages, the training step) and the metrics record of a stage. ``config`` in these
functions is a training config of either pipeline (``TrainFlowConfig`` or ``RLVRTrainConfig``). The run folder, its
frozen config and the checks of both before anything starts are stages/run_folder.py's (no Prefect: a config error
there is reported before this module loads)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.pipeline_specs import PIPELINE_SPECS
from schemas.config import AdvantageSection, ResponseRewardSection
from stages import cluster, gpu_preflight
from stages.advantages import AdvantagesStage
from stages.plan import forward_on_actor, gpu_shares, make_plan
from stages.response_rewards import ResponseRewardsStage
from stages.rollout.driver import pool_source, resolve_model_dir
from stages.rollout.engine_pool import EnginePool
from stages.run_folder import run_folder, save_run_config
from stages.runner import run_stage
from stages.storage import Location, local_side, publish_local_side
from stages.train.checkpoint import keep_training_state
from stages.train.group import TrainerGroup
from stages.train.stage import forward_group, run_logprobs, run_train_step, run_values, train_section

log = logging.getLogger("rollflow.train")
RUN_LOG = "logs/rollflow.log"  # the command's log (flows/console.py), appended by every resume
LOCAL_SIDE = ("logs", "tensorboard", "mlflow", "wandb", "report")  # a run folder's local files (stages/storage.py)


def run_log(config) -> tuple[str, str]:
    """The run folder and its log file: ``<run>/logs/rollflow.log``; for a run folder on an object store, the same
    file in its local side (``<cache>/mirror/...``), continuing the store's copy when this machine has none (a
    resume elsewhere), and uploaded with the rest of the local side by :func:`publish_run`."""
    import os

    import pyarrow.fs as pafs


    run = run_folder(config)
    log_file = f"{local_side(run)}/{RUN_LOG}"
    stored = run.child(RUN_LOG)
    if not run.atomic_rename and not os.path.exists(log_file) and stored.exists():
        os.makedirs(os.path.dirname(log_file), exist_ok=True)
        pafs.copy_files(stored.path, log_file, source_filesystem=run.fs, destination_filesystem=pafs.LocalFileSystem())
    return run.uri(), log_file


def publish_run(run: str) -> list[str]:
    """Upload the local side of the run folder ``run`` (its log, TensorBoard events and report: :data:`LOCAL_SIDE`)
    into it when it is on an object store; nothing for a local run folder. Returns the folders uploaded."""
    return publish_local_side(Location.of(run), LOCAL_SIDE)


@dataclass
class KeptWorkers:
    """The workers a training flow keeps from one iteration to the next, besides the generation engines: the
    training worker group, the actor group (DeepSpeed engines kept in memory), which also computes the log-prob and
    values stages on the engines it holds (issue 44: one copy of the policy for both; a separate reference model is
    loaded beside them). A run whose training group is not kept (``keep_workers: false``) keeps a group of its own
    for those stages (``logprobs``' ranks, :func:`stages.train.stage.forward_group`: models loaded once, new
    checkpoints copied in place). Started on first use; the flow closes them at its end."""

    trainer: Any  # stages.train.group.TrainerGroup
    forward: Any = None  # a kept TrainerGroup of the forward passes only, without a kept training group

    @classmethod
    def of(cls, config) -> "KeptWorkers":
        shares = gpu_shares(config)  # a GPU shared with the engines (device_mapping) is reserved as equal shares
        train = config.train_step_config()
        trainer = TrainerGroup(train.runtime, gpus_per_worker=shares["train"],
                               section=train_section(train).model_dump(mode="json"))
        if forward_on_actor(config):
            return cls(trainer)
        return cls(trainer, forward_group(config.logprobs_config(), kept=True, gpus_per_worker=shares["forward"],
                                          limits=train.runtime))

    def forward_kwargs(self) -> dict[str, Any]:
        """Where the log-prob and values stages run: the actor group, or the run's kept group for them."""
        return {"group": self.forward if self.forward is not None else self.trainer}

    def close(self) -> None:
        self.trainer.close()
        if self.forward is not None:
            self.forward.close()


def stage_task(name: str):
    """A Prefect task around one stage call: no Prefect caching (the runner's manifests decide what is done)."""
    return task(name=name, cache_policy=NO_CACHE, retries=0)


@stage_task("logprobs")
def logprobs_task(config, samples: str, checkpoint: str, reference: str, output: str,
                  workers: KeptWorkers | None = None) -> Any:
    return run_logprobs(samples, checkpoint, config.logprobs_config(), output, reference=reference,
                        **(workers.forward_kwargs() if workers else {}))


@stage_task("values")
def values_task(config, samples: str, checkpoint: str, output: str,
                workers: KeptWorkers | None = None) -> Any:
    return run_values(samples, checkpoint, config.logprobs_config(), output,
                      **(workers.forward_kwargs() if workers else {}))


@stage_task("response_rewards")
def rewards_task(rewards: ResponseRewardSection, samples: str, output: str, *, scored: str | None = None,
                 state_in: dict | None = None, force: bool = False, batch_rows: int = 1024,
                 resources: dict[str, float] | None = None) -> Any:
    """Response-level rewards of a samples table (both training pipelines and the recompute flow): ``scored``, the
    reward workers' scores (RLVR's section); ``state_in``, the running moments of the previous step (RLVR);
    ``resources``: the custom Ray resources its tasks ask for (``runtime.resources_for("response_rewards")``)."""
    inputs = {"samples": samples, **({"scored": scored} if scored is not None else {})}
    return run_stage(ResponseRewardsStage(), rewards, inputs, output, force=force, batch_rows=batch_rows,
                     state_in=state_in, resources=resources)


@stage_task("advantages")
def advantages_task(advantages: AdvantageSection, samples: str, rewarded: str, output: str, state_in: dict | None,
                    *, force: bool = False, batch_rows: int = 1024, resources: dict[str, float] | None = None) -> Any:
    """Token rewards and advantages of a samples table and its rewarded rows; ``state_in`` carries the KL
    controller of the previous iteration (both training pipelines and the recompute flow); ``resources`` as in
    :func:`rewards_task`."""
    return run_stage(AdvantagesStage(), advantages, {"samples": samples, "rewarded": rewarded}, output,
                     state_in=state_in, force=force, batch_rows=batch_rows, resources=resources)


@stage_task("train")
def train_task(config, iteration: int, samples: str, checkpoint: str, output: str,
               workers: KeptWorkers | None = None) -> Any:
    """The training step of ``iteration``: DeepSpeed's state is written every ``train.save_steps`` iterations and at
    the last, weights and a replay record otherwise."""
    train = config.train_step_config()
    return run_train_step(samples, checkpoint, train, output, label=f"[iteration {iteration}] train",
                          trainer=workers.trainer if workers else None,
                          full_state=train.full_state_at(iteration, config.max_steps))


def train_and_keep(config, iteration: int, samples: str, checkpoint: str, output: str, workers: KeptWorkers,
                   metrics, trained: list[str]) -> Any:
    """The training step of ``iteration`` on ``samples`` (:func:`train_task`), recorded; its checkpoint joins
    ``trained`` (this run's checkpoints, oldest first) and the older ones beyond ``train.max_ckpt_to_keep`` lose
    their DeepSpeed state. Returns the step's result."""
    result = train_task(config, iteration, samples, checkpoint, output, workers)
    record(metrics, iteration, "train", result)
    trained.append(result.output)
    keep_training_state(trained, config.train_step_config().max_ckpt_to_keep)
    return result


def record(metrics, iteration: int, stage: str, result: Any, values: dict | None = None, *,
           label: str | None = None, note: str = "") -> dict[str, float]:
    """Log a stage result's numeric, finite metrics (or ``values``) and its wall time under (iteration, stage),
    print a progress line headed ``[label]`` (default ``[iteration <iteration>]``; ``note`` in parentheses after
    it), and return the logged values.
    A stage skipped on resume keeps the record of the run that computed it (its real wall time); it is logged only
    when that record is missing (killed between the commit and the metrics)."""
    raw = values if values is not None else (getattr(result, "metrics", None) or {})
    logged = {k: float(v) for k, v in raw.items() if isinstance(v, (int, float)) and v == v}
    seconds = getattr(result, "seconds", None)
    skipped = getattr(result, "skipped", False)
    if not (skipped and metrics.has(iteration, stage)):
        metrics.log(iteration, stage, logged, wall_s=seconds)
    done = "committed earlier, skipped" if skipped else f"{seconds or 0:.0f}s"
    print(f"[{label or f'iteration {iteration}'}] {stage:<16} {done}{f'  ({note})' if note else ''}", flush=True)
    return logged


def start_run(config, cfg: dict):
    """The set-up both training flows share: freeze ``cfg`` in the run folder (refusing a different one), start or
    join Ray, check the run's resource plan on the cluster (:func:`check_plan`: CPUs and GPUs of every stage, the
    engines of its pipeline included, e.g. an LLM judge's), resolve the initial policy, and make the engine pool
    (built on first use). Returns (run folder, initial policy folder, pool)."""
    import ray


    run = run_folder(config)
    save_run_config(run, config, cfg)
    rt = config.runtime
    cluster.ensure_ray(rt.ray_address, rt.num_cpus, data_memory_mb=rt.data_memory_mb)
    check_plan(config, ray.cluster_resources())
    base = resolve_model_dir(config.pretrain)

    return run, base, EnginePool(config.generation_engine(), pool_source(config.pretrain, base),
                                 config.generation_window(),
                                 gpus_per_engine=gpu_shares(config)["engine"])


def sleep_engines(pool, metrics, iteration: int) -> None:
    """After an iteration's generation: the engines give their memory back (``sleep_level``; colocation) for the
    log-prob, values and training stages, and the pool wakes them with the new weights before the next generation.
    The transition is logged as the iteration's ``engine`` metrics (nothing when the engines never sleep or were not
    built: a resumed iteration whose generation was committed)."""
    slept = pool.sleep()
    if slept is None:
        return
    metrics.log(iteration, "engine", slept, wall_s=slept["engine/sleep_seconds"])
    print(f"[iteration {iteration}] engines asleep (level {int(slept['engine/sleep_level'])}, "
          f"{slept['engine/released_gib']:.2f} GiB released)", flush=True)


def run_plan(config, resources: dict[str, float]):
    """The resource plan (stages/plan.py) of a training config on a cluster of ``resources``, with the engines its
    pipeline keeps for the whole run (its declaration, flows/pipeline_specs.py)."""
    plan = make_plan(config, resources, PIPELINE_SPECS.get(config.pipeline).engines(config))
    # this host's driver, GPUs and compilers against what the run asks (exit 2 if short)
    gpu_preflight.check_run(config, plan)
    return plan


def check_plan(config, resources: dict[str, float]) -> None:
    """Refuse a run whose stages cannot all be scheduled on the cluster (``ray.cluster_resources()``) — engines and
    kept workers hold their CPUs and GPUs for the whole run, so the other stages must fit beside them; otherwise a
    stage waits forever — with the rule, the numbers and the fix (stages/plan.py)."""
    plan = run_plan(config, resources)
    for line in plan.lines():
        log.info("plan: %s", line)
    plan.check()
