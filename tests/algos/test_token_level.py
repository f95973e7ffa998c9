"""Token-level data-side algorithms (spec §1, §2, §4): golden conformance with ROLL, hand-computed cases,
loop-vs-vectorised equivalence, invariances and bad input.

Golden inputs are ROLL's padded ``(B, S)`` / ``(B, S-1)`` arrays. Functions that depend on where a row really ends
(``expand_to_token_level``) get rows trimmed to their attention length; per-position functions get full-width rows
(which is also what ROLL's recursions ran over, padding included). Outputs are padded back with zeros to compare.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from schemas.errors import ConfigError, InvariantError
from stages.algos.advantages import compute_advantage, finalize_advantages, advantage_recursion, opd_kl_penalty
from stages.algos.estimators import ADVANTAGE_ESTIMATORS
from stages.algos.functional import (clip_fraction, masked_clip_fraction, masked_mean, masked_sum, masked_whiten,
                                     sum_partials, whiten_partials, whiten_stats_from_partials)
from stages.algos.kl import (AdaptiveKLController, FixedKLController, approx_kl, get_kl_controller,
                             kl_controller_from_state)
from stages.algos.ragged import Ragged, row_masked_mean, row_sum
from stages.algos.returns import (agentic_reinforce_returns, gae, reinforce_returns, reverse_linear_scan,
                                  segment_masked_mean)
from stages.algos.token_rewards import (compute_token_reward, current_kl_from_partials,
                                        expand_to_token_level, kl_partials)
from tests.algos.reference import (loop_agentic_reinforce, loop_gae_fixed, loop_gae_roll, loop_reward_to_go,
                                   loop_segment_mean, ref_approx_kl, reference_compute_advantage)
from tests.golden import assert_close, family, load, magnitude, mean_scale, sum_scale

WHITENED_ATOL = 1e-4
F = "roll.utils.functionals."
MASKED_OPS = family(F + "{masked_mean,masked_sum,masked_var,masked_whiten,masked_normalize,"
                    "response_level_masked_whiten}")
CLIP_FRACTION = family(F + "compute_clip_fraction")
APPROX_KL = family(F + "compute_approx_kl")
KL_CONTROLLERS = family("roll.utils.kl_controller.{AdaptiveKLController,FixedKLController,get_kl_controller}")
TOKEN_REWARD = family(F + "compute_token_reward")
APPLY_KL_PENALTY = family(F + "apply_kl_penalty")
REINFORCE_RETURN = family(F + "compute_reinforce_return")
GAE = family(F + "compute_gae_advantage_return")
AGENTIC_REINFORCE_RETURN = family("roll.pipeline.agentic.utils.compute_agentic_reinforce_return")
SEGMENT_MEAN = family("roll.pipeline.agentic.utils.compute_segment_masked_mean")
ADVANTAGE_CASES = family(F + "compute_advantage", "roll.pipeline.agentic.utils.agentic_compute_advantage")


def row_sum_scale(*arrays) -> np.ndarray:
    """(B, 1): per row, Σ_t of |x| over the given (B, T) arrays — the largest partial sum of a recursion over it."""
    return sum(np.abs(np.asarray(a, dtype=np.float64)).sum(axis=-1, keepdims=True) for a in arrays)


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
    if not text.startswith("AdaptiveKLController(") or set(kv) != {"init", "target", "horizon"}:
        pytest.fail(f"kl_ctrl param {text!r}: expected FixedKLController(c) or "
                    f"AdaptiveKLController(init=..,target=..,horizon=..)", pytrace=False)
    return get_kl_controller(float(kv["init"]), float(kv["target"]), float(kv["horizon"]))


# ---- independent per-row loop references: tests/algos/reference.py ---------------------------------------------------
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
@pytest.mark.parametrize("name", MASKED_OPS)
def test_masked_ops_golden(name):
    case = load(name)
    case.check_params(())
    x, m = case.inputs["values"], case.inputs["mask"]
    out = case.outputs
    rows = full_rows(x)
    flat_m = full_rows(m).values
    assert_close(masked_mean(x, m), out["masked_mean_all"], scale=mean_scale(x, m))
    assert_close(row_masked_mean(rows, flat_m), out["masked_mean_dim_-1"], scale=mean_scale(x, m, -1))
    assert_close(masked_sum(x, m), out["masked_sum_all"], scale=sum_scale(x, m))
    assert_close(row_sum(rows, flat_m), out["masked_sum_dim_-1"], scale=sum_scale(x, m, -1))
    squares = mean_scale(np.asarray(x, dtype=np.float64) ** 2, m)          # Σ(x − μ)² ≤ Σx² (+ rounding of μ)
    # ROLL's masked_var is the variance of the whitening statistics the stages compute from block partials
    assert_close(masked_var(x, m, unbiased=True), out["masked_var_unbiased"], scale=squares)
    assert_close(masked_var(x, m, unbiased=False), out["masked_var_biased"], scale=squares)
    assert_close(masked_whiten(x, m), out["masked_whiten_shift"], atol=WHITENED_ATOL)
    assert_close(masked_whiten(x, m, shift_mean=False), out["masked_whiten_noshift"], atol=WHITENED_ATOL)
    # masked_normalize (§1.5, out["masked_normalize_dim1"]) is used by neither ROLL's RL pipelines nor ours and is not
    # provided. response_level_masked_whiten is broken in ROLL (BUG-1, out["response_level_masked_whiten_raises"] = 1)
    # and is deliberately not provided.
    assert int(out["response_level_masked_whiten_raises"]) == 1


def masked_var(x: np.ndarray, m: np.ndarray, unbiased: bool = True) -> float:
    """ROLL's ``masked_var`` (§1.3) as the production code computes it: the variance of the whitening statistics."""
    return whiten_stats_from_partials(*whiten_partials(x, m), unbiased=unbiased)[1]


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
    chunked = np.concatenate([masked_whiten(x[a:b], m[a:b], stats=(mean, var)) for a, b in zip(cuts[:-1], cuts[1:])])
    np.testing.assert_allclose(chunked, masked_whiten(x, m), rtol=1e-6, atol=1e-6)
    sel = x[m > 0].astype(np.float64)
    np.testing.assert_allclose([mean, var], [sel.mean(), sel.var(ddof=1)], rtol=1e-9)


@pytest.mark.parametrize("name", CLIP_FRACTION)
def test_clip_fraction_golden(name):
    case = load(name)
    p = case.check_params(("clip_max", "clip_min"))
    frac = clip_fraction(case.inputs["values"], low=p["clip_min"], high=p["clip_max"])
    assert_close(frac, case.outputs["clipfrac"])


def test_clip_fraction_all_vs_masked():
    x = np.array([-3.0, 0.0, 3.0, 5.0])
    m = np.array([1, 1, 0, 0])
    assert clip_fraction(x, low=-1, high=1) == 0.75
    assert masked_clip_fraction(x, m, low=-1, high=1) == 0.5
    assert clip_fraction(np.zeros(0), low=-1, high=1) == 0.0
    assert masked_clip_fraction(x, np.zeros(4), low=-1, high=1) == 0.0


# ---- §2.1, §2.2 KL --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", APPROX_KL)
def test_approx_kl_golden(name):
    from tests.losses.test_primitives import approx_kl_case

    case = load(name)
    lp, lb, mask, kl_penalty, scale = approx_kl_case(case)
    kl = approx_kl(lp, lb, kl_penalty, mask)
    assert kl.dtype == np.float32
    assert_close(kl, case.outputs["kl"], scale=scale)
    assert_close(kl, ref_approx_kl(lp, lb, kl_penalty, mask), scale=scale, what="vs reference")


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


@pytest.mark.parametrize("name", KL_CONTROLLERS)
def test_kl_controllers_golden(name):
    case = load(name)
    p = case.check_params(("adaptive", "fixed"))
    ad, fx = p["adaptive"], p["fixed"]
    assert set(ad) <= {"init_kl_coef", "target", "horizon"} and set(fx) <= {"kl_coef"}, (ad, fx)
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
    return case.inputs.get("response_level_rewards"), mask, old, ref


def _token_reward_scale(case, kl_coef: float, kl_penalty: str) -> tuple[float, float]:
    """(scale of r − β·kl, scale of the kl) for the float32 tolerance."""
    i = case.inputs
    kl = magnitude(ref_approx_kl(i["old_log_probs"], i.get("ref_log_probs", i["old_log_probs"]), kl_penalty),
                   i["old_log_probs"], i.get("ref_log_probs", 0.0))
    return magnitude(i["response_level_rewards"]) + kl_coef * kl, kl


@pytest.mark.parametrize("name", TOKEN_REWARD)
def test_compute_token_reward_golden(name):
    case = load(name)
    p = case.check_params(("kl_penalty", "add_token_level_kl", "reward_clip", "kl_ctrl"))
    rewards, mask, old, ref = _token_reward_inputs(case)
    ctrl = controller_from_param(p["kl_ctrl"])
    scale, kl_scale = _token_reward_scale(case, ctrl.value, p["kl_penalty"])
    res = compute_token_reward(rewards, mask, old, ref, kl_coef=ctrl.value, kl_penalty=p["kl_penalty"],
                               add_token_level_kl=p["add_token_level_kl"], reward_clip=p["reward_clip"])
    ctrl.update(res.current_kl, n_steps=res.kl_partials[1])
    width = case.outputs["token_level_rewards"].shape[1]
    assert_close(padded(res.token_level_rewards, width), case.outputs["token_level_rewards"], scale=scale)
    assert_close(res.metrics["critic/kl"], case.metric("critic/kl"), scale=kl_scale)
    assert_close(res.metrics["critic/kl_coef"], case.metric("critic/kl_coef"))
    assert_close(ctrl.value, case.outputs["kl_ctrl_value_after"])
    if p["reward_clip"]:
        # same clipped count; ROLL divides by B·(S−1) padded positions, we by the real next-token positions
        n_clipped = res.metrics["critic/token_reward_clip_frac"] * len(old.values)
        assert_close(n_clipped, case.metric("critic/token_reward_clip_frac") * rewards.shape[0] * width)
    else:
        assert "critic/token_reward_clip_frac" not in res.metrics


@pytest.mark.parametrize("name", APPLY_KL_PENALTY)
def test_apply_kl_penalty_golden(name):
    """ROLL's apply_kl_penalty (§2.5, kept but not called by its pipelines): the KL always subtracted when there is a
    reference (β = 0 and KL 0 without one), no clip — compute_token_reward, which the pipelines call, with
    ``add_token_level_kl`` = a reference is given and no ``reward_clip``."""
    case = load(name)
    p = case.check_params(("kl_penalty", "kl_ctrl"))
    rewards, mask, old, ref = _token_reward_inputs(case)
    ctrl = controller_from_param(p["kl_ctrl"])
    scale, kl_scale = _token_reward_scale(case, ctrl.value, p["kl_penalty"])
    res = compute_token_reward(rewards, mask, old, ref, kl_coef=ctrl.value, kl_penalty=p["kl_penalty"],
                               add_token_level_kl=ref is not None, reward_clip=None)
    assert "critic/token_reward_clip_frac" not in res.metrics
    ctrl.update(res.current_kl, n_steps=old.num_rows)
    width = case.outputs["token_level_rewards"].shape[1]
    assert_close(padded(res.token_level_rewards, width), case.outputs["token_level_rewards"], scale=scale)
    assert_close(res.metrics["critic/kl"], case.metric("critic/kl"), scale=kl_scale)
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
@pytest.mark.parametrize("name", REINFORCE_RETURN)
def test_reinforce_return_golden(name):
    case = load(name)
    p = case.check_params(("gamma", "lambd"))   # lambd: ROLL's reinforce ignores it (§4.1); so does ours
    r = case.inputs["token_level_rewards"]
    g = reinforce_returns(full_rows(r), p["gamma"])
    scale = row_sum_scale(r)
    assert_close(padded(g, r.shape[1]), case.outputs["advantages"], scale=scale)
    assert_close(padded(g, r.shape[1]), case.outputs["returns"], scale=scale)


def _gae_mask(case) -> np.ndarray | None:
    """A gae case's response mask, when it carries one ((B,T) ``mask``, or ``response_mask`` (B,T) / (B,T+1))."""
    i, width = case.inputs, case.inputs["token_level_rewards"].shape[1]
    for key in ("mask", "response_mask"):
        if key in i:
            return i[key] if i[key].shape[1] == width else i[key][:, 1:]
    return None


@pytest.mark.parametrize("name", GAE)
def test_gae_golden_roll_compat(name):
    """ROLL's compute_gae_advantage_return (§4.2) has no mask; ``roll_compat`` reproduces it. The corrected GAE
    (BUG-4) needs the response mask: where a case carries one, it is checked against the per-row loop reference."""
    case = load(name)
    p = case.check_params(("gamma", "lambd"))
    r, v = case.inputs["token_level_rewards"], case.inputs["values"]
    adv, ret = gae(full_rows(r), full_rows(v), None, p["gamma"], p["lambd"], roll_compat=True)
    scale = row_sum_scale(r, v, v)
    assert_close(padded(adv, r.shape[1]), case.outputs["advantages"], scale=scale)
    assert_close(padded(ret, r.shape[1]), case.outputs["returns"], scale=scale)
    m = _gae_mask(case)
    if m is not None:
        fixed_adv, fixed_ret = gae(full_rows(r), full_rows(v), full_rows(m).values, p["gamma"], p["lambd"])
        for b in range(r.shape[0]):
            ref_adv, ref_ret = loop_gae_fixed(r[b], v[b], m[b], p["gamma"], p["lambd"])
            assert_close(padded(fixed_adv, r.shape[1])[b], ref_adv, scale=scale[b], what=f"fixed row {b}")
            assert_close(padded(fixed_ret, r.shape[1])[b], ref_ret, scale=scale[b], what=f"fixed row {b}")


@pytest.mark.parametrize("name", AGENTIC_REINFORCE_RETURN)
def test_agentic_reinforce_return_golden(name):
    case = load(name)
    p = case.check_params(("gamma", "lambd"))   # lambd: ignored by §4.5
    r, m = case.inputs["token_level_rewards"], case.inputs["mask"]
    g = agentic_reinforce_returns(full_rows(r), full_rows(m).values, p["gamma"])
    assert_close(padded(g, r.shape[1]), case.outputs["advantages"], scale=row_sum_scale(r))


@pytest.mark.parametrize("name", SEGMENT_MEAN)
def test_segment_masked_mean_golden(name):
    case = load(name)
    case.check_params(())
    x, m = case.inputs["tensor"], case.inputs["mask"]
    out = segment_masked_mean(full_rows(x), full_rows(m).values)
    assert_close(padded(out, x.shape[1]), case.outputs["result"], scale=magnitude(x))


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


def test_reward_to_go_of_a_row_does_not_depend_on_the_rows_before_it(monkeypatch):
    """γ = 1 sums each row from its end back, exactly as ROLL's loop adds, whatever shares its block: a stage may cut a
    table into blocks anywhere (Ray Data did, by the cluster's size) and a row must come out the same. A cumsum over the
    whole block rounded a small row after large ones differently (issue 49)."""
    rng = np.random.default_rng(6)
    small = rng.normal(size=7) * 1e-3
    big = Ragged.from_rows([rng.normal(size=n) * 1e6 for n in (50, 0, 9)], dtype=np.float64)
    block = Ragged(np.concatenate([big.values, small]), np.concatenate([big.offsets, [big.offsets[-1] + len(small)]]))
    alone = reverse_linear_scan(small, 1.0, np.array([0, len(small)]))
    np.testing.assert_array_equal(reverse_linear_scan(block.values, 1.0, block.offsets)[-len(small):], alone)
    acc, loop = 0.0, np.zeros(len(small))
    for t in reversed(range(len(small))):
        acc = small[t] + acc
        loop[t] = acc
    np.testing.assert_array_equal(alone, loop)
    monkeypatch.setattr("stages.algos.returns.SCAN_CELLS", 60)  # a step of one row at a time: the same sums
    np.testing.assert_array_equal(reverse_linear_scan(block.values, 1.0, block.offsets)[-len(small):], alone)


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
ADVANTAGE_PARAMS = ("adv_estimator", "gamma", "lambd", "whiten_rewards", "whiten_advantages", "advantage_clip",
                    "response_mask", "pipeline_config")
PIPELINE_CONFIG_KEYS = ("is_pure_opd", "use_opd", "reference_configs", "enable_old_logprobs_recompute", "kl_penalty")
TEACHER_KEYS = ("opd_kl_coef",)


def advantage_case(case) -> dict:
    """Every params entry of a compute_advantage / agentic_compute_advantage case, dispatched (spec §4.3):

    * ``response_mask``: absent or ``"default_mask"`` → M = ``response_mask[:, 1:]`` (an input already (B, T), as in
      ROLL's own edge tests, is M); ``"final_response_mask"`` → the case's ``final_response_mask`` input (the RLVR
      pipeline's call); anything else is refused;
    * ``pipeline_config``: OPD switches; the student log-probs are ``old_log_probs`` when
      ``enable_old_logprobs_recompute`` else ``infer_logprobs``; one teacher per ``reference_configs`` entry
      (``ref_log_probs_<name>`` input, optional ``ref_log_probs_<name>_mask`` row routing, ``opd_kl_coef``);
    * the estimator, γ, λ, whitening switches and clip → the options of the same name."""
    p = case.check_params(ADVANTAGE_PARAMS)
    i = case.inputs
    r = i["token_level_rewards"]
    which = p.get("response_mask") or "default_mask"
    if which == "default_mask":
        m = i["response_mask"] if i["response_mask"].shape == r.shape else i["response_mask"][:, 1:]
    elif which == "final_response_mask":
        assert "final_response_mask" in i, f"{case.name}: response_mask=final_response_mask but no such input"
        m = i["final_response_mask"]
    else:
        pytest.fail(f"{case.name}: response_mask param {which!r} is not default_mask / final_response_mask",
                    pytrace=False)
    assert m.shape == r.shape, f"{case.name}: advantage mask {m.shape} vs rewards {r.shape}"
    opd = dict(p.get("pipeline_config") or {})
    unknown = sorted(set(opd) - set(PIPELINE_CONFIG_KEYS))
    assert not unknown, f"{case.name}: pipeline_config keys {unknown} not honoured"
    out = dict(rewards=r, mask=m.astype(np.int64), values=i.get("values"), estimator=p["adv_estimator"],
               gamma=p["gamma"], lambd=p["lambd"], whiten_rewards=bool(p.get("whiten_rewards", False)),
               whiten_advantages=bool(p.get("whiten_advantages", False)), advantage_clip=p.get("advantage_clip"),
               use_opd=bool(opd.get("use_opd", False)), is_pure_opd=bool(opd.get("is_pure_opd", False)))
    if p["adv_estimator"] == "gae":
        assert out["values"] is not None, f"{case.name}: gae needs the values input"
    if out["use_opd"] or out["is_pure_opd"]:
        student = i["old_log_probs" if opd.get("enable_old_logprobs_recompute") else "infer_logprobs"]
        teachers, coefs, routes = {}, {}, {}
        for name, teacher_cfg in (opd.get("reference_configs") or {"default": None}).items():
            teacher_cfg = dict(teacher_cfg or {})
            assert set(teacher_cfg) <= set(TEACHER_KEYS), f"{case.name}: teacher {name} keys {sorted(teacher_cfg)}"
            teachers[name] = i[f"ref_log_probs_{name}"]
            coefs[name] = float(teacher_cfg.get("opd_kl_coef", 1.0))
            if f"ref_log_probs_{name}_mask" in i:
                routes[name] = np.asarray(i[f"ref_log_probs_{name}_mask"], dtype=bool)
        out.update(student=student, teachers=teachers, coefs=coefs, routes=routes,
                   kl_penalty=opd.get("kl_penalty", "kl"))
    return out


def run_compute_advantage(a: dict, roll_compat: bool):
    """Our compute_advantage on the case's rows at full width (ROLL's recursions ran over every column)."""
    mask = full_rows(a["mask"]).values
    opd_kl = None
    if a["use_opd"] or a["is_pure_opd"]:
        opd_kl = opd_kl_penalty(full_rows(a["student"]), {n: full_rows(t) for n, t in a["teachers"].items()}, mask,
                                kl_penalty=a["kl_penalty"], coefs=a["coefs"], row_masks=a["routes"] or None)
    values = None if a["values"] is None else full_rows(a["values"])
    return compute_advantage(full_rows(a["rewards"]), mask, a["estimator"], gamma=a["gamma"], lambd=a["lambd"],
                             values=values, whiten_rewards=a["whiten_rewards"],
                             whiten_advantages=a["whiten_advantages"], advantage_clip=a["advantage_clip"],
                             opd_kl=opd_kl, use_opd=a["use_opd"], is_pure_opd=a["is_pure_opd"],
                             roll_compat_gae=roll_compat)


def reference_advantage(a: dict, roll: bool) -> dict:
    """tests/algos/reference.py's §4.3 for the case (``roll``: ROLL's GAE, BUG-4)."""
    opd_kl = None
    if a["use_opd"] or a["is_pure_opd"]:
        opd_kl = sum(a["coefs"][n] * ref_approx_kl(a["student"], t, a["kl_penalty"], a["mask"])
                     * (a["routes"][n][:, None] if n in a["routes"] and not a["routes"][n].all() else 1.0)
                     for n, t in a["teachers"].items())
    p = dict(adv_estimator=a["estimator"], gamma=a["gamma"], lambd=a["lambd"], whiten_rewards=a["whiten_rewards"],
             whiten_advantages=a["whiten_advantages"], advantage_clip=a["advantage_clip"], use_opd=a["use_opd"],
             is_pure_opd=a["is_pure_opd"])
    return reference_compute_advantage(a["rewards"], a["mask"], p, values=a["values"], opd_kl=opd_kl, roll=roll)


def _advantage_tolerance(a: dict, ref: dict) -> dict:
    """Floor: 1e-4 for whitened values (golden README), else 1e-6; scale: per row, Σ|r| (+ 2Σ|V| for GAE) of the
    rewards the recursion ran over, and |OPD KL|."""
    whitened = a["whiten_rewards"] or a["whiten_advantages"]
    scale = row_sum_scale(ref["token_level_rewards"], *(() if a["values"] is None else (a["values"], a["values"])))
    if a["use_opd"] or a["is_pure_opd"]:
        scale = scale + magnitude(ref["raw_advantages"] if a["is_pure_opd"] else ref["advantages"])
    return dict(atol=WHITENED_ATOL if whitened else 1e-6, scale=scale)


def _compare_advantage(res, expected: dict, a: dict, tol: dict, what: str) -> None:
    width = a["rewards"].shape[1]
    assert_close(padded(res.advantages, width), expected["advantages"], **tol, what=f"{what} advantages")
    for key in ("returns", "raw_advantages", "token_level_rewards", "values"):
        if expected.get(key) is not None:
            got = getattr(res, key)
            assert got is not None, f"{what}: {key} missing"
            assert_close(padded(got, width), expected[key], **tol, what=f"{what} {key}")


@pytest.mark.parametrize("name", ADVANTAGE_CASES)
def test_compute_advantage_golden_roll_compat(name):
    """``roll_compat_gae`` reproduces ROLL's outputs and clip metric on every case."""
    case = load(name)
    a = advantage_case(case)
    res = run_compute_advantage(a, roll_compat=True)
    expected = {k: v for k, v in case.outputs.items() if not k.startswith("metric:")}
    _compare_advantage(res, expected, a, _advantage_tolerance(a, reference_advantage(a, roll=True)), "compat")
    if "metric:critic|advantage_clip_frac" in case.outputs:
        assert_close(res.metrics["critic/advantage_clip_frac"], case.metric("critic/advantage_clip_frac"))
    else:
        assert "critic/advantage_clip_frac" not in res.metrics


@pytest.mark.parametrize("name", ADVANTAGE_CASES)
def test_compute_advantage_reference_in_roll_mode_reproduces_golden(name):
    """Validates the reference (and its encoding of BUG-4) on every case."""
    case = load(name)
    a = advantage_case(case)
    ref = reference_advantage(a, roll=True)
    expected = {k: v for k, v in case.outputs.items() if not k.startswith("metric:")}
    for key, value in expected.items():
        assert_close(ref[key], value, **_advantage_tolerance(a, ref), what=key)
    if "metric:critic|advantage_clip_frac" in case.outputs:
        assert ref["clip_frac"] == pytest.approx(case.metric("critic/advantage_clip_frac"))


@pytest.mark.parametrize("name", ADVANTAGE_CASES)
def test_compute_advantage_default_matches_corrected_reference(name):
    """Default (BUG-4 fixed): the corrected reference on every case; it equals ROLL wherever the reference's two
    modes agree (every non-GAE case; a GAE case whose values and rewards make no difference)."""
    case = load(name)
    a = advantage_case(case)
    res = run_compute_advantage(a, roll_compat=False)
    ref = reference_advantage(a, roll=False)
    tol = _advantage_tolerance(a, ref)
    _compare_advantage(res, ref, a, tol, "default")
    if ref["clip_frac"] is not None:
        assert res.metrics["critic/advantage_clip_frac"] == pytest.approx(ref["clip_frac"])
    roll_ref = reference_advantage(a, roll=True)
    for key, value in case.outputs.items():
        if not key.startswith("metric:") and np.allclose(ref[key], roll_ref[key], rtol=0, atol=1e-9):
            assert_close(padded(getattr(res, key), a["rewards"].shape[1]), value, **tol, what=f"{key} = ROLL")


def _with_final_response_mask(case):
    """The case as the RLVR pipeline calls it (§0.4): ``response_mask=final_response_mask``, every third row removed
    by the sample mask."""
    m = case.inputs["response_mask"][:, 1:].copy()
    m[::3] = 0
    return dataclasses.replace(case, name=f"{case.name}[final_response_mask]",
                               inputs={**case.inputs, "final_response_mask": m},
                               params={**case.params, "response_mask": "final_response_mask"})


@pytest.mark.parametrize("name", [n for n in ADVANTAGE_CASES
                                  if load(n).params.get("response_mask") == "default_mask"])
def test_compute_advantage_honours_response_mask_final_response_mask(name):
    """A case naming ``response_mask: final_response_mask`` computes with that mask: removed rows get advantage 0,
    whitening statistics leave them out; equal to the corrected reference under that mask."""
    case = _with_final_response_mask(load(name))
    a = advantage_case(case)
    assert np.array_equal(a["mask"], case.inputs["final_response_mask"])
    res = run_compute_advantage(a, roll_compat=False)
    ref = reference_advantage(a, roll=False)
    _compare_advantage(res, ref, a, _advantage_tolerance(a, ref), "final mask")
    assert not padded(res.advantages, a["rewards"].shape[1])[::3].any()


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


def test_estimator_registry_is_built_from_the_capability_table():
    """Every registered estimator has a row of schemas/capabilities.py and every row is registered, with the same
    capabilities (the registry adds only the token recursion)."""
    from dataclasses import fields

    from schemas.capabilities import ESTIMATOR_CAPABILITIES, EstimatorCapabilities
    from stages.algos.estimators import estimator

    assert ADVANTAGE_ESTIMATORS.names() == sorted(ESTIMATOR_CAPABILITIES)
    for name, row in ESTIMATOR_CAPABILITIES.items():
        entry = estimator(name)
        assert entry is ADVANTAGE_ESTIMATORS.get(name) and callable(entry.token_recursion)
        assert {f.name: getattr(entry, f.name) for f in fields(EstimatorCapabilities)} == vars(row)
