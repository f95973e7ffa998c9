"""Statistics that span the whole table are computed over the whole table, not per Ray Data block.

The stages run on a samples table shuffled (so groups and trajectories straddle files) and split into many small
Parquet files, with a small ``runtime.batch_rows``; the reference is the pure functions of ``stages/algos`` called
once on the whole table in this process. Then the golden agentic chains of ROLL run through the two stages.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from stages.algos.advantages import compute_advantage
from stages.algos.functional import masked_whiten
from stages.algos.ragged import Ragged
from stages.algos.response_rewards import RewardNormSettings, compute_response_level_rewards, discounted_returns
from stages.algos.token_rewards import compute_token_reward
from tests.golden import assert_close, family, load
from tests.spine.helpers import config, read_table, run_recompute, write_samples

WHITENED_ATOL = 1e-4


@pytest.fixture(scope="module")
def scattered(step_set, data_root) -> str:
    """``step_set`` with its rows shuffled and written as 17 small files (no manifest)."""
    table = read_table(step_set)
    order = np.random.default_rng(7).permutation(table.num_rows)
    return write_samples(table.take(pa.array(order)), data_root / "scattered", rows_per_file=24)


def _ragged(table: pa.Table, name: str) -> Ragged:
    return Ragged.from_arrow(table.column(name), np.float32)


def _token_mask(table: pa.Table) -> np.ndarray:
    return pc.list_flatten(pc.list_slice(table.column("response_mask"), 1)).to_numpy().astype(np.float32)


def reference(samples: pa.Table, cfg) -> dict[str, np.ndarray]:
    """The whole recompute on the whole table at once with the pure functions (episode-reward estimators)."""
    rn = cfg.reward_normalization
    cols = {"score_sum": samples.column("score").to_numpy(), "traj_group_id": samples.column("group_id").to_numpy(),
            "tags": samples.column("tag").to_numpy()}
    rewards = compute_response_level_rewards(
        "episode", cols, RewardNormSettings(rn.grouping, rn.method, rn.norm_mean_type, rn.norm_std_type),
        reward_clip=cfg.reward_clip).rewards
    mask = _token_mask(samples)
    tok = compute_token_reward(rewards, mask, _ragged(samples, "old_log_probs"), _ragged(samples, "ref_log_probs"),
                               kl_coef=cfg.init_kl_coef, kl_penalty=cfg.kl_penalty,
                               add_token_level_kl=cfg.add_token_level_kl, reward_clip=cfg.reward_clip,
                               masked_clip_metric=True)
    result = compute_advantage(tok.token_level_rewards, mask, cfg.adv_estimator, gamma=cfg.gamma, lambd=cfg.lambd,
                               values=_ragged(samples, "values"), whiten_rewards=cfg.whiten_rewards,
                               whiten_advantages=cfg.whiten_advantages, advantage_clip=cfg.advantage_clip,
                               masked_clip_metric=True)
    return {"response_level_rewards": rewards, "token_level_rewards": result.token_level_rewards.values,
            "advantages": result.advantages.values, "returns": result.returns.values,
            "raw_advantages": result.raw_advantages.values, "kl": tok.current_kl,
            "clip_frac": result.metrics.get("critic/advantage_clip_frac")}


def _flat(table: pa.Table, name: str) -> np.ndarray:
    return pc.list_flatten(table.column(name)).to_numpy()


CROSS_BLOCK_CONFIGS = {
    # batch-level reward normalisation, token KL, whitened rewards and advantages, both clips
    "reinforce_batch_whiten": dict(adv_estimator="reinforce", reward_normalization={"grouping": "batch",
                                   "method": "mean_std"}, whiten_rewards=True, whiten_advantages=True,
                                   add_token_level_kl=True, kl_penalty="k3", init_kl_coef=0.1, reward_clip=2.0,
                                   advantage_clip=1.5, gamma=0.99, group_size=8),
    # critic values, per-group normalisation across files, whitened advantages
    "gae_group_whiten": dict(adv_estimator="gae", gamma=0.9, lambd=0.8, whiten_advantages=True,
                             reward_normalization={"grouping": "traj_group_id", "method": "mean_std"},
                             group_size=8),
}


@pytest.mark.parametrize("name", sorted(CROSS_BLOCK_CONFIGS))
def test_whole_table_statistics_across_many_blocks(name, scattered, tmp_path, ray_cluster):
    cfg = config(None, **CROSS_BLOCK_CONFIGS[name], runtime={"batch_rows": 16})
    samples = read_table(scattered)
    assert len(list(Path(scattered).glob("*.parquet"))) > 10
    run_recompute(scattered, str(tmp_path / "out"), cfg)
    out = read_table(tmp_path / "out" / "advantaged")
    assert out.column("row_id").equals(samples.column("row_id")), "row order is kept"
    ref = reference(samples, cfg)

    assert_close(out.column("response_level_rewards").to_numpy(), ref["response_level_rewards"], atol=WHITENED_ATOL,
                 what="response_level_rewards (normalised over the whole batch / whole groups)")
    for col in ("token_level_rewards", "raw_advantages", "returns", "advantages"):
        assert_close(_flat(out, col), ref[col], atol=WHITENED_ATOL, what=col)

    metrics = json.loads((tmp_path / "out" / "advantaged" / "manifest.json").read_text())["metrics"]
    assert metrics["critic/kl"] == pytest.approx(ref["kl"], rel=1e-6)
    if ref["clip_frac"] is not None:
        assert 0 < ref["clip_frac"] < 1
        assert metrics["critic/advantage_clip_frac"] == pytest.approx(ref["clip_frac"], rel=1e-9)

    # the test can fail: statistics of one block alone are visibly different from the whole table's
    mask = _token_mask(samples)
    one_block = slice(0, int(pc.sum(pc.list_value_length(samples.column("old_log_probs")).slice(0, 16)).as_py()))
    whole = masked_whiten(ref["raw_advantages"], mask)[one_block]
    local = masked_whiten(ref["raw_advantages"][one_block], mask[one_block])
    assert np.abs(whole - local).max() > 100 * WHITENED_ATOL


def test_rewarded_table_matches_pure_gigpo(scattered, step_set, base_run):
    """GiGPO's step returns and anchor-state groups need trajectories and groups whole; the rewarded table of the
    reference run equals the pure functions on the whole table."""
    samples = read_table(step_set)
    rewarded = read_table(Path(base_run) / "rewarded")
    cfg = config()
    step = discounted_returns(samples.column("traj_id").to_numpy(), samples.column("turn_idx").to_numpy(),
                              samples.column("score").to_numpy(), cfg.step_reward_gamma)
    rn = cfg.reward_normalization
    cols = {"traj_group_id": samples.column("group_id").to_numpy(), "traj_id": samples.column("traj_id").to_numpy(),
            "episode_scores": samples.column("episode_score").to_numpy(), "step_rewards": step,
            "state_hash": samples.column("state_hash").to_numpy(), "score_sum": samples.column("score").to_numpy()}
    ref = compute_response_level_rewards("gigpo", cols, RewardNormSettings(rn.grouping, rn.method),
                                         episode_reward_weight=cfg.episode_reward_weight,
                                         step_reward_weight=cfg.step_reward_weight)
    assert_close(rewarded.column("step_rewards").to_numpy(), step, what="step_rewards")
    assert_close(rewarded.column("response_level_rewards").to_numpy(), ref.rewards, atol=WHITENED_ATOL)
    assert rewarded.column("state_group_id").to_pylist() == [str(s) for s in ref.columns["state_group_id"]]


# ---- ROLL's golden agentic chains through the two stages ------------------------------------------------------
def golden_samples(case) -> pa.Table:
    """A ``samples`` table from ROLL's padded chain inputs (rows trimmed to their attention length)."""
    x = case.inputs
    lengths = x["attention_mask"].sum(axis=1)
    assert np.array_equal(x["attention_mask"], (np.arange(x["attention_mask"].shape[1]) < lengths[:, None]))
    # scores are (B, S) with the step reward at the row's last token: one value per row
    assert_close(x["scores"].sum(axis=1), x["step_scores"], atol=1e-6)
    traj = x["traj_id"].astype(str)
    _, inverse, counts = np.unique(traj, return_inverse=True, return_counts=True)

    def rows(a, n):
        return pa.array([list(a[b, : n[b]]) for b in range(len(n))], pa.list_(pa.from_numpy_dtype(a.dtype)))

    return pa.table({
        "row_id": pa.array([f"row{b:03d}" for b in range(len(lengths))]),
        "group_id": pa.array(x["traj_group_id"].astype(str)),
        "traj_id": pa.array(traj),
        "turn_idx": pa.array(x["step"].astype(np.int32)),
        "num_turns": pa.array(counts[inverse].astype(np.int32)),
        "tag": pa.array(x["tags"].astype(str)),
        "input_ids": rows(np.tile(np.arange(x["attention_mask"].shape[1], dtype=np.int32), (len(lengths), 1)),
                          lengths),
        "response_mask": rows(x["response_mask"].astype(np.int8), lengths),
        "score": pa.array(x["step_scores"].astype(np.float32)),
        "episode_score": pa.array(x["episode_scores"].astype(np.float32)),
        "state_hash": pa.array(x["state_hash"].astype(str)),
        "old_log_probs": rows(x["old_log_probs"], lengths - 1),
        "ref_log_probs": rows(x["ref_log_probs"], lengths - 1),
    })


def _padded(table: pa.Table, name: str, width: int) -> np.ndarray:
    return Ragged.from_arrow(table.column(name), np.float32).to_padded(width)


CHAIN_AGENTIC = family("agentic pipeline chain: compute_discounted_returns -> get_agentic_response_level_mask -> "
                       "compute_response_level_rewards -> compute_token_reward -> agentic_compute_advantage")
CHAIN_PARAMS = ("adv_estimator", "reward_normalization", "resolved_norm", "step_reward_gamma", "episode_reward_weight",
                "step_reward_weight", "reward_clip", "advantage_clip", "whiten_advantages", "add_token_level_kl",
                "init_kl_coef", "kl_penalty", "gamma", "lambd")


@pytest.mark.parametrize("name", CHAIN_AGENTIC)
def test_golden_agentic_chain_through_the_stages(name, tmp_path, ray_cluster):
    case = load(name)
    p = case.check_params(CHAIN_PARAMS)      # resolved_norm: checked in tests/algos/test_response_level.py
    samples = golden_samples(case)
    folder = write_samples(samples, tmp_path / "samples", rows_per_file=10)  # blocks split groups
    cfg = config(None, adv_estimator=p["adv_estimator"], reward_normalization=p["reward_normalization"],
                 step_reward_gamma=p["step_reward_gamma"], episode_reward_weight=p["episode_reward_weight"],
                 step_reward_weight=p["step_reward_weight"], reward_clip=p["reward_clip"],
                 advantage_clip=p["advantage_clip"], whiten_advantages=p["whiten_advantages"],
                 add_token_level_kl=p["add_token_level_kl"], init_kl_coef=p["init_kl_coef"],
                 kl_penalty=p["kl_penalty"], gamma=p["gamma"], lambd=p["lambd"], runtime={"batch_rows": 8})
    run_recompute(folder, str(tmp_path / "out"), cfg)
    out = read_table(tmp_path / "out" / "advantaged")
    assert out.column("row_id").equals(samples.column("row_id"))
    expected = case.outputs
    width = expected["advantages"].shape[1]
    lengths = case.inputs["attention_mask"].sum(axis=1)
    real = np.arange(width)[None, :] < (lengths - 1)[:, None]

    assert_close(out.column("response_level_rewards").to_numpy(), expected["response_level_rewards"],
                 atol=WHITENED_ATOL, what="response_level_rewards")
    if "step_rewards" in expected:
        assert_close(out.column("step_rewards").to_numpy(), expected["step_rewards"], what="step_rewards")
    for col in ("token_level_rewards", "advantages", "returns"):
        ours = _padded(out, col, width)
        assert_close(ours[real], expected[col][real], atol=WHITENED_ATOL, what=col)
    # ROLL's padding positions hold nothing for the masked outputs
    assert not expected["advantages"][~real].any() and not expected["token_level_rewards"][~real].any()

    metrics = json.loads((tmp_path / "out" / "advantaged" / "manifest.json").read_text())["metrics"]
    assert metrics["critic/kl"] == pytest.approx(case.metric("critic/kl"), rel=1e-5, abs=1e-7)
    assert metrics["critic/kl_coef"] == case.metric("critic/kl_coef")
    if "metric:critic|advantage_clip_frac" in expected and case.metric("critic/advantage_clip_frac") == 0:
        # ROLL counts over all padded positions, we over the mask: comparable only when nothing is clipped
        assert metrics["critic/advantage_clip_frac"] == 0
