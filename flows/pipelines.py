"""The training pipelines ``rollflow train`` can run, keyed by a config's ``pipeline`` field (default: agentic).

One entry per pipeline: its config model, its Prefect flow, and the lines it prints at the end. The CLI looks a
pipeline up here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from schemas.errors import ConfigError
from stages.registry import Registry

DEFAULT_PIPELINE = "agentic"


@dataclass(frozen=True)
class Pipeline:
    config_model: Callable[[], type]  # lazily imported: the CLI's --help must not import torch
    flow: Callable[[], Callable[[dict], dict]]
    summary_lines: Callable[[], Callable[[dict], list[str]]]
    step_dir: Callable[[], Callable[[str, int], str]]  # the folder of a run's k-th iteration (step)
    evaluation: Callable[[], tuple[Callable[..., dict], Callable[[dict], list[str]]]]  # rollflow eval: flow, lines
    # what a run (evaluation=False) or `rollflow eval` (True) of a validated config checks before Prefect and Ray
    # start: the parts of the config only its stages would otherwise look at (environments, prompt files, workers)
    preflight: Callable[[Any, bool], None]
    # the engines a run of a validated config keeps for its whole length (stages.plan.EngineUse), for its resource plan
    engines: Callable[[Any], list]

    def committed_steps(self, run: str) -> int:
        """How many iterations of the run folder ``run`` are done: the leading iterations whose checkpoint is
        committed (its manifest written)."""
        from stages.storage import MANIFEST, Location

        folder = self.step_dir()
        k = 0
        while Location.of(f"{folder(run, k)}/checkpoint").child(MANIFEST).exists():
            k += 1
        return k


PIPELINES: Registry[Pipeline] = Registry("training pipeline")


def _agentic_model():
    from schemas.train_flow_config import TrainFlowConfig

    return TrainFlowConfig


def _agentic_flow():
    from flows.agentic import train_flow

    return train_flow


def _agentic_summary():
    from flows.agentic import train_summary_lines

    return train_summary_lines


def _agentic_step_dir():
    from flows.agentic import iter_dir

    return iter_dir


def _agentic_evaluation():
    from flows.agentic import eval_flow, eval_summary_lines

    return eval_flow, eval_summary_lines


def _rlvr_model():
    from schemas.rlvr_train_config import RLVRTrainConfig

    return RLVRTrainConfig


def _rlvr_flow():
    from flows.rlvr import rlvr_train_flow

    return rlvr_train_flow


def _rlvr_summary():
    from flows.rlvr import rlvr_summary_lines

    return rlvr_summary_lines


def _rlvr_evaluation():
    from flows.rlvr import rlvr_eval_flow, rlvr_eval_summary_lines

    return rlvr_eval_flow, rlvr_eval_summary_lines


def _rlvr_step_dir():
    from flows.rlvr import step_dir

    return step_dir


def _agentic_preflight(config, evaluation: bool) -> None:
    """Every environment of the run's rollouts (or only of its evaluation) builds from its env_config."""
    from stages.rollout.driver import check_rollout

    if not evaluation:
        check_rollout(config.rollout_for(0), field="rollout.")
    if evaluation or config.eval.eval_steps:
        check_rollout(config.eval_rollout(), field="rollout.")


def _rlvr_preflight(config, evaluation: bool) -> None:
    """The prompt files exist and every reward route names a worker that takes its kwargs: for training, the
    run's prompts and routes; for validation (in a run with eval_steps, or ``rollflow eval``) the validation's; the
    options of every engine the run keeps (the generation engines', an LLM judge's) are their backend's."""
    from stages.generation.engines import check_engine_options
    from stages.rlvr.generate import prompts_section
    from stages.rlvr.stages import check_routes

    if not evaluation:
        prompts_section(config.prompts.data_dir, config.prompts.domains, config.prompts.limit)
        check_routes(config.rewards, "rewards")
    if evaluation or config.validation.eval_steps:
        val = config.validation.prompts
        prompts_section(val.data_dir, val.domains, val.limit, field="validation.prompts")
        check_routes(config.validation_rewards(), "validation.rewards" if config.validation.rewards else "rewards")
    for use in _rlvr_engines(config, evaluation):  # after the routes: whether a judge runs depends on their workers
        check_engine_options(use.engine.backend, use.engine.options, f"{use.section}.options")


def _agentic_engines(config) -> list:
    """The rollout's generation engines (training and evaluation share them)."""
    from stages.plan import default_engines

    return default_engines(config)


def rlvr_judged(config, evaluation: bool = False) -> bool:
    """Whether an RLVR run needs its LLM judge's engines: a reward route of the run, or of its validation when it
    validates, calls a model (``evaluation``: a validation route, for ``rollflow eval``)."""
    from stages.rlvr.generate import needs_model

    validates = evaluation or config.validation.eval_steps > 0
    return (not evaluation and needs_model(config.rewards)) or (validates and needs_model(config.validation_rewards()))


def _rlvr_engines(config, evaluation: bool = False) -> list:
    """The generation engines, and the LLM judge's when a route needs it (both live for the whole run, or for
    ``rollflow eval`` when ``evaluation``)."""
    from stages.plan import EngineUse, default_engines

    engines = default_engines(config)
    if rlvr_judged(config, evaluation):
        engines.append(EngineUse("LLM judge engine", "judge.engine", config.judge.engine))
    return engines


PIPELINES.register("agentic")(Pipeline(_agentic_model, _agentic_flow, _agentic_summary, _agentic_step_dir,
                                        _agentic_evaluation, _agentic_preflight, _agentic_engines))
PIPELINES.register("rlvr")(Pipeline(_rlvr_model, _rlvr_flow, _rlvr_summary, _rlvr_step_dir, _rlvr_evaluation,
                                     _rlvr_preflight, _rlvr_engines))


def pipeline_of(data: dict[str, Any], where: str) -> Pipeline:
    """The pipeline a raw config mapping names (``pipeline: agentic | rlvr``)."""
    name = data.get("pipeline", DEFAULT_PIPELINE)
    if not isinstance(name, str) or name not in PIPELINES:
        raise ConfigError(f"{where}: pipeline {name!r} is unknown; set pipeline to one of {PIPELINES.names()}")
    return PIPELINES.get(name)
