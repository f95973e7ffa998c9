"""RLVRConfig: the shipped configs load; each rule fails with the rule, the reason and the fix; sections."""

from __future__ import annotations

import pytest

from schemas.config import load_config
from schemas.errors import ConfigError
from schemas.rlvr_config import RLVRConfig, reward_section, rlvr_advantage_section, rlvr_reward_section
from tests.rlvr.helpers import REPO, config


@pytest.mark.parametrize("name", ["rlvr_math", "rlvr_mixed"])
def test_shipped_configs_load(name):
    cfg = load_config(RLVRConfig, REPO / f"configs/{name}.yaml")
    assert cfg.adv_estimator == "grpo" and cfg.num_return_sequences_in_group == 8
    assert "math" in cfg.rewards.routes and cfg.rewards.routes["math"].worker == "math_rule"


def test_mixed_config_routes_four_domains_to_registered_workers():
    import stages.rewards  # noqa: F401
    from stages.rewards.registry import resolve_worker

    cfg = load_config(RLVRConfig, REPO / "configs/rlvr_mixed.yaml")
    assert list(cfg.rewards.routes) == ["math", "code", "mcq", "ifeval"]
    for route in cfg.rewards.routes.values():
        resolve_worker(route.worker)


@pytest.mark.parametrize("fields,message", [
    ({"adv_estimator": "agentic_reinforce"}, r"agentic-only, because .* use grpo, reinforce or gae"),
    ({"adv_estimator": "grpo", "num_return_sequences_in_group": 1},
     r"num_return_sequences_in_group \(1\) must be at least 2, because .*set num_return_sequences_in_group: 8"),
    ({"norm_mean_type": "group", "adv_estimator": "reinforce"}, r"must be at least 2"),
    ({"max_len_mask": True}, r"max_len_mask needs max_new_tokens, because .* set max_new_tokens"),
    ({"difficulty_mask": True, "difficulty_low_threshold": 0.9, "difficulty_high_threshold": 0.1},
     r"difficulty_low_threshold \(0.9\) must be below"),
    ({"difficulty_mask": True, "num_return_sequences_in_group": 1},
     r"num_return_sequences_in_group is 1, and with groups of one it keeps every row .* set "
     r"num_return_sequences_in_group: 8, or difficulty_mask: false"),
    ({"reward_clip": 0}, r"reward_clip \(0.0\) must be null or > 0"),
    ({"advantage_clip": -1}, r"advantage_clip \(-1.0\) must be null or > 0"),
    ({"target_kl": 0}, r"target_kl \(0.0\) must be > 0"),
    ({"norm_std_type": "median"}, r"norm_std_type"),
    ({"use_kl_loss": True}, r"field 'use_kl_loss': unknown option"),
    ({"rewards": {"routes": {}}}, r"rewards.routes is empty"),
    ({"rewards": {"routes": {"math": {"worker": "math_rule", "kwarg": {}}}}}, r"unknown option"),
])
def test_rules_name_the_field_the_reason_and_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        config(**fields)


def test_sections_hold_only_what_each_stage_reads():
    cfg = config(num_return_sequences_in_group=4, adv_estimator="grpo", rewards={"domain_column": "tag",
                                                                                  "routes": {"*": {"worker": "m:f"}}})
    assert reward_section(cfg).domain_column == "tag"
    r, a = rlvr_reward_section(cfg), rlvr_advantage_section(cfg)
    assert r.num_return_sequences_in_group == 4
    # the response-rewards and advantages stages are the ones both pipelines run: their sections hold no domain
    # column (the domains come with the scores, then with the rewarded table)
    assert "domain_column" not in type(r).model_fields and "domain_column" not in type(a).model_fields
    assert a.adv_estimator == "grpo"
    assert "gamma" not in type(r).model_fields and "difficulty_mask" not in type(a).model_fields
    # a change to the advantage options leaves the reward section (and so its fingerprint) unchanged
    assert rlvr_reward_section(config(num_return_sequences_in_group=4, adv_estimator="grpo", gamma=0.5,
                                      rewards=cfg.rewards.model_dump())) == r


def test_the_judge_has_its_own_engine_and_a_reply_budget_that_fits():
    """The LLM judge is a model of its own (never the policy), its engine idles outside the reward stage (no CPU
    reserved), and a reply budget that leaves no room for the prompt is refused."""
    cfg = config()
    assert cfg.judge.model is None and cfg.judge.engine.num_cpus_per_engine == 0
    assert cfg.judge.max_new_tokens < cfg.judge.sequence_length
    with pytest.raises(ConfigError, match=r"judge.max_new_tokens \(4096\) must be below judge.sequence_length"):
        config(judge={"max_new_tokens": 4096})


def test_the_judge_engine_window_is_its_max_model_len_and_holds_a_judge_prompt():
    """judge.engine.max_model_len was ignored: the judge's engine always got judge.sequence_length as its window."""
    from stages.rlvr.generate import judge_window

    assert judge_window(config().judge) == 2048
    assert judge_window(config(judge={"engine": {"max_model_len": 4096}}).judge) == 4096
    with pytest.raises(ConfigError, match=r"judge.engine.max_model_len \(1024\) must be >= judge.sequence_length "
                                          r"\(2048\).* raise judge.engine.max_model_len to 2048 or leave it unset"):
        config(judge={"engine": {"max_model_len": 1024}})
