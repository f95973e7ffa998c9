"""Mixed environments in the config (ROLL's tags / num_groups_partition / custom_envs): the rules and their
messages, the layout of groups over tags, evaluation's own tags, and that a single-environment config dumps and
fingerprints exactly as it did before mixed environments existed."""

from __future__ import annotations

import hashlib
import json

import pytest

from schemas.config import validate_config
from schemas.errors import ConfigError
from schemas.rollout_config import RolloutConfig, samples_section, turn_section
from schemas.tracking import TrackingOptions
from schemas.train_flow_config import TrainFlowConfig

MIXED_ENV = {"tags": ["FrozenLake", "Sokoban6"], "num_groups_partition": [1, 2], "num_env_groups": 3,
             "group_size": 2, "max_steps": 4}
SOKOBAN6 = {"env_type": "SimpleSokoban", "max_steps": 5, "env_config": {"dim_room": [6, 6], "num_boxes": 1}}


def _mixed(**env) -> RolloutConfig:
    return validate_config(RolloutConfig, {"env": {**MIXED_ENV, **env}, "custom_envs": {"Sokoban6": SOKOBAN6}})


def _hash(model) -> str:
    return hashlib.sha256(json.dumps(model.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


# ---- single-environment configs are unchanged ----------------------------------------------------------------------

def test_default_single_env_sections_dump_exactly_as_before():
    """The literal dumps and the hashes were computed with the code of main before mixed environments (2fe4ee6):
    a committed run folder's stages keep their fingerprints."""
    config = RolloutConfig(engine={"dtype": "float32"})
    assert turn_section(config).model_dump(mode="json")["env"] == {
        "tag": "FrozenLake", "env_config": {}, "num_env_groups": 8, "group_size": 8, "max_steps": 10}
    assert samples_section(config).model_dump(mode="json") == {
        "run_name": "rollout", "iteration": 0, "sample_level": "trajectory", "group_size": 8, "tag": "FrozenLake"}
    assert "custom_envs" not in turn_section(config).model_dump() and "custom_envs" not in config.model_dump()
    assert _hash(turn_section(config)) == "6b85e7626eedf47a4984edbc44cdd36a17741d68d23a331d3f31693bff7899a7"
    assert _hash(samples_section(config)) == "9219db09f6bea5327e84c9401dde4a6a65dbfeb77b3d7a9e6d6bdb90bbe9c589"


def test_single_env_training_config_fingerprints_as_before():
    data = {"run_name": "fp", "rollout": {"seed": 7, "env": {"tag": "SimpleSokoban", "num_env_groups": 2,
                                                               "group_size": 4, "max_steps": 3,
                                                               "env_config": {"dim_room": [6, 6]}},
                                          "engine": {"dtype": "float32"}},
            "logprobs": {"dtype": "fp32"}, "train": {"actor_train": {"model_args": {"dtype": "fp32"}}},
            "eval": {"num_env_groups": 4, "temperature": 0.5}}
    config = validate_config(TrainFlowConfig, data)
    assert _hash(turn_section(config.rollout_for(1))) == \
        "93b69b02f00705da3346da311f1a89dd3f54ff3361671536a8132553a2557f6e"
    assert _hash(turn_section(config.eval_rollout())) == \
        "2c6ff9314453505917b054148c118f582791c127ea414a007ce9d03592b7aac0"
    assert _hash(samples_section(config.rollout_for(1))) == \
        "3cbd2e81355389293397b6f1a6c1b8a6d9e58143f4c85446f589feb5d7de8f84"
    tracking = set(TrackingOptions.model_fields)  # options added since, which no stage reads (schemas/tracking.py)
    dumped = config.model_dump(mode="json", exclude=tracking)
    assert hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest() == \
        "9da04532425459267b1c5d07ede0840d07bf7e3a350e594d42ae870f054d004c"


def test_an_unused_custom_env_changes_no_fingerprint():
    plain = RolloutConfig(engine={"dtype": "float32"})
    extra = validate_config(RolloutConfig, {"engine": {"dtype": "float32"}, "custom_envs": {"Sokoban6": SOKOBAN6}})
    assert _hash(turn_section(extra)) == _hash(turn_section(plain))


# ---- the mixed form ---------------------------------------------------------------------------------------------

def test_layout_assigns_consecutive_groups_to_tags():
    layout = _mixed().env_layout()
    assert [(e.tag, e.env_type, e.first_group, e.num_groups, e.max_steps) for e in layout] == [
        ("FrozenLake", "FrozenLake", 0, 1, 4), ("Sokoban6", "SimpleSokoban", 1, 2, 5)]
    assert layout[1].env_config == {"dim_room": [6, 6], "num_boxes": 1} and layout[0].env_config == {}


def test_mixed_sections_carry_the_tags_and_only_the_used_custom_envs():
    config = validate_config(RolloutConfig, {"env": MIXED_ENV, "custom_envs": {"Sokoban6": SOKOBAN6, "Other": {}}})
    dumped = turn_section(config).model_dump(mode="json")
    assert dumped["env"]["tags"] == ["FrozenLake", "Sokoban6"] and dumped["env"]["num_groups_partition"] == [1, 2]
    assert set(dumped["custom_envs"]) == {"Sokoban6"}
    assert samples_section(config).tag == "FrozenLake,Sokoban6"
    # the dump of a mixed config validates to the same config (a run's frozen copy)
    assert validate_config(RolloutConfig, config.model_dump(mode="json")) == config
    changed = validate_config(RolloutConfig, {"env": MIXED_ENV, "custom_envs": {
        "Sokoban6": {**SOKOBAN6, "max_steps": 6}}})
    assert _hash(turn_section(changed)) != _hash(turn_section(config))


def test_one_tag_needs_no_partition():
    config = validate_config(RolloutConfig, {"env": {"tags": ["SimpleSokoban"], "num_env_groups": 3}})
    assert config.env.partition == (3,) and config.env_layout()[0].env_type == "SimpleSokoban"


@pytest.mark.parametrize("env, words", [
    ({"num_groups_partition": None}, ["num_groups_partition is required with 2 tags", "2 numbers >= 1 summing to 3"]),
    ({"num_groups_partition": None, "num_env_groups": 4}, ["num_groups_partition: e.g. [2, 2]"]),
    ({"num_groups_partition": [1, 1]}, ["sums to 2", "num_env_groups is 3", "set env.num_env_groups: 2"]),
    ({"num_groups_partition": [3]}, ["1 entries", "tags has 2", "one entry per tag"]),
    ({"num_groups_partition": [0, 3]}, ["below 1", "at least one group"]),
    ({"tags": ["Sokoban6", "Sokoban6"]}, ["more than once", "list each tag once"]),
    ({"tags": ["FrozenLake", "a/b"]}, ["env.tags"]),
    ({"tags": ["stop", "Sokoban6"]}, ["reserved", "rename the tag"]),
    ({"tag": "SimpleSokoban"}, ["env.tag describes the single environment", "rollout.custom_envs"]),
    ({"env_config": {"size": 4}}, ["env.env_config describes the single environment"]),
    ({"tags": None}, ["num_groups_partition is set without env.tags", "set env.tags"]),
])
def test_mixed_rules_name_the_field_reason_and_fix(env, words):
    with pytest.raises(ConfigError) as err:
        _mixed(**env)
    for word in words:
        assert word in str(err.value), str(err.value)


# ---- evaluation's own tags ---------------------------------------------------------------------------------------

def _train(eval_section: dict, env: dict | None = None) -> TrainFlowConfig:
    rollout = {"env": env or MIXED_ENV, "custom_envs": {"Sokoban6": SOKOBAN6}}
    return validate_config(TrainFlowConfig, {"rollout": rollout, "eval": eval_section})


@pytest.mark.parametrize("eval_section, tags, partition", [
    ({"num_env_groups": 3}, ("FrozenLake", "Sokoban6"), (1, 2)),        # the training's partition fits
    ({"num_env_groups": 4}, ("FrozenLake", "Sokoban6"), (2, 2)),        # else an even split
    ({"num_env_groups": 3, "tags": ["Sokoban6"]}, ("Sokoban6",), (3,)),
    ({"num_env_groups": 5, "num_groups_partition": [4, 1]}, ("FrozenLake", "Sokoban6"), (4, 1)),
])
def test_evaluation_has_its_own_tags_defaulting_to_the_trainings(eval_section, tags, partition):
    config = _train(eval_section)
    env = config.eval_rollout().env
    assert (env.tags, env.num_groups_partition, env.num_env_groups) == (tags, partition, eval_section["num_env_groups"])
    assert config.rollout.env.partition == (1, 2)  # training untouched
    sokoban = [e for e in config.eval_rollout().env_layout() if e.tag == "Sokoban6"]
    assert all(e.env_type == "SimpleSokoban" and e.max_steps == 5 for e in sokoban)


def test_a_single_env_training_may_evaluate_on_several():
    config = validate_config(TrainFlowConfig, {"rollout": {"env": {"tag": "SimpleSokoban"}},
                                               "eval": {"num_env_groups": 4, "tags": ["FrozenLake", "SimpleSokoban"]}})
    layout = config.eval_rollout().env_layout()
    assert [(e.tag, e.num_groups) for e in layout] == [("FrozenLake", 2), ("SimpleSokoban", 2)]
    assert config.rollout_for(0).env.tags is None


@pytest.mark.parametrize("eval_section, env, words", [
    ({"num_env_groups": 5}, None, ["cannot be split evenly", "set eval.num_groups_partition"]),
    ({"num_env_groups": 4, "num_groups_partition": [1, 2]}, None, ["eval.num_groups_partition [1, 2] sums to 3"]),
    ({"num_groups_partition": [16]}, {"tag": "FrozenLake"}, ["neither eval.tags nor rollout.env.tags",
                                                            "set eval.tags"]),
    ({"num_env_groups": 2, "tags": ["SimpleSokoban", "FrozenLake"]},
     {"tag": "SimpleSokoban", "env_config": {"dim_room": [5, 5]}}, ["rollout.custom_envs", "rollout.env.tags"]),
])
def test_evaluation_rules(eval_section, env, words):
    with pytest.raises(ConfigError) as err:
        _train(eval_section, env)
    for word in words:
        assert word in str(err.value), str(err.value)
