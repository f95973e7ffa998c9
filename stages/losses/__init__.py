"""Pure training losses over padded torch tensors (spec ALGORITHMS.md §1.8, §4.6, §6). Imports torch and numpy only.

Inputs are one micro-batch padded to (B, T), next-token aligned (T = S − 1), with the token mask
M = response_mask[:, 1:]. Losses take log-probs (``op_compute_log_probs``), not logits, so the training stage can
stream; normalisers are global counts over the mini-batch (``loss_normalisers``, spec §6.2).
"""

from stages.losses.actor import (POLICY_LOSSES, PolicyLoss, agentic_actor_loss, base_actor_loss, clipped_surrogate,
                                 policy_loss, rlvr_actor_loss, sample_weights)
from stages.losses.aggregation import LOSS_AGG_MODES, agg_loss
from stages.losses.config import LossConfig, LossInputs
from stages.losses.critic import critic_loss
from stages.losses.fused_output import fused_label_log_probs_entropy, fused_output_layer_log_probs_entropy
from stages.losses.primitives import (approx_kl, entropy_from_logits, log_probs_from_logits, loss_normalisers,
                                      masked_mean, masked_sum, op_compute_entropy, op_compute_log_probs,
                                      segment_masked_mean, token_entropy, token_log_probs)
from stages.losses.train_infer import (FilterConfig, IsWeightConfig, TrainInferCorrectionConfig,
                                       apply_train_infer_correction_to_batch, compute_train_infer_correction)

__all__ = [
    "POLICY_LOSSES", "PolicyLoss", "policy_loss", "agentic_actor_loss", "base_actor_loss", "rlvr_actor_loss", "clipped_surrogate",
    "sample_weights", "critic_loss", "fused_label_log_probs_entropy", "fused_output_layer_log_probs_entropy",
    "LOSS_AGG_MODES", "agg_loss", "LossConfig", "LossInputs", "approx_kl",
    "entropy_from_logits", "log_probs_from_logits", "loss_normalisers", "masked_mean", "masked_sum",
    "op_compute_entropy", "op_compute_log_probs", "segment_masked_mean", "token_entropy", "token_log_probs",
    "FilterConfig", "IsWeightConfig",
    "TrainInferCorrectionConfig", "apply_train_infer_correction_to_batch", "compute_train_infer_correction",
]
