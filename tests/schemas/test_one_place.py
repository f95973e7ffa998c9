"""Each option of a training run declared in one place (issue 43): the estimator at the top level (the training
step's config takes it from there: ``RunOptions.train_step_config``), the RLVR generation budget in
``generating_args``. The places earlier versions copied them into (``train.adv_estimator``, RLVR's top-level
``max_new_tokens``) stay in a run's config.json, so a run folder's frozen config and its hash are what they were;
loading accepts such a copy when it repeats the option and refuses it, with the fix, when it differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import load_config, parse_overrides, validate_config
from schemas.errors import ConfigError
from schemas.rlvr_config import rlvr_reward_section
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.train_config import RunTrainConfig
from schemas.train_flow_config import TrainFlowConfig

REPO = Path(__file__).resolve().parents[2]
GRPO = (TrainFlowConfig, "configs/train_frozenlake_grpo.yaml")
RLVR = (RLVRTrainConfig, "configs/rlvr_train_math.yaml")
# (a run config, the copies an earlier version wrote into its dump: dotted path -> the option they repeat)
COPIES = [(*GRPO, {"train.adv_estimator": "adv_estimator"}),
          (*RLVR, {"train.adv_estimator": "adv_estimator", "max_new_tokens": "generating_args.max_new_tokens"})]


def _at(data: dict, dotted: str):
    for key in dotted.split("."):
        data = data[key]
    return data


def _without(data: dict, dotted: str) -> dict:
    head, _, rest = dotted.partition(".")
    return {k: v for k, v in data.items() if k != head} if not rest else {**data, head: _without(data[head], rest)}


def test_a_run_declares_the_estimator_and_the_generation_budget_once():
    assert "adv_estimator" not in RunTrainConfig.model_fields
    assert "max_new_tokens" not in RLVRTrainConfig.model_fields
    for path, critic in (("configs/train_frozenlake_gae.yaml", True), ("configs/train_frozenlake_grpo.yaml", False)):
        config = load_config(TrainFlowConfig, REPO / path)
        assert config.train_step_config().adv_estimator == config.adv_estimator
        assert config.train_step_config().needs_critic is critic
    rlvr = load_config(RLVRTrainConfig, REPO / RLVR[1], parse_overrides(["generating_args.max_new_tokens=77"]))
    assert rlvr_reward_section(rlvr).max_new_tokens == rlvr.generation_budget() == 77


@pytest.mark.parametrize("model, path, copies", COPIES, ids=["agentic", "rlvr"])
def test_a_frozen_config_keeps_the_copies_and_loads_with_or_without_them(model, path, copies):
    config = load_config(model, REPO / path)
    frozen = config.model_dump(mode="json")
    for copy, option in copies.items():
        assert _at(frozen, copy) == config.option_value(option)  # config.json as earlier versions wrote it
    assert validate_config(model, frozen) == config
    bare = frozen
    for copy in copies:
        bare = _without(bare, copy)
    assert validate_config(model, bare) == config


@pytest.mark.parametrize("model, path, copies", COPIES, ids=["agentic", "rlvr"])
def test_a_copy_set_again_is_taken_when_it_repeats_the_option_and_refused_with_the_fix_when_it_differs(model, path,
                                                                                                   copies):
    config = load_config(model, REPO / path)
    for copy, option in copies.items():
        same = config.option_value(option)
        assert load_config(model, REPO / path, {copy: same}) == config  # --set train.adv_estimator=<the run's>
        assert load_config(model, REPO / path, {copy: None}) == config  # null: not set
        other = "gae" if isinstance(same, str) else same - 1
        with pytest.raises(ConfigError) as err:
            load_config(model, REPO / path, {copy: other})
        for words in (f"{copy} ({other}) differs from {option} ({same})", f"set it once, at {option}, and remove "
                      f"{copy}"):
            assert words in str(err.value)


def test_the_training_step_config_is_validated_once_per_config_and_a_changed_copy_makes_its_own():
    config = load_config(TrainFlowConfig, REPO / GRPO[1])
    step = config.train_step_config()
    assert config.train_step_config() is step  # kept, not validated again on every call
    fresh = TrainFlowConfig.model_construct(**dict(config))  # the same fields, nothing kept yet
    assert fresh == config and config == fresh
    assert fresh.model_dump(mode="json") == config.model_dump(mode="json")
    assert fresh.train_step_config() == step
    assert config.model_copy().train_step_config() is step
    train = config.train.model_copy(update={"ppo_epochs": config.train.ppo_epochs + 1})
    retrained = config.model_copy(update={"train": train})
    assert retrained.train_step_config().ppo_epochs == config.train.ppo_epochs + 1
    assert retrained != config
    critic = config.model_copy(update={"adv_estimator": "gae"})
    assert (critic.train_step_config().adv_estimator, critic.train_step_config().needs_critic) == ("gae", True)
    assert (config.train_step_config().adv_estimator, step.needs_critic) == (config.adv_estimator, False)
    # the step's cluster settings are the run's top-level runtime (issue 43): a copy with another one makes its own
    moved = config.model_copy(update={"runtime": config.runtime.model_copy(update={"batch_rows": 7})})
    assert moved.train_step_config().runtime.batch_rows == 7 and step.runtime.batch_rows == config.runtime.batch_rows
