"""``rollflow train``: the agentic RL run as a Prefect flow of stage calls (DESIGN.md: the loop is a flow, a new
algorithm adds a registry entry or a stage, never a branch here).

Per iteration ``k`` (policy after ``k`` training steps), every output under ``runs/<run>/iter_<k>/<stage>/``:
rollout (episodes, turns, samples) → logprobs (old/ref) → values (GAE only) → rewarded → advantaged → checkpoint →
eval. Every stage goes through the one runner, so ``rollflow train --resume RUN`` after a crash (SIGKILL included)
skips what is committed and continues with the first missing output. The generation engines are built once per
flow run and load each new checkpoint in place; so do the forward (log-prob, values) workers, and the training
workers keep their DeepSpeed engines from one step to the next (:class:`KeptWorkers`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from schemas.config import AdvantageSection, ResponseRewardSection, section, validate_config
from schemas.errors import RollflowError
from schemas.train_flow_config import TrainFlowConfig
from stages.storage import Location

log = logging.getLogger("rollflow.train")
CONFIG_FILE = "config.json"
RUN_LOG = "logs/rollflow.log"  # the command's log (flows/console.py), appended by every resume


def run_folder(config) -> Location:
    """The run folder ``<runs_dir>/<run_name>`` of a training config (either pipeline)."""
    return Location.of(f"{config.runs_dir}/{config.run_name}")


def run_log(config) -> tuple[str, str | None]:
    """The run folder and its log file (None when the run folder is not local: the log stays in the cache)."""
    import pyarrow.fs as pafs

    run = run_folder(config)
    local = isinstance(run.fs, pafs.LocalFileSystem)
    return run.uri(), (f"{run.path}/{RUN_LOG}" if local else None)


def iter_dir(run: str, iteration: int) -> str:
    return f"{run}/iter_{iteration:04d}"


@dataclass
class KeptWorkers:
    """The workers a training flow keeps from one iteration to the next, besides the generation engines: the
    forward workers (models loaded once, new checkpoints copied in place) and the training worker group (DeepSpeed
    engines kept in memory). Started on first use; the flow closes them at its end."""

    trainer: Any  # stages.train.group.TrainerGroup
    forward: Any  # stages.train.stage.ForwardWorkers

    @classmethod
    def of(cls, config, run: str) -> "KeptWorkers":
        from stages.train.group import TrainerGroup
        from stages.train.stage import ForwardWorkers

        return cls(TrainerGroup(config.train_step_config().runtime, storage=run), ForwardWorkers(config.logprobs))

    def close(self) -> None:
        self.trainer.close()
        self.forward.close()


def _stage_task(name: str):
    return task(name=name, cache_policy=NO_CACHE, retries=0)


@_stage_task("rollout")
def rollout_task(config: TrainFlowConfig, iteration: int, output: str, checkpoint: str, pool) -> Any:
    from stages.rollout.driver import run_rollout

    return run_rollout(config.rollout_for(iteration), output, checkpoint, pool=pool,
                       on_event=_turn_progress(f"iteration {iteration}", "rollout"),
                       label=f"[iteration {iteration}] rollout")


@_stage_task("eval")
def eval_task(config: TrainFlowConfig, output: str, checkpoint: str, pool) -> Any:
    from stages.rollout.driver import run_rollout

    return run_rollout(config.eval_rollout(), output, checkpoint, pool=pool, on_event=_turn_progress("eval", "eval"),
                       label="[eval] eval")


def _turn_progress(label: str, what: str):
    """A rollout event callback that prints one progress line per committed turn."""
    def notify(name: str, info: dict) -> None:
        if name == "turn":
            r = info["result"]
            state = "committed earlier, skipped" if r.skipped else f"{r.seconds:.0f}s"
            print(f"[{label}] {what} turn {info['turn']}: {int(r.metrics.get('rows', 0))} episodes played, "
                  f"{int(r.metrics.get('active', 0))} still active ({state})", flush=True)

    return notify


@_stage_task("logprobs")
def logprobs_task(config: TrainFlowConfig, samples: str, checkpoint: str, reference: str, output: str,
                  workers: KeptWorkers | None = None) -> Any:
    from stages.train.stage import run_logprobs

    return run_logprobs(samples, checkpoint, config.logprobs, output, reference=reference,
                        workers=workers.forward if workers else None)


@_stage_task("values")
def values_task(config: TrainFlowConfig, samples: str, checkpoint: str, output: str,
                workers: KeptWorkers | None = None) -> Any:
    from stages.train.stage import run_values

    return run_values(samples, checkpoint, config.logprobs, output, workers=workers.forward if workers else None)


@_stage_task("response_rewards")
def rewards_task(config: TrainFlowConfig, samples: str, output: str) -> Any:
    from stages.recompute import ResponseRewardsStage
    from stages.runner import run_stage

    rewards = section(config, ResponseRewardSection).model_copy(update={"group_size": config.rollout.env.group_size})
    return run_stage(ResponseRewardsStage(), rewards, {"samples": samples}, output)


@_stage_task("advantages")
def advantages_task(config: TrainFlowConfig, samples: str, rewarded: str, output: str, state_in: dict) -> Any:
    from stages.recompute import AdvantagesStage
    from stages.runner import run_stage

    return run_stage(AdvantagesStage(), section(config, AdvantageSection), {"samples": samples, "rewarded": rewarded},
                     output, state_in=state_in)


@_stage_task("train")
def train_task(config: TrainFlowConfig, iteration: int, samples: str, checkpoint: str, output: str,
               workers: KeptWorkers | None = None) -> Any:
    """The training step of ``iteration``: DeepSpeed's state is written every ``train.save_steps`` iterations and at
    the last, weights and a replay record otherwise."""
    from stages.train.stage import run_train_step

    train = config.train_step_config()
    return run_train_step(samples, checkpoint, train, output, label=f"[iteration {iteration}] train",
                          trainer=workers.trainer if workers else None,
                          full_state=train.full_state_at(iteration, config.max_steps))


def record(metrics, iteration: int, stage: str, result: Any, values: dict | None = None, *,
           label: str | None = None) -> dict[str, float]:
    """Log a stage result's numeric, finite metrics (or ``values``) and its wall time under (iteration, stage),
    print a progress line headed ``[label]`` (default ``[iteration <iteration>]``), and return the logged values.
    A stage skipped on resume keeps the record of the run that computed it (its real wall time); it is logged only
    when that record is missing (killed between the commit and the metrics)."""
    raw = values if values is not None else (getattr(result, "metrics", None) or {})
    logged = {k: float(v) for k, v in raw.items() if isinstance(v, (int, float)) and v == v}
    seconds = getattr(result, "seconds", None)
    skipped = getattr(result, "skipped", False)
    if not (skipped and metrics.has(iteration, stage)):
        metrics.log(iteration, stage, logged, wall_s=seconds)
    done = "committed earlier, skipped" if skipped else f"{seconds or 0:.0f}s"
    print(f"[{label or f'iteration {iteration}'}] {stage:<16} {done}", flush=True)
    return logged


def start_run(config, cfg: dict, max_model_len: int):
    """The set-up both training flows share: freeze ``cfg`` in the run folder (refusing a different one), start or
    join Ray, check the CPU budget, resolve the initial policy, and make the engine pool (built on first use).
    Returns (run folder, initial policy folder, pool)."""
    from stages.cluster import ensure_ray
    from stages.rollout.driver import resolve_model_dir
    from stages.rollout.engine_pool import EnginePool

    run = run_folder(config)
    save_run_config(run, cfg)
    settings = ensure_ray(config.runtime.ray_address, config.runtime.num_cpus)
    check_cpu_budget(config, float(settings["cpus"] or 0))
    base = resolve_model_dir(config.pretrain)
    return run, base, EnginePool(config.generation_engine(), base, max_model_len)


def _rollout_metrics(result: Any) -> dict[str, float]:
    """Rollout metrics: the samples stage's (success, valid actions, lengths, tokens) plus the timing split."""
    out = dict(result.samples.metrics)
    out.update({f"time/rollout/{k.removesuffix('_seconds')}": v for k, v in result.timings.items()})
    return out


def save_run_config(run: Location, cfg: dict) -> None:
    """Freeze the run's config next to its outputs (what ``--resume`` reads). Refuses a different config."""
    path = run.child(CONFIG_FILE)
    if path.exists():
        old = json.loads(path.read_text())
        if old != cfg:
            raise RollflowError(f"run folder {run.path} was started with another config; resume it with "
                                f"`rollflow train --resume {run.path}`, or choose a new run_name")
        return
    run.fs.create_dir(run.path, recursive=True)
    path.write_text(json.dumps(cfg, indent=1, sort_keys=True))


def check_cpu_budget(config, cluster_cpus: float) -> None:
    """The engine actors live for the whole run, so the log-prob actors and the training workers must fit beside
    them with a CPU left for Ray Data's read/write tasks; otherwise Ray Data waits forever (STACK.md). ``config``:
    a training config (:class:`TrainFlowConfig` or ``RLVRTrainConfig``)."""
    engine = config.generation_engine()
    engines = engine.num_cpus_per_engine * engine.num_engines
    forward = config.logprobs.cpus_per_actor
    train = config.train.runtime.cpus_per_worker * config.train.runtime.num_workers
    need = engines + max(forward + 0.5, train)  # log-prob actors run next to Ray Data's read/write tasks
    if need > cluster_cpus:
        raise RollflowError(
            f"the run needs {need:g} CPUs of Ray's {cluster_cpus:g}: engines hold {engines:g} for the whole run, "
            f"log-prob actors {forward:g} plus a share for Ray Data's tasks, training workers {train:g}; otherwise "
            "a stage would wait forever. Set num_cpus_per_engine: 0 in the engine section (the engine idles outside "
            "generation), or lower train.runtime.num_workers / cpus_per_worker, or logprobs.cpus_per_actor")


@flow(name="train")  # progress lines go to stdout; Prefect logs to the log file (flows/console.py)
def train_flow(cfg: dict) -> dict:
    """Run (or resume) the training run described by ``cfg`` (a :class:`TrainFlowConfig` as JSON)."""
    from stages.metrics import MetricsLog
    from stages.train.checkpoint import keep_training_state

    config = validate_config(TrainFlowConfig, cfg)
    run, base, pool = start_run(config, cfg, config.rollout.engine.max_model_len or config.rollout.sequence_length)
    workers = KeptWorkers.of(config, run.path)
    started = time.time()
    summary: dict[str, Any] = {"run": run.path, "iterations": []}
    with MetricsLog(run.path) as metrics:
        try:
            checkpoint = base
            trained: list[str] = []  # this run's checkpoints, oldest first
            kl_state: dict = {}
            if config.eval.eval_steps:
                ev = eval_task(config, f"{run.path}/eval_base", checkpoint, pool)
                record(metrics, 0, "eval", ev, _rollout_metrics(ev), label="eval before training")
                summary["base_eval"] = ev.samples.metrics
            for k in range(config.max_steps):
                here = iter_dir(run.path, k)
                ro = rollout_task(config, k, f"{here}/rollout", checkpoint, pool)
                record(metrics, k, "rollout", ro, _rollout_metrics(ro))
                lp = logprobs_task(config, ro.samples.output, checkpoint, base, f"{here}/logprobs", workers)
                record(metrics, k, "logprobs", lp)
                samples = lp.output
                if config.train_step_config().needs_critic:
                    vals = values_task(config, samples, checkpoint, f"{here}/values", workers)
                    record(metrics, k, "values", vals)
                    samples = vals.output
                rw = rewards_task(config, samples, f"{here}/rewarded")
                record(metrics, k, "response_rewards", rw)
                adv = advantages_task(config, samples, rw.output, f"{here}/advantaged", kl_state)
                record(metrics, k, "advantages", adv)
                kl_state = adv.state
                tr = train_task(config, k, adv.output, checkpoint, f"{here}/checkpoint", workers)
                record(metrics, k, "train", tr)
                checkpoint = tr.output
                trained.append(checkpoint)
                keep_training_state(trained, config.train_step_config().max_ckpt_to_keep)
                evaluated = None
                if config.eval.eval_steps and (k + 1) % config.eval.eval_steps == 0:
                    ev = eval_task(config, f"{here}/eval", checkpoint, pool)
                    # the metrics table files it under k + 1 (the policy after k + 1 steps); the line says when it ran
                    record(metrics, k + 1, "eval", ev, _rollout_metrics(ev), label=f"eval after iteration {k}")
                    evaluated = ev.samples.metrics
                summary["iterations"].append({"iteration": k, "checkpoint": checkpoint, "train_metrics": tr.metrics,
                                              "rollout_metrics": ro.samples.metrics, "eval_metrics": evaluated})
        finally:
            workers.close()
            pool.close()
    summary["seconds"] = time.time() - started
    summary["checkpoint"] = checkpoint
    return summary


def train_summary_lines(summary: dict) -> list[str]:
    """A readable table of a finished run: per iteration the rollout's and the evaluation's success and valid-action
    rates, the policy loss and the KL to the old policy."""
    def rate(m: dict | None, key: str) -> str:
        return f"{m[key]:.3f}" if m and key in m else "-"

    lines = [f"{'':>14} {'rollout':>17} {'evaluation':>17}",
             f"{'':>14} {'success':>8} {'valid':>8} {'success':>8} {'valid':>8} {'pg_loss':>9} {'approx_kl':>9}"]
    base = summary.get("base_eval")
    if base:
        lines.append(f"{'untrained':>14} {'':>8} {'':>8} {rate(base, 'rollout/success_rate'):>8} "
                     f"{rate(base, 'rollout/valid_action_rate'):>8}")
    for it in summary["iterations"]:
        ro, ev, tr = it["rollout_metrics"], it.get("eval_metrics"), it["train_metrics"]
        loss, kl = tr.get("actor/pg_loss"), tr.get("actor/approxkl", tr.get("actor/ppo_kl"))
        lines.append(f"{'iteration ' + str(it['iteration']):>14} {rate(ro, 'rollout/success_rate'):>8} "
                     f"{rate(ro, 'rollout/valid_action_rate'):>8} {rate(ev, 'rollout/success_rate'):>8} "
                     f"{rate(ev, 'rollout/valid_action_rate'):>8} "
                     f"{'-' if loss is None else f'{loss:.4g}':>9} {'-' if kl is None else f'{kl:.3g}':>9}")
    lines.append(f"run {summary['run']} finished in {summary['seconds']:.0f}s; last checkpoint "
                 f"{summary['checkpoint']}")
    return lines
