"""The training pipelines ``rollflow train`` can run, keyed by a config's ``pipeline`` field (default: agentic).

One entry per pipeline: its declaration (flows/pipeline_specs.py: config model, iteration folders, pre-flight,
engines), its Prefect flow, and the lines it prints at the end. The CLI looks a pipeline up here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from flows.pipeline_specs import PIPELINE_SPECS, PipelineSpec
from schemas.errors import ConfigError
from stages.registry import Registry

DEFAULT_PIPELINE = "agentic"


@dataclass(frozen=True)
class Pipeline:
    spec: PipelineSpec
    flow: Callable[[], Callable[[dict], dict]]
    summary_lines: Callable[[], Callable[[dict], list[str]]]
    evaluation: Callable[[], tuple[Callable[..., dict], Callable[[dict], list[str]]]]  # rollflow eval: flow, lines

    @property
    def config_model(self) -> Callable[[], type]:
        return self.spec.config_model

    @property
    def preflight(self) -> Callable[[Any, bool], None]:
        return self.spec.preflight

    @property
    def engines(self) -> Callable[[Any], list]:
        return self.spec.engines

    def committed_steps(self, run: str) -> int:
        return self.spec.committed_steps(run)


PIPELINES: Registry[Pipeline] = Registry("training pipeline")

# The flows are imported when a command runs one, not with the registry: the CLI looks a pipeline up and validates
# its config before Prefect (and the engines) load, so a config error is reported at once
# (tests/spine/test_config_error_imports.py).


def _agentic_flow():
    from flows.agentic import train_flow

    return train_flow


def _agentic_summary():
    from flows.agentic import train_summary_lines

    return train_summary_lines


def _agentic_evaluation():
    from flows.agentic import eval_flow, eval_summary_lines

    return eval_flow, eval_summary_lines


def _rlvr_flow():
    from flows.rlvr import rlvr_train_flow

    return rlvr_train_flow


def _rlvr_summary():
    from flows.rlvr import rlvr_summary_lines

    return rlvr_summary_lines


def _rlvr_evaluation():
    from flows.rlvr import rlvr_eval_flow, rlvr_eval_summary_lines

    return rlvr_eval_flow, rlvr_eval_summary_lines


PIPELINES.register("agentic")(Pipeline(PIPELINE_SPECS.get("agentic"), _agentic_flow, _agentic_summary,
                                        _agentic_evaluation))
PIPELINES.register("rlvr")(Pipeline(PIPELINE_SPECS.get("rlvr"), _rlvr_flow, _rlvr_summary, _rlvr_evaluation))


def pipeline_of(data: dict[str, Any], where: str) -> Pipeline:
    """The pipeline a raw config mapping names (``pipeline: agentic | rlvr``)."""
    name = data.get("pipeline", DEFAULT_PIPELINE)
    if not isinstance(name, str) or name not in PIPELINES:
        raise ConfigError(f"{where}: pipeline {name!r} is unknown; set pipeline to one of {PIPELINES.names()}")
    return PIPELINES.get(name)
