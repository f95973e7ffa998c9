"""Critic (value) loss with optional value clipping (spec §6.7, ROLL's CriticWorker.loss_func; gae only)."""

from __future__ import annotations

import torch

from schemas.errors import ConfigError
from stages.losses.primitives import check_same_shape, masked_mean


def critic_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                value_clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """values (B,T) predicted (= value-head output[:, :-1, 0]), old_values (B,T) from the rollout, returns (B,T),
    mask (B,T) = response_mask[:, 1:] → (vf_loss, metrics).

    With ``value_clip`` c: Vc = clip(V, V_old − c, V_old + c), loss_t = max((V − R)², (Vc − R)²); else (V − R)².
    vf_loss = ½·mean_b(masked_mean_t(loss_t)) — rows without tokens give 0 but count in the mean, and the loss
    ignores ``loss_agg_mode`` and the global counts (as ROLL does). Metrics ``critic/{loss,value,vpred,clipfrac,
    error}`` are means over rows of per-row masked means (value: old values; error: unclipped squared error;
    clipfrac: share of tokens where the clipped error is larger, or the squared error itself without a clip).
    """
    check_same_shape("critic loss", values=values, old_values=old_values, returns=returns, mask=mask)
    if value_clip is not None and value_clip <= 0:
        raise ConfigError(f"value_clip = {value_clip} must be > 0, or None to turn value clipping off")
    m = mask.to(values.dtype)
    unclipped = (values - returns).square()
    if value_clip is None:
        per_token, clipfrac_src = unclipped, unclipped
    else:
        clipped_values = torch.clamp(values, old_values - value_clip, old_values + value_clip)
        clipped = (clipped_values - returns).square()
        per_token = torch.max(unclipped, clipped)
        clipfrac_src = (clipped > unclipped).to(values.dtype)
    vf_loss = 0.5 * _mean_of_row_means(per_token, m)
    metrics = {
        "critic/loss": float(vf_loss.detach()),
        "critic/value": float(_mean_of_row_means(old_values, m)),
        "critic/vpred": float(_mean_of_row_means(values.detach(), m)),
        "critic/clipfrac": float(_mean_of_row_means(clipfrac_src.detach(), m)),
        "critic/error": float(_mean_of_row_means(unclipped.detach(), m)),
    }
    return vf_loss, metrics


def _mean_of_row_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean over ALL rows of the per-row masked mean (rows without tokens count as 0). (B,T) → scalar."""
    return masked_mean(x, mask, dim=-1).mean()
