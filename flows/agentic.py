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

from typing import Any

from prefect import flow

from flows.loop import (TRAIN_STEP, VALUES_STEP, Evaluation, IterStep, PipelineFlow, Run, advantages_step,
                        logprobs_step, rewards_step, run_pipeline)
from flows.pipeline_specs import PIPELINE_SPECS
from flows.runkit import stage_task
from schemas.config import AdvantageSection, ResponseRewardSection, section, validate_config
from schemas.train_flow_config import TrainFlowConfig
from stages import cluster
from stages.rollout.driver import pool_source, resolve_model_dir, run_eval, run_rollout
from stages.rollout.engine_pool import EnginePool

iter_dir = PIPELINE_SPECS.get("agentic").step_dir  # runs/<run>/iter_<k>


@stage_task("rollout")
def rollout_task(config: TrainFlowConfig, iteration: int, output: str, checkpoint: str, pool) -> Any:
    """The rollout of ``iteration`` with ``checkpoint``; played ahead (async_generation_ratio > 0) its samples carry
    their staleness (:meth:`RunOptions.rollout_staleness`)."""
    return run_rollout(config.rollout_for(iteration), output, checkpoint, pool=pool,
                       on_event=_turn_progress(f"iteration {iteration}", "rollout"),
                       label=f"[iteration {iteration}] rollout", staleness=config.rollout_staleness(iteration))


@stage_task("eval")
def eval_task(config: TrainFlowConfig, output: str, checkpoint: str, pool) -> Any:
    """The held-out rollout with ``checkpoint``, committed with its own manifest (the checkpoint it read), so that a
    re-run of the training step with ``rollflow stage ... --downstream`` re-runs it too."""
    return run_eval(config.eval_rollout(), output, checkpoint, pool=pool, on_event=_turn_progress("eval", "eval"),
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


def rewards_section(config: TrainFlowConfig) -> ResponseRewardSection:
    """The response-rewards section of an agentic run: the algorithm's options and the rollout's group size."""
    return section(config, ResponseRewardSection).model_copy(update={"group_size": config.rollout.env.group_size})


def _rollout_metrics(result: Any) -> dict[str, float]:
    """Rollout metrics: the samples stage's (success, valid actions, lengths, tokens) plus the timing split."""
    out = dict(result.samples.metrics)
    out.update({f"time/rollout/{k.removesuffix('_seconds')}": v for k, v in result.timings.items()})
    return out


def _summarize(r: Run, evaluated: dict | None) -> dict:
    return {"iteration": r.iteration, "checkpoint": r.checkpoint, "train_metrics": r.results["train"].metrics,
            "rollout_metrics": r.results["rollout"].samples.metrics, "eval_metrics": evaluated}


# The agentic pipeline: per iteration rollout -> logprobs (-> values) -> rewarded -> advantaged -> checkpoint, and the
# held-out evaluation before training and every eval.eval_steps iterations.
AGENTIC = PipelineFlow(
    spec=PIPELINE_SPECS.get("agentic"),
    iteration=(
        IterStep("rollout", lambda r: rollout_task(r.config, r.iteration, r.out("rollout"), r.checkpoint, r.pool),
                 metrics=lambda ro: _rollout_metrics(ro), generation=True),
        logprobs_step(lambda r: r.results["rollout"].samples.output),
        VALUES_STEP,
        rewards_step(rewards_section, Run.tokens),
        advantages_step(lambda config: section(config, AdvantageSection)),
        TRAIN_STEP,
    ),
    evaluation=Evaluation("eval", "eval_base", "eval", every=lambda config: config.eval.eval_steps,
                          run=lambda r, output, checkpoint, when: eval_task(r.config, output, checkpoint, r.pool),
                          metrics=lambda ev: _rollout_metrics(ev), summary=lambda ev: ev.samples.metrics),
    summarize=_summarize, base_summary="base_eval", step_word="iteration")


@flow(name="train")  # progress lines go to stdout; Prefect logs to the log file (flows/console.py)
def train_flow(cfg: dict) -> dict:
    """Run (or resume) the training run described by ``cfg`` (a :class:`TrainFlowConfig` as JSON): the agentic
    declaration run by the one loop (flows/loop.py)."""
    return run_pipeline(AGENTIC, validate_config(TrainFlowConfig, cfg), cfg)


@flow(name="eval")  # the progress lines go to stdout; Prefect logs to the log file (flows/console.py)
def eval_flow(cfg: dict, checkpoint: str, output: str) -> dict:
    """Evaluate ``checkpoint`` on the held-out levels of the agentic config ``cfg`` — its ``eval`` section: the seeds
    and episodes of a training run's evaluations, so the result equals that run's evaluation of the same checkpoint —
    without training. The rollout is committed under ``output`` (a re-run skips it, a killed one resumes)."""
    config = validate_config(TrainFlowConfig, cfg)
    rt = config.runtime
    cluster.ensure_ray(rt.ray_address, rt.num_cpus, data_memory_mb=rt.data_memory_mb)
    model = resolve_model_dir(checkpoint)
    pool = EnginePool(config.generation_engine(), pool_source(checkpoint, model), config.generation_window())
    try:
        ev = eval_task(config, output, model, pool)
    finally:
        pool.close()
    return {"output": ev.output, "checkpoint": model, "metrics": _rollout_metrics(ev), "skipped": ev.samples.skipped,
            "episodes": config.eval.num_env_groups * config.eval.group_size}


def eval_summary_lines(summary: dict) -> list[str]:
    """The evaluation's rates and the folder of its episodes."""
    m = summary["metrics"]
    lines = [f"evaluated {summary['checkpoint']} on {summary['episodes']} held-out episodes"]
    for key in ("rollout/success_rate", "rollout/valid_action_rate", "rollout/format_penalty_rate",
                "rollout/mean_episode_length", "rollout/episode_score/mean"):
        if key in m:
            lines.append(f"  {key:<30} {m[key]:.4g}")
    tags = sorted({k.split("/")[1] for k in m if k.startswith("rollout/") and k.endswith("/success_rate")
                   and k.count("/") == 2})
    if len(tags) > 1:  # a mixed evaluation: the rates of each environment
        for tag in tags:
            lines.append(f"  {tag:<30} success {m[f'rollout/{tag}/success_rate']:.4g}, valid actions "
                         f"{m[f'rollout/{tag}/valid_action_rate']:.4g} ({int(m[f'rollout/{tag}/episodes'])} episodes)")
    lines.append(f"episodes: {summary['output']}  (rollflow show {summary['output']} to read them)")
    return lines


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
