"""One response-rewards stage for both pipelines (issue 12): the config section selects ROLL's algorithm, an agentic
section fingerprints exactly as before the merge (committed run folders stay up to date), a section read back from a
manifest selects the same algorithm, and the inputs a section does not read are refused."""

from __future__ import annotations

import json

import pytest

from schemas.config import RecomputeConfig, ResponseRewardSection, section, validate_config
from schemas.errors import SchemaError
from schemas.rlvr_config import rlvr_reward_section
from stages.response_rewards import ResponseRewardsStage, RewardsSection
from stages.runner import run_stage, stage_fingerprint
from stages.storage import Location
from tests.rlvr.helpers import config as rlvr_config

# computed by the separate agentic stage before the merge (033da5d) on a folder whose manifest fingerprint is 0…0
BEFORE_MERGE = {"grpo": "b2e34d0f823592b2588916864234638ef8e4f8d416fc4d8d127500ee10bfe269",
                "gigpo": "9c7773eda3a4b3e65c27943151eb17ca93cfb62fe3ba67ff9e7efd555c1eff79",
                "step_reinforce": "80f4a7867a60689a47edb0144785e84e9f2e74304a315c54923f04c4d8350da6"}


@pytest.fixture
def committed(tmp_path) -> Location:
    (tmp_path / "manifest.json").write_text(json.dumps({"fingerprint": "0" * 64}))
    return Location.of(str(tmp_path))


@pytest.mark.parametrize("estimator", sorted(BEFORE_MERGE))
def test_agentic_sections_fingerprint_as_before_the_merge(estimator, committed):
    s = section(validate_config(RecomputeConfig, {"adv_estimator": estimator}), ResponseRewardSection)
    assert stage_fingerprint(ResponseRewardsStage(), s, {"samples": committed}, {}) == BEFORE_MERGE[estimator]
    # as `rollflow stage` reads it back from the manifest: the same algorithm, the same fingerprint
    back = validate_config(RewardsSection, s.model_dump(mode="json"))
    assert back == s
    assert stage_fingerprint(ResponseRewardsStage(), back, {"samples": committed}, {}) == BEFORE_MERGE[estimator]


def test_an_rlvr_section_selects_the_rlvr_algorithm_and_its_inputs():
    s = rlvr_reward_section(rlvr_config(num_return_sequences_in_group=4, adv_estimator="grpo"))
    stage = ResponseRewardsStage()
    assert validate_config(RewardsSection, s.model_dump(mode="json")) == s
    assert set(stage.inputs_for(s)) == {"samples", "scored"} and stage.required_columns(s) == {"scored": ("domain",)}
    agentic = section(validate_config(RecomputeConfig, {}), ResponseRewardSection)
    assert set(stage.inputs_for(agentic)) == {"samples"} and stage.required_columns(agentic) == {}


def test_an_input_the_section_does_not_read_is_refused(committed, tmp_path):
    s = section(validate_config(RecomputeConfig, {}), ResponseRewardSection)
    with pytest.raises(SchemaError, match=r"input\(s\) \['scored'\] are not read under this config section"):
        run_stage(ResponseRewardsStage(), s, {"samples": committed.path, "scored": committed.path},
                  str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
