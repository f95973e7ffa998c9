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

The prompts table is written once under ``runs/<run>/prompts``. Every stage goes through the one runner, so
``--resume`` after a crash continues with the first missing output; the running reward moments and the KL
controller travel in the manifests' state.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prefect import flow

from flows.loop import (TRAIN_STEP, VALUES_STEP, Evaluation, IterStep, PipelineFlow, Run, advantages_step,
                        logprobs_step, rewards_step, run_pipeline)
from flows.pipeline_specs import PIPELINE_SPECS, rlvr_judged
from flows.runkit import run_folder, stage_task
from schemas.config import validate_config
from schemas.errors import RollflowError
from schemas.rlvr_config import rlvr_advantage_section, rlvr_reward_section
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.stage_specs import is_declared, stage_spec
from stages.preflight import Step
from stages.storage import Location


step_dir = PIPELINE_SPECS.get("rlvr").step_dir  # runs/<run>/step_<k>


def reward_step(responses: str, out: str, cfg, services: dict | None = None) -> Step:
    """The reward workers on ``responses`` → ``<out>/scored``."""
    from schemas.rlvr_config import reward_section
    from stages.rlvr.stages import RewardStage

    return Step(RewardStage(services), reward_section(cfg), {"responses": responses}, f"{out}/scored")


def samples_step(responses: str, out: str) -> Step:
    """``responses`` and their scores → ``<out>/samples``, the token table of every pipeline."""
    from stages.rlvr.stages import RLVRSamplesStage, SamplesSection

    return Step(RLVRSamplesStage(), SamplesSection(), {"responses": responses, "scored": f"{out}/scored"},
                f"{out}/samples")


def chain_steps(out: str, cfg, samples: str) -> list[Step]:
    """Sample masks and normalised rewards per domain (the response-rewards stage of both pipelines, on the step's
    ``<out>/samples`` and ``<out>/scored`` → ``<out>/rewarded``), then the advantages stage of both pipelines on
    ``samples`` (with the log-probs and values its settings need) → ``<out>/advantaged``."""
    from schemas.rlvr_config import rlvr_advantage_section, rlvr_reward_section
    from stages.advantages import AdvantagesStage
    from stages.response_rewards import ResponseRewardsStage

    return [Step(ResponseRewardsStage(), rlvr_reward_section(cfg), {"samples": f"{out}/samples",
                                                                    "scored": f"{out}/scored"}, f"{out}/rewarded"),
            Step(AdvantagesStage(), rlvr_advantage_section(cfg), {"samples": samples, "rewarded": f"{out}/rewarded"},
                 f"{out}/advantaged")]


def score_steps(input_dir: str, output_dir: str, cfg, *, advantages: bool = False,
                services: dict | None = None) -> list[Step]:
    """The stages of ``rollflow score`` with their inputs and outputs: what :func:`score_responses` runs and what the
    pre-flight check (stages/preflight.py) checks before Prefect and Ray start."""
    out = output_dir.rstrip("/")
    steps = [reward_step(input_dir, out, cfg, services)]
    if advantages:
        steps += [samples_step(input_dir, out), *chain_steps(out, cfg, f"{out}/samples")]
    return steps


def run_steps(steps: list[Step], cfg, *, force: bool = False, state_in: dict | None = None,
              training_progress: float | None = None) -> dict[str, Any]:
    """Run ``steps`` in order through the runner; results by output folder name (scored, samples, rewarded,
    advantaged). ``state_in``: ``running_moments`` and ``kl_ctrl`` of a previous step (from its manifests' state);
    ``training_progress``: step / max_steps of a training run, given to the reward workers that read it."""
    from stages.rlvr.stages import RUN_CONTEXT
    from stages.runner import run_stage

    state_in = {**(state_in or {}), **({} if training_progress is None else {"training_progress": training_progress})}
    results = {}
    for step in steps:
        if step.stage.name == "rewards":
            state = {key: state_in[key] for key in RUN_CONTEXT if key in state_in}
        else:  # what the stage carries from one step to the next (its declaration's carries)
            spec = stage_spec(step.stage.name) if is_declared(step.stage.name) else None
            key = spec.carries[0] if spec is not None and spec.carries else None
            value = state_in[key] if key in state_in else spec.first_carried() if spec is not None else None
            state = {} if value is None else {key: value}
        results[step.output.rstrip("/").rsplit("/", 1)[-1]] = run_stage(
            step.stage, step.section, step.inputs, step.output, force=force, batch_rows=cfg.runtime.batch_rows,
            state_in=state, resources=cfg.runtime.resources_for(step.stage.name))
    return results


def score_responses(input_dir: str, output_dir: str, cfg, *, advantages: bool = False, force: bool = False,
                    state_in: dict | None = None, services: dict | None = None) -> dict[str, Any]:
    """Run the reward stage (and with ``advantages`` the RLVR chain up to advantages, without log-probs: the
    responses' own log-prob columns, if any) on the responses in ``input_dir``. Outputs: ``<output_dir>/scored``
    (+ ``samples``, ``rewarded``, ``advantaged``); ``services``: reward-stage service factories. Runs on the
    Ray cluster its caller connected to (``rollflow score``, the RLVR flow's validation)."""
    return run_steps(score_steps(input_dir, output_dir, cfg, advantages=advantages, services=services), cfg,
                     force=force, state_in=state_in)


def refuse_old_layout(run: Location) -> None:
    """A run folder whose RLVR steps were written by an earlier layout cannot be resumed by this version: refused
    with the fix. Two earlier layouts: advantages computed in two passes on the responses (``step_*/first_pass``,
    stage ``rlvr_advantages``), and rewards by a separate RLVR stage on the responses (``step_*/rlvr_rewarded``;
    now the response-rewards stage of both pipelines on the samples, with the domains in ``scored``)."""
    from stages.storage import read_manifest

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
    from stages.rlvr.generate import PromptsStage, prompts_section
    from stages.runner import run_stage

    return run_stage(PromptsStage(), prompts_section(prompts.data_dir, prompts.domains, prompts.limit), {}, output)


def _generate(config: RLVRTrainConfig, section_values: dict, prompts: str, checkpoint: str, pool, output: str,
              label: str) -> Any:
    """Responses of the prompts ``section_values["prompt_ids"]`` under ``checkpoint`` (the pool loads it in place),
    committed in ``output``; the rest of the generation section comes from the run's config."""
    from schemas.rollout_config import EngineIdentity
    from stages import progress
    from stages.rlvr.generate import GenerateSection, GenerateStage
    from stages.rollout.engine_pool import checkpoint_fingerprint
    from stages.runner import run_stage

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
    import pyarrow.dataset as pads

    loc = Location.of(where)
    return pads.dataset(loc.parquet_files(), filesystem=loc.fs).to_table(columns=columns)


def _prompt_ids(prompts: str) -> list[str]:
    return _read(prompts, ["prompt_id"]).column(0).to_pylist()


@stage_task("generate")
def generate_task(config: RLVRTrainConfig, step: int, prompts: str, checkpoint: str, pool, output: str) -> Any:
    from stages.rlvr.generate import step_prompt_ids

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
    from stages.rlvr.generate import judge_services

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
    import numpy as np

    from stages.algos.intervals import mean_interval

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
    """The reward workers on the step's responses, then its token table (``scored``, ``samples``). An LLM judge route
    is served by the run's judge engine (``judge``: its pool, None without such a route); workers that read the
    training progress get ``step / max_steps`` (ROLL's global_step / max_steps)."""
    from stages.rlvr.generate import judge_services, reads_context

    services = judge_services(config.rewards, config.judge, judge)
    progress = step / config.max_steps if reads_context(config.rewards, "training_progress") else None
    return run_steps([reward_step(responses, output, config, services), samples_step(responses, output)], config,
                     training_progress=progress)


def _setup(r: Run) -> None:
    """The prompts (and validation prompts), the LLM judge's engines when a route needs them (built on first use),
    and the running reward moments the first step starts from."""
    from stages.rlvr.generate import judge_pool

    config = r.config
    # the judge's engines are part of the run's resource plan (flows/pipeline_specs.py)
    r.held["judge"] = judge_pool(config.judge) if rlvr_judged(config) else None
    r.held["prompts"] = prompts_task(config.prompts, r.run.child("prompts").uri()).output
    if config.validation.eval_steps > 0:
        r.held["val_prompts"] = prompts_task(config.validation.prompts, r.run.child("val_prompts").uri()).output
    r.state["running_moments"] = stage_spec("response_rewards").first_carried()


def _close(r: Run) -> None:
    if r.held.get("judge") is not None:
        r.held["judge"].close()


def _score(r: Run) -> dict[str, Any]:
    """The reward workers' scores and the step's token table, by the names they are recorded under."""
    done = score_task(r.config, r.iteration, r.results["generate"].output, r.here, r.held.get("judge"))
    return {"rewards": done["scored"], "samples": done["samples"]}


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
        rewards_step(rlvr_reward_section, lambda r: r.out("samples"), scored=lambda r: r.out("scored")),
        advantages_step(rlvr_advantage_section),
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
    from stages.cluster import ensure_ray
    from stages.rlvr.generate import judge_pool, needs_model
    from stages.rollout.driver import resolve_model_dir
    from stages.rollout.engine_pool import EnginePool

    config = validate_config(RLVRTrainConfig, cfg)
    rt = config.runtime
    ensure_ray(rt.ray_address, rt.num_cpus, data_memory_mb=rt.data_memory_mb)
    model = resolve_model_dir(checkpoint or config.pretrain)
    pool = EnginePool(config.generation_engine(), model, config.generation_window())
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
