"""§6.6 train/inference correction: every golden case (ROLL compat exact; BUG-9 fixed against an independent
reference), the batch-level application, weight types, upper bound, detach, filters, config errors."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from schemas.errors import ConfigError
from stages.losses import (FilterConfig, IsWeightConfig, TrainInferCorrectionConfig,
                           apply_train_infer_correction_to_batch, compute_train_infer_correction)
from tests.golden import assert_close, family, load
from tests.losses.golden_adapter import golden_metrics
from tests.losses.reference import correction

CASES = family("roll.utils.train_infer_corrections.compute_train_infer_correction")
APPLY_CASES = family("roll.utils.train_infer_corrections.apply_train_infer_correction_to_batch")
# Configs that apply_train_infer_correction_to_batch cases name instead of spelling out (manifest "cfg": "<name>"),
# each pinned by its case's outputs. A case naming another config fails until it is added here.
NAMED_CFGS = {
    "filter_segment_ratio_diff_disabled_extra": {
        "is_weight": {"enabled": True, "weight_type": "token", "upper_bound": 1.1},
        "filters": [{"enabled": True, "agg_type": "segment", "ratio_enabled": True, "ratio_low": 0.9,
                     "ratio_high": 1.1, "diff_enabled": True, "diff_low": -0.2, "diff_high": 0.2},
                    {"enabled": False, "agg_type": "token"}]},
}


def _counts(c) -> tuple[float | None, float | None]:
    """The params' ``counts``: "given" → global_valid_samples / global_valid_tokens from params; "inferred" → None
    (counted on the mask, spec §6.6)."""
    p = c.params
    counts = p.get("counts", "given" if "global_valid_samples" in p or "global_valid_tokens" in p else "inferred")
    assert counts in ("given", "inferred"), f"{c.name}: counts = {counts!r}"
    if counts == "inferred":
        assert "global_valid_samples" not in p and "global_valid_tokens" not in p, c.name
        return None, None
    return p.get("global_valid_samples"), p.get("global_valid_tokens")


def _run(name, roll_compat):
    c = load(name)
    c.check_params(("cfg", "counts", "global_valid_samples", "global_valid_tokens"))
    cfg = TrainInferCorrectionConfig.from_dict(c.params["cfg"])
    n_seq, n_tok = _counts(c)
    out = compute_train_infer_correction(
        cfg, torch.tensor(c.inputs["response_mask"]), torch.tensor(c.inputs["old_log_probs"]),
        torch.tensor(c.inputs["infer_log_probs"]), n_seq, n_tok, roll_compat=roll_compat)
    return c, out


def _reference(c, roll: bool, mask=None, old=None, infer=None, cfg=None):
    """tests/losses/reference.py's §6.6 (corrected, or ROLL's with ``roll``) with the case's counts."""
    mask = (c.inputs["response_mask"] if mask is None else mask).astype(int).tolist()
    n_seq, n_tok = _counts(c) if cfg is None else (None, None)
    n_seq = n_seq or max(sum(any(r) for r in mask), 1)
    n_tok = n_tok or max(sum(map(sum, mask)), 1)
    return correction(c.params["cfg"] if cfg is None else cfg, mask,
                      torch.tensor(c.inputs["old_log_probs"] if old is None else old, dtype=torch.float64),
                      torch.tensor(c.inputs["infer_log_probs"] if infer is None else infer, dtype=torch.float64),
                      n_seq, n_tok, roll=roll)


def _assert_metrics(metrics, expected):
    assert set(metrics) == set(expected), sorted(set(metrics) ^ set(expected))
    for key, value in expected.items():
        assert_close(metrics[key], value, what=key)


@pytest.mark.parametrize("name", CASES)
def test_roll_compat_reproduces_golden(name):
    c, (is_weight, keep, metrics) = _run(name, roll_compat=True)
    assert_close(is_weight, c.outputs["is_weight"])
    np.testing.assert_array_equal(keep.numpy(), c.outputs["filter_mask"])
    _assert_metrics(metrics, golden_metrics(c))
    _assert_metrics(_reference(c, roll=True)[2], golden_metrics(c))     # the reference's ROLL mode, validated


@pytest.mark.parametrize("name", CASES)
def test_default_fixes_bug9_and_matches_independent_reference(name):
    """Default: the rates count masked positions only (= corrected reference); weight and filter are ROLL's; every
    metric on which the reference's two modes agree (no padding counted) equals ROLL's."""
    c, (is_weight, keep, metrics) = _run(name, roll_compat=False)
    assert_close(is_weight, c.outputs["is_weight"])
    np.testing.assert_array_equal(keep.numpy(), c.outputs["filter_mask"])
    ref, roll_ref = _reference(c, roll=False)[2], _reference(c, roll=True)[2]
    _assert_metrics(metrics, ref)
    for key, value in golden_metrics(c).items():
        if abs(ref[key] - roll_ref[key]) <= 1e-9:
            assert_close(metrics[key], value, what=key)
        if key.endswith("_mask_mean@sum") or "clipfrac" in key:
            assert metrics[key] <= 1.0


def _apply_case(name):
    """(case, batch, cfg, update_mask_keys) of an apply_train_infer_correction_to_batch case. Where the inputs were
    captured after ROLL filtered ``response_mask`` in place (in == out), the original response mask is recovered
    from where the behaviour log-probs are non-zero (they are 0 off the mask)."""
    c = load(name)
    p = c.check_params(("cfg", "update_mask_keys", "stat_mask_key"))
    batch = {k: torch.tensor(v) for k, v in c.inputs.items()}
    if np.array_equal(c.inputs["response_mask"], c.outputs["response_mask"]):
        original = (batch["old_log_probs"] != 0).long()
        batch["response_mask"] = torch.cat([batch["response_mask"][:, :1], original], 1)
    cfg_dict = p["cfg"]
    if isinstance(cfg_dict, str):
        assert cfg_dict in NAMED_CFGS, f"{name}: config named {cfg_dict!r} is not in NAMED_CFGS"
        cfg_dict = NAMED_CFGS[cfg_dict]
    return c, batch, cfg_dict, p.get("update_mask_keys"), p.get("stat_mask_key", "response_mask")


@pytest.mark.parametrize("name", APPLY_CASES)
def test_apply_to_batch_golden(name):
    c, batch, cfg_dict, keys, stat_key = _apply_case(name)
    out, metrics = apply_train_infer_correction_to_batch(TrainInferCorrectionConfig.from_dict(cfg_dict), batch,
                                                         stat_key, keys, roll_compat=True)
    for key in keys or (stat_key,):
        np.testing.assert_array_equal(out[key].numpy(), c.outputs[key], err_msg=key)
    assert_close(out["train_infer_is_weight"], c.outputs["train_infer_is_weight"])
    _assert_metrics(metrics, golden_metrics(c))
    assert torch.equal(out[stat_key][:, 0], batch[stat_key][:, 0])
    assert batch[stat_key][:, 1:].sum() >= out[stat_key][:, 1:].sum()              # input left untouched


@pytest.mark.parametrize("name", APPLY_CASES)
def test_apply_to_batch_default_fixes_bug9(name):
    c, batch, cfg_dict, keys, stat_key = _apply_case(name)
    _, metrics = apply_train_infer_correction_to_batch(TrainInferCorrectionConfig.from_dict(cfg_dict), batch,
                                                       stat_key, keys)
    mask = batch[stat_key][:, 1:].numpy()
    _, _, ref = _reference(c, False, mask, batch["old_log_probs"].numpy(), batch["infer_logprobs"].numpy(), cfg_dict)
    _assert_metrics(metrics, ref)
    for key, value in metrics.items():
        if key.endswith("_mask_mean@sum"):
            assert value <= 1.0


def test_apply_to_batch_without_infer_logprobs_is_identity():
    batch = {"response_mask": torch.tensor([[0, 1, 1]]), "old_log_probs": torch.tensor([[-1.0, -2.0]])}
    cfg = TrainInferCorrectionConfig(filters=(FilterConfig(enabled=True),))
    out, metrics = apply_train_infer_correction_to_batch(cfg, batch)
    assert metrics == {} and torch.equal(out["response_mask"], batch["response_mask"])
    assert out["train_infer_is_weight"].tolist() == [[1.0, 1.0]]


def test_hand_case_weights_filters_and_detach():
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    old = torch.tensor([[-1.0, -1.0, 0.0, -1.0], [-1.0, -1.0, -1.0, 0.0]], requires_grad=True)
    infer = torch.tensor([[-1.5, -1.0, 0.0, -0.9], [-1.0, -1.1, -1.0, 0.0]])
    gap = (old - infer).detach()
    for weight_type, expected in [
        ("token", gap.exp()),
        ("geometric", torch.tensor([[0.4 / 3] * 4, [0.1 / 3] * 4]).exp()),
        ("sequence", torch.tensor([[0.4] * 4, [0.1] * 4]).exp()),
        ("segment", torch.tensor([[0.25, 0.25, 0.0, -0.1], [0.1 / 3] * 3 + [0.0]]).exp()),
    ]:
        cfg = TrainInferCorrectionConfig(is_weight=IsWeightConfig(enabled=True, weight_type=weight_type, upper_bound=None,
                                                                  detach=False))
        isw, keep, _ = compute_train_infer_correction(cfg, mask, old, infer)
        assert_close(isw.detach(), expected, atol=1e-6, what=weight_type)
        assert isw.requires_grad and torch.all(keep == 1)
    clamped = TrainInferCorrectionConfig(is_weight=IsWeightConfig(enabled=True, weight_type="token", upper_bound=1.2))
    isw, _, metrics = compute_train_infer_correction(clamped, mask, old, infer)
    assert not isw.requires_grad and float(isw.max()) == pytest.approx(1.2)
    assert metrics["actor/is_weight_clipfrac@sum"] == pytest.approx(1 / 6)     # one of 6 tokens above 1.2
    cfg = TrainInferCorrectionConfig(filters=(FilterConfig(enabled=True, agg_type="token", ratio_enabled=True,
                                                           ratio_low=0.95, ratio_high=1.05),))
    _, keep, metrics = compute_train_infer_correction(cfg, mask, old, infer)
    assert keep.tolist() == [[0, 1, 1, 0], [1, 0, 1, 1]]
    assert metrics["actor/train_infer_token_ratio_mask_mean@sum"] == pytest.approx(3 / 6)
    assert metrics["actor/train_infer_final_mask_mean"] == pytest.approx(3 / 6)


def test_disabled_correction_is_ones():
    mask = torch.tensor([[1, 0]])
    isw, keep, metrics = compute_train_infer_correction(TrainInferCorrectionConfig(), mask, torch.tensor([[-1.0, 0]]),
                                                        torch.tensor([[-3.0, 0]]))
    assert isw.tolist() == [[1.0, 1.0]] and keep.tolist() == [[1.0, 1.0]]
    assert "actor/train_infer_final_mask_mean" not in metrics and len(metrics) == 8


def test_config_errors():
    with pytest.raises(ConfigError, match="weight_type"):
        TrainInferCorrectionConfig.from_dict({"is_weight": {"enabled": True, "weight_type": "tokens"}})
    with pytest.raises(ValidationError, match="weight_type"):                   # built in code: pydantic's error
        IsWeightConfig(enabled=True, weight_type="tokens")
    with pytest.raises(ConfigError, match=r"filters\[0\].agg_type"):
        TrainInferCorrectionConfig.from_dict({"filters": [{"agg_type": "row"}]})
    with pytest.raises(ConfigError, match="unknown keys"):
        TrainInferCorrectionConfig.from_dict({"is_weights": {}})
