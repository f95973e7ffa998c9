"""The one iteration loop: it runs a training pipeline's declaration (:class:`PipelineFlow`).

A pipeline declares the ordered steps of an iteration (:class:`IterStep`: a stage, or a few stages run as one task,
recorded under their names) and its evaluation (:class:`Evaluation`: before training and every ``eval_steps``
iterations); the loop runs them in order, the same way for every pipeline: it starts the run (frozen config, Ray,
resource plan, engine pool, kept workers), records each step's metrics and progress line, lets the engines sleep
after generation, threads the state the stages carry from one iteration to the next (their declarations'
``carries``, schemas/stage_specs.py), keeps the training checkpoints, and closes what the run holds at its end.
``flows/agentic.py`` and ``flows/rlvr.py`` hold the two declarations and no loop of their own.

With ``async_generation_ratio: r > 0`` (ROLL's option) the generation steps of iterations k + 1 .. k + ceil(r) are
submitted to the flow's task runner (Prefect tasks, one after the other on the engines) as soon as iteration k's
rollout is in, and play while iteration k's later steps run, the one of iteration j with the policy after
``max(0, j - ceil(r))`` training steps (:func:`played_with`, a fixed schedule: a resumed run replays the same choice);
the evaluation waits for them, as it shares the engines. ``r = 0`` runs the steps in turn, as before.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from prefect.context import FlowRunContext

from prefect.utilities.annotations import quote

from flows.pipeline_specs import PipelineSpec
from flows.runkit import (KeptWorkers, advantages_task, logprobs_task, record, rewards_task, sleep_engines, stage_task,
                          start_run, train_and_keep, values_task)
from schemas.run_config import played_with, rollout_lag
from schemas.stage_specs import is_declared, stage_spec
from stages.metrics import MetricsLog
from stages.storage import Location
from stages.trackers import open_trackers


@dataclass
class Run:
    """What the steps of a run read and write: the config, the run folder and its kept parts, the policy being
    trained, the carried state, and this iteration's results by step name."""

    config: Any
    run: Location
    base: str  # the initial policy folder
    pool: Any  # the generation engines (stages.rollout.engine_pool.EnginePool)
    workers: KeptWorkers
    metrics: Any  # stages.metrics.MetricsLog
    checkpoint: str  # the policy the next step reads
    state: dict = field(default_factory=dict)  # carried from one iteration to the next, by state key
    held: dict = field(default_factory=dict)  # what the pipeline's set-up made (RLVR: prompts, judge engines)
    trained: list[str] = field(default_factory=list)  # this run's checkpoints, oldest first
    iteration: int = -1
    here: str = ""  # the iteration's folder
    results: dict = field(default_factory=dict)  # this iteration's results by step name
    force: bool = False  # recompute outputs that are up to date (rollflow score --force)

    @classmethod
    def of_folder(cls, config, folder: str, *, held: dict | None = None, state: dict | None = None,
                  force: bool = False) -> "Run":
        """Steps run outside a training run, into ``folder`` (``rollflow score``, an RLVR step's scoring): no
        engines, kept workers, metrics or policy; ``held`` and ``state`` as a pipeline's set-up leaves them."""
        return cls(config, Location.of(folder), "", None, None, None, "", state=dict(state or {}),
                   held=dict(held or {}), here=folder.rstrip("/"), force=force)

    def out(self, name: str) -> str:
        """The folder ``name`` of this iteration."""
        return f"{self.here}/{name}"

    def tokens(self) -> str:
        """This iteration's token table with its log-probs (and values, when the critic's were computed); a pipeline
        that reads stored samples (a step named ``samples``) without computing them: those."""
        return next(self.results[name] for name in ("values", "logprobs", "samples") if name in self.results).output

    def carried(self, stage: str) -> dict:
        """The state stage ``stage`` continues from: what its declaration carries (``carries``), as the previous
        iteration (or the pipeline's set-up) left it in :attr:`state`; {} when nothing is there."""
        key = _carried_key(stage)
        return {key: self.state[key]} if key in self.state else {}

    def keep(self, stage: str, result: Any) -> Any:
        """Keep the state ``result`` of stage ``stage`` carries to the next iteration; returns ``result``."""
        key = _carried_key(stage)
        if key is not None and key in result.state:
            self.state[key] = result.state[key]
        return result


def _carried_key(stage: str) -> str | None:
    """The state key stage ``stage`` declares it carries (``StageSpec.carries``), None when it carries nothing."""
    spec = stage_spec(stage) if is_declared(stage) else None
    return spec.carries[0] if spec is not None and spec.carries else None


def first_state(*stages: str) -> dict:
    """The carried state of ``stages`` at the first iteration: each one's declared first value (those declared
    absent until set, ``None``, are left out)."""
    firsts = {_carried_key(name): stage_spec(name).first_carried() for name in stages}
    return {key: value for key, value in firsts.items() if key is not None and value is not None}


def _always(config) -> bool:
    return True


@dataclass(frozen=True)
class IterStep:
    """One step of an iteration: ``run`` returns its result (a stage result, or several by name, see ``records``),
    kept in ``Run.results[name]``; the metrics table files it under ``name``."""

    name: str
    run: Callable[[Run], Any]
    when: Callable[[Any], bool] = _always  # whether a run of this config has the step (values: with a critic)
    # the metrics a step's result records (default: its own metrics); None for a step that records several stages
    metrics: Callable[[Any], dict] | None = None
    records: tuple[str, ...] = ()  # a step of several stages: the names its result holds, recorded one by one
    generation: bool = False  # the engines sleep after it (colocation: the GPU is the next stages' until then)
    trains: bool = False  # the training step: its checkpoint is the policy from now on


@dataclass(frozen=True)
class Evaluation:
    """A pipeline's evaluation of a checkpoint: before training and after every ``every(config)`` iterations (0:
    never), into ``<run>/<base_dir>`` and ``<iteration>/<dir>``, recorded under ``name``."""

    name: str  # "eval", "validation"
    base_dir: str
    dir: str
    every: Callable[[Any], int]
    run: Callable[[Run, str, str, str], Any]  # (run, output, checkpoint, when: "before training", "after ...")
    metrics: Callable[[Any], dict]  # what the metrics table records
    summary: Callable[[Any], dict]  # what the run's summary keeps


@dataclass(frozen=True)
class PipelineFlow:
    """A training pipeline, declared: its folders (``spec``), the steps of an iteration in order, its evaluation,
    what it sets up before the first iteration and closes after the last, and what its summary keeps."""

    spec: PipelineSpec
    iteration: tuple[IterStep, ...]
    evaluation: Evaluation
    summarize: Callable[[Run, dict | None], dict]  # an iteration's summary entry (with the evaluation's, or None)
    base_summary: str  # the summary key of the evaluation before training
    step_word: str  # "iteration", "step": how the progress lines name an iteration
    before_start: Callable[[Any], None] = lambda config: None  # checks of the run folder before anything starts
    setup: Callable[[Run], None] = lambda run: None  # fills Run.held (inside the metrics log)
    close: Callable[[Run], None] = lambda run: None  # closes what setup made
    summary_fields: dict = field(default_factory=dict)  # constant entries of the summary (e.g. the pipeline)


def _run_step(step: IterStep, r: Run) -> None:
    _keep_result(step, r, step.run(r))
    if step.generation:
        sleep_engines(r.pool, r.metrics, r.iteration)


def _keep_result(step: IterStep, r: Run, result: Any, extra: dict | None = None, note: str = "") -> None:
    """Keep and record ``result``, what ``step`` returned in this iteration (``extra``: more metrics to record,
    ``note``: what its progress line adds)."""
    r.results[step.name] = result
    k = r.iteration
    if step.trains:  # train_and_keep recorded it
        r.checkpoint = result.output
        return
    if step.records:
        for name in step.records:
            r.results[name] = result[name]
            record(r.metrics, k, name, result[name])
    elif extra:
        values = step.metrics(result) if step.metrics else dict(getattr(result, "metrics", None) or {})
        record(r.metrics, k, step.name, result, {**values, **extra}, note=note)
    else:
        record(r.metrics, k, step.name, result, step.metrics(result) if step.metrics else None)


def run_steps(steps: Sequence[IterStep], r: Run) -> dict[str, Any]:
    """Run ``steps`` (those of ``r.config``) in order, outside the loop: no metrics record, no engines to put to sleep
    (``rollflow score``, an RLVR step's scoring). Returns ``r.results``, the results by step name."""
    for step in steps:
        if step.when(r.config):
            r.results[step.name] = step.run(r)
    return r.results


def _called(task) -> Callable:
    """A stage task as a Prefect task inside a flow run; outside one (``rollflow score``) its plain function, so a
    command that runs no flow starts no Prefect server."""
    return task if FlowRunContext.get() is not None else task.fn


# The steps both pipelines share, from the token table on (samples -> logprobs (-> values) -> rewarded -> advantaged
# -> checkpoint), run one way.

def logprobs_step(samples: Callable[[Run], str]) -> IterStep:
    """Old (and reference) log-probs of the iteration's token table (``samples(run)``), under the current policy."""
    return IterStep("logprobs", lambda r: logprobs_task(r.config, samples(r), r.checkpoint, r.base, r.out("logprobs"),
                                                        r.workers))


def _needs_critic(config) -> bool:
    return config.train_step_config().needs_critic


VALUES_STEP = IterStep("values", lambda r: values_task(r.config, r.results["logprobs"].output, r.checkpoint,
                                                      r.out("values"), r.workers), when=_needs_critic)


def rewards_step(section: Callable[[Any], Any], samples: Callable[[Run], str],
                 scored: Callable[[Run], str | None] = lambda r: None) -> IterStep:
    """Response-level rewards (``section(config)``) of the table ``samples(run)`` (with the workers' scores,
    ``scored(run)``, for RLVR's section) -> ``rewarded``, continuing from the state the stage carries."""
    def run(r: Run) -> Any:
        rt = r.config.runtime
        return r.keep("response_rewards", _called(rewards_task)(
            section(r.config), samples(r), r.out("rewarded"), scored=scored(r), state_in=r.carried("response_rewards"),
            force=r.force, batch_rows=rt.batch_rows, resources=rt.resources_for("response_rewards")))

    return IterStep("response_rewards", run)


def advantages_step(section: Callable[[Any], Any]) -> IterStep:
    """Token rewards and advantages (``section(config)``) of the token table and its rewarded rows -> ``advantaged``,
    continuing from the KL controller the previous iteration left."""
    def run(r: Run) -> Any:
        rt = r.config.runtime
        return r.keep("advantages", _called(advantages_task)(
            section(r.config), r.tokens(), r.results["response_rewards"].output, r.out("advantaged"),
            r.carried("advantages"), force=r.force, batch_rows=rt.batch_rows,
            resources=rt.resources_for("advantages")))

    return IterStep("advantages", run)


def _train(r: Run) -> Any:
    return train_and_keep(r.config, r.iteration, r.results["advantages"].output, r.checkpoint, r.out("checkpoint"),
                          r.workers, r.metrics, r.trained)


TRAIN_STEP = IterStep("train", _train, trains=True)  # the training step every iteration ends with


# Asynchronous generation (ROLL's async_generation_ratio, issue 46): the generation steps of iterations k + 1 ..
# k + ceil(r) run as Prefect tasks (the flow's task runner), one after the other on the engines, while iteration k's
# later steps run on the flow's thread.

def async_lag(config) -> int:
    """How many iterations a rollout's policy may be behind the one trained: ceil(async_generation_ratio); 0 runs
    each iteration's steps in turn."""
    return rollout_lag(getattr(config, "async_generation_ratio", 0) or 0)


@dataclass
class Ahead:
    """The generation step of ``iteration`` played ahead (``future``: of :func:`_generate`), and when the flow's
    thread was busy with the later steps of the iterations before it meanwhile (``busy``: (start, end) each)."""

    iteration: int
    policy: int  # the training steps of the checkpoint it plays with
    future: Any
    busy: list[tuple[float, float]] = field(default_factory=list)

    def overlap_seconds(self, start: float, end: float) -> float:
        """Seconds the generation (``start``..``end``) and the flow's later steps both ran."""
        return sum(max(0.0, min(end, b_end) - max(start, b_start)) for b_start, b_end in self.busy)


@stage_task("generation ahead")
def _generate(step: IterStep, r: Run) -> tuple[Any, float, float]:
    """``step`` of the iteration ``r`` is set to (with its checkpoint loaded before its first turn and kept until its
    last): its result and when it started and ended."""
    start = time.time()
    result = step.run(r)
    return result, start, time.time()


def _generation_run(flow: PipelineFlow, r: Run, iteration: int, lag: int) -> Run:
    """What the generation step of ``iteration`` reads: the run with that iteration's folder and the checkpoint of
    :func:`played_with` (the initial policy, or the one iteration ``played_with - 1`` committed)."""
    policies = [r.base, *r.trained]  # policy after j training steps, j = 0..
    return dataclasses.replace(r, iteration=iteration, here=flow.spec.step_dir(r.run.uri(), iteration), results={},
                               checkpoint=policies[played_with(iteration, lag)])


def _play_ahead(flow: PipelineFlow, step: IterStep, r: Run, iteration: int, lag: int,
                after: Ahead | None = None) -> Ahead:
    """Submit the generation step of ``iteration`` to the flow's task runner, to start once ``after`` (the rollout
    before it in flight, on the same engines) has ended."""
    return Ahead(iteration, played_with(iteration, lag),
                 _generate.submit(quote(step), quote(_generation_run(flow, r, iteration, lag)),
                                  wait_for=[after.future] if after is not None else None))


def _iterate_ahead(flow: PipelineFlow, steps: list[IterStep], r: Run, ahead: list[Ahead], lag: int) -> list[Ahead]:
    """Iteration ``r.iteration`` with its generation played ahead: its rollout is the first of those in flight,
    submitted during an earlier iteration (played now when none is: the first iteration of a run or of a resume),
    recorded with its staleness (training steps between its checkpoint and the trained one) and overlap; before this
    iteration's later steps run, the rollouts up to iteration k + ``lag`` (whose policies, k + j - lag <= k training
    steps, are committed) are submitted, each to start when the one before it ends. The engines never sleep (they
    have devices of their own). Returns the rollouts in flight, oldest first."""
    k, last = r.iteration, r.config.max_steps - 1
    busy = time.time()
    for step in steps:
        if not step.generation:
            _run_step(step, r)
            continue
        if not ahead or ahead[0].iteration != k:  # nothing in flight: play it now
            ahead = [_play_ahead(flow, step, r, k, lag)]
        now, ahead = ahead[0], ahead[1:]
        result, start, end = now.future.result()
        stale, overlap = k - now.policy, now.overlap_seconds(start, end)
        _keep_result(step, r, result, {"rollout/staleness": float(stale), "rollout/overlap_seconds": overlap},
                     note=f"played with the policy {stale} step{'s' * (stale != 1)} behind, {overlap:.0f}s "
                          "beside training")
        for j in range(k + 1 + len(ahead), min(k + lag, last) + 1):
            ahead.append(_play_ahead(flow, step, r, j, lag, after=ahead[-1] if ahead else None))
        busy = time.time()
    for played in ahead:
        played.busy.append((busy, time.time()))
    return ahead


def _join(ahead: list[Ahead]) -> None:
    """Wait for the rollouts in flight (their errors are raised where their results are read)."""
    for played in ahead:
        played.future.wait()


def run_pipeline(flow: PipelineFlow, config, cfg: dict) -> dict:
    """Run (or resume) the training run of ``config`` (validated from ``cfg``) as ``flow`` declares it. Returns the
    run's summary: its folder, one entry per iteration, the evaluation before training, seconds, last checkpoint."""
    flow.before_start(config)
    run, base, pool = start_run(config, cfg)
    r = Run(config, run, base, pool, None, None, base)  # type: ignore[arg-type]
    r.workers = KeptWorkers.of(config)
    started = time.time()
    summary: dict[str, Any] = {"run": run.uri(), **flow.summary_fields, "iterations": []}
    ev = flow.evaluation
    every = ev.every(config)
    steps = [s for s in flow.iteration if s.when(config)]
    lag = async_lag(config) if any(s.generation for s in steps) else 0
    ahead: list[Ahead] = []  # the generation steps in flight, oldest first (async_generation_ratio > 0)
    with MetricsLog(run.uri(), trackers=open_trackers(config, run, cfg)) as metrics:  # ROLL's track_with
        r.metrics = metrics
        try:
            flow.setup(r)
            if every:
                result = ev.run(r, f"{run.uri()}/{ev.base_dir}", r.checkpoint, "before training")
                record(metrics, 0, ev.name, result, ev.metrics(result), label=f"{ev.name} before training")
                summary[flow.base_summary] = ev.summary(result)
            for k in range(config.max_steps):
                r.iteration, r.here, r.results = k, flow.spec.step_dir(run.uri(), k), {}
                if lag:
                    ahead = _iterate_ahead(flow, steps, r, ahead, lag)
                else:
                    for step in steps:
                        _run_step(step, r)
                evaluated = None
                if every and (k + 1) % every == 0:
                    _join(ahead)  # the evaluation shares the engines: never while a rollout plays on them
                    when = f"after {flow.step_word} {k}"
                    result = ev.run(r, r.out(ev.dir), r.checkpoint, when)
                    # the metrics table files it under k + 1 (the policy after k + 1 steps); the line says when it ran
                    record(metrics, k + 1, ev.name, result, ev.metrics(result), label=f"{ev.name} {when}")
                    evaluated = ev.summary(result)
                summary["iterations"].append(flow.summarize(r, evaluated))
        finally:
            r.workers.close()
            pool.close()
            _join_quietly(ahead)  # its engines are gone: it ends at once
            flow.close(r)
    summary["seconds"] = time.time() - started
    summary["checkpoint"] = r.checkpoint
    return summary


def _join_quietly(ahead: list[Ahead]) -> None:
    """At the end of a run that failed (or was interrupted) with rollouts in flight: let them end, whatever they
    say."""
    for played in ahead:
        played.future.wait(timeout=60)
