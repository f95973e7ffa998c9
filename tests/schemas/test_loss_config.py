"""The loss options (schemas/loss_config.py): declared once, inherited by the training section, dumped as written."""

from __future__ import annotations

import pytest

from schemas.config import validate_config
from schemas.errors import ConfigError
from schemas.loss_config import LossOptions, TrainInferCorrectionConfig
from schemas.train_config import TrainSection, TrainStepConfig


def test_the_training_section_is_the_loss_options_plus_its_own():
    assert issubclass(TrainSection, LossOptions)
    cfg = validate_config(TrainStepConfig, {"pg_clip": 0.1, "loss_agg_mode": "token-mean",
                                            "train_infer_correction": {"is_weight": {"enabled": True}}})
    loss = cfg.loss_config()
    assert type(loss) is LossOptions and set(loss.model_dump()) == set(LossOptions.model_fields)
    assert (loss.pg_clip, loss.loss_agg_mode, loss.clip_range) == (0.1, "token-mean", (0.1, 0.1))
    assert loss.train_infer_correction.is_weight.enabled and loss.train_infer_correction.is_weight.upper_bound == 1.2


@pytest.mark.parametrize("written", [
    {},
    {"is_weight": {"enabled": True}},
    {"is_weight": {"enabled": True, "upper_bound": 1.5}, "filters": [{"enabled": True, "agg_type": "segment"}]},
])
def test_train_infer_correction_dumps_as_written(written):
    """The section's dump (its fingerprint, a run's config.json) holds the mapping as written, as it did when the
    field was a plain dict, so existing run folders resume; loading the dump gives the same options back."""
    cfg = validate_config(TrainStepConfig, {"train_infer_correction": written})
    dumped = cfg.model_dump(mode="json")
    assert dumped["train_infer_correction"] == written
    assert validate_config(TrainStepConfig, dumped) == cfg


def test_bad_correction_entries_name_the_entry():
    with pytest.raises(ConfigError, match=r"field 'train_infer_correction.filters\[1\].agg_type'"):
        validate_config(TrainStepConfig, {"train_infer_correction": {"filters": [{}, {"agg_type": "row"}]}})
    with pytest.raises(ConfigError, match=r"sum_norm_constant \(0.0\) must be > 0"):
        validate_config(TrainStepConfig, {"sum_norm_constant": 0})
    assert TrainInferCorrectionConfig.from_dict({"is_weight": None, "filters": None}) == TrainInferCorrectionConfig()


@pytest.mark.parametrize("written, phrases", [
    ({"value_clip": 0}, ["field '(top level)'", "value_clip (0.0) must be null or > 0",
                         "set value_clip: null to turn value clipping off"]),
    ({"train_infer_correction": {"is_weight": {"enabled": True, "upper_bound": -1}}},
     ["field 'train_infer_correction.is_weight'", "is_weight.upper_bound (-1.0) must be null or > 0",
      "makes every weight -1.0", "use e.g. 1.2 (ROLL's default), or null for no clamp"]),
    ({"train_infer_correction": {"is_weight": {"upper_bound": 0}}}, ["is_weight.upper_bound (0.0) must be null"]),
    ({"train_infer_correction": {"filters": [{}, {"enabled": True, "ratio_low": 1.2, "ratio_high": 0.8}]}},
     ["field 'train_infer_correction.filters[1]'", "ratio_low (1.2) must not exceed ratio_high (0.8)",
      "an empty range drops every token; swap them"]),
    ({"train_infer_correction": {"filters": [{"diff_enabled": True, "diff_low": 0.3}]}},
     ["field 'train_infer_correction.filters[0]'", "diff_low (0.3) must not exceed diff_high (0.2)"]),
    ({"train_infer_correction": {"filters": [{"ratio_low": 0, "ratio_high": 0}]}},
     ["ratio_high (0.0) must be > 0", "use e.g. 1.2"]),
    ({"rl_loss_coef": -1}, ["field 'rl_loss_coef'", "greater than 0"]),
    ({"rl_loss_coef": 0}, ["field 'rl_loss_coef'", "greater than 0"]),
], ids=lambda v: str(v)[:40])
def test_meaningless_loss_values_name_the_field_and_the_fix(written, phrases):
    """Values ROLL's loss would compute with but that mean nothing (an empty clip range, a bound that zeroes or flips
    every weight) are refused when the config is loaded, not by a training worker, or never."""
    with pytest.raises(ConfigError) as err:
        validate_config(TrainStepConfig, written, "train.yaml")
    for phrase in phrases:
        assert phrase in str(err.value), str(err.value)



@pytest.mark.parametrize("option, value", [("rl_loss_coef", 0.5), ("difficulty_loss_weight", True),
                                           ("length_loss_weight", True)])
@pytest.mark.parametrize("loss", ["agentic", "base"])
def test_an_option_only_the_rlvr_loss_reads_is_refused_with_another_loss(loss, option, value):
    """ROLL's agentic and base actor losses (spec §6.3, §6.4) never read these: the value changed nothing."""
    with pytest.raises(ConfigError) as err:
        validate_config(TrainStepConfig, {"policy_loss": loss, option: value}, "train.yaml")
    for phrase in (f"{option} ({value}) is read only by the rlvr policy loss", f"policy_loss is {loss}, which "
                   "ignores it", f"set policy_loss: rlvr, or remove {option}"):
        assert phrase in str(err.value), str(err.value)
    assert getattr(validate_config(TrainStepConfig, {"policy_loss": "rlvr", option: value}), option) == value
    validate_config(TrainStepConfig, {"policy_loss": loss, option: TrainStepConfig.model_fields[option].default})

@pytest.mark.parametrize("option, value, owner", [("ratio_type", "segment", "agentic"),
                                                  ("importance_sampling", "seq", "rlvr")])
@pytest.mark.parametrize("loss", ["agentic", "base", "rlvr"])
def test_a_ratio_level_of_another_loss_is_refused(loss, option, value, owner):
    """A per-turn (agentic) or per-sequence (rlvr) ratio with a loss whose ratios are per token changed nothing."""
    if loss == owner:
        assert getattr(validate_config(TrainStepConfig, {"policy_loss": loss, option: value}), option) == value
        return
    with pytest.raises(ConfigError) as err:
        validate_config(TrainStepConfig, {"policy_loss": loss, option: value}, "train.yaml")
    for phrase in (f"{option} {value} is a ratio of the {owner} policy loss", f"policy_loss is {loss}",
                   f"set policy_loss: {owner}, or {option}: token"):
        assert phrase in str(err.value), str(err.value)
    validate_config(TrainStepConfig, {"policy_loss": loss, option: "token"})
