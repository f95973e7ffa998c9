"""The training pipelines ``rollflow train`` can run, keyed by a config's ``pipeline`` field (default: agentic).

One entry per pipeline: its declaration (flows/pipeline_specs.py: config model, iteration folders, pre-flight,
engines), its Prefect flow, and the lines it prints at the end. The CLI looks a pipeline up here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from flows.agentic import eval_flow, eval_summary_lines, train_flow, train_summary_lines
from flows.pipeline_specs import PIPELINE_SPECS, PipelineSpec
from flows.rlvr import rlvr_eval_flow, rlvr_eval_summary_lines, rlvr_summary_lines, rlvr_train_flow
from schemas.errors import ConfigError
from stages.registry import Registry

DEFAULT_PIPELINE = "agentic"


@dataclass(frozen=True)
class Pipeline:
    spec: PipelineSpec
    flow: Callable[[dict], dict]  # its Prefect flow (rollflow train)
    summary_lines: Callable[[dict], list[str]]  # the lines it prints at the end
    evaluation: tuple[Callable[..., dict], Callable[[dict], list[str]]]  # rollflow eval: its flow and its lines

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


PIPELINES.register("agentic")(Pipeline(PIPELINE_SPECS.get("agentic"), train_flow, train_summary_lines,
                                        (eval_flow, eval_summary_lines)))
PIPELINES.register("rlvr")(Pipeline(PIPELINE_SPECS.get("rlvr"), rlvr_train_flow, rlvr_summary_lines,
                                     (rlvr_eval_flow, rlvr_eval_summary_lines)))


def pipeline_of(data: dict[str, Any], where: str) -> Pipeline:
    """The pipeline a raw config mapping names (``pipeline: agentic | rlvr``)."""
    name = data.get("pipeline", DEFAULT_PIPELINE)
    if not isinstance(name, str) or name not in PIPELINES:
        raise ConfigError(f"{where}: pipeline {name!r} is unknown; set pipeline to one of {PIPELINES.names()}")
    return PIPELINES.get(name)
