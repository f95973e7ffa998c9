"""``agg_loss``: a (B, T) loss matrix to one scalar (spec §6.1), with BUG-7 fixed by default and Q-14's constant.

Normalisers are global counts (spec §6.2): ``num_tokens`` / ``num_seqs`` count the whole mini-batch over all
micro-batches and ranks, so micro-batch losses add up (with gradient accumulation) to the mini-batch loss.
"""

from __future__ import annotations

import torch

from schemas.errors import ConfigError
from schemas.loss_config import LOSS_AGG_MODES
from stages.losses.primitives import EPS, masked_mean, masked_sum


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, num_tokens: float | None = None,
             num_seqs: float | None = None, weights: torch.Tensor | None = None, *, roll_compat: bool = False,
             sum_norm_constant: float | None = None) -> torch.Tensor:
    """loss_mat (B,T), loss_mask (B,T), weights (B,) → scalar (spec §6.1).

    * ``token-mean``: Σ_{b,t} loss·mask·w_b / N_tok. ROLL leaves the mask out of the numerator **[BUG-7]**;
      ``roll_compat=True`` reproduces that.
    * ``seq-mean-token-sum``: Σ_b w_b·masked_sum(loss_b) / (N_seq + 1e-8).
    * ``seq-mean-token-mean``: Σ_b w_b·masked_mean(loss_b) / (N_seq + 1e-8).
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): Σ_b w_b·masked_sum(loss_b) / C, with C = ``sum_norm_constant``;
      when it is None, C is ROLL's padded length T of this micro-batch, which depends on padding **[Q-14]** —
      pass a fixed constant (e.g. the max response length) to make the loss independent of padding.

    ``num_tokens`` defaults to Σ mask, ``num_seqs`` to B (ROLL's defaults; every row counts, empty ones too).
    Rows without a token contribute 0 to the seq modes.
    """
    mask = loss_mask.to(loss_mat.dtype)
    w = torch.ones(loss_mat.shape[0], dtype=loss_mat.dtype, device=loss_mat.device) if weights is None \
        else weights.to(loss_mat.dtype)
    if mode == "token-mean":
        n_tok = mask.sum() if num_tokens is None else num_tokens
        numerator = loss_mat if roll_compat else loss_mat * mask
        return (numerator * w.unsqueeze(-1)).sum() / n_tok
    valid = (mask.sum(dim=-1) > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
        norm = float(loss_mat.shape[-1]) if sum_norm_constant is None else float(sum_norm_constant)
        return (per_seq * w * valid).sum() / norm
    else:
        raise ConfigError(f"loss_agg_mode '{mode}' is unknown; use one of {', '.join(LOSS_AGG_MODES)}")
    n_seq = float(loss_mat.shape[0]) if num_seqs is None else num_seqs
    return (per_seq * w * valid).sum() / (n_seq + EPS)
