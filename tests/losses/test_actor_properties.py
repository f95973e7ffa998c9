"""Actor-loss properties: hand-computed cases, micro-batch equivalence with global counts (spec §6.2), segment ratio
= token ratio on one-token segments, the cache path, the dual-clip constant (Q-15), SGD decreases the loss,
the registry, and bad input."""

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from schemas.errors import ConfigError, InvariantError
from stages.losses import (LOSS_AGG_MODES, POLICY_LOSSES, FilterConfig, IsWeightConfig, LossConfig, LossInputs,
                           TrainInferCorrectionConfig, agentic_actor_loss, base_actor_loss, clipped_surrogate,
                           compute_train_infer_correction, loss_normalisers, op_compute_entropy, op_compute_log_probs,
                           rlvr_actor_loss, sample_weights)
from tests.golden import assert_close, load
from tests.losses.golden_adapter import loss_cases

LOSS_FN = {"agentic": agentic_actor_loss, "rlvr": rlvr_actor_loss, "base": base_actor_loss}
MATERIAL_INPUTS = ("logits", "input_ids", "response_mask", "old_log_probs", "ref_log_probs", "infer_logprobs",
                   "advantages")


def material(min_rows: int = 6):
    """Realistic data for the property tests: the first golden agentic loss case that carries logits, ids and
    old/ref/infer log-probs and advantages (the properties hold for any such data, whatever the case's params)."""
    for name in loss_cases("agentic"):
        c = load(name)
        if all(k in c.inputs for k in MATERIAL_INPUTS) and c.inputs["input_ids"].shape[0] >= min_rows:
            return c
    pytest.skip("no golden agentic loss case with logits, ids, old/ref/infer log-probs and advantages")


def halves(c, first: float = 5 / 12) -> tuple[list[slice], list[slice]]:
    """([all rows], [two micro-batches]) of a case's rows."""
    rows = c.inputs["input_ids"].shape[0]
    cut = max(1, min(rows - 1, round(rows * first)))
    return [slice(0, rows)], [slice(0, cut), slice(cut, rows)]


# ---- hand-computed ------------------------------------------------------------------------------------------------

def test_hand_computed_token_mean_loss_and_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    inputs = LossInputs(log_probs=lp, mask=torch.tensor([[1, 1]]), advantages=torch.tensor([[1.0, -1.0]]),
                        old_log_probs=torch.log(torch.tensor([[0.4, 0.25]])))
    total, metrics = agentic_actor_loss(inputs, LossConfig(loss_agg_mode="token-mean"))
    # ratio (1.25, 1): surr (1.25, -1), clipped (1.2, -1) → L = (-1.2, 1), mean -0.1
    assert_close(total.detach(), -0.1)
    total.backward()
    assert_close(lp.grad, [[0.0, 0.5]], atol=1e-6)       # clipped token has no gradient; −A·ρ/N on the other
    assert metrics["actor/ppo_ratio_high_clipfrac@sum"] == pytest.approx(0.5)
    assert metrics["actor/clipfrac@sum"] == pytest.approx(0.5)
    assert metrics["actor/ratio_max@max"] == pytest.approx(1.25)
    assert metrics["actor/ratio_min@min"] == pytest.approx(1.0)


def test_asymmetric_clip_and_dual_clip_constant():
    ratio, adv = torch.tensor([1.3, 5.0, 5.0]), torch.tensor([1.0, -1.0, 1.0])
    loss, _, _ = clipped_surrogate(ratio, adv, 0.2, 0.28, None)
    assert_close(loss, [-1.28, 5.0, -1.28])
    assert_close(clipped_surrogate(ratio, adv, 0.2, 0.28, 1.4)[0], [-1.28, 1.4, -1.28])
    assert LossConfig(pg_clip=0.2).dual_clip_constant == pytest.approx(1.4)          # ROLL's 1 + 2·pg_clip
    assert LossConfig(dual_clip_c=3.0).dual_clip_constant == 3.0                     # configurable
    lp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    inputs = LossInputs(log_probs=lp, mask=torch.ones(1, 1), advantages=torch.tensor([[-1.0]]),
                        old_log_probs=torch.log(torch.tensor([[0.1]])))
    for c, expected in [(None, 1.4), (3.0, 3.0), (10.0, 5.0)]:
        total, _ = agentic_actor_loss(inputs, LossConfig(dual_clip_loss=True, dual_clip_c=c))
        assert_close(total.detach(), expected, atol=1e-5)


def test_kl_entropy_and_rl_loss_coef():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(2, 3, generator=g)).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp_m = lp * mask
    ref = -torch.rand(2, 3, generator=g) * mask
    adv = torch.randn(2, 3, generator=g) * mask
    entropy = torch.rand(2, 3, generator=g) * mask
    inputs = LossInputs(log_probs=lp_m, mask=mask, advantages=adv, old_log_probs=lp_m.detach(), ref_log_probs=ref,
                        entropy=entropy)
    base_cfg = dict(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.3, entropy_loss_coef=0.05)
    _, m0 = agentic_actor_loss(inputs, LossConfig(**base_cfg))
    k = (ref - lp_m).detach()
    k3 = ((k.exp() - k - 1) * mask).sum() / 3
    assert_close(m0["actor/kl_loss@sum"], float(k3), atol=1e-6)
    assert_close(m0["actor/pg_loss@sum"], float(-(adv * mask).sum() / 3), atol=1e-6)        # ratio 1
    expected = m0["actor/pg_loss@sum"] + 0.3 * m0["actor/kl_loss@sum"] - 0.05 * float(entropy.sum() / 3)
    assert_close(m0["actor/total_loss@sum"], expected, atol=1e-6)
    _, m1 = agentic_actor_loss(inputs, LossConfig(**dict(base_cfg, kl_loss_type="kl")))
    assert_close(m1["actor/kl_loss@sum"], float(((lp_m - ref) * mask).detach().sum() / 3), atol=1e-6)
    _, r = rlvr_actor_loss(inputs, LossConfig(**dict(base_cfg, rl_loss_coef=0.5)))
    expected = 0.5 * (r["actor/weighted_pg_loss@sum"] + 0.3 * r["actor/kl_loss@sum"]) - 0.05 * float(entropy.sum() / 3)
    assert_close(r["actor/total_loss@sum"], expected, atol=1e-6)


def test_cache_path_without_old_log_probs_has_ratio_one():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    lp = ((-torch.rand(2, 3, generator=g)) * mask).requires_grad_()
    adv = torch.randn(2, 3, generator=g) * mask
    total, metrics = agentic_actor_loss(LossInputs(log_probs=lp, mask=mask, advantages=adv),
                                        LossConfig(loss_agg_mode="token-mean"))
    total.backward()
    assert metrics["actor/ratio_mean@sum"] == pytest.approx(1.0)
    assert metrics["actor/approxkl@sum"] == 0.0 and metrics["actor/clipfrac@sum"] == 0.0
    assert_close(lp.grad, -adv / 4, atol=1e-7)                         # d(−ρA)/dlp = −A at ρ = 1


def test_segment_ratio_equals_token_ratio_when_every_segment_has_one_token():
    c = material()
    response_mask = torch.tensor(c.inputs["response_mask"])
    one_token_runs = response_mask.clone()
    one_token_runs[:, 1::2] = 0                                          # no two adjacent response tokens
    assert one_token_runs.sum() > 0
    results = []
    for ratio_type in ("token", "segment"):
        logits = torch.tensor(c.inputs["logits"], requires_grad=True)
        lp = op_compute_log_probs(logits, torch.tensor(c.inputs["input_ids"]), one_token_runs)
        m = one_token_runs[:, 1:]
        inputs = LossInputs(log_probs=lp, mask=m, advantages=torch.tensor(c.inputs["advantages"]) * m,
                            old_log_probs=torch.tensor(c.inputs["old_log_probs"]) * m)
        total, metrics = agentic_actor_loss(inputs, LossConfig(ratio_type=ratio_type, dual_clip_loss=True))
        total.backward()
        results.append((float(total.detach()), metrics, logits.grad.numpy()))
    assert_close(results[0][0], results[1][0], atol=1e-6)
    assert_close(results[0][2], results[1][2], atol=1e-6)
    for key in results[0][1]:
        assert_close(results[0][1][key], results[1][1][key], atol=1e-6, what=key)


def test_segment_ratio_differs_from_token_ratio_on_multi_token_turns():
    lp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    inputs = LossInputs(log_probs=lp, mask=torch.ones(1, 2), advantages=torch.ones(1, 2),
                        old_log_probs=torch.log(torch.tensor([[0.25, 0.2]])))
    _, token = agentic_actor_loss(inputs, LossConfig())
    _, segment = agentic_actor_loss(inputs, LossConfig(ratio_type="segment"))
    assert token["actor/ratio_max@max"] == pytest.approx(2.0)
    assert segment["actor/ratio_max@max"] == pytest.approx(math.sqrt(2.0))       # exp(mean log-ratio) per turn


# ---- micro-batch equivalence (spec §6.2) --------------------------------------------------------------------------

def _inputs(c, logits, rows, cols, counts, kind):
    """LossInputs for rows × first ``cols`` positions of a golden case, sharing one logits leaf."""
    i = c.inputs
    rm = torch.tensor(i["response_mask"])[rows, :cols]
    nt = {k: torch.tensor(i[k])[rows, :cols - 1] for k in ("old_log_probs", "ref_log_probs", "infer_logprobs",
                                                           "advantages")}
    lg = logits[rows, :cols]
    final = _final_mask(c)[rows, :cols - 1] if kind == "rlvr" else None
    return LossInputs(log_probs=op_compute_log_probs(lg, torch.tensor(i["input_ids"])[rows, :cols], rm),
                      mask=rm[:, 1:], advantages=nt["advantages"], old_log_probs=nt["old_log_probs"],
                      ref_log_probs=nt["ref_log_probs"], infer_log_probs=nt["infer_logprobs"],
                      entropy=op_compute_entropy(lg, rm), final_mask=final, **counts)


def _final_mask(c):
    """A sample-level mask removing every third row of the mini-batch (RLVR's final_response_mask)."""
    final = torch.tensor(c.inputs["response_mask"])[:, 1:].clone()
    final[::3] = 0
    return final


def _global_counts(c, kind, cfg):
    rm = torch.tensor(c.inputs["response_mask"])
    m = rm[:, 1:]
    _, keep, _ = compute_train_infer_correction(cfg.train_infer_correction, m, torch.tensor(c.inputs["old_log_probs"]),
                                                torch.tensor(c.inputs["infer_logprobs"]))
    n_tok, n_seq = loss_normalisers(m * keep)                              # counted after the filter
    counts = dict(num_tokens=n_tok, num_seqs=n_seq)
    if kind == "rlvr":
        counts.update(zip(("final_num_tokens", "final_num_seqs"), loss_normalisers(_final_mask(c) * keep)))
    return counts


def _loss_and_grad(c, kind, cfg, parts, trim):
    logits = torch.tensor(c.inputs["logits"], requires_grad=True)
    counts = _global_counts(c, kind, cfg)
    rm = c.inputs["response_mask"]
    total = 0.0
    for rows in parts:
        cols = int(np.nonzero(rm[rows].any(0))[0].max()) + 1 if trim else rm.shape[1]
        loss, _ = LOSS_FN[kind](_inputs(c, logits, rows, cols, counts, kind), cfg)
        loss.backward()
        total += float(loss.detach())
    return total, logits.grad.numpy()


MICRO_CFGS = [("agentic", dict(ratio_type="token")), ("agentic", dict(ratio_type="segment", dual_clip_loss=True)),
              ("rlvr", dict(importance_sampling="token")), ("rlvr", dict(importance_sampling="seq")),
              ("base", dict())]


@pytest.mark.parametrize("kind, opts", MICRO_CFGS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_mini_batch(kind, opts, mode):
    c = material()
    cfg = LossConfig(loss_agg_mode=mode, sum_norm_constant=50.0, use_kl_loss=True, kl_loss_coef=0.1,
                     entropy_loss_coef=0.01, **opts)
    all_rows, split = halves(c)
    whole, whole_grad = _loss_and_grad(c, kind, cfg, all_rows, trim=False)
    parts, parts_grad = _loss_and_grad(c, kind, cfg, split, trim=True)
    assert_close(parts, whole, atol=1e-5)
    assert_close(parts_grad, whole_grad, atol=1e-6)


def test_micro_batches_with_in_loss_filter_and_is_weight():
    c = material()
    correction = TrainInferCorrectionConfig(
        is_weight=IsWeightConfig(enabled=True, weight_type="segment", upper_bound=1.5),
        filters=(FilterConfig(enabled=True, agg_type="token", ratio_enabled=True, ratio_low=0.85, ratio_high=1.15),))
    for mode in ("token-mean", "seq-mean-token-mean"):
        cfg = LossConfig(loss_agg_mode=mode, train_infer_correction=correction)
        all_rows, split = halves(c, 7 / 12)
        whole, whole_grad = _loss_and_grad(c, "agentic", cfg, all_rows, trim=False)
        parts, parts_grad = _loss_and_grad(c, "agentic", cfg, split, trim=True)
        assert_close(parts, whole, atol=1e-5)
        assert_close(parts_grad, whole_grad, atol=1e-6)


def test_sum_norm_without_constant_depends_on_micro_batch_padding():
    c = material()
    cfg = LossConfig(loss_agg_mode="seq-mean-token-sum-norm")                    # ROLL: divide by padded T
    all_rows, split = halves(c)
    whole, _ = _loss_and_grad(c, "agentic", cfg, all_rows, trim=False)
    parts, _ = _loss_and_grad(c, "agentic", cfg, split, trim=True)
    assert abs(parts - whole) > 1e-4


def test_missing_counts_default_to_the_filtered_mask():
    mask = torch.tensor([[1, 1, 1, 0]])
    lp = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    inputs = LossInputs(log_probs=lp, mask=mask, advantages=torch.tensor([[1.0, 2.0, 4.0, 0.0]]), old_log_probs=lp,
                        infer_log_probs=torch.tensor([[-1.0, -3.0, -1.0, 0.0]]))
    drop_second = TrainInferCorrectionConfig(filters=(FilterConfig(enabled=True, agg_type="token", ratio_enabled=True,
                                                                   ratio_low=0.9, ratio_high=1.1),))
    total, _ = agentic_actor_loss(inputs, LossConfig(loss_agg_mode="token-mean", train_infer_correction=drop_second))
    assert_close(total, -(1.0 + 4.0) / 2)                                        # fixed: 2 kept tokens
    total, _ = agentic_actor_loss(inputs, LossConfig(loss_agg_mode="token-mean", train_infer_correction=drop_second,
                                                     roll_compat=True))
    assert_close(total, -(1.0 + 2.0 + 4.0) / 3)                                  # ROLL [BUG-7]


# ---- optimisation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, opts", [("agentic", {}), ("agentic", dict(ratio_type="segment")),
                                        ("rlvr", dict(importance_sampling="seq")), ("base", {})])
def test_sgd_on_toy_logits_decreases_the_loss(name, opts):
    g = torch.Generator().manual_seed(7)
    B, S, V = 4, 8, 6
    logits = torch.randn(B, S, V, generator=g).requires_grad_()
    ids = torch.randint(0, V, (B, S), generator=g)
    response_mask = torch.zeros(B, S, dtype=torch.long)
    response_mask[:, 3:] = 1
    response_mask[1, 6:] = 0
    m = response_mask[:, 1:]
    adv = torch.randn(B, 1, generator=g).expand(B, S - 1) * m
    old = op_compute_log_probs(logits, ids, response_mask).detach()
    cfg = LossConfig(**opts)
    optimiser = torch.optim.SGD([logits], lr=1.0)
    losses = []
    for _ in range(6):
        optimiser.zero_grad()
        inputs = LossInputs(log_probs=op_compute_log_probs(logits, ids, response_mask), mask=m, advantages=adv,
                            old_log_probs=old)
        loss, _ = POLICY_LOSSES.get(name)(inputs, cfg)
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05
    assert all(b <= a + 1e-6 for a, b in zip(losses, losses[1:]))


# ---- RLVR sample weights ---------------------------------------------------------------------------------------------

def test_sample_weights_difficulty_and_length():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    difficulty = np.array([0.0, 0.5, 2.0], dtype=object)                         # DataProto's object dtype
    w = sample_weights(mask, LossConfig(difficulty_loss_weight=True), difficulty)
    raw = np.array([0.5, 1.25, 2.0])
    assert_close(w, raw * 3 / raw.sum())
    w = sample_weights(mask, LossConfig(length_loss_weight=True))
    raw = np.array([0.5, 1.5 - 1 / 3, 1.5])
    assert_close(w, raw * 3 / raw.sum())
    assert_close(sample_weights(mask, LossConfig(difficulty_loss_weight=True, roll_compat=True), difficulty),
                 [1.0, 1.0, 1.0])                                                # ROLL never applies it [BUG-8]


def test_sample_weights_fail_loudly():
    mask = torch.ones(2, 3)
    with pytest.raises(InvariantError, match="difficulty"):
        sample_weights(mask, LossConfig(difficulty_loss_weight=True), None)
    with pytest.raises(InvariantError, match="difficulty"):
        sample_weights(mask, LossConfig(difficulty_loss_weight=True), np.array(["hard", "easy"], dtype=object))
    with pytest.raises(InvariantError, match="2 finite numbers"):
        sample_weights(mask, LossConfig(difficulty_loss_weight=True), [0.5])


# ---- registry and bad input ----------------------------------------------------------------------------------------

def test_registry():
    assert POLICY_LOSSES.names() == ["agentic", "base", "rlvr"]
    assert POLICY_LOSSES.get("agentic").fn is agentic_actor_loss
    assert POLICY_LOSSES.get("rlvr").uses_final_mask and not POLICY_LOSSES.get("agentic").uses_final_mask
    for name in POLICY_LOSSES:                        # every level an entry offers is a valid value of its field
        entry = POLICY_LOSSES.get(name)
        for level in entry.levels:
            LossConfig(**({entry.level_field: level} if entry.level_field else {}))
    with pytest.raises(KeyError, match="agentic, base, rlvr"):
        POLICY_LOSSES.get("ppo")
    with pytest.raises(ValueError, match="twice"):
        POLICY_LOSSES.register("agentic")(POLICY_LOSSES.get("agentic"))


def test_same_signature_for_every_entry():
    inputs = LossInputs(log_probs=torch.zeros(1, 2), mask=torch.ones(1, 2), advantages=torch.ones(1, 2),
                        old_log_probs=torch.zeros(1, 2))
    for name in POLICY_LOSSES:
        total, metrics = POLICY_LOSSES.get(name)(inputs, LossConfig())
        assert total.shape == () and all(isinstance(v, float) for v in metrics.values())


def test_bad_input():
    lp = torch.zeros(1, 2)
    with pytest.raises(InvariantError, match="'advantages'"):
        LossInputs(log_probs=lp, mask=torch.ones(1, 2), advantages=torch.ones(1, 3))
    with pytest.raises(InvariantError, match="entropy"):
        agentic_actor_loss(LossInputs(log_probs=lp, mask=torch.ones(1, 2), advantages=torch.ones(1, 2)),
                           LossConfig(entropy_loss_coef=0.1))
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        LossConfig.from_dict({"loss_agg_mode": "mean"})
    with pytest.raises(ConfigError, match="ratio_type"):
        LossConfig.from_dict({"ratio_type": "sequence"})
    with pytest.raises(ConfigError, match="dual_clip_c"):
        LossConfig.from_dict({"dual_clip_c": 0.5})
    with pytest.raises(ValidationError, match="dual_clip_c"):                   # built in code: pydantic's error
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ConfigError, match="unknown options"):
        LossConfig.from_dict({"pg_clip_hi": 0.3})
    cfg = LossConfig.from_dict({"pg_clip": 0.1, "train_infer_correction": {"is_weight": {"enabled": True}}})
    assert cfg.train_infer_correction.is_weight.enabled and cfg.clip_range == (0.1, 0.1)
    assert cfg.model_copy(update={"use_pg_clip_range": True, "pg_clip_high": 0.3}).clip_range == (0.2, 0.3)


def test_loss_registry_is_built_from_the_capability_table():
    """Every registered loss has a row of schemas/capabilities.py and every row is registered, with the same
    capabilities (the registry adds only the function)."""
    from dataclasses import fields

    from schemas.capabilities import POLICY_LOSS_CAPABILITIES, PolicyLossCapabilities
    from stages.losses import policy_loss

    assert POLICY_LOSSES.names() == sorted(POLICY_LOSS_CAPABILITIES)
    for name, row in POLICY_LOSS_CAPABILITIES.items():
        entry = policy_loss(name)
        assert entry is POLICY_LOSSES.get(name) and callable(entry.fn)
        assert {f.name: getattr(entry, f.name) for f in fields(PolicyLossCapabilities)} == vars(row)
