"""The stage declarations (schemas/stage_specs.py): one per stage, and every reader takes them from there."""

from __future__ import annotations

import importlib

import pytest

from flows.restage import known, rerun_of
from schemas.config import RuntimeConfig
from schemas.stage_specs import StageSpec, declare_stage, is_declared, pinnable_stages, stage_spec, stage_specs
from stages.stage import Stage

STAGE_MODULES = ("stages.advantages", "stages.response_rewards", "stages.rlvr.stages", "stages.rlvr.generate",
                 "stages.rollout.stages", "stages.rollout.driver", "stages.train.stage")


def _stage_classes() -> list[type]:
    for module in STAGE_MODULES:
        importlib.import_module(module)
    found, frontier = [], list(Stage.__subclasses__())
    while frontier:
        cls = frontier.pop()
        frontier.extend(cls.__subclasses__())
        if cls.__module__.startswith("stages.") and "name" in vars(cls):
            found.append(cls)
    return found


def test_a_second_declaration_of_a_name_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        declare_stage(StageSpec("advantages", "AdvantageSection", ("samples",), "advantaged", rerun="runner",
                                runner_class="stages.advantages:AdvantagesStage"))
    assert stage_spec("advantages").carries == ("kl_ctrl", None), "the first declaration stays"


def test_a_declaration_is_checked_when_it_is_made():
    with pytest.raises(ValueError, match="phase"):
        StageSpec("x", "S", (), "x", phase="dinner", rerun="eval")
    with pytest.raises(ValueError, match="runner_class"):
        StageSpec("x", "S", (), "x", rerun="runner")
    with pytest.raises(ValueError, match="redo"):
        StageSpec("x", "S", (), "x")


def test_every_stage_class_is_declared_and_the_runner_classes_match_their_declaration():
    names = {cls.name for cls in _stage_classes()}
    from stages.rollout.driver import EvalStage
    from stages.train.stage import TrainStage

    names |= {EvalStage.name, TrainStage.name}
    assert names == {s.name for s in stage_specs()}
    for spec in stage_specs():
        if spec.rerun == "runner":
            module, _, cls_name = spec.runner_class.partition(":")
            cls = getattr(importlib.import_module(module), cls_name)
            assert cls.name == spec.name
            assert set(cls.input_specs) == set(spec.reads), spec.name


def test_the_class_names_of_stages_are_unique():
    classes = _stage_classes()
    assert len({c.__name__ for c in classes}) == len(classes), sorted(c.__name__ for c in classes)


def test_the_readers_take_the_declarations():
    assert pinnable_stages() == ("response_rewards", "advantages", "logprobs", "train_step")
    RuntimeConfig(stage_resources={name: {"node_a": 1} for name in pinnable_stages()})
    with pytest.raises(ValueError, match="use one of response_rewards, advantages, logprobs, train_step"):
        RuntimeConfig(stage_resources={"rewards": {"node_a": 1}})
    assert known().split(", ") == [s.name for s in stage_specs() if s.rerun is not None]
    assert rerun_of("rlvr_generate") is None and rerun_of("nonsense") is None and not is_declared("nonsense")
    assert rerun_of("advantages")[0].__name__ == stage_spec("advantages").section
    assert stage_spec("response_rewards").first_carried() == {}
    assert stage_spec("response_rewards").first_carried() is not stage_spec("response_rewards").carries[1]


def test_the_output_check_takes_the_folders_a_rollout_and_a_validation_write_from_the_declarations():
    """stages/outputs.py keeps no list of rollout or evaluation stage names: a rollout's folders and an RLVR
    validation's come from each stage's ``writes`` (a folder of outputs, turns/turn_<t>, names no stage)."""
    from stages.outputs import EVAL_WRITES, ROLLOUT_CHILDREN

    assert ROLLOUT_CHILDREN == {"episodes": ("rollout_reset",), "turns": (), "samples": ("rollout_samples",)}
    assert EVAL_WRITES.stages == ("eval",)
    assert dict(EVAL_WRITES.children) == {**ROLLOUT_CHILDREN, "prompts": ("rlvr_prompts",),
                                          "responses": ("rlvr_generate",), "scored": ("rewards",)}


def test_the_first_carried_state_and_the_tasks_outside_a_flow_come_from_the_declarations():
    """Steps run outside the loop (rollflow score) start from the state the stages declare they carry (a state
    declared absent until set is left out) and call the shared stage tasks' plain functions: no Prefect server."""
    from flows.loop import Run, _called, first_state
    from flows.runkit import rewards_task

    assert first_state("response_rewards", "advantages", "rewards") == {"running_moments": {}}
    assert first_state("response_rewards")["running_moments"] is not stage_spec("response_rewards").carries[1]
    r = Run.of_folder(None, "/tmp/x/out/", state=first_state("response_rewards"), force=True)
    assert r.out("scored") == "/tmp/x/out/scored" and r.carried("response_rewards") == {"running_moments": {}}
    assert r.carried("advantages") == {} and r.force
    assert _called(rewards_task) is rewards_task.fn
