"""The losses a training step backpropagates, per micro-batch: the actor's policy loss from its logits at the loss
tokens and the critic's value loss, both with the mini-batch's global normalisers (spec §6.2-6.7). No Ray, no
DeepSpeed."""

from __future__ import annotations

import numpy as np
import torch

from schemas.train_config import TrainSection
from stages.losses import LossInputs, agg_loss, critic_loss, policy_loss as lookup_policy_loss
from stages.train.batching import MicroBatch, MiniBatchPlan, TokenHidden, TokenLogits, unpad_next_token

Metrics = dict[str, float]  # metric name (ROLL's) -> value


class ActorObjective:
    """The policy loss of a micro-batch from the logits (spec §1.8, §6.3-6.5), with the mini-batch's global counts.

    Without an ``old_log_probs`` column, the first pass over a row uses ``detach(log_probs)`` (ratio 1) and caches it
    for later epochs (ROLL's cache path, spec §6.3 step 2)."""

    def __init__(self, policy_loss: str, loss_cfg, entropy_metric: bool = True):
        self.loss_fn = lookup_policy_loss(policy_loss)
        self.loss_cfg = loss_cfg
        self.entropy_metric = entropy_metric
        self.old_cache: dict[int, np.ndarray] = {}

    @classmethod
    def from_section(cls, cfg: TrainSection) -> "ActorObjective":
        return cls(cfg.policy_loss, cfg.loss_config(), cfg.compute_entropy_metric)

    def __call__(self, logits: TokenLogits | TokenHidden | torch.Tensor, mb: MicroBatch, rows: np.ndarray,
                 plan: MiniBatchPlan) -> tuple[torch.Tensor, Metrics]:
        """``logits``: the engine's :class:`TokenLogits` or :class:`TokenHidden`, or full ``(b, S, V)`` logits (ROLL's
        golden cases)."""
        mask = mb.loss_mask
        if not isinstance(logits, (TokenLogits, TokenHidden)):
            logits = TokenLogits.from_dense(logits, mb)
        log_probs = logits.log_probs(mb)
        entropy = logits.entropy() if self.loss_cfg.entropy_loss_coef > 0 else None
        t = mb.next_token
        old = t.get("old_log_probs")
        cached = old is None and not mb.padding_step and all(int(r) in self.old_cache for r in rows)
        if cached:
            old = _pad_rows([self.old_cache[int(r)] for r in rows], mask.shape, mask.device)
        inputs = LossInputs(log_probs=log_probs, mask=mask, advantages=t["advantages"], old_log_probs=old,
                            ref_log_probs=t.get("ref_log_probs"), infer_log_probs=t.get("infer_logprobs"),
                            train_infer_is_weight=t.get("train_infer_is_weight"), entropy=entropy,
                            final_mask=t.get("final_response_mask"), num_tokens=plan.num_tokens,
                            num_seqs=plan.num_seqs, final_num_tokens=plan.final_num_tokens,
                            final_num_seqs=plan.final_num_seqs, difficulty=mb.per_row.get("difficulty"))
        loss, metrics = self.loss_fn(inputs, self.loss_cfg)
        if old is None and not mb.padding_step:
            lp = unpad_next_token(log_probs, mb.lengths)
            for i, r in enumerate(rows):
                self.old_cache[int(r)] = lp.row(i).copy()
        if self.entropy_metric:
            with torch.no_grad():
                ent = entropy if entropy is not None else logits.entropy()
                metrics["actor/entropy@sum"] = float(self._agg(ent, mask, plan))
        return loss, metrics

    def _agg(self, x: torch.Tensor, mask: torch.Tensor, plan: MiniBatchPlan) -> torch.Tensor:
        c = self.loss_cfg
        return agg_loss(x.detach(), mask, c.loss_agg_mode, plan.num_tokens, plan.num_seqs,
                        sum_norm_constant=c.sum_norm_constant)


def _pad_rows(rows: list[np.ndarray], shape: tuple[int, int], device) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.from_numpy(r)
    return out.to(device)


class CriticObjective:
    """The critic loss of a micro-batch (spec §6.7): ``V = output[:, :-1, 0]``; ROLL's ½·mean over rows of per-row
    masked means, taken over the whole mini-batch (each micro-batch weighs rows / mini-batch rows)."""

    def __init__(self, value_clip: float | None = None):
        self.value_clip = value_clip

    def __call__(self, output: torch.Tensor, mb: MicroBatch, rows: np.ndarray, plan: MiniBatchPlan,
                 ) -> tuple[torch.Tensor, Metrics]:
        values = output[:, :-1, 0].float()
        t = mb.next_token
        loss, metrics = critic_loss(values, t["values"], t["returns"], mb.loss_mask, self.value_clip)
        share = mb.num_rows / plan.num_rows
        return loss * share, {f"{k}@sum": v * share for k, v in metrics.items()}
