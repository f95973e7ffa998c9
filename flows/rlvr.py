"""The RLVR pipeline: ``rollflow train`` for configs with ``pipeline: rlvr`` (a Prefect flow of stage calls), and the
scoring of stored responses that ``rollflow score`` runs offline and the flow runs once per step
(:func:`score_responses`: the reward stage, then optionally the RLVR chain up to advantages).

Per step ``k`` (policy after ``k`` training steps), every output under ``runs/<run>/step_<k>/<stage>/``, in ROLL's
order: responses (``rollout_batch_size`` prompts × ``num_return_sequences_in_group`` samples from the engine pool) →
scored (reward workers, routed by domain; ROLL scores each response as it is generated) → samples (the token table
in the layout of every samples table) → logprobs (old/ref log-probs under the step's policy) → values (the critic's,
for ``adv_estimator: gae``) → rewarded (sample masks, reward post-processing per domain) → advantaged (token
rewards with the KL to the reference, advantages, ``final_response_mask``: the advantages stage both pipelines run)
→ checkpoint (one PPO step; the loss is aggregated over ``final_response_mask``).

With ``async_generation_ratio: r > 0`` the one loop generates the responses of steps k + 1 .. k + ceil(r) while step
k's scoring and later stages run (flows/loop.py), each step's with the policy its manifest names, and the samples
carry their staleness (training steps between that policy and the trained one) to the table training reads.

The prompts table is written once under ``runs/<run>/prompts``. Every stage goes through the one runner, so
``--resume`` after a crash continues with the first missing output; the running reward moments and the KL
controller travel in the manifests' state.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.dataset as pads
from prefect import flow

from flows.loop import (TRAIN_STEP, VALUES_STEP, Evaluation, IterStep, PipelineFlow, Run, advantages_step,
                        first_state, logprobs_step, rewards_step, run_pipeline, run_steps)
from flows.pipeline_specs import PIPELINE_SPECS, rlvr_judged
from flows.runkit import stage_task
from schemas.config import validate_config
from schemas.errors import RollflowError
from schemas.rlvr_config import reward_section, rlvr_advantage_section, rlvr_reward_section
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.rollout_config import EngineIdentity
from stages import cluster, progress
from stages.advantages import AdvantagesStage
from stages.algos.intervals import mean_interval
from stages.preflight import Step
from stages.response_rewards import ResponseRewardsStage
from stages.rlvr.generate import (GenerateSection, GenerateStage, PromptsStage, judge_pool, judge_services, needs_model,
                                  prompts_section, reads_context, resumed_section, step_prompt_ids)
from stages.rlvr.stages import RewardStage, RLVRSamplesStage, SamplesSection, run_context
from stages.rollout.driver import pool_source, resolve_model_dir
from stages.rollout.engine_pool import EnginePool, checkpoint_fingerprint
from stages.run_folder import run_folder
from stages.runner import run_stage
from stages.storage import Location, read_manifest


step_dir = PIPELINE_SPECS.get("rlvr").step_dir  # runs/<run>/step_<k>


def _reward_workers(r: Run) -> Any:
    """The reward workers on the responses (``r.held["responses"]``) -> ``scored``: the services the run holds (an LLM
    judge's engines, ``r.held["services"]``) serve their routes, and the workers that read the run's context
    (``training_progress`` in ``r.state``) get it."""
    rt = r.config.runtime
    return run_stage(RewardStage(r.held.get("services")), reward_section(r.config), {"responses": r.held["responses"]},
                     r.out("scored"), force=r.force, batch_rows=rt.batch_rows, state_in=run_context(r.state),
                     resources=rt.resources_for("rewards"))


def _token_table(r: Run) -> Any:
    """The responses and their scores -> ``samples``, the token table of every pipeline; responses generated ahead of
    training (a training step's, ``r.held["staleness"]`` not None) get their staleness column."""
    rt = r.config.runtime
    return run_stage(RLVRSamplesStage(), SamplesSection(staleness=r.held.get("staleness")),
                     {"responses": r.held["responses"], "scored": r.out("scored")}, r.out("samples"), force=r.force,
                     batch_rows=rt.batch_rows, state_in={}, resources=rt.resources_for("rlvr_samples"))


# The scoring of a step's responses (and of rollflow score): the reward workers, then the token table; then the chain
# both pipelines share, response-level rewards per domain (on the samples and the workers' scores) and advantages.
REWARD_WORKERS = IterStep("rewards", _reward_workers)
SCORING = (REWARD_WORKERS, IterStep("samples", _token_table))
RLVR_REWARDS = rewards_step(rlvr_reward_section, lambda r: r.out("samples"), scored=lambda r: r.out("scored"))
RLVR_ADVANTAGES = advantages_step(rlvr_advantage_section)


def score_steps(input_dir: str, output_dir: str, cfg, *, advantages: bool = False) -> list[Step]:
    """The stages :func:`score_responses` runs, with their inputs and outputs: what the pre-flight check
    (stages/preflight.py) checks before Prefect and Ray start."""
    out = output_dir.rstrip("/")
    steps = [Step(RewardStage(), reward_section(cfg), {"responses": input_dir}, f"{out}/scored")]
    if advantages:
        steps += [Step(RLVRSamplesStage(), SamplesSection(), {"responses": input_dir, "scored": f"{out}/scored"},
                       f"{out}/samples"),
                  Step(ResponseRewardsStage(), rlvr_reward_section(cfg), {"samples": f"{out}/samples",
                                                                           "scored": f"{out}/scored"},
                       f"{out}/rewarded"),
                  Step(AdvantagesStage(), rlvr_advantage_section(cfg), {"samples": f"{out}/samples",
                                                                        "rewarded": f"{out}/rewarded"},
                       f"{out}/advantaged")]
    return steps


def score_responses(input_dir: str, output_dir: str, cfg, *, advantages: bool = False, force: bool = False,
                    services: dict | None = None) -> dict[str, Any]:
    """The reward workers (and with ``advantages`` the rest of an RLVR step's scoring and the chain up to advantages,
    without log-probs: the responses' own log-prob columns, if any) on the responses in ``input_dir``, the steps of
    the RLVR declaration run as the loop runs them (flows/loop.py ``run_steps``). Outputs: ``<output_dir>/scored``
    (+ ``samples``, ``rewarded``, ``advantaged``), the results by folder name; ``services``: reward-stage service factories. Runs on the Ray
    cluster its caller connected to (``rollflow score``, the RLVR flow's validation)."""
    r = Run.of_folder(cfg, output_dir, held={"responses": input_dir, "services": services},
                      state=first_state("response_rewards", "advantages"), force=force)
    steps = (*SCORING, RLVR_REWARDS, RLVR_ADVANTAGES) if advantages else (REWARD_WORKERS,)
    return {Location.of(result.output).name: result for result in run_steps(steps, r).values()}


def refuse_old_layout(run: Location) -> None:
    """A run folder whose RLVR steps were written by an earlier layout cannot be resumed by this version: refused
    with the fix. Two earlier layouts: advantages computed in two passes on the responses (``step_*/first_pass``,
    stage ``rlvr_advantages``), and rewards by a separate RLVR stage on the responses (``step_*/rlvr_rewarded``;
    now the response-rewards stage of both pipelines on the samples, with the domains in ``scored``)."""
    step0 = run.child("step_0000")
    layouts = {
        "computed the advantages on the responses before the log-probs (step_*/first_pass, stage rlvr_advantages)":
            step0.child("first_pass").exists() or (
                step0.child("advantaged").exists()
                and (read_manifest(step0.child("advantaged")) or {}).get("stage") == "rlvr_advantages"),
        "computed the rewards with a separate RLVR stage (step_*/rlvr_rewarded, stage rlvr_rewards)":
            step0.child("rlvr_rewarded").exists(),
    }
    for what, found in layouts.items():
        if found:
            raise RollflowError(f"run folder {run.uri()} was written by an earlier rollflow whose RLVR steps {what}; "
                                "this version runs the stages both pipelines share, in ROLL's order, and cannot "
                                "continue it. Start a new run (another run_name), or finish this one with the "
                                "rollflow that started it")


@stage_task("prompts")
def prompts_task(prompts, output: str) -> Any:
    """The prompts table of a prompt set (``prompts``: the run's prompts or its validation prompts)."""
    section = resumed_section(prompts_section(prompts.data_dir, prompts.domains, prompts.limit), output)
    return run_stage(PromptsStage(), section, {}, output)


def _generate(config: RLVRTrainConfig, section_values: dict, prompts: str, checkpoint: str, pool, output: str,
              label: str) -> Any:
    """Responses of the prompts ``section_values["prompt_ids"]`` under ``checkpoint`` (the pool loads it in place),
    committed in ``output``; the rest of the generation section comes from the run's config."""
    engine = EngineIdentity(backend=config.engine.backend, dtype=config.engine.dtype,
                            max_model_len=config.generation_window())
    section = GenerateSection(**{"seed": config.seed, "sequence_length": config.sequence_length, "engine": engine,
                                 **section_values})
    pool.use_checkpoint(checkpoint)
    with progress.bar(label, "responses", total=len(section.prompt_ids) * section.n) as ticker:
        return run_stage(GenerateStage(pool, ticker), section, {"prompts": prompts}, output,
                         state_in={"checkpoint": checkpoint_fingerprint(checkpoint)})


def _read(where: str, columns: list[str]):
    """Columns of the committed table at ``where``."""
    loc = Location.of(where)
    return pads.dataset(loc.parquet_files(), filesystem=loc.fs).to_table(columns=columns)


def _prompt_ids(prompts: str) -> list[str]:
    return _read(prompts, ["prompt_id"]).column(0).to_pylist()


@stage_task("generate")
def generate_task(config: RLVRTrainConfig, step: int, prompts: str, checkpoint: str, pool, output: str) -> Any:
    ids = step_prompt_ids(_prompt_ids(prompts), step, config.rollout_batch_size, config.seed)
    return _generate(config, {"run_name": config.run_name, "step": step, "n": config.num_return_sequences_in_group,
                              "prompt_ids": tuple(ids), "system_prompt": config.prompts.system_prompt,
                              "generating_args": config.generating_args}, prompts, checkpoint, pool, output,
                     f"[iteration {step}] generate")


@stage_task("validation")
def validation_task(config: RLVRTrainConfig, prompts: str, checkpoint: str, pool, judge, output: str,
                    label: str) -> SimpleNamespace:
    """Every validation prompt answered under ``checkpoint`` (the same sampling seeds at every validation) and
    scored by the validation's reward routes, under ``output``. Returns the generation and scoring results, their
    seconds, and the metrics: ``val/score/mean`` and ``val/<domain>/score/mean`` over scored rows, ``val/unscored``."""
    v = config.validation
    gen = _generate(config, {"run_name": f"{config.run_name}-val", "step": 0, "n": v.num_return_sequences,
                             "prompt_ids": tuple(_prompt_ids(prompts)), "system_prompt": v.prompts.system_prompt,
                             "generating_args": config.generating_args.model_copy(update={"temperature": v.temperature}),
                             }, prompts, checkpoint, pool, f"{output}/responses", f"[{label}] validation")
    rewards = config.validation_rewards()
    scored = score_responses(gen.output, output, config.model_copy(update={"rewards": rewards}),
                             services=judge_services(rewards, config.judge, judge))["scored"]
    return SimpleNamespace(output=output, responses=gen, scored=scored, seconds=gen.seconds + scored.seconds,
                           skipped=gen.skipped and scored.skipped,
                           metrics=validation_metrics(gen.output, scored.output, rewards.domain_column))


def validation_metrics(responses: str, scored: str, domain_column: str) -> dict[str, float]:
    """Mean score over the scored rows, overall and per domain (``val/[<domain>/]score/mean``), with its 95 %
    interval (``.../ci95_low``, ``.../ci95_high``: Wilson's for 0/1 scores, else the normal approximation; the
    report draws it) and the rows it rests on (``val/[<domain>/]scored``), and the number of unscored rows."""
    domains = dict(zip(*(_read(responses, ["row_id", domain_column]).column(i).to_pylist() for i in (0, 1))))
    table = _read(scored, ["row_id", "scores"])
    rows = list(zip(table.column("row_id").to_pylist(), table.column("scores").to_pylist()))
    metrics = {"val/unscored": float(sum(score is None for _, score in rows))}
    for name, keep in [("", None), *((f"{d}/", d) for d in sorted(set(domains.values())))]:
        values = [score for rid, score in rows if score is not None and (keep is None or domains[rid] == keep)]
        metrics[f"val/{name}score/mean"] = float(np.mean(values)) if values else 0.0
        metrics[f"val/{name}scored"] = float(len(values))
        if values:
            low, high = mean_interval(np.array(values, float))
            metrics[f"val/{name}score/ci95_low"], metrics[f"val/{name}score/ci95_high"] = low, high
    return metrics


@stage_task("rewards")
def score_task(config: RLVRTrainConfig, step: int, responses: str, output: str, judge) -> dict[str, Any]:
    """The reward workers on the step's responses, then its token table (``scored``, ``samples``; the results by step
    name, ``rewards`` and ``samples``). An LLM judge route
    is served by the run's judge engine (``judge``: its pool, None without such a route); workers that read the
    training progress get ``step / max_steps`` (ROLL's global_step / max_steps). Responses generated ahead
    (async_generation_ratio > 0) give the samples their staleness (:meth:`RunOptions.rollout_staleness`)."""
    services = judge_services(config.rewards, config.judge, judge)
    context = {"training_progress": step / config.max_steps} if reads_context(config.rewards, "training_progress") \
        else {}
    held = {"responses": responses, "services": services, "staleness": config.rollout_staleness(step)}
    return run_steps(SCORING, Run.of_folder(config, output, held=held, state=context))


def _setup(r: Run) -> None:
    """The prompts (and validation prompts), the LLM judge's engines when a route needs them (built on first use),
    and the running reward moments the first step starts from."""
    config = r.config
    # the judge's engines are part of the run's resource plan (flows/pipeline_specs.py)
    r.held["judge"] = judge_pool(config.judge) if rlvr_judged(config) else None
    r.held["prompts"] = prompts_task(config.prompts, r.run.child("prompts").uri()).output
    if config.validation.eval_steps > 0:
        r.held["val_prompts"] = prompts_task(config.validation.prompts, r.run.child("val_prompts").uri()).output
    r.state.update(first_state("response_rewards"))


def _close(r: Run) -> None:
    if r.held.get("judge") is not None:
        r.held["judge"].close()


def _score(r: Run) -> dict[str, Any]:
    """The reward workers' scores and the step's token table, by the names they are recorded under."""
    return score_task(r.config, r.iteration, r.results["generate"].output, r.here, r.held.get("judge"))


def _finite(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and value == value else None


def _summarize(r: Run, validated: dict | None) -> dict:
    return {"iteration": r.iteration, "checkpoint": r.checkpoint, "train_metrics": r.results["train"].metrics,
            "score": _finite(r.results["rewards"].metrics, "critic/score/mean"),
            "generate_metrics": r.results["generate"].metrics, "validation": validated}


# The RLVR pipeline: per step generate -> scored, samples -> logprobs (-> values) -> rewarded -> advantaged ->
# checkpoint, and the validation before training and every validation.eval_steps steps.
RLVR = PipelineFlow(
    spec=PIPELINE_SPECS.get("rlvr"),
    iteration=(
        IterStep("generate", lambda r: generate_task(r.config, r.iteration, r.held["prompts"], r.checkpoint, r.pool,
                                                     r.out("responses")), generation=True),
        IterStep("score", _score, records=("rewards", "samples")),  # the reward workers, then the token table
        logprobs_step(lambda r: r.results["samples"].output),
        VALUES_STEP,
        RLVR_REWARDS,
        RLVR_ADVANTAGES,
        TRAIN_STEP,
    ),
    evaluation=Evaluation(
        "validation", "val_base", "validation", every=lambda config: config.validation.eval_steps,
        run=lambda r, output, checkpoint, when: validation_task(r.config, r.held["val_prompts"], checkpoint, r.pool,
                                                                r.held.get("judge"), output, when),
        metrics=lambda val: val.metrics, summary=lambda val: val.metrics),
    summarize=_summarize, base_summary="base_validation", step_word="step",
    before_start=lambda config: refuse_old_layout(run_folder(config)), setup=_setup, close=_close,
    summary_fields={"pipeline": "rlvr"})


@flow(name="rlvr-train")  # progress lines go to stdout; Prefect logs to the log file (flows/console.py)
def rlvr_train_flow(cfg: dict) -> dict:
    """Run (or resume) the RLVR training run described by ``cfg`` (an :class:`RLVRTrainConfig` as JSON): the RLVR
    declaration run by the one loop (flows/loop.py)."""
    return run_pipeline(RLVR, validate_config(RLVRTrainConfig, cfg), cfg)


def rlvr_summary_lines(summary: dict) -> list[str]:
    """Per step: mean score of the step's responses (before its update), policy loss, response tokens/s, and the
    validation score after the step (when the run validates)."""
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'':>10} {'score':>8} {'pg_loss':>10} {'gen tok/s':>10} {'val score':>10}"]
    if summary.get("base_validation"):
        lines.append(f"{'untrained':>10} {'':>8} {'':>10} {'':>10} "
                     f"{fmt(summary['base_validation'].get('val/score/mean'), '.3f'):>10}")
    for it in summary["iterations"]:
        val = (it.get("validation") or {}).get("val/score/mean")
        lines.append(f"{'step ' + str(it['iteration']):>10} {fmt(it['score'], '.3f'):>8} "
                     f"{fmt(it['train_metrics'].get('actor/pg_loss'), '.4g'):>10} "
                     f"{fmt(it['generate_metrics'].get('generate/tokens_per_second'), '.1f'):>10} "
                     f"{fmt(val, '.3f'):>10}")
    lines.append(f"run {summary['run']} finished in {summary['seconds']:.0f}s; last checkpoint "
                 f"{summary['checkpoint']}")
    return lines


@flow(name="rlvr-eval")  # progress lines go to stdout; Prefect logs to the log file (flows/console.py)
def rlvr_eval_flow(cfg: dict, checkpoint: str | None, output: str) -> dict:
    """Validate ``checkpoint`` (default: the config's initial policy) on the validation prompts of the RLVR config
    ``cfg`` without training — the seeds of a run's validations, so the result equals that run's validation of the
    same checkpoint. Its prompts, responses and scores are committed under ``output`` (resumable)."""
    config = validate_config(RLVRTrainConfig, cfg)
    rt = config.runtime
    cluster.ensure_ray(rt.ray_address, rt.num_cpus, data_memory_mb=rt.data_memory_mb)
    model = resolve_model_dir(checkpoint or config.pretrain)
    pool = EnginePool(config.generation_engine(), pool_source(checkpoint or config.pretrain, model),
                      config.generation_window())
    judge = judge_pool(config.judge) if needs_model(config.validation_rewards()) else None
    try:
        prompts = prompts_task(config.validation.prompts, f"{output}/prompts")
        val = validation_task(config, prompts.output, model, pool, judge, output, "eval")
    finally:
        pool.close()
        if judge is not None:
            judge.close()
    return {"output": output, "checkpoint": model, "metrics": val.metrics, "responses": val.responses.output,
            "scored": val.scored.output}


def rlvr_eval_summary_lines(summary: dict) -> list[str]:
    """The validation's mean scores per domain and the folders of its responses and scores."""
    m = summary["metrics"]
    lines = [f"validated {summary['checkpoint']}"]
    lines += [f"  {key:<30} {m[key]:.4g}" for key in sorted(m)]
    lines.append(f"responses: {summary['responses']}  scores: {summary['scored']}")
    return lines
