"""Actor (policy) losses: agentic (spec §6.3), base (§6.4) and RLVR (§6.5), and the policy-loss registry.

Every entry of ``POLICY_LOSSES`` is ``loss(inputs: LossInputs, cfg: LossConfig) -> (total_loss, metrics)``: a scalar
tensor to back-propagate and a dict of floats under ROLL's metric names. An entry is the loss's row of the capability
table (:data:`schemas.capabilities.POLICY_LOSS_CAPABILITIES`: ``levels``, the importance-ratio granularities it offers,
and ``level_field``, the config field choosing one; ``uses_final_mask``, RLVR: pass ``final_mask`` and its global
counts) plus the loss function; :func:`policy_loss` is the one lookup.

Train/infer correction: when ``inputs.train_infer_is_weight`` is given, the correction ran upstream
(``apply_train_infer_correction_to_batch``, ROLL's recompute-on path) and the loss only applies the weight;
otherwise the loss runs it (ROLL's recompute-off path). The base loss has no correction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from schemas.capabilities import POLICY_LOSS_CAPABILITIES, PolicyLossCapabilities
from schemas.errors import InvariantError
from stages.losses.aggregation import agg_loss
from stages.losses.config import LossConfig, LossInputs, difficulty_array
from stages.losses.primitives import EPS, approx_kl, loss_normalisers, masked_mean, segment_masked_mean
from stages.losses.train_infer import compute_train_infer_correction
from stages.registry import Registry

Metrics = dict[str, float]


@dataclass(frozen=True)
class PolicyLoss(PolicyLossCapabilities):
    """A registered policy loss: its capabilities (its table row) and its function ``fn``."""

    fn: Callable[[LossInputs, LossConfig], tuple[torch.Tensor, Metrics]] = field(kw_only=True)

    def __call__(self, inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
        return self.fn(inputs, cfg)


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss ``name`` (the one lookup; KeyError names the known losses)."""
    return POLICY_LOSSES.get(name)


# ---- building blocks ------------------------------------------------------------------------------------------

def _f(x: torch.Tensor) -> float:
    return float(x.detach())


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                      dual_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped loss per token (spec §6.3 steps 6–7). (B,T) → (loss, surr1, surr2).

    L = −min(ρA, clamp(ρ, 1−ε_lo, 1+ε_hi)A); with a dual clip, where A < 0: L ← min(L, −c·A)."""
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip_c * advantages), loss)
    return loss, surr1, surr2


def _dual_clip_c(cfg: LossConfig) -> float | None:
    return cfg.dual_clip_constant if cfg.dual_clip_loss else None


def _counts(mask: torch.Tensor, num_tokens: float | None, num_seqs: float | None) -> tuple[float, float]:
    """Given global counts, or this micro-batch's counts of ``mask`` (spec §6.2)."""
    local_tokens, local_seqs = loss_normalisers(mask)
    return (local_tokens if num_tokens is None else float(num_tokens),
            local_seqs if num_seqs is None else float(num_seqs))


def _behaviour_log_probs(inputs: LossInputs) -> torch.Tensor:
    """old log-probs, or detach(log_probs) on the cache path (spec §6.3 step 2: ratio exactly 1)."""
    return inputs.log_probs.detach() if inputs.old_log_probs is None else inputs.old_log_probs


def _train_infer_step(inputs: LossInputs, cfg: LossConfig, mask: torch.Tensor, old: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """(filter, is_weight, metrics) of spec §6.3 step 4: the precomputed weight when the correction ran upstream
    (filter = ones), else the in-loss correction against the pre-filter counts."""
    if inputs.train_infer_is_weight is not None:
        return torch.ones_like(mask), inputs.train_infer_is_weight, {}
    infer = old if inputs.infer_log_probs is None else inputs.infer_log_probs
    is_weight, keep, metrics = compute_train_infer_correction(
        cfg.train_infer_correction, mask, old.detach(), infer, inputs.num_seqs, inputs.num_tokens,
        roll_compat=cfg.roll_compat)
    return keep, is_weight, metrics


def _agg(x: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, num_tokens: float, num_seqs: float) -> torch.Tensor:
    """agg_loss of (B,T) ``x`` under ``mask`` with the config's ``loss_agg_mode`` and ROLL options."""
    return agg_loss(x, mask, cfg.loss_agg_mode, num_tokens, num_seqs, roll_compat=cfg.roll_compat,
                    sum_norm_constant=cfg.sum_norm_constant)


def _entropy_term(inputs: LossInputs, cfg: LossConfig, mask: torch.Tensor, num_tokens: float, num_seqs: float,
                  ) -> torch.Tensor:
    """agg_loss of the per-token entropy (spec §6.3 step 12)."""
    if inputs.entropy is None:
        raise InvariantError("loss inputs: entropy_loss_coef > 0 but no 'entropy' tensor was given; compute it with "
                             "op_compute_entropy (or set entropy_loss_coef: 0)")
    return _agg(inputs.entropy, mask, cfg, num_tokens, num_seqs)


def _loss_total(inputs: LossInputs, cfg: LossConfig, loss: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                num_tokens: float, num_seqs: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_loss, kl_loss, total) of the token-level actor losses (spec §6.3 steps 10-12): ``loss`` (B,T) and the KL
    to ``ref`` aggregated by ``loss_agg_mode``; the KL term added when ``use_kl_loss``, the entropy bonus subtracted
    when ``entropy_loss_coef > 0``."""
    pg_loss = _agg(loss, mask, cfg, num_tokens, num_seqs)
    kl_loss = _agg(approx_kl(inputs.log_probs, ref, mask, cfg.kl_loss_type), mask, cfg, num_tokens, num_seqs)
    total = pg_loss + cfg.kl_loss_coef * kl_loss if cfg.use_kl_loss else pg_loss
    if cfg.entropy_loss_coef > 0:
        total = total - cfg.entropy_loss_coef * _entropy_term(inputs, cfg, mask, num_tokens, num_seqs)
    return pg_loss, kl_loss, total


def _ratio_metrics(ratio: torch.Tensor, surr1: torch.Tensor, surr2: torch.Tensor, mask: torch.Tensor,
                   cfg: LossConfig, num_tokens: float, num_seqs: float, *, clip_mask: torch.Tensor | None = None,
                   clip_tokens: float | None = None) -> Metrics:
    """Clip fractions and ratio statistics (spec §6.3 step 13), keys with ROLL's ``@sum/@max/@min`` suffixes.

    The ratio clip fractions are token-means over ``clip_mask`` / ``clip_tokens`` (default: ``mask`` /
    ``num_tokens``; RLVR passes its final mask and counts, and ``actor/clipfrac`` then uses ``clip_tokens`` in
    token-mean mode, as ROLL does)."""
    clip_mask = mask if clip_mask is None else clip_mask
    clip_tokens = num_tokens if clip_tokens is None else clip_tokens
    clip_low, clip_high = cfg.clip_range
    high = (ratio > 1.0 + clip_high).to(ratio.dtype)
    low = (ratio < 1.0 - clip_low).to(ratio.dtype)

    def token_rate(indicator: torch.Tensor) -> float:
        return _f(agg_loss(indicator, clip_mask, "token-mean", clip_tokens, roll_compat=cfg.roll_compat))

    m = mask.to(ratio.dtype)
    return {
        "actor/ppo_ratio_high_clipfrac@sum": token_rate(high),
        "actor/ppo_ratio_low_clipfrac@sum": token_rate(low),
        "actor/ppo_ratio_clipfrac@sum": token_rate(high + low),
        "actor/ratio_mean@sum": _f(agg_loss(ratio, m, "seq-mean-token-mean", num_seqs=num_seqs)),
        "actor/ratio_max@max": _f((ratio * m).max()),
        "actor/ratio_min@min": _f((ratio * m + (1 - m) * 1e10).min()),
        "actor/clipfrac@sum": _f(_agg((surr2 < surr1).to(ratio.dtype), m, cfg, clip_tokens, num_seqs)),
    }


def _policy_kl_metrics(log_probs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
                       num_tokens: float, num_seqs: float, suffix: str) -> Metrics:
    """``actor/approxkl`` (½(lp−old)²) and ``actor/policykl`` (lp−old), aggregated like the loss."""
    lp = log_probs.detach()
    return {f"actor/approxkl{suffix}": float(_agg(approx_kl(lp, old, mask, "mse"), mask, cfg, num_tokens, num_seqs)),
            f"actor/policykl{suffix}": float(_agg(approx_kl(lp, old, mask, "kl"), mask, cfg, num_tokens, num_seqs))}


# ---- agentic (spec §6.3) ----------------------------------------------------------------------------------------

def agentic_actor_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """ROLL's agentic ActorWorker.loss_func (spec §6.3); ``cfg.ratio_type`` token | segment (GSPO-like per turn).

    Fixed by default [BUG-7]: filtered tokens leave the token-mean numerators, and missing counts are taken after
    the filter. ``cfg.roll_compat`` reproduces ROLL.
    """
    lp = inputs.log_probs
    response_mask = inputs.mask.to(lp.dtype)
    old = _behaviour_log_probs(inputs)
    ref = old if inputs.ref_log_probs is None else inputs.ref_log_probs
    keep, is_weight, metrics = _train_infer_step(inputs, cfg, response_mask, old)
    mask = response_mask * keep
    n_tok, n_seq = _counts(response_mask if cfg.roll_compat else mask, inputs.num_tokens, inputs.num_seqs)

    log_ratio = lp - old
    if cfg.ratio_type == "segment":
        log_ratio = segment_masked_mean(log_ratio, mask)
    ratio = torch.exp(log_ratio)
    clip_low, clip_high = cfg.clip_range
    loss, surr1, surr2 = clipped_surrogate(ratio, inputs.advantages, clip_low, clip_high, _dual_clip_c(cfg))
    if cfg.train_infer_correction.is_weight.enabled:
        loss = loss * is_weight

    pg_loss, kl_loss, total = _loss_total(inputs, cfg, loss, ref, mask, n_tok, n_seq)

    metrics.update(_ratio_metrics(ratio.detach(), surr1.detach(), surr2.detach(), mask, cfg, n_tok, n_seq))
    metrics.update(_policy_kl_metrics(lp, old, mask, cfg, n_tok, n_seq, "@sum"))
    metrics.update({"actor/pg_loss@sum": _f(pg_loss), "actor/kl_loss@sum": _f(kl_loss),
                    "actor/total_loss@sum": _f(total)})
    return total, metrics


# ---- base (spec §6.4) -------------------------------------------------------------------------------------------

def base_actor_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """ROLL's base ActorWorker.loss_func (spec §6.4): token ratio, no train/infer correction, metric names without
    suffix; the three ratio clip fractions are plain means over all (B,T) positions (ROLL's, diluted by padding)."""
    lp = inputs.log_probs
    mask = inputs.mask.to(lp.dtype)
    old = _behaviour_log_probs(inputs)
    ref = old if inputs.ref_log_probs is None else inputs.ref_log_probs
    n_tok, n_seq = _counts(mask, inputs.num_tokens, inputs.num_seqs)
    ratio = torch.exp(lp - old)
    clip_low, clip_high = cfg.clip_range
    loss, surr1, surr2 = clipped_surrogate(ratio, inputs.advantages, clip_low, clip_high, _dual_clip_c(cfg))

    pg_loss, kl_loss, total = _loss_total(inputs, cfg, loss, ref, mask, n_tok, n_seq)

    r = ratio.detach()
    high = (r > 1.0 + clip_high).to(r.dtype)
    low = (r < 1.0 - clip_low).to(r.dtype)
    metrics = {
        "actor/ppo_ratio_high_clipfrac": float(high.mean()),
        "actor/ppo_ratio_low_clipfrac": float(low.mean()),
        "actor/ppo_ratio_clipfrac": float((high + low).mean()),
        "actor/ratio_mean": float(masked_mean(r, mask, dim=-1).mean()),
        "actor/ratio_max": float((r * mask).max()),
        "actor/ratio_min": float((r * mask + (1 - mask) * 1e10).min()),
        "actor/clipfrac": _f(_agg((surr2 < surr1).to(r.dtype), mask, cfg, n_tok, n_seq)),
        "actor/pg_loss": _f(pg_loss), "actor/kl_loss": _f(kl_loss), "actor/total_loss": _f(total),
    }
    metrics.update(_policy_kl_metrics(lp, old, mask, cfg, n_tok, n_seq, ""))
    return total, metrics


# ---- RLVR (spec §6.5) -------------------------------------------------------------------------------------------

def sample_weights(mask: torch.Tensor, cfg: LossConfig, difficulty=None) -> torch.Tensor:
    """(B,T) response mask → (B,) per-row weights of the pg term (spec §6.5 ``compute_sample_weights``).

    difficulty: w ← w·(0.5 + 1.5·clip(d, 0, 1)) — fixed [BUG-8]: applied from any float-convertible array, loud
    error if missing or unreadable; ``roll_compat`` never applies it (as ROLL). length: w ← w·(1.5 − (L − Lmin) /
    (Lmax − Lmin + 1e-8)) with L = tokens per row, min/max over this micro-batch. Then w ← w·B/(Σw + 1e-8) if Σw > 0.
    """
    batch_size = mask.shape[0]
    weights = torch.ones(batch_size, dtype=torch.float32, device=mask.device)
    if cfg.difficulty_loss_weight and not cfg.roll_compat:
        if difficulty is None:
            raise InvariantError("loss inputs: difficulty_loss_weight is on but no 'difficulty' column was given; "
                                 "add one number in [0, 1] per row or turn difficulty_loss_weight off")
        d = torch.as_tensor(difficulty_array(difficulty, batch_size), dtype=torch.float32, device=mask.device)
        weights = weights * (0.5 + 1.5 * d.clamp(0.0, 1.0))
    if cfg.length_loss_weight:
        lengths = mask.to(torch.float32).sum(dim=-1)
        spread = lengths.max() - lengths.min() + EPS
        weights = weights * (1.5 - (lengths - lengths.min()) / spread)
    if weights.sum() > 0:
        weights = weights * (batch_size / (weights.sum() + EPS))
    return weights


def rlvr_actor_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """ROLL's RLVR ActorWorker.loss_func (spec §6.5): ``final_mask`` for the pg and KL terms, ``importance_sampling``
    token | seq (GSPO sequence ratio), sample weights on the pg term, ``rl_loss_coef`` on pg + KL (not entropy)."""
    lp = inputs.log_probs
    response_mask = inputs.mask.to(lp.dtype)
    final_given = response_mask if inputs.final_mask is None else inputs.final_mask.to(lp.dtype)
    old = _behaviour_log_probs(inputs)
    ref = old if inputs.ref_log_probs is None else inputs.ref_log_probs
    keep, is_weight, metrics = _train_infer_step(inputs, cfg, response_mask, old)
    mask, final = response_mask * keep, final_given * keep
    n_tok, n_seq = _counts(response_mask if cfg.roll_compat else mask, inputs.num_tokens, inputs.num_seqs)
    f_tok, f_seq = _counts(final_given if cfg.roll_compat else final, inputs.final_num_tokens,
                           inputs.final_num_seqs)

    log_ratio = lp - old
    if cfg.importance_sampling == "seq":
        log_ratio = masked_mean(log_ratio, final, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    clip_low, clip_high = cfg.clip_range
    loss, surr1, surr2 = clipped_surrogate(ratio, inputs.advantages, clip_low, clip_high, _dual_clip_c(cfg))
    if cfg.train_infer_correction.is_weight.enabled:
        loss = loss * is_weight
    weights = sample_weights(mask, cfg, inputs.difficulty)

    def agg_final(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        return agg_loss(x, final, cfg.loss_agg_mode, f_tok, f_seq, w, roll_compat=cfg.roll_compat,
                        sum_norm_constant=cfg.sum_norm_constant)

    weighted_pg_loss, pg_loss = agg_final(loss, weights), agg_final(loss)
    kl_loss = agg_final(approx_kl(lp, ref, final, cfg.kl_loss_type))
    total = weighted_pg_loss + cfg.kl_loss_coef * kl_loss if cfg.use_kl_loss else weighted_pg_loss
    total = total * cfg.rl_loss_coef
    if cfg.entropy_loss_coef > 0:
        entropy_mask = response_mask if cfg.roll_compat else mask
        total = total - cfg.entropy_loss_coef * _entropy_term(inputs, cfg, entropy_mask, n_tok, n_seq)

    valid = (final > 0).any(dim=-1).to(torch.float32)
    metrics.update(_ratio_metrics(ratio.detach(), surr1.detach(), surr2.detach(), mask, cfg, n_tok, n_seq,
                                  clip_mask=final, clip_tokens=f_tok))
    metrics.update(_policy_kl_metrics(lp, old, mask, cfg, n_tok, n_seq, "@sum"))
    metrics.update({
        "actor/pg_loss@sum": _f(pg_loss), "actor/weighted_pg_loss@sum": _f(weighted_pg_loss),
        "actor/kl_loss@sum": _f(kl_loss), "actor/total_loss@sum": _f(total),
        "actor/valid_samples@sum": float(valid.sum()), "actor/total_samples@sum": float(valid.shape[0]),
        "actor/valid_sample_ratio@sum": float(valid.sum()) / n_seq,
        "actor/sample_weights_mean@mean": float(weights.mean()), "actor/sample_weights_min@min": float(weights.min()),
        "actor/sample_weights_max@max": float(weights.max()),
    })
    return total, metrics


# ---- registry ---------------------------------------------------------------------------------------------------

def _register(name: str, fn: Callable[[LossInputs, LossConfig], tuple[torch.Tensor, Metrics]]) -> None:
    """Register ``name``'s table row with its function (a name without a row is a KeyError here)."""
    POLICY_LOSSES.register(name)(PolicyLoss(**asdict(POLICY_LOSS_CAPABILITIES[name]), fn=fn))


_register("agentic", agentic_actor_loss)
_register("base", base_actor_loss)
_register("rlvr", rlvr_actor_loss)
