"""The agentic response-level rewards stage: a samples table → ``rewarded`` (spec §5.1, §5.4).

It needs whole-table statistics (groups, batch mean/std, discounted returns across a trajectory's rows), so it reads
only the narrow identity and score columns — a few bytes a row — and computes them in one batch over the whole
table. The advantages stage (stages/advantages.py) joins its rows by row_id.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from schemas.config import ResponseRewardSection
from schemas.errors import ConfigError, InvariantError, SchemaError
from schemas.tables import REWARDED, SAMPLES, check_row_invariants, check_structure
from stages.runner import Stage, StageContext, read_partials, write_partials
from stages.storage import Location

# ROLL's grouping names → our columns (spec §5.2; ROLL's traj_group_id is our group_id)
GROUPING_COLUMNS = {"traj_group_id": "group_id", "tags": "tag", "traj_id": "traj_id", "group_id": "group_id",
                    "tag": "tag"}
NARROW = ["row_id", "group_id", "traj_id", "turn_idx", "num_turns", "tag", "score", "episode_score"]


# ---- response-level rewards -------------------------------------------------------------------------------------

def response_rewards_table(table: pa.Table, section: ResponseRewardSection, where: str) -> tuple[pa.Table, dict]:
    """Whole narrow ``samples`` table → ``rewarded`` table (row_id + reward columns) and metrics (spec §5.1, §5.4)."""
    from stages.algos.estimators import estimator
    from stages.algos.response_rewards import RewardNormSettings, compute_response_level_rewards, discounted_returns

    check_row_invariants(SAMPLES, table, where)
    check_structure(table, where, section.group_size)
    est = estimator(section.adv_estimator)
    col = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    if est.needs_step_rows and ("state_hash" not in col and est.response_reward == "gigpo"):
        raise SchemaError(f"samples table at {where}: adv_estimator {section.adv_estimator} groups steps by anchor "
                          "state and needs the 'state_hash' column of step-level rows; roll out with step-level "
                          "samples or choose grpo/reinforce")
    roll = {"traj_group_id": col["group_id"], "traj_id": col["traj_id"], "step": col["turn_idx"],
            "episode_scores": col["episode_score"], "score_sum": col["score"], "tags": col["tag"]}
    out: dict[str, Any] = {"row_id": table.column("row_id")}
    if est.needs_step_rows:
        step_rewards = discounted_returns(col["traj_id"], col["turn_idx"], col["score"], section.step_reward_gamma)
        roll["step_rewards"] = step_rewards
        out["step_rewards"] = pa.array(step_rewards, pa.float32())
    if "state_hash" in col:
        if est.response_reward == "gigpo" and table.column("state_hash").null_count:
            raise InvariantError(f"samples table at {where}: 'state_hash' is null in some rows; GiGPO needs the anchor "
                                 "state of every step row (trajectory-level rows have none)")
        roll["state_hash"] = col["state_hash"]
    rn = section.reward_normalization
    grouping = GROUPING_COLUMNS.get(rn.grouping, rn.grouping)
    if rn.grouping != "batch":
        if grouping not in col:
            raise ConfigError(f"reward_normalization.grouping '{rn.grouping}' names no column of the samples table; "
                              f"use batch, traj_group_id, tags or traj_id")
        roll[rn.grouping] = col[grouping]
    result = compute_response_level_rewards(
        est.response_reward, roll,
        RewardNormSettings(rn.grouping, rn.method, rn.norm_mean_type, rn.norm_std_type),
        episode_reward_weight=section.episode_reward_weight, step_reward_weight=section.step_reward_weight,
        reward_clip=section.reward_clip, roll_compat=section.roll_compat)
    out["response_level_rewards"] = pa.array(result.rewards, pa.float32())
    for name, values in result.columns.items():
        typ = pa.string() if name == "state_group_id" else pa.float32()
        out[name] = pa.array(values if typ != pa.string() else [str(v) for v in values], typ)
    rewarded = pa.table(out)
    return rewarded.select([f.name for f in REWARDED.arrow_schema(present=rewarded.column_names)]), result.metrics


class ResponseRewardsStage(Stage):
    name = "response_rewards"
    version = "1"
    output_spec = REWARDED
    section_model = ResponseRewardSection
    input_specs = {"samples": SAMPLES}

    def build(self, ctx: StageContext):
        section = ctx.section
        columns = NARROW + (["state_hash"] if "state_hash" in ctx.schemas["samples"].names else [])
        where = ctx.inputs["samples"].path

        out = ctx.output

        def whole_table(batch: pa.Table) -> pa.Table:
            table, metrics = response_rewards_table(batch, section, where)
            rewards = table.column("response_level_rewards").to_numpy()
            if len(rewards):
                metrics.update({"critic/response_level_rewards/mean": float(rewards.mean()),
                                "critic/response_level_rewards/max": float(rewards.max()),
                                "critic/response_level_rewards/min": float(rewards.min())})
            write_partials(out, "whole-table", metrics)
            return table

        ds = ctx.read("samples", columns=columns).repartition(1, shuffle=False)
        return ds.map_batches(whole_table, batch_size=None, batch_format="pyarrow")

    def finalize(self, ctx: StageContext, written: Location):
        parts = read_partials(written)
        return (parts[0] if parts else {}), {}
