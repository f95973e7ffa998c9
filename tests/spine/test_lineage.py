"""``rollflow lineage``: where a table came from (the inputs each manifest records) and which outputs are stale after
an input was recomputed in place or removed."""

from __future__ import annotations

import shutil

from typer.testing import CliRunner

from flows.cli import app
from schemas.config import ResponseRewardSection, section
from tests.spine.helpers import GIGPO, config, run_recompute, tree_digest

runner = CliRunner()


def lineage(path) -> str:
    result = runner.invoke(app, ["lineage", str(path)])
    assert result.exit_code == 0, result.output
    return result.output


def test_lineage_follows_the_manifests_and_marks_outputs_whose_input_changed(step_set, tmp_path, ray_cluster):
    from stages.response_rewards import ResponseRewardsStage
    from stages.runner import run_stage

    out = tmp_path / "run"
    run_recompute(step_set, str(out), GIGPO)
    before = tree_digest(out)

    text = lineage(out / "advantaged")
    lines = text.splitlines()
    assert lines[0].startswith(f"{out / 'advantaged'}  stage advantages v")
    assert f"  <- rewarded: {out / 'rewarded'}  stage response_rewards v" in text
    assert f"    <- samples: {step_set}  stage example v1, " in text  # rewarded's own input, one level down
    assert f"  <- samples: {step_set}  stage example v1, " in text  # the generated example set has a manifest too
    assert "STALE" not in text and "1 stage outputs under" in text and "none is stale" in text
    assert "2 stage outputs under" in lineage(out) and "none is stale" in lineage(out)
    assert tree_digest(out) == before, "lineage writes nothing"

    # the rewards are recomputed in place with another config: the advantages were computed from the old ones
    changed = section(config(GIGPO, reward_normalization__method="mean"), ResponseRewardSection)
    run_stage(ResponseRewardsStage(), changed, {"samples": step_set}, str(out / "rewarded"), force=True)
    text = lineage(out / "advantaged")
    assert f"<- rewarded: {out / 'rewarded'}" in text and "STALE: input 'rewarded'" in text
    assert "changed since this output was written" in text
    summary = lineage(out)
    assert "1 stale of 2 stage outputs" in summary and f"{out / 'advantaged'}: input 'rewarded'" in summary

    shutil.rmtree(out / "rewarded")
    text = lineage(out / "advantaged")
    assert f"<- rewarded: {out / 'rewarded'}  missing  STALE: input 'rewarded' ({out / 'rewarded'}) is gone" in text


def test_lineage_of_a_missing_folder_is_a_user_error(tmp_path):
    result = runner.invoke(app, ["lineage", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "is not a folder" in result.output and "Traceback" not in result.output
