"""Config models (schemas/config.py): loading, overrides, rules with field/reason/fix, frozen models, sections."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas.config import (AdvantageOptions, AdvantageSection, AlgorithmConfig, RecomputeConfig, ResponseRewardSection,
                            load_config, load_config_data, parse_overrides, section, validate_config)
from schemas.errors import ConfigError
from schemas.rlvr_config import RLVRConfig
from schemas.rlvr_train_config import RLVRTrainConfig
from schemas.train_flow_config import TrainFlowConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("recompute_*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(RecomputeConfig, path)
    assert cfg.group_size == 8
    section(cfg, ResponseRewardSection)
    section(cfg, AdvantageSection)


def test_defaults_are_rolls():
    cfg = load_config(RecomputeConfig, None)
    assert (cfg.adv_estimator, cfg.gamma, cfg.lambd, cfg.init_kl_coef, cfg.kl_penalty) == ("gae", 1.0, 0.95, 0.2, "kl")
    assert cfg.reward_normalization.grouping == "batch" and cfg.reward_normalization.method == "identity"
    assert cfg.runtime.batch_rows == 1024


def test_every_field_has_a_description():
    for model in (AlgorithmConfig, RecomputeConfig):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"


def test_models_are_frozen():
    cfg = load_config(RecomputeConfig, None)
    with pytest.raises(ValidationError):
        cfg.gamma = 0.5  # type: ignore[misc]


def test_overrides_are_dotted_and_yaml_typed(tmp_path):
    assert parse_overrides(["gamma=0.9", "reward_normalization.method=mean_std", "reward_clip=null",
                            "whiten_advantages=true", "tag=a=b"]) == {
        "gamma": 0.9, "reward_normalization.method": "mean_std", "reward_clip": None, "whiten_advantages": True,
        "tag": "a=b"}
    cfg = load_config(RecomputeConfig, CONFIGS[0], parse_overrides(["reward_normalization.method=mean",
                                                                     "runtime.batch_rows=64"]))
    assert cfg.reward_normalization.method == "mean" and cfg.runtime.batch_rows == 64
    assert cfg.reward_normalization.grouping == "traj_group_id", "the rest of the section stays"
    with pytest.raises(ConfigError, match="override 'gamma' must look like key=value"):
        parse_overrides(["gamma"])
    with pytest.raises(ConfigError, match="override 'gamma.x': 'gamma' is not a section"):
        load_config(RecomputeConfig, None, {"gamma": 1.0, "gamma.x": 2})


def test_an_override_into_a_value_names_the_fix_and_one_into_an_empty_section_works(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("'gamma' is not a section but the value 1.0, which has no options "
                                                    "inside; set it whole (--set 'gamma=...'), or check the key path")):
        load_config(RecomputeConfig, None, {"gamma": 1.0, "gamma.x": 2})
    with pytest.raises(ConfigError, match=re.escape("'filters' is not a section but a list, which has no options "
                                                    "inside; set it whole (--set 'train.train_infer_correction.filters"
                                                    "=...')")):
        load_config(TrainFlowConfig, None, parse_overrides(["train.train_infer_correction.filters=[{}]",
                                                            "train.train_infer_correction.filters.0.enabled=true"]))
    empty = tmp_path / "empty_section.yaml"
    empty.write_text("adv_estimator: grpo\nreward_normalization:\n")  # a section whose options are all left out
    cfg = load_config(RecomputeConfig, empty, parse_overrides(["reward_normalization.method=mean_std"]))
    assert cfg.reward_normalization.method == "mean_std"


@pytest.mark.parametrize("data,phrases", [
    ({"reward_clip": 0}, ["field '(top level)'", "reward_clip (0.0) must be null or > 0", "set reward_clip: null"]),
    ({"advantage_clip": -2}, ["advantage_clip (-2.0) must be null or > 0", "advantage_clip: null"]),
    ({"target_kl": 0}, ["target_kl (0.0) must be > 0", "target_kl: null"]),
    ({"gamma": 2}, ["field 'gamma'", "less than or equal to 1"]),
    ({"kl_horizon": 0}, ["field 'kl_horizon'", "greater than 0"]),
    ({"adv_estimator": "ppo"}, ["field 'adv_estimator'", "'gigpo'"]),
    ({"kl_penalty": "kl2"}, ["field 'kl_penalty'", "'k3'"]),
    ({"whiten": True}, ["field 'whiten'", "unknown option", "ROLL option names"]),
    ({"reward_normalization": {"method": "z"}}, ["field 'reward_normalization.method'"]),
    ({"reward_normalization": {"norm_mean_type": "running"}}, ["field 'reward_normalization.norm_mean_type'"]),
    ({"runtime": {"batch_rows": 0}}, ["field 'runtime.batch_rows'"]),
    ({"group_size": 0}, ["field 'group_size'"]),
    ({"adv_estimator": "gigpo", "group_size": 1, "reward_normalization": {"grouping": "traj_group_id",
                                                                          "method": "mean_std"}},
     ["group_size (1) must be at least 2", "set group_size: 8"]),
    ({"adv_estimator": "gigpo", "episode_reward_weight": -1.0},
     ["episode_reward_weight and step_reward_weight must be >= 0", "use 0 to switch a part off"]),
    ({"adv_estimator": "gigpo", "step_reward_weight": -0.5}, ["must be >= 0, because a negative weight"]),
    ({"adv_estimator": "gigpo", "episode_reward_weight": 0, "step_reward_weight": 0},
     ["both 0, so GiGPO rewards would be 0", "set episode_reward_weight: 1.0"]),
])
def test_rule_violations_name_field_rule_and_fix(data, phrases):
    with pytest.raises(ConfigError) as err:
        validate_config(RecomputeConfig, data, "my.yaml")
    text = str(err.value)
    assert text.startswith("invalid config my.yaml:")
    for phrase in phrases:
        assert phrase in text, text


SHARED_RULES = [({"reward_clip": 0}, "reward_clip (0.0) must be null or > 0"),
                ({"advantage_clip": -2}, "advantage_clip (-2.0) must be null or > 0"),
                ({"target_kl": 0}, "target_kl (0.0) must be > 0")]


@pytest.mark.parametrize("override,phrase", SHARED_RULES, ids=lambda v: str(v)[:16])
@pytest.mark.parametrize("model,path", [
    (RecomputeConfig, "recompute_grpo.yaml"), (TrainFlowConfig, "train_frozenlake_grpo.yaml"),
    (RLVRConfig, "rlvr_math.yaml"), (RLVRTrainConfig, "rlvr_train_math.yaml")], ids=lambda v: getattr(v, "__name__", v))
def test_shared_advantage_rules_run_in_every_pipeline(model, path, override, phrase):
    """AdvantageOptions declares these rules once; each pipeline's own rules must run beside them, not replace them
    (a pydantic validator of the same name in a subclass would)."""
    assert issubclass(model, AdvantageOptions)
    load_config(model, REPO / "configs" / path)
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        load_config(model, REPO / "configs" / path, override)


@pytest.mark.parametrize("model,path,override", [
    (RecomputeConfig, "recompute_grpo.yaml", "advantage_clip=.nan"),
    (RecomputeConfig, "recompute_grpo.yaml", "gamma=nan"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "train.pg_clip=.inf"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "rollout.format_penalty=-.inf"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "train.train_infer_correction.is_weight.upper_bound=.nan"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "train.actor_train.training_args.max_grad_norm=.inf"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "runtime.stage_resources={train_step: {trainer_node: .inf}}"),
    (RLVRConfig, "rlvr_math.yaml", "difficulty_high_threshold=.nan"),
    (RLVRTrainConfig, "rlvr_train_math.yaml", "generating_args.temperature=.inf"),
], ids=lambda v: getattr(v, "__name__", v))
def test_non_finite_numbers_are_refused_with_the_field_and_the_fix(model, path, override):
    """.nan and .inf parse as floats and pass every bound they are not compared with (nan) or satisfy (inf): a nan
    clip or coefficient would turn advantages or losses into nan a stage later."""
    with pytest.raises(ConfigError) as err:
        load_config(model, REPO / "configs" / path, parse_overrides([override]))
    text = str(err.value)
    assert f"field '{override.split('=')[0].split('{')[0]}" in text and "must be a finite number" in text, text
    assert "write a number, or null where the option can be switched off" in text


@pytest.mark.parametrize("model,path", [(TrainFlowConfig, "train_frozenlake_grpo.yaml"),
                                        (RLVRTrainConfig, "rlvr_train_math.yaml")], ids=lambda v: getattr(v, "__name__", v))
def test_an_unknown_estimator_is_reported_once_where_it_was_written(model, path):
    """Not also as train.adv_estimator, the copy the training section would have received."""
    with pytest.raises(ConfigError) as err:
        load_config(model, REPO / "configs" / path, {"adv_estimator": "ppo"})
    assert [line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]] == ["field 'adv_estimator'"]


@pytest.mark.parametrize("grouping", ["", "traj_group", "state_group_id", "score"])
@pytest.mark.parametrize("model,path", [(RecomputeConfig, "recompute_grpo.yaml"),
                                        (TrainFlowConfig, "train_frozenlake_grpo.yaml")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_a_grouping_that_names_no_column_is_refused_with_the_choices(model, path, grouping):
    """It failed only in the response_rewards stage, after the rollout (or a recompute's first stages)."""
    with pytest.raises(ConfigError) as err:
        load_config(model, REPO / "configs" / path, {"reward_normalization": {"grouping": grouping}})
    assert "field 'reward_normalization.grouping'" in str(err.value)
    assert "'batch', 'traj_group_id', 'tags', 'traj_id', 'group_id' or 'tag'" in str(err.value)
    for name in ("batch", "traj_group_id", "tags", "traj_id", "group_id", "tag"):
        load_config(model, REPO / "configs" / path, {"reward_normalization": {"grouping": name, "method": "mean_std"}})


@pytest.mark.parametrize("model,path,name", [
    (RecomputeConfig, "recompute_grpo.yaml", "reward_normalization"), (RecomputeConfig, "recompute_grpo.yaml", "runtime"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "reward_normalization"),
    (TrainFlowConfig, "train_frozenlake_grpo.yaml", "eval"), (TrainFlowConfig, "train_frozenlake_grpo.yaml", "train"),
    (RLVRConfig, "rlvr_math.yaml", "judge"), (RLVRTrainConfig, "rlvr_train_math.yaml", "validation"),
], ids=lambda v: getattr(v, "__name__", v))
def test_an_empty_section_is_its_defaults_in_every_config(tmp_path, model, path, name):
    """`name:` with nothing under it (YAML null) was refused in a recompute config ("Input should be a valid
    dictionary") but taken as the defaults for some sections of a training config."""
    without = re.sub(rf"(?ms)^{name}:.*?(?=^\S|\Z)", "", (REPO / "configs" / path).read_text())
    assert f"\n{name}:" not in without
    (tmp_path / "absent.yaml").write_text(without)
    (tmp_path / "empty.yaml").write_text(f"{without}\n{name}:\n")
    assert load_config(model, tmp_path / "empty.yaml") == load_config(model, tmp_path / "absent.yaml")


def test_a_required_section_left_empty_is_still_refused(tmp_path):
    cfg = tmp_path / "rlvr.yaml"
    cfg.write_text("rewards:\n")
    with pytest.raises(ConfigError, match="field 'rewards': Input should be a valid dictionary"):
        load_config(RLVRConfig, cfg)


@pytest.mark.parametrize("key,field", [("dtype", "dtype"), ("max_model_len", "max_model_len"),
                                       ("num_threads", "threads"), ("sleep_mode", "sleep_level")])
def test_an_engine_option_the_section_sets_from_a_field_is_refused(key, field):
    """The engine pool passes these from the section's own fields and let options override them: options.dtype
    skipped the dtype choices, options.max_model_len the window rule, and neither reached the rollout's fingerprint."""
    from schemas.rollout_config import RolloutConfig

    with pytest.raises(ConfigError) as err:
        load_config(RolloutConfig, REPO / "configs/rollout_frozenlake.yaml", {"engine": {"options": {key: 1}}})
    for phrase in ("field 'engine.options'", f"'{key}' is passed to the backend from engine.{field}",
                   f"set engine.{field} instead and remove '{key}' from the options"):
        assert phrase in str(err.value), str(err.value)


def test_several_violations_are_reported_together():
    with pytest.raises(ConfigError) as err:
        validate_config(RecomputeConfig, {"gamma": 3, "lambd": -1, "nope": 1})
    assert {"field 'gamma'", "field 'lambd'", "field 'nope'"} <= {line.split(":")[0].strip()
                                                                  for line in str(err.value).splitlines()[1:]}


def test_group_size_one_is_fine_without_group_normalisation():
    validate_config(RecomputeConfig, {"adv_estimator": "grpo", "group_size": 1})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RecomputeConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gamma: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(RecomputeConfig, bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(RecomputeConfig, bad)
    for text in (b"", b"# only a comment\n", b"{}\n"):  # defaults the user did not ask for: --config left out says so
        bad.write_bytes(text)
        with pytest.raises(ConfigError, match="bad.yaml holds no options .* leave out --config"):
            load_config(RecomputeConfig, bad)
    bad.write_bytes("gamma: 0.9  # \u00e9t\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="bad.yaml is not UTF-8 text .byte 0xe9 at offset 14.; .* save it as UTF-8"):
        load_config(RecomputeConfig, bad)
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder; pass a YAML file"):
        load_config(RecomputeConfig, tmp_path)


def test_a_config_of_another_command_names_the_command_that_takes_it():
    """Before: one 'unknown option, check the spelling' line per key of the other command's config."""
    rollout = load_config_data(REPO / "configs/rollout_frozenlake.yaml")
    with pytest.raises(ConfigError, match=re.escape("x.yaml is a config of rollflow rollout (episodes played by a "
                                                    "policy)")) as err:
        validate_config(RecomputeConfig, rollout, "x.yaml")
    assert "use it with rollflow rollout, or pass a config of rollflow recompute" in str(err.value)
    with pytest.raises(ConfigError, match="its option group_size is not an option of rollflow score; use it with "
                                          "rollflow recompute"):
        validate_config(RLVRConfig, {"group_size": 8}, "x.yaml")
    with pytest.raises(ConfigError, match="field 'gama': unknown option; check the spelling"):  # a typo stays one
        validate_config(RecomputeConfig, {"gama": 0.9}, "x.yaml")


def test_a_key_written_twice_is_an_error_with_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys silently: the value a reader sees first is not the one the run uses."""
    bad = tmp_path / "twice.yaml"
    bad.write_text("gamma: 0.9\nreward_normalization:\n  method: mean\n  method: mean_std\n")
    with pytest.raises(ConfigError, match=re.escape("twice.yaml is not valid YAML: key 'method' appears twice in one "
                                                    "mapping (lines 3 and 4)")) as err:
        load_config(RecomputeConfig, bad)
    assert "remove one of them" in str(err.value)
    with pytest.raises(ConfigError, match=re.escape("key 'gamma' appears twice")):
        parse_overrides(["reward_normalization={gamma: 1, gamma: 0.5}"])
    assert parse_overrides(  # a merge's keys may be overridden
        ["reward_normalization={<<: {method: mean, grouping: batch}, method: mean_std}"]) == {
        "reward_normalization": {"method": "mean_std", "grouping": "batch"}}


def test_sections_hold_only_what_a_stage_reads():
    cfg = load_config(RecomputeConfig, CONFIGS[0], {"gamma": 0.5, "runtime.batch_rows": 7})
    rewards = section(cfg, ResponseRewardSection)
    adv = section(cfg, AdvantageSection)
    assert rewards.group_size == cfg.group_size and rewards.reward_normalization == cfg.reward_normalization
    assert adv.gamma == 0.5 and not hasattr(rewards, "gamma")
    # runtime settings never enter a stage section (so they never change a fingerprint)
    assert "runtime" not in rewards.model_dump() and "runtime" not in adv.model_dump()
    # a change to an advantages-only option leaves the rewards section equal
    other = load_config(RecomputeConfig, CONFIGS[0], {"gamma": 0.9})
    assert section(other, ResponseRewardSection) == rewards and section(other, AdvantageSection) != adv


def test_training_packing_is_dumped_only_when_on_so_older_fingerprints_hold():
    from schemas.train_config import TrainSection

    off = TrainSection()
    assert "use_sequence_packing" not in off.model_dump(mode="json")["actor_train"]
    on = TrainSection.model_validate({"actor_train": {"use_sequence_packing": True}})
    dumped = on.model_dump(mode="json")
    assert dumped["actor_train"]["use_sequence_packing"] is True
    assert TrainSection.model_validate(dumped) == on and TrainSection.model_validate(off.model_dump()) == off
