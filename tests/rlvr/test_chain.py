"""The RLVR chain as pure functions (stages/algos/rlvr_chain.py, no Ray): golden conformance with ROLL's chain, equality
with the stages/algos functions it is built from, None rows left out of group statistics with zero advantage,
per-domain whitening from block partials, invariances and bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from schemas.errors import InvariantError
from schemas.rlvr_config import rlvr_advantage_section, rlvr_reward_section
from stages.algos.advantages import compute_advantage
from stages.algos.ragged import Ragged
from stages.algos.reward_norm import RunningMoments, reward_postprocess
from stages.algos.sample_masks import get_sample_level_mask
from stages.algos.token_rewards import compute_token_reward
from stages.algos.rlvr_chain import (concat_rows, normalise_rewards, response_to_next_token, response_tokens,
                                     rlvr_response_rewards, sample_level_mask)
from stages.algos.token_chain import stats_from_partials, take_rows, token_batch, whiten_partials_by_domain
from tests.golden import assert_close, family, load
from tests.rlvr.helpers import config, golden_config, golden_rows

CHAIN_RLVR = family("rlvr pipeline chain (one domain): get_sample_level_mask -> reward_postprocess -> "
                    "compute_token_reward -> compute_advantage(response_mask=final_response_mask)")
SAMPLE_LEVEL_MASK = family("roll.utils.functionals.get_sample_level_mask")
SAMPLE_MASK_PARAMS = ("max_len_mask", "difficulty_mask", "error_max_len_clip", "error_max_len_threshold",
                      "difficulty_low_threshold", "difficulty_high_threshold", "num_return_sequences")

NORM_TOL = dict(atol=1e-4, rtol=1e-5)
PLAIN_TOL = dict(atol=1e-6, rtol=1e-5)


def tokens_of(cols: dict, aligned=("old_log_probs", "ref_log_probs")):
    return response_tokens(Ragged.from_rows(cols["prompt_ids"], np.int32), Ragged.from_rows(cols["response_ids"],
                                                                                          np.int32),
                           {c: Ragged.from_rows(cols[c], np.float32) for c in aligned if c in cols})


def run_chain(cols: dict, cfg, kl_coef: float, running: dict | None = None):
    """The whole chain on one block (the table): narrow part then token part."""
    tokens = tokens_of(cols)
    scores = np.array([np.nan if g == "none" else float(g) for g in cols["ground_truth"]])
    rewards = rlvr_response_rewards(np.array(cols["prompt_id"]), np.array(cols["domain"]), scores, scores,
                                    tokens.response_len, rlvr_reward_section(cfg), {} if running is None else running)
    batch = token_batch(tokens, rewards.rewards, rewards.sample_mask, np.array(cols["domain"]),
                             rlvr_advantage_section(cfg), kl_coef)
    return tokens, rewards, batch


# ---- golden: ROLL's RLVR chain --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CHAIN_RLVR)
def test_chain_rlvr_golden(name):
    case = load(name)
    cols = golden_rows(case)
    cfg = golden_config(case)
    tokens, rewards, batch = run_chain(cols, cfg, kl_coef=cfg.init_kl_coef)
    width = case.outputs["advantages"].shape[1]
    final = Ragged(batch.final_mask, batch.advantages.offsets).to_padded(width)
    np.testing.assert_array_equal(final, case.outputs["final_response_mask"])
    assert_close(rewards.rewards, case.outputs["response_level_rewards"], **NORM_TOL)
    assert_close(batch.token_level_rewards.to_padded(width), case.outputs["token_level_rewards"], **NORM_TOL)
    assert_close(batch.advantages.to_padded(width), case.outputs["advantages"], **NORM_TOL)
    assert_close(batch.returns.to_padded(width), case.outputs["returns"], **NORM_TOL)
    metrics = {k.split("golden/", 1)[1]: v for k, v in rewards.metrics.items() if k.startswith("golden/")}
    all_positions = float(case.outputs["advantages"].size)      # ROLL's clip fractions: over all B·(S−1) positions
    for key, value in case.metrics().items():
        if key == "critic/kl":
            got = batch.partials["kl_sum"] / batch.partials["rows"]
        elif key == "critic/kl_coef":
            got = cfg.init_kl_coef if cfg.add_token_level_kl else 0.0
        elif key == "critic/advantage_clip_frac":
            got = batch.partials.get("adv_clipped", 0.0) / all_positions
        elif key == "critic/token_reward_clip_frac":
            got = batch.partials.get("token_reward_clipped", 0.0) / all_positions
        else:
            assert key in metrics, f"metric {key} of the golden chain is not produced by the RLVR chain"
            got = metrics[key]
        assert got == pytest.approx(value, rel=1e-5, abs=1e-7), key


# ---- equality with the stages/algos functions on complete, scored groups ------------------------------------------

@pytest.mark.parametrize("name", SAMPLE_LEVEL_MASK)
def test_sample_level_mask_equals_roll_on_sorted_groups(name):
    case = load(name)
    p, i = case.check_params(SAMPLE_MASK_PARAMS), case.inputs
    p = {"max_len_mask": False, "difficulty_mask": False, "difficulty_low_threshold": 0.0,
         "difficulty_high_threshold": 1.0, "error_max_len_clip": False, "error_max_len_threshold": 9999999999,
         **p}                                                           # ROLL's defaults (§3.5) for absent params
    lengths = i["response_mask"][:, 1:].sum(-1)
    n = p["num_return_sequences"]
    cfg = config(num_return_sequences_in_group=n, max_len_mask=p["max_len_mask"],
                 max_new_tokens=int(i["responses_width"]), difficulty_mask=p["difficulty_mask"],
                 difficulty_low_threshold=p["difficulty_low_threshold"],
                 difficulty_high_threshold=p["difficulty_high_threshold"], error_max_len_clip=p["error_max_len_clip"],
                 error_max_len_threshold=p["error_max_len_threshold"], adv_estimator="reinforce")
    group = np.arange(len(lengths)) // n
    mask, metrics = sample_level_mask(lengths, i["scores"].astype(np.float64), group, rlvr_reward_section(cfg))
    ref_mask, ref_metrics = get_sample_level_mask(
        lengths, int(i["responses_width"]), i["scores"], n, max_len_mask=p["max_len_mask"],
        use_difficulty_mask=p["difficulty_mask"], difficulty_low_threshold=p["difficulty_low_threshold"],
        difficulty_high_threshold=p["difficulty_high_threshold"], error_max_len_clip=p["error_max_len_clip"],
        error_max_len_threshold=p["error_max_len_threshold"])
    np.testing.assert_array_equal(mask, ref_mask)
    assert metrics == pytest.approx(ref_metrics)
    np.testing.assert_array_equal(i["response_mask"][:, 1:] * mask[:, None], case.outputs["final_response_mask"])


TYPES = [None, "batch", "group", "running"]


@pytest.mark.parametrize("mean_type,std_type", list(itertools.product(TYPES, TYPES)))
def test_normalise_rewards_equals_reward_postprocess(mean_type, std_type):
    rng = np.random.default_rng(3)
    n, groups = 4, 6
    r = rng.integers(0, 2, n * groups).astype(np.float64) + rng.normal(0, 0.3, n * groups)
    cfg = config(num_return_sequences_in_group=n, adv_estimator="reinforce", norm_mean_type=mean_type,
                 norm_std_type=std_type, reward_clip=1.5)
    mine, ours_running = normalise_rewards(r, np.arange(len(r)) // n, rlvr_reward_section(cfg), RunningMoments())
    ref, ref_metrics = reward_postprocess(r, "reinforce", mean_type, std_type, n, 1.5, RunningMoments())
    np.testing.assert_array_equal(mine, ref)  # same float64 operations, bit for bit
    assert ours_running == pytest.approx(ref_metrics)


def test_token_part_equals_compute_token_reward_then_compute_advantage():
    rng = np.random.default_rng(5)
    cols = _random_table(rng, prompts=3, n=4, domain="d")
    cfg = config(num_return_sequences_in_group=4, adv_estimator="reinforce", gamma=0.9, add_token_level_kl=True,
                 kl_penalty="k3", reward_clip=0.8, whiten_advantages=True, advantage_clip=2.0)
    tokens, rewards, batch = run_chain(cols, cfg, kl_coef=0.1)
    tok = compute_token_reward(rewards.rewards, tokens.token_mask, tokens.next_token["old_log_probs"],
                               tokens.next_token["ref_log_probs"], kl_coef=0.1, kl_penalty="k3",
                               add_token_level_kl=True, reward_clip=0.8, masked_clip_metric=True)
    fmask = tokens.token_mask * np.repeat(rewards.sample_mask, tokens.input_ids.lengths - 1)
    ref = compute_advantage(tok.token_level_rewards, fmask, "reinforce", gamma=0.9, lambd=0.95,
                            whiten_advantages=True, advantage_clip=2.0, masked_clip_metric=True)
    np.testing.assert_array_equal(batch.advantages.values, ref.advantages.values)
    np.testing.assert_array_equal(batch.returns.values, ref.returns.values)
    np.testing.assert_array_equal(batch.token_level_rewards.values, ref.token_level_rewards.values)


# ---- None rows: out of every statistic, zero advantage --------------------------------------------------------------

def test_none_rows_are_left_out_of_group_statistics():
    cfg = config(num_return_sequences_in_group=4, adv_estimator="grpo")
    scores = np.array([1.0, 0.0, np.nan, 1.0, 0.0, 0.0, 1.0, 1.0])
    out = rlvr_response_rewards(np.array(["a"] * 4 + ["b"] * 4), np.array(["m"] * 8), scores, scores,
                                np.full(8, 5), rlvr_reward_section(cfg), {})
    # group a without its None row is a group of 3: exactly reward_postprocess on [1, 0, 1] with n=3
    ref3, _ = reward_postprocess(np.array([1.0, 0.0, 1.0]), "grpo", None, None, 3)
    np.testing.assert_array_equal(out.rewards[[0, 1, 3]], ref3)
    ref4, _ = reward_postprocess(scores[4:], "grpo", None, None, 4)
    np.testing.assert_array_equal(out.rewards[4:], ref4)
    assert out.rewards[2] == 0.0 and out.sample_mask[2] == 0.0 and not out.scored[2]
    np.testing.assert_array_equal(out.sample_mask[[0, 1, 3, 4, 5, 6, 7]], 1.0)
    assert out.metrics["m/rewards/unscored"] == 1.0 and out.metrics["actor/samples_used"] == 7.0


def test_none_rows_do_not_move_pass_rates_or_running_moments():
    cfg = config(num_return_sequences_in_group=4, adv_estimator="reinforce", norm_mean_type="running",
                 norm_std_type="running", difficulty_mask=True, difficulty_low_threshold=0.0,
                 difficulty_high_threshold=1.0)
    scores = np.array([1.0, 1.0, np.nan, 1.0, 1.0, 0.0, np.nan, np.nan])
    running: dict[str, RunningMoments] = {}
    out = rlvr_response_rewards(np.array(["a"] * 4 + ["b"] * 4), np.array(["m"] * 8), scores, scores,
                                np.full(8, 5), rlvr_reward_section(cfg), running)
    # group a: pass rate over its 3 scored rows is 1.0 → masked (not < 1); the None row does not pull it to 0.75
    np.testing.assert_array_equal(out.sample_mask, [0, 0, 0, 0, 1, 1, 0, 0])
    reference = RunningMoments()
    reference.update(np.array([1.0, 1.0, 1.0, 1.0, 0.0]))
    assert running["m"].state_dict() == pytest.approx(reference.state_dict())


def test_none_rows_get_zero_advantage_and_zero_final_mask():
    rng = np.random.default_rng(7)
    cols = _random_table(rng, prompts=2, n=4, domain="d")
    cols["ground_truth"][1] = "none"
    cfg = config(num_return_sequences_in_group=4, adv_estimator="grpo", add_token_level_kl=True)
    tokens, rewards, batch = run_chain(cols, cfg, kl_coef=0.2)
    row = slice(batch.advantages.offsets[1], batch.advantages.offsets[2])
    assert not rewards.scored[1]
    np.testing.assert_array_equal(batch.advantages.values[row], 0.0)
    np.testing.assert_array_equal(batch.final_mask[row], 0.0)
    assert np.abs(batch.advantages.values[batch.advantages.offsets[2]:]).sum() > 0  # other rows train


def test_a_group_left_with_one_scored_row_gets_reward_zero_not_nan():
    cfg = config(num_return_sequences_in_group=2, adv_estimator="grpo")
    scores = np.array([1.0, np.nan, 0.0, 1.0])
    out = rlvr_response_rewards(np.array(["a", "a", "b", "b"]), np.array(["m"] * 4), scores, scores, np.full(4, 3),
                                rlvr_reward_section(cfg), {})
    assert np.isfinite(out.rewards).all() and out.rewards[0] == 0.0 and out.sample_mask[0] == 1.0
    # a domain with a single scored row under a batch std: 0 as well (its batch std is undefined)
    batch = config(num_return_sequences_in_group=2, adv_estimator="reinforce", norm_mean_type="batch",
                   norm_std_type="batch")
    out = rlvr_response_rewards(np.array(["a", "a"]), np.array(["m"] * 2), scores[:2], scores[:2], np.full(2, 3),
                                rlvr_reward_section(batch), {})
    assert out.rewards.tolist() == [0.0, 0.0]


# ---- domains: separate statistics, trackers by name (BUG-2), block partials -----------------------------------------

def test_each_domain_is_normalised_on_its_own_with_its_own_tracker():
    cfg = config(num_return_sequences_in_group=2, adv_estimator="reinforce", norm_mean_type="running",
                 norm_std_type="batch")
    scores = np.array([1.0, 0.0, 5.0, 7.0, 0.0, 1.0])
    domain = np.array(["math", "math", "code", "code", "math", "math"])
    prompt = np.array(["p0", "p0", "p1", "p1", "p2", "p2"])
    running = {"math": RunningMoments(mean=0.5, var=0.25, std=0.5, count=4.0)}
    out = rlvr_response_rewards(prompt, domain, scores, scores, np.full(6, 3), rlvr_reward_section(cfg), running)
    math_rows, code_rows = [0, 1, 4, 5], [2, 3]
    tracker = RunningMoments(mean=0.5, var=0.25, std=0.5, count=4.0)
    ref_math, _ = reward_postprocess(scores[math_rows], "reinforce", "running", "batch", 2, None, tracker)
    ref_code, _ = reward_postprocess(scores[code_rows], "reinforce", "running", "batch", 2, None, RunningMoments())
    np.testing.assert_array_equal(out.rewards[math_rows], ref_math)
    np.testing.assert_array_equal(out.rewards[code_rows], ref_code)
    assert running["math"].state_dict() == tracker.state_dict() and running["code"].count == pytest.approx(2.0)


def test_blockwise_whitening_per_domain_equals_whole_table():
    rng = np.random.default_rng(11)
    cols = _concat(_random_table(rng, prompts=3, n=4, domain="math"), _random_table(rng, prompts=2, n=4,
                                                                                    domain="code"))
    order = rng.permutation(len(cols["row_id"]))  # domains interleaved across blocks
    cols = {k: [v[i] for i in order] for k, v in cols.items()}
    cfg = config(num_return_sequences_in_group=4, adv_estimator="reinforce", norm_mean_type="group",
                 whiten_rewards=True, whiten_advantages=True, advantage_clip=1.5, gamma=0.95)
    tokens, rewards, whole = run_chain(cols, cfg, kl_coef=0.0)
    domains = np.array(cols["domain"])
    s = rlvr_advantage_section(cfg)
    blocks = [np.arange(0, 7), np.arange(7, 13), np.arange(13, 20)]

    def block_tokens(rows):
        sub = {k: [v[i] for i in rows] for k, v in cols.items()}
        return tokens_of(sub)

    def sum_parts(fn):
        total = {}
        for rows in blocks:
            for d, p in fn(rows).items():
                total[d] = tuple(a + b for a, b in zip(total.get(d, (0.0, 0.0, 0.0)), p))
        return stats_from_partials(total)

    def reward_parts(rows):
        b = token_batch(block_tokens(rows), rewards.rewards[rows], rewards.sample_mask[rows], domains[rows], s,
                             0.0, final=False, reward_stats={"math": None, "code": None})
        return whiten_partials_by_domain(b.token_level_rewards.values, b.final_mask, b.token_level_rewards.offsets,
                                         domains[rows])

    reward_stats = sum_parts(reward_parts)

    def advantage_parts(rows):
        b = token_batch(block_tokens(rows), rewards.rewards[rows], rewards.sample_mask[rows], domains[rows], s,
                             0.0, final=False, reward_stats=reward_stats)
        return whiten_partials_by_domain(b.advantages.values, b.final_mask, b.advantages.offsets, domains[rows])

    advantage_stats = sum_parts(advantage_parts)
    pieces = [token_batch(block_tokens(rows), rewards.rewards[rows], rewards.sample_mask[rows], domains[rows],
                               s, 0.0, reward_stats=reward_stats, advantage_stats=advantage_stats) for rows in blocks]
    blockwise = np.concatenate([p.advantages.values for p in pieces])
    assert_close(blockwise, whole.advantages.values, atol=1e-5)
    # and the whole-table result is per-domain compute_advantage (each domain whitened with its own statistics)
    for name in ("math", "code"):
        rows = np.flatnonzero(domains == name)
        ref_tok = compute_token_reward(rewards.rewards[rows], tokens_of({k: [v[i] for i in rows] for k, v in
                                                                          cols.items()}).token_mask,
                                       take_rows(tokens.next_token["old_log_probs"], rows),
                                       take_rows(tokens.next_token["ref_log_probs"], rows), kl_coef=0.0)
        sub_mask = take_rows(Ragged(whole.final_mask, whole.advantages.offsets), rows).values
        ref = compute_advantage(ref_tok.token_level_rewards, sub_mask, "reinforce", gamma=0.95, lambd=0.95,
                                whiten_rewards=True, whiten_advantages=True, advantage_clip=1.5)
        np.testing.assert_allclose(take_rows(whole.advantages, rows).values, ref.advantages.values, atol=1e-6)


def test_row_permutation_permutes_the_outputs():
    rng = np.random.default_rng(13)
    cols = _concat(_random_table(rng, prompts=3, n=3, domain="a"), _random_table(rng, prompts=2, n=3, domain="b"))
    cfg = config(num_return_sequences_in_group=3, adv_estimator="grpo", difficulty_mask=True,
                 difficulty_low_threshold=0.1, difficulty_high_threshold=0.95)
    _, base, base_batch = run_chain(cols, cfg, 0.0)
    order = rng.permutation(len(cols["row_id"]))
    _, perm, perm_batch = run_chain({k: [v[i] for i in order] for k, v in cols.items()}, cfg, 0.0)
    np.testing.assert_array_equal(perm.rewards, base.rewards[order])
    np.testing.assert_array_equal(perm.sample_mask, base.sample_mask[order])
    np.testing.assert_array_equal(perm_batch.advantages.values, take_rows(base_batch.advantages, order).values)


# ---- token layout ---------------------------------------------------------------------------------------------------

def test_token_layout_hand_case():
    prompt = Ragged.from_rows([[7, 8], [9]], np.int32)
    response = Ragged.from_rows([[1, 2, 3], []], np.int32)
    logp = Ragged.from_rows([[-0.1, -0.2, -0.3], []], np.float32)
    t = response_tokens(prompt, response, {"infer_logprobs": logp})
    assert [t.input_ids.row(b).tolist() for b in range(2)] == [[7, 8, 1, 2, 3], [9]]
    assert [t.response_mask.row(b).tolist() for b in range(2)] == [[0, 0, 1, 1, 1], [0]]
    np.testing.assert_array_equal(t.token_mask, [0, 1, 1, 1])  # response_mask[1:]; the 1-token row has none
    np.testing.assert_allclose(t.next_token["infer_logprobs"].values, [0, -0.1, -0.2, -0.3])
    assert concat_rows(prompt, response).lengths.tolist() == [5, 1]
    assert response_to_next_token(logp, np.array([1, 4])).lengths.tolist() == [3, 3]


# ---- bad input -------------------------------------------------------------------------------------------------------

def test_incomplete_group_and_mixed_domain_group_are_errors():
    cfg = rlvr_reward_section(config(num_return_sequences_in_group=2, adv_estimator="grpo"))
    s = np.ones(3)
    with pytest.raises(InvariantError, match=r"prompt_id 'b' has 1 responses, expected num_return_sequences"):
        rlvr_response_rewards(np.array(["a", "a", "b"]), np.array(["m"] * 3), s, s, np.ones(3), cfg, {}, "T")
    with pytest.raises(InvariantError, match="prompt_id 'a' belong to several domains"):
        rlvr_response_rewards(np.array(["a", "a"]), np.array(["m", "c"]), s[:2], s[:2], np.ones(2), cfg, {}, "T")
    with pytest.raises(InvariantError, match="empty prompt"):
        response_tokens(Ragged.from_rows([[]], np.int32), Ragged.from_rows([[1]], np.int32))


# ---- helpers ---------------------------------------------------------------------------------------------------------

def _random_table(rng, prompts: int, n: int, domain: str) -> dict[str, list]:
    cols: dict[str, list] = {k: [] for k in ("row_id", "prompt_id", "domain", "ground_truth", "prompt_ids",
                                             "response_ids", "old_log_probs", "ref_log_probs")}
    for p in range(prompts):
        for k in range(n):
            plen, rlen = int(rng.integers(1, 5)), int(rng.integers(0, 7))
            old = rng.normal(-1, 0.5, rlen).astype(np.float32)
            cols["row_id"].append(f"{domain}-{p}-{k}")
            cols["prompt_id"].append(f"{domain}-{p}")
            cols["domain"].append(domain)
            cols["ground_truth"].append(repr(float(rng.integers(0, 2))))
            cols["prompt_ids"].append(rng.integers(3, 50, plen).tolist())
            cols["response_ids"].append(rng.integers(3, 50, rlen).tolist())
            cols["old_log_probs"].append(old.tolist())
            cols["ref_log_probs"].append((old + rng.normal(0, 0.1, rlen)).astype(np.float32).tolist())
    return cols


def _concat(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
