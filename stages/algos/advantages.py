"""Advantages and returns from token-level rewards (spec ALGORITHMS.md §4.3 ``compute_advantage``, §4.4 agentic).

One function serves both pipelines (the agentic one adds ``agentic_reinforce``, an ``agentic_only`` estimator).
Inputs are next-token ``Ragged`` columns sharing one ``offsets`` and the token mask ``m (N,)`` (``response_mask[1:]``
of each row, or RLVR's ``final_response_mask``).

Whitening pools over the whole batch. A stage that sees the batch in blocks runs it in two phases:
1. :func:`advantage_recursion` per block, with ``reward_stats`` = global ``(mean, var)`` of the token rewards
   (from :func:`~stages.algos.functional.whiten_partials` of every block) when ``whiten_rewards``;
2. :func:`finalize_advantages` per block, with ``advantage_stats`` = global statistics of phase 1's ``advantages``.
``compute_advantage`` does both on one block with local statistics. ROLL disables both whitenings when the batch's
mask sums to ≤ 1 (``functional.can_whiten``); a multi-block caller checks that on the global count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from schemas.errors import ConfigError, InvariantError
from stages.algos.estimators import estimator as get_estimator
from stages.algos.functional import as_mask, can_whiten, clip_fraction, masked_clip_fraction, masked_whiten
from stages.algos.kl import approx_kl
from stages.algos.ragged import Ragged

WhitenStats = tuple[float, float]  # (mean, unbiased variance)


@dataclass(frozen=True)
class AdvantageResult:
    """All columns are ``Ragged (N,)`` float32 with the rows of the token rewards.

    ``advantages``: final (after OPD, whitening, mask, clip; in phase 1 before whitening/mask/clip).
    ``returns``: from the recursion, neither masked, whitened nor clipped. ``raw_advantages``: the recursion's
    advantages before OPD and whitening. ``token_level_rewards``: after reward whitening and masking (untouched in
    pure OPD). ``values``: ``V·m`` for a critic estimator, else ``None`` (the input column stays as it is).
    """

    advantages: Ragged
    returns: Ragged
    raw_advantages: Ragged
    token_level_rewards: Ragged
    values: Ragged | None
    metrics: dict[str, float] = field(default_factory=dict)


def opd_kl_penalty(log_probs: Ragged, teacher_log_probs: Mapping[str, Ragged], mask: np.ndarray, *,
                   kl_penalty: str = "kl", coefs: Mapping[str, float] | None = None,
                   row_masks: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """On-policy distillation term ``K = Σ_teacher coef·approx_kl(log_probs, teacher, kl_penalty)·m`` (§4.3 step 2).

    ``log_probs``: ``old_log_probs`` when recomputed, else ``infer_logprobs``. ``coefs`` default to 1.0 (teacher
    ``opd_kl_coef``). ``row_masks[name] (B,)`` bool routes rows to a teacher; other rows get 0 from it. ``(N,)`` f32.
    """
    m = as_mask(mask, log_probs.values.shape)
    total = np.zeros(len(log_probs.values), dtype=np.float64)
    rows = log_probs.row_index()
    for name, teacher in teacher_log_probs.items():
        if not np.array_equal(teacher.offsets, log_probs.offsets):
            raise InvariantError(f"teacher '{name}' log-probs rows differ in length from the student's log-probs")
        kl = approx_kl(log_probs.values, teacher.values, kl_penalty, m).astype(np.float64)
        if row_masks is not None and name in row_masks:
            kl = kl * np.asarray(row_masks[name], dtype=bool)[rows]
        total += (1.0 if coefs is None else float(coefs.get(name, 1.0))) * kl
    return total.astype(np.float32)


def _whiten(x: np.ndarray, m: np.ndarray, stats: WhitenStats | None) -> np.ndarray:
    """:func:`masked_whiten` with the whole batch's ``stats``, or with ``x``'s own when None; ``x`` unchanged when
    ROLL would skip whitening (its own ``Σm ≤ 1``; a multi-block caller checks the global count)."""
    if stats is None and not can_whiten(float(np.sum(m))):
        return x
    return masked_whiten(x, m, stats=stats)


def advantage_recursion(token_level_rewards: Ragged, mask: np.ndarray, estimator: str, *, gamma: float,
                        lambd: float, values: Ragged | None = None, whiten_rewards: bool = False,
                        reward_stats: WhitenStats | None = None, opd_kl: np.ndarray | None = None,
                        use_opd: bool = False, is_pure_opd: bool = False,
                        roll_compat_gae: bool = False) -> AdvantageResult:
    """Steps 1-3 of §4.3: reward whitening and masking, the estimator's recursion, OPD. ``advantages`` here are
    ``A − K`` (mixed OPD) or ``A``, not yet whitened, masked or clipped. ``reward_stats`` overrides local stats."""
    if use_opd and is_pure_opd:
        raise ConfigError("use_opd and is_pure_opd are mutually exclusive; set one of them")
    if (use_opd or is_pure_opd) and opd_kl is None:
        raise InvariantError("on-policy distillation needs the KL term opd_kl (see opd_kl_penalty)")
    m = as_mask(mask, token_level_rewards.values.shape)
    rewards = token_level_rewards.with_values(token_level_rewards.values.astype(np.float32))
    if is_pure_opd:  # step 3: advantages = returns = raw_advantages = −K; rewards untouched
        minus_k = rewards.with_values(-np.asarray(opd_kl, dtype=np.float32))
        return AdvantageResult(minus_k, minus_k, minus_k, rewards, None)
    entry = get_estimator(estimator)
    r = rewards.values
    if whiten_rewards:
        r = _whiten(r, m, reward_stats)
    rewards = rewards.with_values((r * m).astype(np.float32))
    adv, returns = entry.token_recursion(rewards, m, values, gamma, lambd, roll_compat_gae)
    masked_values = values.with_values((values.values * m).astype(np.float32)) if entry.needs_critic else None
    a = adv.values - np.asarray(opd_kl, dtype=np.float32) if use_opd else adv.values
    return AdvantageResult(adv.with_values(a.astype(np.float32)), returns, adv, rewards, masked_values)


def finalize_advantages(advantages: np.ndarray, mask: np.ndarray, *, whiten_advantages: bool = False,
                        advantage_stats: WhitenStats | None = None, advantage_clip: float | None = None,
                        masked_clip_metric: bool = False) -> tuple[np.ndarray, dict[str, float]]:
    """Steps 4-5 of §4.3 on flat ``(N,)`` advantages: optional whitening, ``·m``, optional clip with the metric
    ``critic/advantage_clip_frac`` (over all positions as ROLL, or over the mask with ``masked_clip_metric``)."""
    m = as_mask(mask, np.shape(advantages))
    a = np.asarray(advantages, dtype=np.float32)
    if whiten_advantages:
        a = _whiten(a, m, advantage_stats)
    a = (a * m).astype(np.float32)
    metrics: dict[str, float] = {}
    if advantage_clip is not None:
        c = float(advantage_clip)
        metrics["critic/advantage_clip_frac"] = (masked_clip_fraction(a, m, low=-c, high=c) if masked_clip_metric
                                                 else clip_fraction(a, low=-c, high=c))
        a = np.clip(a, -c, c).astype(np.float32)
    return a, metrics


def compute_advantage(token_level_rewards: Ragged, mask: np.ndarray, estimator: str, *, gamma: float,
                      lambd: float, values: Ragged | None = None, whiten_rewards: bool = False,
                      whiten_advantages: bool = False, advantage_clip: float | None = None,
                      reward_stats: WhitenStats | None = None, advantage_stats: WhitenStats | None = None,
                      opd_kl: np.ndarray | None = None, use_opd: bool = False, is_pure_opd: bool = False,
                      roll_compat_gae: bool = False, masked_clip_metric: bool = False) -> AdvantageResult:
    """ROLL's ``compute_advantage`` / ``agentic_compute_advantage`` (§4.3, §4.4) on ragged rows.

    Order: rewards → float → whiten (optional, batch-wide over ``m``) → ``·m`` → estimator recursion →
    ``raw_advantages`` → ``− K`` (mixed OPD) → whiten advantages (optional) → ``·m`` → clip (optional, metric).
    Pure OPD: ``advantages = returns = raw_advantages = −K``, then whitening/mask/clip. GAE runs with the BUG-4 fix
    unless ``roll_compat_gae``. ``reward_stats`` / ``advantage_stats`` replace the local whitening statistics.
    """
    phase1 = advantage_recursion(token_level_rewards, mask, estimator, gamma=gamma, lambd=lambd, values=values,
                                 whiten_rewards=whiten_rewards, reward_stats=reward_stats, opd_kl=opd_kl,
                                 use_opd=use_opd, is_pure_opd=is_pure_opd, roll_compat_gae=roll_compat_gae)
    a, metrics = finalize_advantages(phase1.advantages.values, mask, whiten_advantages=whiten_advantages,
                                     advantage_stats=advantage_stats, advantage_clip=advantage_clip,
                                     masked_clip_metric=masked_clip_metric)
    return AdvantageResult(phase1.advantages.with_values(a), phase1.returns, phase1.raw_advantages,
                           phase1.token_level_rewards, phase1.values, metrics)
