"""Train/inference mismatch correction (spec §6.6): an importance weight and token filters from the gap between
the train-side behaviour log-probs (``old``) and the inference engine's (``infer``).

Neither output depends on the current policy, so the correction can run once per mini-batch before the loss
(``apply_train_infer_correction_to_batch``; then count the loss normalisers on the filtered mask) or inside the loss.
"""

from __future__ import annotations

from typing import Mapping

import torch

from schemas.loss_config import AGG_TYPES, FilterConfig, IsWeightConfig, TrainInferCorrectionConfig
from stages.losses.aggregation import agg_loss
from stages.losses.primitives import masked_mean, masked_sum, segment_masked_mean

# the option models live in schemas/ (the training section holds them); imported here under their old names
__all__ = ["AGG_TYPES", "FilterConfig", "IsWeightConfig", "TrainInferCorrectionConfig", "mismatch_ratios",
           "mismatch_diffs", "compute_train_infer_correction", "apply_train_infer_correction_to_batch"]


def mismatch_ratios(log_gap: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """ℓ = old − infer (B,T) → {agg_type: (B,T) ratio}: token e^ℓ; geometric e^{row masked mean ℓ}; sequence
    e^{row masked sum ℓ}; segment e^{segment mean ℓ} (row values broadcast to every position of the row)."""
    return {
        "token": torch.exp(log_gap),
        "geometric": torch.exp(masked_mean(log_gap, mask, dim=-1)).unsqueeze(-1).expand_as(log_gap),
        "sequence": torch.exp(masked_sum(log_gap, mask, dim=-1)).unsqueeze(-1).expand_as(log_gap),
        "segment": torch.exp(segment_masked_mean(log_gap, mask)),
    }


def mismatch_diffs(prob_gap: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """d = e^old − e^infer (B,T) → {agg_type: (B,T)} at the same four granularities (means/sums, no exp)."""
    return {
        "token": prob_gap,
        "geometric": masked_mean(prob_gap, mask, dim=-1).unsqueeze(-1).expand_as(prob_gap),
        "sequence": masked_sum(prob_gap, mask, dim=-1).unsqueeze(-1).expand_as(prob_gap),
        "segment": segment_masked_mean(prob_gap, mask),
    }


def _token_rate(indicator: torch.Tensor, mask: torch.Tensor, num_tokens: float, roll_compat: bool) -> float:
    """Token-mean of a 0/1 indicator. ROLL counts padding positions in the numerator [BUG-9]; fixed: masked."""
    return float(agg_loss(indicator.detach(), mask, "token-mean", num_tokens, roll_compat=roll_compat))


def compute_train_infer_correction(cfg: TrainInferCorrectionConfig, mask: torch.Tensor, old_log_probs: torch.Tensor,
                                   infer_log_probs: torch.Tensor, num_seqs: float | None = None,
                                   num_tokens: float | None = None, *, roll_compat: bool = False,
                                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """mask, old, infer (B,T) → (is_weight (B,T), filter_mask (B,T), metrics) (spec §6.6).

    ``num_seqs`` defaults to #rows with a token and ``num_tokens`` to Σ mask (each ≥ 1). Fixed by default: the
    filter pass-rate and IS-weight clip-fraction metrics count only masked tokens [BUG-9]; ``roll_compat=True``
    reproduces ROLL's unmasked numerators (padding passes every ratio filter, so rates can exceed 1).
    """
    m = mask.to(old_log_probs.dtype)
    n_seq = num_seqs if num_seqs is not None else max(float((m.sum(-1) > 0).sum()), 1.0)
    n_tok = num_tokens if num_tokens is not None else max(float(m.sum()), 1.0)
    ratios = mismatch_ratios(old_log_probs - infer_log_probs, m)
    diffs = mismatch_diffs(torch.exp(old_log_probs) - torch.exp(infer_log_probs), m)
    metrics: dict[str, float] = {}
    for agg in AGG_TYPES:
        metrics[f"actor/train_infer_ratio_{agg}_mean@sum"] = float(
            agg_loss(ratios[agg].detach(), m, "seq-mean-token-mean", num_seqs=n_seq))
        metrics[f"actor/train_infer_diff_{agg}_mean@sum"] = float(
            agg_loss(diffs[agg].detach(), m, "seq-mean-token-mean", num_seqs=n_seq))
    is_weight = _is_weight(cfg.is_weight, ratios, m, n_tok, roll_compat, metrics)
    filter_mask = torch.ones_like(m)
    for f in (f for f in cfg.filters if f.enabled):
        checks = [("ratio", ratios, f.ratio_low, f.ratio_high)] if f.ratio_enabled else []
        checks += [("diff", diffs, f.diff_low, f.diff_high)] if f.diff_enabled else []
        for kind, values, low, high in checks:
            passed = ((values[f.agg_type] >= low) & (values[f.agg_type] <= high)).to(m.dtype)
            filter_mask = filter_mask * passed
            metrics[f"actor/train_infer_{f.agg_type}_{kind}_mask_mean@sum"] = _token_rate(passed, m, n_tok,
                                                                                          roll_compat)
    if cfg.filters:
        metrics["actor/train_infer_final_mask_mean"] = float(masked_mean(m * filter_mask, m).detach())
    return is_weight, filter_mask, metrics


def _is_weight(cfg: IsWeightConfig, ratios: dict[str, torch.Tensor], mask: torch.Tensor, num_tokens: float,
               roll_compat: bool, metrics: dict[str, float]) -> torch.Tensor:
    """ratio[weight_type] clamped to [0, upper_bound] (metric ``actor/is_weight_clipfrac@sum``), or ones."""
    if not cfg.enabled:
        return torch.ones_like(mask)
    weight = ratios[cfg.weight_type]
    if cfg.upper_bound is not None:
        clipped = (weight > cfg.upper_bound).to(mask.dtype)
        metrics["actor/is_weight_clipfrac@sum"] = _token_rate(clipped, mask, num_tokens, roll_compat)
        weight = weight.clamp(min=0, max=cfg.upper_bound)
    return weight.detach() if cfg.detach else weight


def apply_train_infer_correction_to_batch(
        cfg: TrainInferCorrectionConfig, batch: Mapping[str, torch.Tensor], stat_mask_key: str = "response_mask",
        update_mask_keys: tuple[str, ...] | list[str] | None = None, *, roll_compat: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Pipeline-level correction (spec §6.6): returns a NEW batch dict with ``train_infer_is_weight`` (B,T) and each
    mask in ``update_mask_keys`` (default: the stat mask) multiplied by the filter, plus the metrics.

    A (B,S) mask is filtered on its ``[:, 1:]`` part, a (B,T) mask directly. Without ``old_log_probs`` or
    ``infer_logprobs`` the weight is all ones and nothing is filtered. Counts are inferred from the stat mask.
    """
    out = dict(batch)
    keys = tuple(update_mask_keys) if update_mask_keys is not None else (stat_mask_key,)
    width = _next_token_width(batch)
    stat_mask = _next_token_part(batch[stat_mask_key], width)
    if batch.get("old_log_probs") is None or batch.get("infer_logprobs") is None:
        out["train_infer_is_weight"] = torch.ones(stat_mask.shape, dtype=torch.float32, device=stat_mask.device)
        return out, {}
    is_weight, filter_mask, metrics = compute_train_infer_correction(
        cfg, stat_mask, batch["old_log_probs"], batch["infer_logprobs"], roll_compat=roll_compat)
    out["train_infer_is_weight"] = is_weight
    for key in keys:
        mask = batch[key]
        keep = filter_mask.to(mask.dtype)
        out[key] = mask * keep if mask.shape[-1] == width else torch.cat([mask[:, :1], mask[:, 1:] * keep], dim=1)
    return out, metrics


def _next_token_width(batch: Mapping[str, torch.Tensor]) -> int:
    """T = S − 1: the width of ``old_log_probs``, else ``response_mask``'s width minus one."""
    if batch.get("old_log_probs") is not None:
        return batch["old_log_probs"].shape[-1]
    return batch["response_mask"].shape[-1] - 1


def _next_token_part(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A (B,S) mask → its (B,T) next-token part ``[:, 1:]``; a (B,T) mask as is."""
    return mask if mask.shape[-1] == width else mask[:, 1:]
