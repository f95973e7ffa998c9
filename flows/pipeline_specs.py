"""The training pipelines as data: what the run kit, the resource plan and the CLI need to know of a pipeline
without running it (its config model, its iteration folders, the engines it keeps, its pre-flight check).

The flows themselves (flows/agentic.py, flows/rlvr.py) and their summaries are joined to these declarations in
flows/pipelines.py; this module imports neither, so the flows and the run kit (flows/runkit.py) may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.train_flow_config import TrainFlowConfig
from stages.generation.engines import check_engine_options
from stages.plan import EngineUse, default_engines
from stages.registry import Registry
from stages.rlvr.generate import check_judge_read, needs_model, prompts_section
from stages.rlvr.stages import check_routes
from stages.rollout.baseline import evaluation_baseline
from stages.rollout.driver import check_envs, check_rollout
from stages.storage import MANIFEST, Location


@dataclass(frozen=True)
class ChanceLevel:
    """What a pipeline's held-out success rate is read against: a policy without learning, its rate and Wilson 95 %
    interval over ``episodes``; ``what`` says how it was measured."""

    label: str
    value: float
    low: float
    high: float
    episodes: int
    what: str


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline, declared: its name, config model, the prefix of its iteration folders, what a run checks before
    Prefect and Ray start, and the engines it keeps for its whole length."""

    name: str
    config_model: Callable[[], type]  # lazily imported: the CLI's --help must not import torch
    # the folder of a run's k-th iteration: <run>/<step_prefix><k:04d> (agentic: iter_, RLVR: step_; each pipeline
    # keeps the names its run folders were written with, so a run folder of an earlier version resumes)
    step_prefix: str
    # what a run (evaluation=False) or `rollflow eval` (True) of a validated config checks before Prefect and Ray
    # start: the parts of the config only its stages would otherwise look at (environments, prompt files, workers)
    preflight: Callable[[Any, bool], None]
    # the engines a run of a validated config keeps for its whole length (stages.plan.EngineUse), for its resource plan
    engines: Callable[[Any], list]
    # the chance level of a validated config's held-out success rate (the report draws it), None where it has none;
    # a RollflowError where the config cannot be measured here (an environment this install lacks: the report draws
    # none), any other error is a bug
    chance_level: Callable[[Any], ChanceLevel | None] = lambda config: None
    # refuses options of a validated config that no command running it would read (a ConfigError with the fix); for a
    # new run and ``rollflow eval``, not for a run folder frozen with the config (it resumes as it was started)
    refuse_unread: Callable[[Any], None] = lambda config: None

    def step_dir(self, run: str, step: int) -> str:
        """The folder of iteration ``step`` of the run folder ``run``."""
        return f"{run}/{self.step_prefix}{step:04d}"

    def committed_steps(self, run: str) -> int:
        """How many iterations of the run folder ``run`` are done: the leading iterations whose checkpoint is
        committed (its manifest written)."""
        k = 0
        while Location.of(f"{self.step_dir(run, k)}/checkpoint").child(MANIFEST).exists():
            k += 1
        return k


PIPELINE_SPECS: Registry[PipelineSpec] = Registry("training pipeline")


def _agentic_model():
    return TrainFlowConfig


def _rlvr_model():
    return RLVRTrainConfig


def _agentic_preflight(config, evaluation: bool) -> None:
    """Every environment of the run's rollouts (or only of its evaluation) builds from its env_config."""
    if not evaluation:
        check_rollout(config.rollout_for(0), field="rollout.")
    if evaluation or config.eval.eval_steps:
        check_rollout(config.eval_rollout(), field="rollout.")


def _rlvr_preflight(config, evaluation: bool) -> None:
    """The prompt files exist and every reward route names a worker that takes its kwargs: for training, the
    run's prompts and routes; for validation (in a run with eval_steps, or ``rollflow eval``) the validation's; the
    options of every engine the run keeps (the generation engines', an LLM judge's) are their backend's."""
    if not evaluation:
        prompts_section(config.prompts.data_dir, config.prompts.domains, config.prompts.limit)
        check_routes(config.rewards, "rewards")
    if evaluation or config.validation.eval_steps:
        val = config.validation.prompts
        prompts_section(val.data_dir, val.domains, val.limit, field="validation.prompts")
        check_routes(config.validation_rewards(), "validation.rewards" if config.validation.rewards else "rewards")
    for use in _rlvr_engines(config, evaluation):  # after the routes: whether a judge runs depends on their workers
        check_engine_options(use.engine.backend, use.engine.options, f"{use.section}.options")


def _rlvr_unread(config) -> None:
    """The LLM judge's settings are read only where a route of the run, or of its validation (also ``rollflow
    eval``'s), calls a model."""
    routes = {"rewards": config.rewards}
    if config.validation.rewards is not None:
        routes["validation.rewards"] = config.validation.rewards
    check_judge_read(config.judge, routes)


def _agentic_engines(config) -> list:
    """The rollout's generation engines (training and evaluation share them)."""
    return default_engines(config)


def rlvr_judged(config, evaluation: bool = False) -> bool:
    """Whether an RLVR run needs its LLM judge's engines: a reward route of the run, or of its validation when it
    validates, calls a model (``evaluation``: a validation route, for ``rollflow eval``)."""
    validates = evaluation or config.validation.eval_steps > 0
    return (not evaluation and needs_model(config.rewards)) or (validates and needs_model(config.validation_rewards()))


def _rlvr_engines(config, evaluation: bool = False) -> list:
    """The generation engines, and the LLM judge's when a route needs it (both live for the whole run, or for
    ``rollflow eval`` when ``evaluation``)."""
    engines = default_engines(config)
    if rlvr_judged(config, evaluation):
        engines.append(EngineUse("LLM judge engine", "judge.engine", config.judge.engine))
    return engines


def _agentic_chance_level(config) -> ChanceLevel | None:
    """Uniformly random legal actions on the evaluation's levels under its turn limit (stages/rollout/baseline.py);
    None for environments without a list of legal actions; a ConfigError when an environment of the evaluation is
    not registered or does not build from its env_config."""
    check_envs(config.eval_rollout(), field="rollout.")
    found = evaluation_baseline(config)
    if found is None:
        return None
    low, high = found.interval()
    return ChanceLevel("random legal actions", found.success_rate, low, high, found.episodes,
                       f"uniformly random legal actions on the evaluation's levels, at most {found.longest} turns")


PIPELINE_SPECS.register("agentic")(PipelineSpec("agentic", _agentic_model, "iter_", _agentic_preflight,
                                                _agentic_engines, _agentic_chance_level))
PIPELINE_SPECS.register("rlvr")(PipelineSpec("rlvr", _rlvr_model, "step_", _rlvr_preflight, _rlvr_engines,
                                             refuse_unread=_rlvr_unread))
