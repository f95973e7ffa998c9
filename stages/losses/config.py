"""The two arguments every policy loss takes: ``LossInputs`` (tensors of one padded micro-batch) and ``LossConfig``
(ROLL's option names, spec §7.1). Every policy loss is ``loss(inputs, cfg) -> (total_loss, metrics)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from schemas.errors import ConfigError, InvariantError
from stages.losses.aggregation import LOSS_AGG_MODES
from stages.losses.primitives import KL_TYPES, check_same_shape
from stages.losses.train_infer import TrainInferCorrectionConfig


@dataclass(frozen=True)
class LossConfig:
    """Options of the actor losses, named as in ROLL (spec §6.3–6.5, §7.1).

    Ours: ``dual_clip_c`` (None → ROLL's 1 + 2·pg_clip, [Q-15]); ``kl_loss_type`` (ROLL hard-wires k3);
    ``sum_norm_constant`` (None → ROLL's padded length T, [Q-14]); ``roll_compat`` (reproduce ROLL's BUG-7/8/9).
    """
    pg_clip: float = 0.2
    use_pg_clip_range: bool = False
    pg_clip_low: float = 0.2
    pg_clip_high: float = 0.2
    dual_clip_loss: bool = False
    dual_clip_c: float | None = None
    loss_agg_mode: str = "seq-mean-token-mean"
    sum_norm_constant: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k3"
    entropy_loss_coef: float = 0.0
    ratio_type: str = "token"
    importance_sampling: str = "token"
    rl_loss_coef: float = 1.0
    difficulty_loss_weight: bool = False
    length_loss_weight: bool = False
    train_infer_correction: TrainInferCorrectionConfig = field(default_factory=TrainInferCorrectionConfig)
    roll_compat: bool = False

    def __post_init__(self) -> None:
        choices = {"loss_agg_mode": LOSS_AGG_MODES, "kl_loss_type": KL_TYPES[:-1],
                   "ratio_type": ("token", "segment"), "importance_sampling": ("token", "seq")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"loss config {name} = '{getattr(self, name)}' is unknown; use one of "
                                  f"{', '.join(allowed)}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ConfigError(f"loss config dual_clip_c = {self.dual_clip_c} must be > 1 (the dual clip bounds the "
                              f"loss of a negative advantage at c·|A|); use e.g. 3.0, or None for ROLL's 1 + 2·pg_clip")
        if self.sum_norm_constant is not None and self.sum_norm_constant <= 0:
            raise ConfigError(f"loss config sum_norm_constant = {self.sum_norm_constant} must be > 0 (e.g. the "
                              f"maximum response length), or None for ROLL's padded length")

    @property
    def clip_range(self) -> tuple[float, float]:
        """(ε_low, ε_high) of the ratio clip (spec §6.3 step 6)."""
        if self.use_pg_clip_range:
            return self.pg_clip_low, self.pg_clip_high
        return self.pg_clip, self.pg_clip

    @property
    def dual_clip_constant(self) -> float:
        """c of the dual clip: ``dual_clip_c`` or ROLL's fixed 1 + 2·pg_clip [Q-15]."""
        return 1.0 + 2.0 * self.pg_clip if self.dual_clip_c is None else self.dual_clip_c

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LossConfig":
        """From ROLL-style flat options; ``train_infer_correction`` may be a nested dict."""
        d = dict(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"loss config has unknown options {sorted(unknown)}; known: "
                              f"{', '.join(sorted(cls.__dataclass_fields__))}")
        if isinstance(d.get("train_infer_correction"), Mapping):
            d["train_infer_correction"] = TrainInferCorrectionConfig.from_dict(d["train_infer_correction"])
        return cls(**d)


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
