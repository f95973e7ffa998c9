"""Token-level data-side algorithms (spec §1, §2, §4): golden conformance with ROLL, hand-computed cases,
loop-vs-vectorised equivalence, invariances and bad input.

Golden inputs are ROLL's padded ``(B, S)`` / ``(B, S-1)`` arrays. Functions that depend on where a row really ends
(``expand_to_token_level``) get rows trimmed to their attention length; per-position functions get full-width rows
(which is also what ROLL's recursions ran over, padding included). Outputs are padded back with zeros to compare.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from schemas.errors import ConfigError, InvariantError
from stages.algos.advantages import compute_advantage, finalize_advantages, advantage_recursion, opd_kl_penalty
from stages.algos.estimators import ADVANTAGE_ESTIMATORS
from stages.algos.functional import (clip_fraction, masked_clip_fraction, masked_mean, masked_normalize, masked_sum,
                                     masked_var, masked_whiten, row_masked_sum, sum_partials, whiten_partials,
                                     whiten_stats_from_partials, whiten_with)
from stages.algos.kl import (AdaptiveKLController, FixedKLController, approx_kl, get_kl_controller,
                             kl_controller_from_state)
from stages.algos.ragged import Ragged, row_masked_mean
from stages.algos.returns import (agentic_reinforce_returns, gae, reinforce_returns, reverse_linear_scan,
                                  segment_masked_mean)
from stages.algos.token_rewards import (apply_kl_penalty, compute_token_reward, current_kl_from_partials,
                                        expand_to_token_level, kl_partials)
from tests.golden import assert_close, case_names, load

WHITENED_ATOL = 1e-4


# ---- conversions -----------------------------------------------------------------------------------------------------
def full_rows(padded: np.ndarray) -> Ragged:
    """Every row of a ``(B, T)`` array kept at full width ``T``."""
    padded = np.asarray(padded)
    return Ragged.from_padded(padded, np.full(padded.shape[0], padded.shape[1]))


def trimmed_rows(padded: np.ndarray, lengths: np.ndarray) -> Ragged:
    return Ragged.from_padded(np.asarray(padded), lengths)


def real_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """``L_b`` of right-padded rows (asserts that the attention mask is a prefix of ones)."""
    lengths = attention_mask.sum(axis=1)
    assert np.array_equal(attention_mask, (np.arange(attention_mask.shape[1]) < lengths[:, None]).astype(int))
    return lengths


def padded(x: Ragged, width: int) -> np.ndarray:
    return x.to_padded(width)


def controller_from_param(text: str):
    """``FixedKLController(0.1)`` / ``AdaptiveKLController(init=..,target=..,horizon=..)`` from a manifest param."""
    fixed = re.fullmatch(r"FixedKLController\(([-\d.e]+)\)", text)
    if fixed:
        return get_kl_controller(float(fixed.group(1)))
    kv = dict(re.findall(r"(\w+)=([-\d.e]+)", text))
    return get_kl_controller(float(kv["init"]), float(kv["target"]), float(kv["horizon"]))


# ---- independent per-row loop references ---------------------------------------------------------------------------
def loop_reward_to_go(r: np.ndarray, gamma: float) -> np.ndarray:
    out, g = np.zeros(len(r)), 0.0
    for t in reversed(range(len(r))):
        g = r[t] + gamma * g
        out[t] = g
    return out


def loop_gae_roll(r: np.ndarray, v: np.ndarray, gamma: float, lambd: float) -> tuple[np.ndarray, np.ndarray]:
    adv, a, next_v = np.zeros(len(r)), 0.0, 0.0
    for t in reversed(range(len(r))):
        a = r[t] + gamma * next_v - v[t] + gamma * lambd * a
        adv[t], next_v = a, v[t]
    return adv, adv + np.asarray(v, dtype=np.float64)


def loop_gae_fixed(r: np.ndarray, v: np.ndarray, m: np.ndarray, gamma: float,
                   lambd: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE over the response positions of one row only (BUG-4 fixed)."""
    adv, ret = np.zeros(len(r)), np.zeros(len(r))
    a, next_v = 0.0, 0.0
    for t in reversed([t for t in range(len(r)) if m[t] > 0]):
        a = r[t] + gamma * next_v - v[t] + gamma * lambd * a
        adv[t], ret[t], next_v = a, a + v[t], v[t]
    return adv, ret


def loop_segments(m: np.ndarray) -> list[tuple[int, int]]:
    segs, t = [], 0
    while t < len(m):
        if m[t] > 0:
            s = t
            while t < len(m) and m[t] > 0:
                t += 1
            segs.append((s, t))
        else:
            t += 1
    return segs


def loop_agentic_reinforce(r: np.ndarray, m: np.ndarray, gamma: float) -> np.ndarray:
    out, g = np.zeros(len(r)), 0.0
    for s, e in reversed(loop_segments(m)):
        g = r[e - 1] + gamma * g
        out[s:e] = g
    return out


def loop_segment_mean(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x))
    for s, e in loop_segments(m):
        out[s:e] = np.sum(x[s:e], dtype=np.float64) / (e - s + 1e-8)
    return out


def per_row(fn, *rows_and_args):
    """Apply a per-row loop reference to every row of ``Ragged`` inputs; flat float64 result."""
    raggeds = [a for a in rows_and_args if isinstance(a, Ragged)]
    args = [a for a in rows_and_args if not isinstance(a, Ragged)]
    n_rows = raggeds[0].num_rows
    parts = [fn(*[g.row(b) for g in raggeds], *args) for b in range(n_rows)]
    return np.concatenate(parts) if parts else np.zeros(0)


def random_rows(rng: np.random.Generator, n_rows: int = 9, max_len: int = 23) -> tuple[Ragged, np.ndarray]:
    """Random next-token rows (lengths 0..max_len, including 0 and 1) and a multi-segment token mask."""
    lengths = rng.integers(0, max_len + 1, n_rows)
    lengths[:2] = [0, 1]
    x = Ragged.from_rows([rng.normal(size=n) for n in lengths])
    m = (rng.random(len(x.values)) < 0.6).astype(np.int64)
    return x, m


# ---- §1 primitives -------------------------------------------------------------------------------------------------
def test_masked_ops_golden():
    case = load("masked_ops")
    x, m = case.inputs["values"], case.inputs["mask"]
    out = case.outputs
    rows = full_rows(x)
    flat_m = full_rows(m).values
    assert_close(masked_mean(x, m), out["masked_mean_all"])
    assert_close(row_masked_mean(rows, flat_m), out["masked_mean_dim_-1"])
    assert_close(masked_sum(x, m), out["masked_sum_all"])
    assert_close(row_masked_sum(rows, flat_m), out["masked_sum_dim_-1"])
    assert_close(masked_var(x, m, unbiased=True), out["masked_var_unbiased"])
    assert_close(masked_var(x, m, unbiased=False), out["masked_var_biased"])
    assert_close(masked_whiten(x, m), out["masked_whiten_shift"], atol=WHITENED_ATOL)
    assert_close(masked_whiten(x, m, shift_mean=False), out["masked_whiten_noshift"], atol=WHITENED_ATOL)
    assert_close(padded(rows.with_values(masked_normalize(rows, flat_m)), x.shape[1]), out["masked_normalize_dim1"],
                 atol=WHITENED_ATOL)
    # response_level_masked_whiten is broken in ROLL (BUG-1, out["response_level_masked_whiten_raises"] = 1) and is
    # deliberately not provided.
    assert int(out["response_level_masked_whiten_raises"]) == 1


def test_masked_var_needs_two_elements():
    x = np.array([1.0, 2.0, 3.0])
    with pytest.raises(InvariantError, match="at least one"):
        masked_var(x, np.zeros(3))
    with pytest.raises(InvariantError, match="sums to 1"):
        masked_var(x, np.array([0, 1, 0]))
    assert masked_var(x, np.zeros(3), unbiased=False) == 0.0
    assert masked_var(x, np.array([1, 1, 0])) == pytest.approx(0.5, rel=1e-6)


def test_mask_shape_mismatch_is_a_clear_error():
    with pytest.raises(InvariantError, match="one entry per value"):
        masked_mean(np.zeros(4), np.ones(3))
    rows = Ragged.from_rows([[1.0, 2.0], [3.0]])
    with pytest.raises(InvariantError, match="gae mask"):
        gae(rows, rows, np.ones(2), 1.0, 1.0)
    with pytest.raises(InvariantError, match="different lengths"):
        gae(rows, Ragged.from_rows([[1.0], [2.0, 3.0]]), np.ones(3), 1.0, 1.0)
    with pytest.raises(InvariantError, match="one entry per value"):
        compute_advantage(rows, np.ones(4), "reinforce", gamma=1.0, lambd=1.0)


def test_whitening_across_chunks_equals_whole_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=1000).astype(np.float32)
    m = (rng.random(1000) < 0.7).astype(np.int64)
    cuts = [0, 1, 137, 138, 600, 1000]  # includes an empty and a one-element chunk
    parts = [whiten_partials(x[a:b], m[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    mean, var = whiten_stats_from_partials(*sum_partials(parts))
    chunked = np.concatenate([whiten_with(x[a:b], mean, var) for a, b in zip(cuts[:-1], cuts[1:])])
    np.testing.assert_allclose(chunked, masked_whiten(x, m), rtol=1e-6, atol=1e-6)
    sel = x[m > 0].astype(np.float64)
    np.testing.assert_allclose([mean, var], [sel.mean(), sel.var(ddof=1)], rtol=1e-9)


def test_clip_fraction_golden():
    case = load("compute_clip_fraction")
    frac = clip_fraction(case.inputs["values"], low=case.params["clip_min"], high=case.params["clip_max"])
    assert_close(frac, case.outputs["clipfrac"])


def test_clip_fraction_all_vs_masked():
    x = np.array([-3.0, 0.0, 3.0, 5.0])
    m = np.array([1, 1, 0, 0])
    assert clip_fraction(x, low=-1, high=1) == 0.75
    assert masked_clip_fraction(x, m, low=-1, high=1) == 0.5
    assert clip_fraction(np.zeros(0), low=-1, high=1) == 0.0
    assert masked_clip_fraction(x, np.zeros(4), low=-1, high=1) == 0.0


# ---- §2.1, §2.2 KL --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", case_names("approx_kl__"))
def test_approx_kl_golden(name):
    case = load(name)
    mask = case.inputs.get("action_mask")
    kl = approx_kl(case.inputs["log_probs"], case.inputs["log_probs_base"], case.params["kl_penalty"], mask)
    assert kl.dtype == np.float32
    assert_close(kl, case.outputs["kl"])


def test_approx_kl_hand_values_and_full():
    lp, lb = np.array([-1.0, -2.0]), np.array([-1.5, -1.0])
    assert_close(approx_kl(lp, lb, "kl"), [0.5, -1.0])
    assert_close(approx_kl(lp, lb, "abs"), [0.5, 1.0])
    assert_close(approx_kl(lp, lb, "mse"), [0.125, 0.5])
    assert_close(approx_kl(lp, lb, "k3"), [np.exp(-0.5) + 0.5 - 1, np.exp(1.0) - 1 - 1])
    assert_close(approx_kl(np.array([0.0]), np.array([-20.0]), "k3"), [10.0])  # clamped
    rng = np.random.default_rng(1)
    logits_p, logits_q = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    logp = logits_p - np.log(np.exp(logits_p).sum(-1, keepdims=True))
    logq = logits_q - np.log(np.exp(logits_q).sum(-1, keepdims=True))
    full = approx_kl(logp, logq, "full", mask=np.array([1, 1, 0, 1, 1]))
    expected = (np.exp(logp) * (logp - logq)).sum(-1) * np.array([1, 1, 0, 1, 1])
    assert_close(full, expected)
    assert np.all(full >= 0)
    with pytest.raises(ConfigError, match="not supported"):
        approx_kl(lp, lb, "forward")


def test_kl_controllers_golden():
    case = load("kl_controllers__sequence")
    ad, fx = case.params["adaptive"], case.params["fixed"]
    adaptive = get_kl_controller(ad["init_kl_coef"], ad["target"], ad["horizon"])
    fixed = get_kl_controller(fx["kl_coef"])
    assert [type(adaptive).__name__, type(fixed).__name__] == list(case.outputs["controller_types"])
    got_a, got_f = [], []
    for current, n in zip(case.inputs["current_kl"], case.inputs["n_steps"]):
        adaptive.update(float(current), int(n))
        fixed.update(float(current), int(n))
        got_a.append(adaptive.value)
        got_f.append(fixed.value)
    assert_close(got_a, case.outputs["adaptive_values"], rtol=1e-12, atol=0)
    assert_close(got_f, case.outputs["fixed_values"], rtol=0, atol=0)


def test_kl_controller_state_round_trips_through_json():
    ctrl = AdaptiveKLController(0.2, 0.05, 1000)
    ctrl.update(0.3, 64)
    again = kl_controller_from_state(json.loads(json.dumps(ctrl.state_dict())))
    assert again == ctrl
    again.update(0.01, 64)
    ctrl.update(0.01, 64)
    assert again.value == ctrl.value
    assert kl_controller_from_state(FixedKLController(0.1).state_dict()) == FixedKLController(0.1)
    assert AdaptiveKLController(0.0, 0.1, 10).value == 0.0
    with pytest.raises(ConfigError, match="target_kl"):
        get_kl_controller(0.2, 0.0, 100)
    with pytest.raises(ConfigError, match="kind"):
        kl_controller_from_state({"kind": "pid", "value": 1.0})


# ---- §2.3-2.5 token rewards -----------------------------------------------------------------------------------------
def test_expand_to_token_level_places_reward_at_last_position():
    offsets = np.array([0, 3, 3, 4, 6])  # rows of 3, 0, 1, 2 next-token positions
    r = expand_to_token_level(np.array([1.0, 2.0, 3.0, 4.0]), offsets)
    assert r.values.dtype == np.float32
    assert_close(r.values, [0, 0, 1, 3, 0, 4])  # the empty row gets nothing
    with pytest.raises(InvariantError, match="one reward per row"):
        expand_to_token_level(np.array([1.0]), offsets)


def _token_reward_inputs(case):
    lengths = real_lengths(case.inputs["attention_mask"])
    # ROLL's reward sits at argmax(position_ids·attention_mask) = L−1, i.e. the last next-token position L−2
    pos_att = case.inputs["position_ids"] * case.inputs["attention_mask"]
    assert np.array_equal(pos_att.argmax(axis=1), lengths - 1)
    next_len = np.maximum(lengths - 1, 0)
    mask = trimmed_rows(case.inputs["response_mask"][:, 1:], next_len).values
    old = trimmed_rows(case.inputs["old_log_probs"], next_len)
    ref = trimmed_rows(case.inputs["ref_log_probs"], next_len) if "ref_log_probs" in case.inputs else None
    return case.inputs["response_level_rewards"], mask, old, ref


@pytest.mark.parametrize("name", case_names("compute_token_reward__"))
def test_compute_token_reward_golden(name):
    case = load(name)
    p = case.params
    rewards, mask, old, ref = _token_reward_inputs(case)
    ctrl = controller_from_param(p["kl_ctrl"])
    res = compute_token_reward(rewards, mask, old, ref, kl_coef=ctrl.value, kl_penalty=p["kl_penalty"],
                               add_token_level_kl=p["add_token_level_kl"], reward_clip=p["reward_clip"])
    ctrl.update(res.current_kl, n_steps=res.kl_partials[1])
    width = case.outputs["token_level_rewards"].shape[1]
    assert_close(padded(res.token_level_rewards, width), case.outputs["token_level_rewards"])
    assert_close(res.metrics["critic/kl"], case.metric("critic/kl"))
    assert_close(res.metrics["critic/kl_coef"], case.metric("critic/kl_coef"))
    assert_close(ctrl.value, case.outputs["kl_ctrl_value_after"])
    if p["reward_clip"]:
        # same clipped count; ROLL divides by B·(S−1) padded positions, we by the real next-token positions
        n_clipped = res.metrics["critic/token_reward_clip_frac"] * len(old.values)
        assert_close(n_clipped, case.metric("critic/token_reward_clip_frac") * rewards.shape[0] * width)
    else:
        assert "critic/token_reward_clip_frac" not in res.metrics


@pytest.mark.parametrize("name", case_names("apply_kl_penalty__"))
def test_apply_kl_penalty_golden(name):
    case = load(name)
    rewards, mask, old, ref = _token_reward_inputs(case)
    ctrl = controller_from_param(case.params["kl_ctrl"])
    res = apply_kl_penalty(rewards, mask, old, ref, kl_coef=ctrl.value, kl_penalty=case.params["kl_penalty"])
    ctrl.update(res.current_kl, n_steps=old.num_rows)
    width = case.outputs["token_level_rewards"].shape[1]
    assert_close(padded(res.token_level_rewards, width), case.outputs["token_level_rewards"])
    assert_close(res.metrics["critic/kl"], case.metric("critic/kl"))
    assert_close(res.metrics["critic/kl_coef"], case.metric("critic/kl_coef"))
    assert_close(ctrl.value, case.outputs["kl_ctrl_value_after"])


def test_kl_partials_across_blocks_equal_whole_batch():
    rng = np.random.default_rng(2)
    kl, m = random_rows(rng, n_rows=12)
    whole = current_kl_from_partials([kl_partials(kl, m)])
    blocks = []
    for lo, hi in [(0, 5), (5, 5), (5, 12)]:
        a, b = kl.offsets[lo], kl.offsets[hi]
        block = Ragged(kl.values[a:b], kl.offsets[lo:hi + 1] - a)
        blocks.append(kl_partials(block, m[a:b]))
    assert current_kl_from_partials(blocks)[1] == 12
    assert current_kl_from_partials(blocks)[0] == pytest.approx(whole[0], rel=1e-12)
    assert current_kl_from_partials([]) == (0.0, 0)


def test_token_reward_hand_case_with_kl_and_clip():
    old = Ragged.from_rows([[0.0, -1.0, -2.0], [-0.5]])
    ref = Ragged.from_rows([[0.0, -1.5, -1.0], [-0.5]])
    mask = np.array([0, 1, 1, 0])
    res = compute_token_reward(np.array([2.0, 5.0]), mask, old, ref, kl_coef=0.5, add_token_level_kl=True,
                               reward_clip=1.5)
    # kl = [0, 0.5, -1.0 | 0 (masked)]; r = [0, -0.25, 2 + 0.5 | 5] → clip ±1.5
    assert_close(res.token_level_rewards.values, [0.0, -0.25, 1.5, 1.5])
    assert res.metrics["critic/token_reward_clip_frac"] == 0.5
    assert res.metrics["critic/kl"] == pytest.approx((-0.25 + 0.0) / 2, rel=1e-6)  # empty-mask row counts
    assert res.metrics["critic/kl_coef"] == 0.5
    masked = compute_token_reward(np.array([2.0, 5.0]), mask, old, ref, kl_coef=0.5, add_token_level_kl=True,
                                  reward_clip=1.5, masked_clip_metric=True)
    assert masked.metrics["critic/token_reward_clip_frac"] == 0.5
    off = compute_token_reward(np.array([2.0, 5.0]), mask, old, ref, kl_coef=0.5, reward_clip=0)
    assert off.kl_coef == 0.0 and "critic/token_reward_clip_frac" not in off.metrics
    assert_close(off.token_level_rewards.values, [0, 0, 2, 5])


# ---- §4.1, §4.2, §4.5, §4.6 recursions ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", case_names("reinforce_return__"))
def test_reinforce_return_golden(name):
    case = load(name)
    r = case.inputs["token_level_rewards"]
    g = reinforce_returns(full_rows(r), case.params["gamma"])
    assert_close(padded(g, r.shape[1]), case.outputs["advantages"])
    assert_close(padded(g, r.shape[1]), case.outputs["returns"])


@pytest.mark.parametrize("name", case_names("gae__"))
def test_gae_golden_roll_compat(name):
    case = load(name)
    r, v = case.inputs["token_level_rewards"], case.inputs["values"]
    adv, ret = gae(full_rows(r), full_rows(v), None, case.params["gamma"], case.params["lambd"], roll_compat=True)
    assert_close(padded(adv, r.shape[1]), case.outputs["advantages"])
    assert_close(padded(ret, r.shape[1]), case.outputs["returns"])


def test_agentic_reinforce_return_golden():
    case = load("compute_agentic_reinforce_return__gamma0.0")
    r, m = case.inputs["token_level_rewards"], case.inputs["mask"]
    g = agentic_reinforce_returns(full_rows(r), full_rows(m).values, case.params["gamma"])
    assert_close(padded(g, r.shape[1]), case.outputs["advantages"])


def test_segment_masked_mean_golden():
    case = load("compute_segment_masked_mean")
    x, m = case.inputs["tensor"], case.inputs["mask"]
    out = segment_masked_mean(full_rows(x), full_rows(m).values)
    assert_close(padded(out, x.shape[1]), case.outputs["result"])


def test_gae_fixed_hand_computed_two_turns():
    # one row, positions 0..5: prompt, turn 1 (1, 2), observation (3), turn 2 (4), trailing position 5
    r = Ragged.from_rows([[9.0, 0.0, 1.0, 7.0, 2.0, 5.0]])
    v = Ragged.from_rows([[100.0, 0.5, 0.25, 100.0, 1.0, 100.0]])
    m = np.array([0, 1, 1, 0, 1, 0])
    gamma, lambd = 0.5, 0.5
    adv, ret = gae(r, v, m, gamma, lambd)
    # response positions 1, 2, 4 in order; V after the last response token = 0
    d4 = 2.0 + 0.0 - 1.0                  # 1.0
    d2 = 1.0 + gamma * 1.0 - 0.25         # 1.25 (bootstraps from V at position 4, skipping the observation)
    d1 = 0.0 + gamma * 0.25 - 0.5         # -0.375
    a4, a2 = d4, d2 + gamma * lambd * d4  # 1.0, 1.5
    a1 = d1 + gamma * lambd * a2          # 0.0
    assert_close(adv.values, [0, a1, a2, 0, a4, 0])
    assert_close(ret.values, [0, a1 + 0.5, a2 + 0.25, 0, a4 + 1.0, 0])


def test_reinforce_and_agentic_hand_computed():
    r = Ragged.from_rows([[1.0, 0.0, 2.0, 0.0, 4.0], [], [3.0]])
    assert_close(reinforce_returns(r, 0.5).values, [1 + 0.5 * 1.5, 1.5, 2 + 0.5 * 2, 2, 4, 3])
    m = np.array([1, 1, 0, 1, 1, 1])
    # row 0 segments [0, 2) and [3, 5): G2 = 4, G1 = r[1] + 0.5·4 = 2
    assert_close(agentic_reinforce_returns(r, m, 0.5).values, [2, 2, 0, 4, 4, 3])
    assert_close(segment_masked_mean(r, m).values, [0.5, 0.5, 0, 2, 2, 3], rtol=1e-6)


@pytest.mark.parametrize("gamma", [0.9, 1.0, 0.0])
def test_recursions_match_per_row_loops(gamma):
    rng = np.random.default_rng(int(gamma * 10) + 3)
    r, m = random_rows(rng, n_rows=15, max_len=40)
    v = r.with_values(rng.normal(size=len(r.values)))
    lambd = 0.8
    assert_close(reinforce_returns(r, gamma).values, per_row(loop_reward_to_go, r, gamma))
    adv, ret = gae(r, v, m, gamma, lambd, roll_compat=True)
    assert_close(adv.values, per_row(lambda a, b: loop_gae_roll(a, b, gamma, lambd)[0], r, v), atol=1e-5)
    assert_close(ret.values, per_row(lambda a, b: loop_gae_roll(a, b, gamma, lambd)[1], r, v), atol=1e-5)
    mr = r.with_values(m)
    adv, ret = gae(r, v, m, gamma, lambd)
    assert_close(adv.values, per_row(lambda a, b, c: loop_gae_fixed(a, b, c, gamma, lambd)[0], r, v, mr), atol=1e-5)
    assert_close(ret.values, per_row(lambda a, b, c: loop_gae_fixed(a, b, c, gamma, lambd)[1], r, v, mr), atol=1e-5)
    assert_close(agentic_reinforce_returns(r, m, gamma).values, per_row(loop_agentic_reinforce, r, mr, gamma))
    assert_close(segment_masked_mean(r, m).values, per_row(loop_segment_mean, r, mr), atol=1e-6)


def test_reverse_linear_scan_long_rows_and_per_position_coefficients():
    rng = np.random.default_rng(4)
    x = Ragged.from_rows([rng.normal(size=n) for n in (1000, 0, 3, 517)], dtype=np.float64)
    coef = rng.uniform(0.5, 1.0, size=len(x.values))
    expected = []
    for b in range(x.num_rows):
        row, c = x.row(b), coef[x.offsets[b]:x.offsets[b + 1]]
        y, acc = np.zeros(len(row)), 0.0
        for t in reversed(range(len(row))):
            acc = row[t] + (c[t] * acc if t + 1 < len(row) else 0.0)
            y[t] = acc
        expected.append(y)
    scanned = reverse_linear_scan(x.values, coef, x.offsets)
    np.testing.assert_allclose(scanned, np.concatenate(expected), rtol=1e-10)
    ones = reverse_linear_scan(x.values, 1.0, x.offsets)
    np.testing.assert_allclose(ones, per_row(loop_reward_to_go, x, 1.0), rtol=1e-9, atol=1e-9)
    assert len(reverse_linear_scan(np.zeros(0), 0.9, np.array([0, 0]))) == 0


def test_gae_ignores_values_and_rewards_at_non_response_positions():
    rng = np.random.default_rng(5)
    r, m = random_rows(rng, n_rows=10, max_len=30)
    v = r.with_values(rng.normal(size=len(r.values)))
    outside = m == 0
    v2 = v.with_values(np.where(outside, rng.normal(scale=100, size=len(m)), v.values))
    r2 = r.with_values(np.where(outside, rng.normal(scale=100, size=len(m)), r.values))
    a1, ret1 = gae(r, v, m, 0.95, 0.9)
    a2, ret2 = gae(r2, v2, m, 0.95, 0.9)
    np.testing.assert_array_equal(a1.values, a2.values)
    np.testing.assert_array_equal(ret1.values, ret2.values)
    assert np.all(a1.values[outside] == 0) and np.all(ret1.values[outside] == 0)
    a3, _ = gae(r, v2, m, 0.95, 0.9, roll_compat=True)  # ROLL's version is not invariant (BUG-4)
    assert not np.allclose(a3.values[~outside], gae(r, v, m, 0.95, 0.9, roll_compat=True)[0].values[~outside])


def test_gae_single_turn_right_padded_rows_agree_with_roll_when_values_masked():
    """With one response block ending the row and masked values/rewards, ROLL's GAE is already correct."""
    rng = np.random.default_rng(6)
    lengths = rng.integers(1, 20, 8)
    m = np.concatenate([(np.arange(n) >= rng.integers(0, n)).astype(float) for n in lengths])
    r = Ragged.from_rows([rng.normal(size=n) for n in lengths])
    r = r.with_values(r.values * m)
    v = r.with_values(rng.normal(size=len(m)) * m)
    a_fix, ret_fix = gae(r, v, m, 0.9, 0.7)
    a_roll, ret_roll = gae(r, v, m, 0.9, 0.7, roll_compat=True)
    assert_close(a_fix.values, a_roll.values * m)
    assert_close(ret_fix.values, ret_roll.values * m)


# ---- §4.3, §4.4 compute_advantage ----------------------------------------------------------------------------------
ADVANTAGE_CASES = case_names("compute_advantage__") + case_names("agentic_compute_advantage__")


def _advantage_inputs(case):
    r = case.inputs["token_level_rewards"]
    full_mask = case.inputs["response_mask"]
    # edge cases pass response_mask already in the (B, S-1) layout; the others give (B, S) → response_mask[:, 1:]
    m = full_mask if full_mask.shape == r.shape else full_mask[:, 1:]
    values = full_rows(case.inputs["values"]) if "values" in case.inputs else None
    return full_rows(r), full_rows(m).values, values, m


def _reference_advantages(case, m: np.ndarray):
    """Corrected GAE pipeline, written independently per row, from ROLL's whitened+masked rewards."""
    p = case.params
    r = case.outputs["token_level_rewards"].astype(np.float64)
    v = case.inputs["values"].astype(np.float64)
    raw = np.zeros_like(r)
    ret = np.zeros_like(r)
    for b in range(r.shape[0]):
        raw[b], ret[b] = loop_gae_fixed(r[b], v[b], m[b], p["gamma"], p["lambd"])
    a = raw.copy()
    if p["whiten_advantages"] and m.sum() > 1:
        sel = a[m > 0]
        a = (a - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    a = a * m
    frac = None
    if p.get("advantage_clip") is not None:
        c = p["advantage_clip"]
        frac = float(np.mean((a > c) | (a < -c)))
        a = np.clip(a, -c, c)
    return a, ret, raw, frac


@pytest.mark.parametrize("name", ADVANTAGE_CASES)
def test_compute_advantage_golden(name):
    case = load(name)
    p = case.params
    rewards, mask, values, m2d = _advantage_inputs(case)
    opd = p.get("pipeline_config") or {}
    opd_kl = None
    if opd.get("is_pure_opd") or opd.get("use_opd"):
        student = full_rows(case.inputs["infer_logprobs"])  # enable_old_logprobs_recompute is False here
        teachers = {n: full_rows(case.inputs[f"ref_log_probs_{n}"]) for n in opd["reference_configs"]}
        opd_kl = opd_kl_penalty(student, teachers, mask, kl_penalty=opd["kl_penalty"])
    kwargs = dict(gamma=p["gamma"], lambd=p["lambd"], values=values, whiten_rewards=p.get("whiten_rewards", False),
                  whiten_advantages=p.get("whiten_advantages", False), advantage_clip=p.get("advantage_clip"),
                  opd_kl=opd_kl, use_opd=opd.get("use_opd", False), is_pure_opd=opd.get("is_pure_opd", False))
    is_gae = p["adv_estimator"] == "gae"
    res = compute_advantage(rewards, mask, p["adv_estimator"], roll_compat_gae=is_gae, **kwargs)
    width = rewards.lengths.max()
    whitened = p.get("whiten_rewards") or p.get("whiten_advantages")
    atol = WHITENED_ATOL if whitened else 1e-6
    out = case.outputs
    assert_close(padded(res.advantages, width), out["advantages"], atol=atol, what="advantages")
    for key in ("returns", "raw_advantages", "token_level_rewards", "values"):
        if key in out:
            got = getattr(res, key)
            assert_close(padded(got, width), out[key], atol=atol, what=key)
    if "metric:critic|advantage_clip_frac" in out:
        assert_close(res.metrics["critic/advantage_clip_frac"], case.metric("critic/advantage_clip_frac"))
    else:
        assert "critic/advantage_clip_frac" not in res.metrics
    if is_gae:  # BUG-4: the default (fixed) GAE differs from ROLL; check it against the per-row loop reference
        fixed = compute_advantage(rewards, mask, "gae", **kwargs)
        a, ret, raw, frac = _reference_advantages(case, m2d)
        assert not np.allclose(padded(fixed.advantages, width), out["advantages"], atol=1e-3)
        assert_close(padded(fixed.advantages, width), a, atol=atol, what="fixed advantages")
        assert_close(padded(fixed.returns, width), ret, atol=atol, what="fixed returns")
        assert_close(padded(fixed.raw_advantages, width), raw, atol=atol, what="fixed raw advantages")
        assert_close(padded(fixed.token_level_rewards, width), out["token_level_rewards"], atol=atol)
        if frac is not None:
            assert_close(fixed.metrics["critic/advantage_clip_frac"], frac)


@pytest.mark.parametrize("mask, expected", [([0, 0, 0], [0, 0, 0]), ([0, 1, 0], [0, 3, 0]),
                                            ([1, 1, 0], [-0.70710677, 0.70710677, 0])])
def test_compute_advantage_short_masks_like_roll_tests(mask, expected):
    """ROLL's tests/utils/test_compute_advantage.py: whitening is skipped when the mask sums to ≤ 1."""
    rewards = Ragged.from_rows([[1.0, 3.0, 0.0]])
    res = compute_advantage(rewards, np.array(mask), "reinforce", gamma=0.0, lambd=1.0, whiten_rewards=True,
                            whiten_advantages=True)
    assert_close(res.advantages.values, expected, atol=WHITENED_ATOL)


def test_compute_advantage_in_two_phases_over_blocks_equals_whole_batch():
    rng = np.random.default_rng(7)
    r, m = random_rows(rng, n_rows=14, max_len=25)
    v = r.with_values(rng.normal(size=len(m)))
    opts = dict(gamma=0.9, lambd=0.95, whiten_rewards=True, whiten_advantages=True, advantage_clip=1.0)
    whole = compute_advantage(r, m, "gae", values=v, **opts)

    def block(x: Ragged, lo, hi):
        a, b = x.offsets[lo], x.offsets[hi]
        return Ragged(x.values[a:b], x.offsets[lo:hi + 1] - a), slice(a, b)

    splits = [(0, 4), (4, 9), (9, 14)]
    reward_stats = whiten_stats_from_partials(*sum_partials(
        whiten_partials(block(r, lo, hi)[0].values, m[block(r, lo, hi)[1]]) for lo, hi in splits))
    phase1 = []
    for lo, hi in splits:
        rb, sl = block(r, lo, hi)
        phase1.append((advantage_recursion(rb, m[sl], "gae", gamma=0.9, lambd=0.95, values=block(v, lo, hi)[0],
                                           whiten_rewards=True, reward_stats=reward_stats), sl))
    adv_stats = whiten_stats_from_partials(*sum_partials(whiten_partials(p.advantages.values, m[sl])
                                                         for p, sl in phase1))
    final = np.concatenate([finalize_advantages(p.advantages.values, m[sl], whiten_advantages=True,
                                                advantage_stats=adv_stats, advantage_clip=1.0)[0]
                            for p, sl in phase1])
    np.testing.assert_allclose(final, whole.advantages.values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([p.returns.values for p, _ in phase1]), whole.returns.values,
                               rtol=1e-5, atol=1e-6)


def test_compute_advantage_values_masked_and_opd_modes():
    rewards = Ragged.from_rows([[0.0, 1.0, 2.0], [4.0]])
    m = np.array([0, 1, 1, 1])
    values = rewards.with_values(np.array([5.0, 1.0, 1.0, 1.0], dtype=np.float32))
    res = compute_advantage(rewards, m, "gae", gamma=1.0, lambd=1.0, values=values)
    assert_close(res.values.values, [0, 1, 1, 1])
    assert_close(res.advantages.values, [0, 2.0, 1.0, 3.0])  # Σ future r − V
    k = np.array([0.0, 0.5, 0.25, 1.0], dtype=np.float32)
    mixed = compute_advantage(rewards, m, "reinforce", gamma=1.0, lambd=1.0, opd_kl=k, use_opd=True)
    assert_close(mixed.raw_advantages.values, [3, 3, 2, 4])
    assert_close(mixed.advantages.values, [0, 2.5, 1.75, 3.0])
    pure = compute_advantage(rewards, m, "reinforce", gamma=0.0, lambd=1.0, opd_kl=k, is_pure_opd=True)
    assert_close(pure.advantages.values, -k)
    assert_close(pure.returns.values, -k)
    assert_close(pure.token_level_rewards.values, rewards.values)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        compute_advantage(rewards, m, "reinforce", gamma=1.0, lambd=1.0, opd_kl=k, use_opd=True, is_pure_opd=True)
    with pytest.raises(InvariantError, match="opd_kl"):
        compute_advantage(rewards, m, "reinforce", gamma=1.0, lambd=1.0, use_opd=True)
    with pytest.raises(InvariantError, match="values"):
        compute_advantage(rewards, m, "gae", gamma=1.0, lambd=1.0)


def test_opd_kl_penalty_routing_and_coefficients():
    student = Ragged.from_rows([[-1.0, -1.0], [-1.0]])
    t1 = student.with_values(np.array([-2.0, -1.5, -3.0], dtype=np.float32))
    t2 = student.with_values(np.array([-1.0, -0.5, -2.0], dtype=np.float32))
    m = np.array([1, 1, 1])
    k = opd_kl_penalty(student, {"a": t1, "b": t2}, m, coefs={"a": 2.0},
                       row_masks={"b": np.array([False, True])})
    # a: kl = [1, 0.5, 2]·2 ; b only on row 1: kl = 1
    assert_close(k, [2.0, 1.0, 5.0])


def test_estimator_registry():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"gae", "reinforce", "grpo", "gigpo", "step_reinforce",
                                                 "agentic_reinforce"}
    assert [n for n in ADVANTAGE_ESTIMATORS if ADVANTAGE_ESTIMATORS.get(n).needs_critic] == ["gae"]
    assert {n for n in ADVANTAGE_ESTIMATORS if ADVANTAGE_ESTIMATORS.get(n).needs_step_rows} == {"gigpo",
                                                                                             "step_reinforce"}
    assert ADVANTAGE_ESTIMATORS.get("gigpo").response_reward == "gigpo"
    assert ADVANTAGE_ESTIMATORS.get("step_reinforce").response_reward == "step_return"
    assert ADVANTAGE_ESTIMATORS.get("agentic_reinforce").agentic_only
    with pytest.raises(KeyError, match="known: agentic_reinforce"):
        compute_advantage(Ragged.from_rows([[1.0]]), np.array([1]), "ppo", gamma=1.0, lambd=1.0)
