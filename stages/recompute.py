"""The recompute stages: stored samples → ``rewarded`` (response-level rewards) → ``advantaged``.

``response_rewards`` needs whole-table statistics (groups, batch mean/std, discounted returns across a trajectory's
rows), so it reads only the narrow identity and score columns — a few bytes a row — and computes them in one batch
over the whole table. ``advantages`` is row-parallel over the wide token columns; the few statistics that span
blocks (whitening moments, the KL controller's current KL) are computed from additive partials over all blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.config import AdvantageSection, ResponseRewardSection
from schemas.errors import ConfigError, InvariantError, SchemaError
from schemas.tables import ADVANTAGED, REWARDED, SAMPLES, check_row_invariants, check_structure
from stages.runner import Stage, StageContext, read_partials, sum_partials, write_partials
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


# ---- token rewards and advantages -------------------------------------------------------------------------------

REWARD_LOOKUP_CACHE: dict[str, tuple[Any, dict[str, np.ndarray]]] = {}
REWARD_COLUMNS = ("response_level_rewards", "step_rewards", "episode_rewards_norm", "step_rewards_norm",
                  "state_group_id")


def reward_lookup(files: list[str], fs, key: str):
    """The rewarded table of this run as (pandas Index over row_id, columns), cached per worker process."""
    import pandas as pd
    import pyarrow.dataset as pads

    if key not in REWARD_LOOKUP_CACHE:
        table = pads.dataset(files, filesystem=fs).to_table()
        cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names if c != "row_id"}
        REWARD_LOOKUP_CACHE.clear()
        REWARD_LOOKUP_CACHE[key] = (pd.Index(table.column("row_id").to_numpy(zero_copy_only=False)), cols)
    return REWARD_LOOKUP_CACHE[key]


def _ragged(batch: pa.Table, name: str):
    from stages.algos.ragged import Ragged

    return Ragged.from_arrow(batch.column(name), np.float32) if name in batch.column_names else None


def next_token_mask(batch: pa.Table) -> np.ndarray:
    """``(N',)`` float32 token mask ``response_mask[1:]`` of every row, flat (next-token aligned)."""
    from stages.algos.ragged import Ragged

    rm = Ragged.from_arrow(batch.column("response_mask"), np.float32)
    keep = np.ones(len(rm.values), dtype=bool)
    keep[rm.offsets[:-1][rm.lengths > 0]] = False
    return rm.values[keep]


def final_response_mask(batch: pa.Table) -> np.ndarray:
    """``(N',)`` float32 ``final_response_mask``: the token mask ``response_mask[1:]`` of each row times the row's
    sample mask from ``agentic_response_level_mask`` (spec §5.5; ROLL's is all ones)."""
    from stages.algos.response_rewards import agentic_response_level_mask

    next_token_lengths = np.maximum(pc.list_value_length(batch.column("response_mask")).to_numpy() - 1, 0)
    sample_mask, _ = agentic_response_level_mask(len(batch))
    return (next_token_mask(batch) * np.repeat(sample_mask, next_token_lengths)).astype(np.float32)


class _AdvantageBatch:
    """The per-batch computation of the advantages stage, shared by its statistics passes and its output pass."""

    def __init__(self, section: AdvantageSection, where: str, rewarded_files: list[str], rewarded_fs, key: str,
                 kl_coef: float, reward_stats=None, advantage_stats=None):
        self.s, self.where, self.kl_coef = section, where, kl_coef
        self.rewarded = (rewarded_files, rewarded_fs, key)
        self.reward_stats, self.advantage_stats = reward_stats, advantage_stats

    def _inputs(self, batch: pa.Table):
        from stages.algos.ragged import Ragged
        from stages.algos.token_rewards import compute_token_reward

        check_row_invariants(SAMPLES, batch, self.where)
        index, cols = reward_lookup(*self.rewarded)
        pos = index.get_indexer(batch.column("row_id").to_numpy(zero_copy_only=False))
        if (pos < 0).any():
            rid = batch.column("row_id")[int(np.flatnonzero(pos < 0)[0])].as_py()
            raise InvariantError(f"samples table at {self.where}: row_id {rid} has no response-level reward in the "
                                 "rewarded table; re-run the response_rewards stage on this input")
        rewards = {c: v[pos] for c, v in cols.items()}
        mask = final_response_mask(batch)
        old = _ragged(batch, "old_log_probs") or _ragged(batch, "infer_logprobs")
        if old is None:
            lengths = np.maximum(pc.list_value_length(batch.column("input_ids")).to_numpy() - 1, 0)
            old = Ragged(np.zeros(int(lengths.sum()), np.float32), np.concatenate([[0], np.cumsum(lengths)]))
        ref = _ragged(batch, "ref_log_probs") or old
        tok = compute_token_reward(rewards["response_level_rewards"], mask, old, ref, kl_coef=self.kl_coef,
                                   kl_penalty=self.s.kl_penalty, add_token_level_kl=self.s.add_token_level_kl,
                                   reward_clip=self.s.reward_clip, masked_clip_metric=True)
        return rewards, mask, tok

    def reward_partials(self, batch: pa.Table) -> pa.Table:
        from stages.algos.functional import whiten_partials

        _, mask, tok = self._inputs(batch)
        return pa.table({"partials": [list(whiten_partials(tok.token_level_rewards.values, mask))]})

    def _advantages(self, batch: pa.Table, final: bool):
        from stages.algos.advantages import compute_advantage

        rewards, mask, tok = self._inputs(batch)
        result = compute_advantage(
            tok.token_level_rewards, mask, self.s.adv_estimator, gamma=self.s.gamma, lambd=self.s.lambd,
            values=_ragged(batch, "values"), whiten_rewards=self.s.whiten_rewards,
            whiten_advantages=self.s.whiten_advantages and final, advantage_clip=self.s.advantage_clip if final else None,
            reward_stats=self.reward_stats, advantage_stats=self.advantage_stats,
            roll_compat_gae=self.s.roll_compat, masked_clip_metric=True)
        return rewards, mask, tok, result

    def advantage_partials(self, batch: pa.Table) -> pa.Table:
        from stages.algos.functional import whiten_partials

        _, mask, _, result = self._advantages(batch, final=False)
        return pa.table({"partials": [list(whiten_partials(result.advantages.values, mask))]})

    def __call__(self, batch: pa.Table) -> pa.Table:
        rewards, mask, tok, result = self._advantages(batch, final=True)
        out = batch
        for name in REWARD_COLUMNS:
            if name in rewards:
                typ = pa.string() if name == "state_group_id" else pa.float32()
                out = out.append_column(name, pa.array(rewards[name], typ))
        for name, ragged in (("token_level_rewards", result.token_level_rewards), ("advantages", result.advantages),
                             ("returns", result.returns), ("raw_advantages", result.raw_advantages)):
            out = out.append_column(name, ragged.to_arrow(pa.float32()))
        n_mask = float(mask.sum())
        parts = {"kl_sum": tok.kl_partials[0], "rows": tok.kl_partials[1], "mask_tokens": n_mask,
                 "adv_sum": float((result.advantages.values.astype(np.float64) * mask).sum())}
        if "critic/advantage_clip_frac" in result.metrics:
            parts["adv_clipped"] = result.metrics["critic/advantage_clip_frac"] * n_mask
        if "critic/token_reward_clip_frac" in tok.metrics:
            parts["token_reward_clipped"] = tok.metrics["critic/token_reward_clip_frac"] * n_mask
        if len(batch):
            from stages.runner import write_partials

            write_partials(self.output, batch.column("row_id")[0].as_py(), parts)
        return out.select([f.name for f in ADVANTAGED.arrow_schema(present=out.column_names)])


def _stats_from(ds, fn) -> tuple[float, float] | None:
    """Sum the whitening partials ``(count, sum, sumsq)`` of all blocks into (mean, var), or None (ROLL: Σm ≤ 1)."""
    from stages.algos.functional import can_whiten, whiten_stats_from_partials

    rows = ds.map_batches(fn, batch_format="pyarrow").take_all()
    count, total, total_sq = (sum(r["partials"][i] for r in rows) for i in range(3))
    return whiten_stats_from_partials(count, total, total_sq) if can_whiten(count) else None


class AdvantagesStage(Stage):
    name = "advantages"
    version = "1"
    output_spec = ADVANTAGED
    section_model = AdvantageSection
    input_specs = {"samples": SAMPLES, "rewarded": REWARDED}

    def required_columns(self, section: AdvantageSection) -> dict[str, tuple[str, ...]]:
        from stages.algos.estimators import estimator

        needs: tuple[str, ...] = ("values",) if estimator(section.adv_estimator).needs_critic else ()
        if section.add_token_level_kl:
            needs += ("old_log_probs", "ref_log_probs")
        return {"samples": needs}

    def _controller(self, ctx: StageContext):
        from stages.algos.kl import get_kl_controller, kl_controller_from_state

        s = ctx.section
        state = ctx.state_in.get("kl_ctrl")
        return kl_controller_from_state(state) if state else get_kl_controller(s.init_kl_coef, s.target_kl,
                                                                                s.kl_horizon)

    def build(self, ctx: StageContext):
        rewarded = ctx.inputs["rewarded"]
        from stages.storage import folder_fingerprint

        key = folder_fingerprint(rewarded)
        fn = _AdvantageBatch(ctx.section, ctx.inputs["samples"].path, rewarded.parquet_files(), rewarded.fs, key,
                             self._controller(ctx).value)
        fn.output = ctx.output
        read = lambda: ctx.read("samples")  # noqa: E731 - each pass re-reads (streaming, bounded memory)
        if ctx.section.whiten_rewards:
            fn.reward_stats = _stats_from(read(), fn.reward_partials)
        if ctx.section.whiten_advantages:
            fn.advantage_stats = _stats_from(read(), fn.advantage_partials)
        return read().map_batches(fn, batch_format="pyarrow", batch_size=ctx.batch_rows)

    def finalize(self, ctx: StageContext, written: Location):
        total = sum_partials(read_partials(written))
        rows = total.get("rows", 0.0)
        current_kl = total.get("kl_sum", 0.0) / rows if rows else 0.0
        ctrl = self._controller(ctx)
        beta = ctrl.value if ctx.section.add_token_level_kl else 0.0
        ctrl.update(current_kl, int(rows))
        tokens = total.get("mask_tokens", 0.0)
        metrics = {"critic/kl": current_kl, "critic/kl_coef": beta,
                   "critic/advantages/mean": total.get("adv_sum", 0.0) / tokens if tokens else 0.0}
        if "adv_clipped" in total:
            metrics["critic/advantage_clip_frac"] = total["adv_clipped"] / tokens if tokens else 0.0
        if "token_reward_clipped" in total:
            metrics["critic/token_reward_clip_frac"] = total["token_reward_clipped"] / tokens if tokens else 0.0
        return metrics, {"kl_ctrl": ctrl.state_dict()}
