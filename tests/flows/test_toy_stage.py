"""A stage and a pipeline declared here, in the test only, and nowhere else: the one loop (flows/loop.py) runs it,
``rollflow stage`` re-runs it with ``--downstream``, ``rollflow lineage`` shows it and ``rollflow plan`` counts it.

The toy stage adds a column (``toy_bonus``: each row's response-level reward doubled) to the advantaged table. The toy
pipeline's iteration reads a stored samples table (``rollflow example``'s step-level FrozenLake rows, no model),
then runs the response rewards and advantages of the agentic pipeline and the toy stage: no generation, log-probs or
training, so the run needs no engine and no DeepSpeed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from flows.agentic import rewards_section
from flows.cli import app
from flows.loop import Evaluation, IterStep, PipelineFlow, Run, advantages_step, rewards_step, run_pipeline
from flows.pipeline_specs import PIPELINE_SPECS, PipelineSpec
from schemas.config import AdvantageSection, Frozen, section, validate_config
from schemas.errors import ConfigError
from schemas.stage_specs import StageSpec, declare_stage, withdraw_stage
from schemas.tables import ADVANTAGED, TableSpec
from schemas.train_flow_config import TrainFlowConfig
from stages.example import ExampleSpec, generate
from stages.stage import Stage, StageContext
from tests.spine.helpers import REPO, read_table

TOYED = TableSpec("toyed", {**ADVANTAGED.required, "toy_bonus": pa.float32()}, ADVANTAGED.optional)
PIN = "toy_node"


class ToySection(Frozen):
    scale: float = 2.0


def _add_bonus(batch: pa.RecordBatch, scale: float) -> pa.RecordBatch:
    bonus = pc.multiply(batch.column("response_level_rewards"), pa.scalar(scale, pa.float32()))
    return batch.append_column("toy_bonus", bonus.cast(pa.float32()))


class ToyStage(Stage):
    """``advantaged`` -> the same rows with ``toy_bonus``."""

    name = "toy_bonus"
    version = "1"
    output_spec = TOYED
    section_model = ToySection
    input_specs = {"advantaged": ADVANTAGED}

    def build(self, ctx: StageContext):
        return ctx.read("advantaged").map_batches(_add_bonus, batch_format="pyarrow", batch_size=ctx.batch_rows,
                                                  fn_kwargs={"scale": ctx.section.scale})


TOY_SPEC = StageSpec("toy_bonus", "ToySection", ("advantaged",), "toyed", phase="rewards / advantages", pinnable=True,
                     rerun="runner", runner_class=f"{__name__}:ToyStage")


def _toy_step(r: Run):
    from stages.runner import run_stage

    return run_stage(ToyStage(), ToySection(), {"advantaged": r.results["advantages"].output}, r.out("toyed"),
                     resources=r.config.runtime.resources_for("toy_bonus"))


def _toy_flow(samples: str) -> PipelineFlow:
    """A pipeline whose iteration reads ``samples`` (a stored table), then rewards, advantages and the toy stage."""
    spec = PipelineSpec("toy", lambda: TrainFlowConfig, "iter_", lambda config, evaluation: None,
                        PIPELINE_SPECS.get("agentic").engines)
    stored = IterStep("samples", lambda r: SimpleNamespace(output=samples, metrics={}, seconds=0.0, skipped=True))
    return PipelineFlow(
        spec=spec,
        iteration=(stored, rewards_step(rewards_section, Run.tokens),
                   advantages_step(lambda config: section(config, AdvantageSection)), IterStep("toy_bonus", _toy_step)),
        evaluation=Evaluation("eval", "eval_base", "eval", every=lambda config: 0, run=None, metrics=dict,
                              summary=dict),
        summarize=lambda r, evaluated: {"iteration": r.iteration, "toyed": r.results["toy_bonus"].output},
        base_summary="base_eval", step_word="iteration")


@pytest.fixture
def step_set(tmp_path) -> str:
    """64 step-level FrozenLake rows in groups of 8 (rollflow example), short responses."""
    path = str(tmp_path / "step_set")
    generate(ExampleSpec(samples=64, seed=1, rows_per_file=64, response_len=(8, 16), prompt_len=(4, 8)), path)
    return path


@pytest.fixture
def toy_declared():
    declare_stage(TOY_SPEC)
    try:
        yield TOY_SPEC
    finally:
        withdraw_stage(TOY_SPEC.name)


def _cli(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result.output


def test_a_stage_declared_in_a_test_is_run_re_run_traced_and_planned(toy_declared, step_set, ray_cluster, tmp_path):
    from stages.generation.model_store import tiny_random_model_dir

    cfg = {"run_name": "toy", "runs_dir": str(tmp_path), "max_steps": 1, "pretrain": str(tiny_random_model_dir()),
           "rollout": {"env": {"group_size": 8}, "engine": {"num_cpus_per_engine": 0}}, "runtime": {"num_cpus": 2}}
    summary = run_pipeline(_toy_flow(step_set), validate_config(TrainFlowConfig, cfg), cfg)
    toyed = tmp_path / "toy" / "iter_0000" / "toyed"
    assert summary["iterations"] == [{"iteration": 0, "toyed": str(toyed)}]
    table = read_table(str(toyed), ["response_level_rewards", "toy_bonus"])
    assert table.num_rows == read_table(step_set, ["row_id"]).num_rows
    assert table.column("toy_bonus").to_pylist() == [2 * v for v in table.column("response_level_rewards").to_pylist()]

    advantaged = tmp_path / "toy" / "iter_0000" / "advantaged"
    text = _cli("stage", "advantages", "--from", advantaged, "--set", "whiten_advantages=true", "--downstream")
    assert "toy_bonus: wrote" in text, text
    rerun = [p for p in toyed.parent.iterdir() if p.name.startswith("toyed@")]
    assert len(rerun) == 1 and read_table(str(rerun[0]), ["toy_bonus"]).num_rows == table.num_rows

    assert "stage toy_bonus v1" in _cli("lineage", toyed)

    config = REPO / "configs/train_frozenlake_grpo.yaml"
    plan = _cli("plan", "--config", config, "--cpus", 8, "--gpus", 0, "--resources", f'{{"{PIN}": 1}}',
                "--set", f"runtime.stage_resources.toy_bonus.{PIN}=1")
    assert "toy_bonus tasks" in plan and "fits: yes" in plan, plan


def test_without_its_declaration_the_toy_stage_is_unknown_to_the_readers():
    from flows.restage import known

    assert "toy_bonus" not in known()
    with pytest.raises(ConfigError, match="names stage 'toy_bonus'"):
        validate_config(TrainFlowConfig, {"runtime": {"stage_resources": {"toy_bonus": {PIN: 1}}}})
