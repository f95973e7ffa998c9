"""§6.6 train/inference correction: every golden case (ROLL compat exact; BUG-9 fixed against an independent
reference), the batch-level application, weight types, upper bound, detach, filters, config errors."""

import numpy as np
import pytest
import torch

from schemas.errors import ConfigError
from stages.losses import (FilterConfig, IsWeightConfig, TrainInferCorrectionConfig,
                           apply_train_infer_correction_to_batch, compute_train_infer_correction)
from tests.golden import assert_close, case_names, load
from tests.losses.golden_adapter import golden_metrics
from tests.losses.reference import correction

CASES = case_names("train_infer_correction__")
PASS_RATE = "_mask_mean@sum"          # the BUG-9 metrics (filter pass rates)


def _run(name, roll_compat):
    c = load(name)
    cfg = TrainInferCorrectionConfig.from_dict(c.params["cfg"])
    out = compute_train_infer_correction(
        cfg, torch.tensor(c.inputs["response_mask"]), torch.tensor(c.inputs["old_log_probs"]),
        torch.tensor(c.inputs["infer_log_probs"]), c.params.get("global_valid_samples"),
        c.params.get("global_valid_tokens"), roll_compat=roll_compat)
    return c, out


def test_all_golden_cases_covered():
    assert len(CASES) == 6


@pytest.mark.parametrize("name", CASES)
def test_roll_compat_reproduces_golden(name):
    c, (is_weight, keep, metrics) = _run(name, roll_compat=True)
    assert_close(is_weight, c.outputs["is_weight"])
    np.testing.assert_array_equal(keep.numpy(), c.outputs["filter_mask"])
    expected = golden_metrics(c)
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert_close(metrics[key], value, what=key)


@pytest.mark.parametrize("name", CASES)
def test_default_fixes_bug9_and_matches_independent_reference(name):
    c, (is_weight, keep, metrics) = _run(name, roll_compat=False)
    assert_close(is_weight, c.outputs["is_weight"])
    np.testing.assert_array_equal(keep.numpy(), c.outputs["filter_mask"])
    mask = c.inputs["response_mask"].astype(int).tolist()
    n_seq = c.params.get("global_valid_samples") or max(sum(any(r) for r in mask), 1)
    n_tok = c.params.get("global_valid_tokens") or max(sum(map(sum, mask)), 1)
    _, _, ref = correction(c.params["cfg"], mask, torch.tensor(c.inputs["old_log_probs"]),
                           torch.tensor(c.inputs["infer_log_probs"]), n_seq, n_tok)
    assert set(metrics) == set(ref)
    for key, value in ref.items():
        assert_close(metrics[key], value, what=key)
    for key, value in golden_metrics(c).items():
        if key.endswith(PASS_RATE):
            assert metrics[key] <= 1.0 < value        # ROLL's rate counts padding and exceeds 1
        elif key == "actor/is_weight_clipfrac@sum" and c.params["cfg"]["is_weight"]["weight_type"] != "token":
            assert metrics[key] < value               # a row weight broadcast over padding counted by ROLL
        else:
            assert_close(metrics[key], value, what=key)


def _apply_case():
    """The golden inputs were captured after ROLL filtered ``response_mask`` in place (in == out); the original
    response mask is where the behaviour log-probs are non-zero (they are 0 off the mask)."""
    c = load("apply_train_infer_correction_to_batch")
    np.testing.assert_array_equal(c.inputs["response_mask"], c.outputs["response_mask"])
    batch = {k: torch.tensor(v) for k, v in c.inputs.items()}
    original = (batch["old_log_probs"] != 0).long()
    batch["response_mask"] = torch.cat([torch.zeros_like(original[:, :1]), original], 1)
    # the case's config "filter_segment_ratio_diff_disabled_extra", pinned by its outputs
    cfg = TrainInferCorrectionConfig(IsWeightConfig(True, "token", 1.1), (
        FilterConfig(True, "segment", True, 0.9, 1.1, True, -0.2, 0.2), FilterConfig(False, "token")))
    return c, batch, cfg


def test_apply_to_batch_golden():
    c, batch, cfg = _apply_case()
    out, metrics = apply_train_infer_correction_to_batch(cfg, batch, update_mask_keys=["response_mask",
                                                                                       "final_response_mask"],
                                                         roll_compat=True)
    np.testing.assert_array_equal(out["response_mask"].numpy(), c.outputs["response_mask"])
    np.testing.assert_array_equal(out["final_response_mask"].numpy(), c.outputs["final_response_mask"])
    assert_close(out["train_infer_is_weight"], c.outputs["train_infer_is_weight"])
    for key, value in golden_metrics(c).items():
        assert_close(metrics[key], value, what=key)
    assert batch["response_mask"][:, 1:].sum() > out["response_mask"][:, 1:].sum()    # input left untouched
    assert torch.equal(out["response_mask"][:, 0], batch["response_mask"][:, 0])


def test_apply_to_batch_default_fixes_bug9():
    c, batch, cfg = _apply_case()
    _, metrics = apply_train_infer_correction_to_batch(cfg, batch)
    mask = batch["response_mask"][:, 1:].tolist()
    n_tok = float(sum(map(sum, mask)))
    n_seq = float(sum(any(r) for r in mask))
    _, _, ref = correction({"is_weight": {"enabled": True, "weight_type": "token", "upper_bound": 1.1},
                            "filters": [{"enabled": True, "agg_type": "segment", "ratio_low": 0.9, "ratio_high": 1.1,
                                         "diff_enabled": True}, {"enabled": False}]},
                           mask, batch["old_log_probs"], batch["infer_logprobs"], n_seq, n_tok)
    assert set(metrics) == set(ref)
    for key, value in ref.items():
        assert_close(metrics[key], value, what=key)
    for key in ("actor/train_infer_segment_ratio_mask_mean@sum", "actor/train_infer_segment_diff_mask_mean@sum"):
        assert metrics[key] <= 1.0 < float(c.outputs["metric:" + key.replace("/", "|")])


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
        cfg = TrainInferCorrectionConfig(IsWeightConfig(True, weight_type, None, detach=False))
        isw, keep, _ = compute_train_infer_correction(cfg, mask, old, infer)
        assert_close(isw.detach(), expected, atol=1e-6, what=weight_type)
        assert isw.requires_grad and torch.all(keep == 1)
    isw, _, metrics = compute_train_infer_correction(TrainInferCorrectionConfig(IsWeightConfig(True, "token", 1.2)),
                                                     mask, old, infer)
    assert not isw.requires_grad and float(isw.max()) == pytest.approx(1.2)
    assert metrics["actor/is_weight_clipfrac@sum"] == pytest.approx(1 / 6)     # one of 6 tokens above 1.2
    cfg = TrainInferCorrectionConfig(filters=(FilterConfig(True, "token", True, 0.95, 1.05),))
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
        TrainInferCorrectionConfig(IsWeightConfig(True, "tokens"))
    with pytest.raises(ConfigError, match=r"filters\[0\].agg_type"):
        TrainInferCorrectionConfig.from_dict({"filters": [{"agg_type": "row"}]})
    with pytest.raises(ConfigError, match="unknown keys"):
        TrainInferCorrectionConfig.from_dict({"is_weights": {}})
