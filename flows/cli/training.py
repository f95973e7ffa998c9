"""The training commands: ``train`` (a whole run, either pipeline), ``plan`` (its resource plan), ``eval`` (a
checkpoint on a run's held-out levels), ``train-step``, ``logprobs`` and ``values``."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable, Optional

import typer

from flows import interrupt
from flows.cli.app import app
from flows.cli.common import OverrideOpt, announce_precision, connect, fail as _fail, guard as _guard
from schemas.errors import ConfigError

# Each command imports what it runs inside its function (config models: pydantic; tables: pyarrow; flows: Prefect;
# Ray; torch), so `rollflow --help` and every command load their own libraries only (CONTRIBUTING.md, imports).


@app.command()
def train(config: Optional[Path] = typer.Option(None, "--config", help="YAML config (configs/train_*.yaml)."),
          resume: Optional[str] = typer.Option(None, "--resume", help="Continue the run in this run folder "
                                                                      "(runs/<run>, or s3://bucket/runs/<run>) from "
                                                                      "its last committed stage."),
          overrides: Optional[list[str]] = OverrideOpt,
          report: bool = typer.Option(True, "--report/--no-report", help="Write the run's report at the end.")) -> None:
    """Run (or resume) an agentic RL training run: a Prefect flow of rollout, log-prob, reward, advantage, training
    and evaluation stages per iteration."""
    from flows.pipelines import pipeline_of
    from schemas.config import load_config_data, parse_overrides, validate_config

    if (config is None) == (resume is None):
        _fail(ValueError("pass either --config FILE (a new run) or --resume RUN_DIR (continue a run)"))
    if resume is not None:
        from stages.run_folder import CONFIG_FILE, read_frozen_config
        from stages.storage import Location

        if overrides:
            _fail(ValueError("--set cannot change a run being resumed; start a new run (another run_name) instead"))
        folder = _guard(lambda: Location.of(resume.rstrip("/")))
        data = _guard(lambda: read_frozen_config(folder))
        if data is None:
            _fail(FileNotFoundError(f"{resume} has no {CONFIG_FILE}; pass the folder of a run started by "
                                    "`rollflow train --config`"))
        where = folder.child(CONFIG_FILE).uri()
    else:
        data = _guard(lambda: load_config_data(config, parse_overrides(overrides or [])))
        where = str(config)
    pipeline = _guard(lambda: pipeline_of(data, where))
    cfg = _guard(lambda: validate_config(pipeline.config_model(), data, where))
    from stages.run_folder import check_resumed_folder, check_run

    if resume is not None:
        _guard(lambda: check_resumed_folder(folder, cfg))

    # before Prefect and Ray start, and before the run's log is opened; the run folder against the config first: a
    # run started with another config is a config error, reported before the engines' and models' checks load torch
    _guard(lambda: check_run(cfg, cfg.model_dump(mode="json"), pipeline.spec))
    _guard(lambda: pipeline.preflight(cfg, False))
    from flows import console
    from flows.runkit import publish_run, run_log

    run, log = _guard(lambda: run_log(cfg))
    interrupt.resume_with(f"rollflow train --resume {shlex.quote(interrupt.shown(run))}")
    console.log_to(log)
    typer.echo(f"run {run}  (log: {console.log_path()})")
    announce_precision()
    from flows.services import start_services

    try:
        _guard(lambda: start_services(cfg.runtime))
        summary = _guard(lambda: pipeline.flow()(cfg.model_dump(mode="json")))
        for line in pipeline.summary_lines()(summary):
            typer.echo(line)
        if report:
            from flows.report import write_report

            rep = write_report(summary["run"])
            typer.echo(f"report: {rep.html}")
    finally:  # a run folder on an object store gets its log, TensorBoard events and report, also after a failure
        for uploaded in _guard(lambda: publish_run(run)):
            typer.echo(f"uploaded {uploaded}")


@app.command()
def plan(config: Path = typer.Option(..., "--config", help="YAML config of a training run (agentic or RLVR)."),
         overrides: Optional[list[str]] = OverrideOpt,
         cpus: Optional[float] = typer.Option(None, "--cpus", min=0, help="Plan for a cluster of N CPUs (what-if; "
                                              "default: the Ray cluster's when RAY_ADDRESS is set, else "
                                              "runtime.num_cpus or this machine's)."),
         gpus: Optional[float] = typer.Option(None, "--gpus", min=0, help="Plan for N GPUs (what-if; default: the "
                                              "Ray cluster's when RAY_ADDRESS is set, else the GPUs torch sees)."),
         custom: Optional[str] = typer.Option(None, "--resources", help="Custom resources the cluster declares, "
                                              "as JSON (what-if, for runtime.stage_resources; e.g. "
                                              "'{\"trainer_node\": 2}'; default: the Ray cluster's).")
         ) -> None:
    """Print the run's resource plan (stage, units, CPUs and GPUs each, how long they are held, a memory estimate,
    where they go) and whether the cluster can schedule it: exit 0 if it fits, 2 if not (with the rule, the numbers
    and the fix). Starts no engine, no Prefect, and no Ray cluster."""
    from flows.pipelines import pipeline_of
    from schemas.config import load_config_data, parse_overrides, validate_config

    data = _guard(lambda: load_config_data(config, parse_overrides(overrides or [])))
    pipeline = _guard(lambda: pipeline_of(data, str(config)))
    cfg = _guard(lambda: validate_config(pipeline.config_model(), data, str(config)))
    from flows.runkit import run_plan  # after the config's check: it loads Prefect (1-4 s on the 2-core machine)

    resources: dict[str, float] = {}
    if cpus is None or gpus is None:
        from stages.cluster import cluster_resources

        resources = _guard(lambda: cluster_resources(cfg.runtime.ray_address, cfg.runtime.num_cpus))
    resources.update({k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v is not None})
    if custom is not None:
        resources.update(_guard(lambda: _custom_resources(custom)))
    result = _guard(lambda: run_plan(cfg, resources))
    typer.echo(f"plan of {config} (pipeline {cfg.pipeline}, run {cfg.run_name})")
    for line in result.lines():
        typer.echo(line)
    _guard(result.check)


def _custom_resources(text: str) -> dict[str, float]:
    """``rollflow plan --resources``: a JSON object of resource name -> amount."""
    import json


    try:
        value = json.loads(text)
        if isinstance(value, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in value.values()):
            return {str(k): float(v) for k, v in value.items()}
    except ValueError:
        pass
    raise ConfigError(f"--resources {text!r} is not a JSON object of resource names and amounts >= 0 (as ray start "
                      "--resources takes); write e.g. --resources '{\"trainer_node\": 2}'")


@app.command("eval")
def evaluate(config: Path = typer.Option(..., "--config", help="YAML config of a training run (agentic or RLVR): its "
                                                              "eval / validation section says what to evaluate on."),
             checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Model folder to evaluate: a "
                                                       "run's checkpoint (default: the config's pretrain, else the "
                                                       "default model)."),
             output: Path = typer.Option(..., "--output", help="Folder for the evaluation's episodes, turns and "
                                                               "samples."),
             overrides: Optional[list[str]] = OverrideOpt) -> None:
    """Evaluate a checkpoint without training: an agentic config's held-out levels (the episodes of the run's own
    evaluations), or an RLVR config's validation prompts scored by their reward workers."""
    from flows.pipelines import pipeline_of
    from schemas.config import load_config_data, parse_overrides, validate_config

    data = _guard(lambda: load_config_data(config, parse_overrides(overrides or [])))
    pipeline = _guard(lambda: pipeline_of(data, str(config)))
    cfg = _guard(lambda: validate_config(pipeline.config_model(), data, str(config)))
    target = str(checkpoint) if checkpoint else cfg.pretrain
    _guard(lambda: _check_evaluation(pipeline, cfg, target, output))  # before Prefect and Ray start
    announce_precision()
    from flows.services import start_services

    _guard(lambda: start_services(cfg.runtime))
    run_eval, lines = pipeline.evaluation()
    summary = _guard(lambda: run_eval(cfg.model_dump(mode="json"), target, str(output)))
    for line in lines(summary):
        typer.echo(line)


def _check_evaluation(pipeline, cfg, checkpoint: str | None, output: Path) -> None:
    """What ``rollflow eval`` checks before Prefect and Ray start: the pipeline's evaluation settings, the config's
    options that nothing reads, the model folder (when one is named; the default model is converted on first use) and
    the output location."""
    from stages.generation.engines import preflight_model_dir
    from stages.outputs import EVAL_WRITES, check_output

    pipeline.preflight(cfg, True)
    pipeline.spec.refuse_unread(cfg)
    if checkpoint:
        preflight_model_dir(checkpoint)
    check_output(str(output), EVAL_WRITES, {"--checkpoint": checkpoint})


def _state(result) -> str:
    return "up to date, skipped" if result.skipped else f"computed in {result.seconds:.1f}s"


def _print_metrics(metrics: dict[str, float], prefixes: tuple[str, ...]) -> None:
    for key in sorted(metrics):
        if key.startswith(prefixes):
            typer.echo(f"  {key:<34} {metrics[key]:.6g}")


def _prepare(model: str, config: Path | None, overrides: list[str] | None, table: str, samples: Path | str,
             output: Path | str, needs: Callable = lambda cfg: (), checkpoints: tuple[Path | str | None, ...] = (),
             stage: str = "", command: str = ""):
    """What the table-in, folder-out training commands do before their stage: load the config (``model``, a class
    name of schemas.train_config), print the dtype choice, check the input table (``table``, a contract of
    schemas.tables, with the columns ``needs(cfg)``), the model folders in ``checkpoints`` and the output path before
    Ray starts, then join or start Ray. (Whether the command's worker group fits the cluster is checked by its stage,
    before the group starts and not when the output is up to date: stages/train/stage.py.) Returns the config."""
    import schemas.tables as tables
    import schemas.train_config as train_config
    from schemas.config import load_config, parse_overrides
    from stages.outputs import check_output, stage_writes
    from stages.preflight import check_input
    from stages.train.checkpoint import read_checkpoint

    cfg = _guard(lambda: load_config(getattr(train_config, model), config, parse_overrides(overrides or [])))
    announce_precision()
    _guard(lambda: check_input(getattr(tables, table), str(samples), needs(cfg)))
    for checkpoint in filter(None, checkpoints):
        _guard(lambda: read_checkpoint(str(checkpoint)))
    _guard(lambda: check_output(str(output), stage_writes(f"rollflow {command}", stage),
                                {"--samples": str(samples), **{f"model folder {c}": str(c) for c in checkpoints if c}}))
    connect(cfg.runtime)
    return cfg


@app.command("train-step")
def train_step(samples: str = typer.Option(..., "--samples", help="Advantaged table folder (Parquet; a path or "
                                                                   "a URI)."),
               checkpoint: str = typer.Option(..., "--checkpoint", help="Model folder: the default model or an "
                                                                        "earlier train-step output (a path or a "
                                                                        "URI)."),
               config: Optional[Path] = typer.Option(None, "--config", help="YAML training config "
                                                                            "(schemas/train_config.py)."),
               output: str = typer.Option(..., "--output", help="New checkpoint folder (a path or an "
                                                                "s3://bucket/folder URI)."),
               overrides: Optional[list[str]] = OverrideOpt,
               force: bool = typer.Option(False, "--force", help="Train even if the output is up to date.")) -> None:
    """One PPO training step (actor, and critic for gae) on DeepSpeed in Ray actors; writes a checkpoint."""
    cfg = _prepare("TrainStepConfig", config, overrides, "ADVANTAGED", samples, output,
                   lambda cfg: cfg.table_needs, (checkpoint,), "train_step", "train-step")
    from stages.train.stage import run_train_step

    result = _guard(lambda: run_train_step(str(samples), str(checkpoint), cfg, str(output), force=force))
    typer.echo(f"checkpoint  {result.output}  (step {result.state.get('global_step')}, {result.rows:,} rows, "
               f"{_state(result)})")
    _print_metrics(result.metrics, ("actor/", "critic/", "system/", "time/"))


@app.command()
def logprobs(samples: Path = typer.Option(..., "--samples", help="Samples table folder (Parquet)."),
             checkpoint: Path = typer.Option(..., "--checkpoint", help="Model folder for old_log_probs."),
             reference: Optional[Path] = typer.Option(None, "--reference", help="Model folder for ref_log_probs "
                                                                               "(default: the checkpoint)."),
             config: Optional[Path] = typer.Option(None, "--config", help="YAML forward config (ForwardConfig)."),
             output: Path = typer.Option(..., "--output", help="New table folder."),
             overrides: Optional[list[str]] = OverrideOpt,
             force: bool = typer.Option(False, "--force")) -> None:
    """Add old_log_probs (and ref_log_probs, entropy) to a samples table, on num_actors data-parallel ranks."""
    cfg = _prepare("ForwardConfig", config, overrides, "SAMPLES", samples, output, checkpoints=(checkpoint, reference),
                   stage="logprobs", command="logprobs")
    from stages.train.stage import run_logprobs

    result = _guard(lambda: run_logprobs(str(samples), str(checkpoint), cfg, str(output),
                                           reference=str(reference) if reference else None, force=force))
    typer.echo(f"logprobs  {result.output}  ({result.rows:,} rows, {_state(result)})")
    _print_metrics(result.metrics, ("logprobs/",))


@app.command()
def values(samples: Path = typer.Option(..., "--samples", help="Samples table folder (Parquet)."),
           checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint whose critic/ gives the values (a "
                                                                     "new seeded value head before the first step)."),
           config: Optional[Path] = typer.Option(None, "--config", help="YAML forward config (ForwardConfig)."),
           output: Path = typer.Option(..., "--output", help="New table folder."),
           overrides: Optional[list[str]] = OverrideOpt,
           force: bool = typer.Option(False, "--force")) -> None:
    """Add the critic's values to a samples table (gae), on num_actors data-parallel ranks."""
    cfg = _prepare("ForwardConfig", config, overrides, "SAMPLES", samples, output, checkpoints=(checkpoint,),
                   stage="values", command="values")
    from stages.train.stage import run_values

    result = _guard(lambda: run_values(str(samples), str(checkpoint), cfg, str(output), force=force))
    typer.echo(f"values  {result.output}  ({result.rows:,} rows, {_state(result)})")
    _print_metrics(result.metrics, ("values/",))
