"""The two arguments every policy loss takes: ``LossInputs`` (tensors of one padded micro-batch) and ``LossConfig``
(ROLL's option names, spec §7.1: :class:`schemas.loss_config.LossOptions`). Every policy loss is
``loss(inputs, cfg) -> (total_loss, metrics)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from schemas.errors import InvariantError
from schemas.loss_config import LossOptions
from stages.losses.primitives import check_same_shape


# The loss options are one pydantic model, declared once in schemas/ (the training section inherits it); the losses
# keep calling it LossConfig: ``LossConfig(pg_clip=0.1)``, ``LossConfig.from_dict(roll_options)`` (ConfigError on a bad
# option), ``.clip_range``, ``.dual_clip_constant``, ``.train_infer_correction.is_weight``.
LossConfig = LossOptions


@dataclass
class LossInputs:
    """One padded micro-batch, (B, T) next-token aligned (T = S-1, spec §0.1). Only ``log_probs`` carries a gradient.

    * ``log_probs``: current policy log-probs, 0 off ``mask`` (``op_compute_log_probs`` or the masked equivalent).
    * ``mask``: the token mask M = response_mask[:, 1:] (already train/infer-filtered if the correction ran
      upstream).
    * ``old_log_probs``: behaviour log-probs; None → the cache path of spec §6.3 step 2 (old = detach(log_probs),
      ratio 1).
    * ``ref_log_probs``: reference log-probs for the KL loss; None → ``old_log_probs`` (ROLL without a reference).
    * ``infer_log_probs``: inference-engine log-probs; None → old (the correction is then the identity).
    * ``train_infer_is_weight``: precomputed by ``apply_train_infer_correction_to_batch``; given → the loss uses it
      and runs no correction itself (ROLL's recompute-on path); None → the correction runs inside the loss.
    * ``entropy``: per-token entropy, 0 off ``mask``; needed only when ``entropy_loss_coef > 0``.
    * ``final_mask`` (RLVR): ``final_response_mask`` (M times the sample mask); None → ``mask``.
    * ``num_tokens`` / ``num_seqs``: global counts of the loss mask over the whole mini-batch (spec §6.2; after the
      train/infer filter — see ``loss_normalisers``); None → counted on this micro-batch.
    * ``final_num_tokens`` / ``final_num_seqs`` (RLVR): the same for ``final_mask``; None → counted on this
      micro-batch's final mask (ROLL's golden runs pass the final mask's own counts).
    * ``difficulty`` (RLVR): per-row difficulty in [0, 1], (B,), for ``difficulty_loss_weight``.
    """
    log_probs: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    infer_log_probs: torch.Tensor | None = None
    train_infer_is_weight: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    final_mask: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    final_num_tokens: float | None = None
    final_num_seqs: float | None = None
    difficulty: Any = None

    def __post_init__(self) -> None:
        check_same_shape("loss inputs", log_probs=self.log_probs, mask=self.mask, advantages=self.advantages,
                         old_log_probs=self.old_log_probs, ref_log_probs=self.ref_log_probs,
                         infer_log_probs=self.infer_log_probs, train_infer_is_weight=self.train_infer_is_weight,
                         entropy=self.entropy, final_mask=self.final_mask)
        if self.log_probs.dim() != 2:
            raise InvariantError(f"loss inputs: log_probs must be (B, T), got shape {tuple(self.log_probs.shape)}; "
                              f"gather the token log-probs first (op_compute_log_probs)")


def difficulty_array(difficulty: Any, batch_size: int) -> np.ndarray:
    """Any sequence (object arrays included) → float64 (B,) or a loud error (the fix of BUG-8)."""
    try:
        values = np.asarray(difficulty, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise InvariantError(f"loss inputs: column 'difficulty' cannot be read as floats ({exc}); give one number in "
                          f"[0, 1] per row") from None
    if values.shape[0] != batch_size or not np.all(np.isfinite(values)):
        raise InvariantError(f"loss inputs: column 'difficulty' must hold {batch_size} finite numbers (one per row), "
                          f"got shape {values.shape} — fix the data or turn off difficulty_loss_weight")
    return values
