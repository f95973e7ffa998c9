"""Token-level rewards: response reward at the last token minus an optional KL penalty (spec ALGORITHMS.md §2.3-2.5).

All token columns are next-token ``Ragged`` rows (``L − 1`` entries for a row of ``L`` tokens) sharing one
``offsets``; ``mask (N,)`` is the token mask ``response_mask[1:]`` of each row. ROLL's ``apply_kl_penalty`` (§2.5,
kept but not called by its pipelines) is :func:`compute_token_reward` with ``add_token_level_kl`` set when there is a
reference and no ``reward_clip``.

The KL controller is **not** updated here, so that a row-parallel stage can run these functions block by block:
each result carries its KL partials ``(Σ_rows masked row mean of the KL, number of rows)``; the stage adds them over
blocks, turns them into ``current_kl`` with :func:`current_kl_from_partials` and calls
``controller.update(current_kl, n_steps=n_rows)`` once per step (§2.4 step 5). The KL coefficient ``β`` is passed in
(``controller.value`` read **before** that update, §2.4 step 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from schemas.errors import InvariantError
from stages.algos.functional import as_mask, clip_fraction, masked_clip_fraction
from stages.algos.kl import approx_kl
from stages.algos.ragged import Ragged, row_masked_mean

KLPartials = tuple[float, int]  # (Σ over rows of the masked row-mean KL, number of rows); additive across blocks


def expand_to_token_level(response_level_rewards: np.ndarray, offsets: np.ndarray) -> Ragged:
    """Response reward ``R_b`` at the last next-token position of row ``b`` (flat index ``offsets[b+1] − 1``),
    zeros elsewhere; rows without next-token positions get nothing (§2.3). ``(B,)`` → ``Ragged (N,)`` float32."""
    offsets = np.asarray(offsets, dtype=np.int64)
    rewards = np.asarray(response_level_rewards, dtype=np.float32).reshape(-1)
    if len(rewards) != len(offsets) - 1:
        raise InvariantError(f"response_level_rewards has {len(rewards)} rows but the token columns have "
                             f"{len(offsets) - 1}; one reward per row is required")
    out = np.zeros(int(offsets[-1]), dtype=np.float32)
    has_tokens = np.diff(offsets) > 0
    out[offsets[1:][has_tokens] - 1] = rewards[has_tokens]
    return Ragged(out, offsets)


def kl_partials(kl: Ragged, mask: np.ndarray) -> KLPartials:
    """``(Σ_b masked_mean(kl_b, m_b), B)``; rows without a masked token contribute 0 but are counted [Q-4]."""
    row_means = row_masked_mean(kl, as_mask(mask, kl.values.shape))
    return float(row_means.sum()), kl.num_rows


def current_kl_from_partials(parts: Iterable[KLPartials]) -> tuple[float, int]:
    """``(current_kl, n_rows)`` from the partials of all blocks: the mean over all rows (0 for no rows)."""
    total, n_rows = 0.0, 0
    for s, n in parts:
        total, n_rows = total + s, n_rows + n
    return (total / n_rows if n_rows else 0.0), n_rows


@dataclass(frozen=True)
class TokenRewardResult:
    """``token_level_rewards`` and ``kl`` are ``Ragged (N,)`` float32 like the inputs; ``kl`` is masked."""

    token_level_rewards: Ragged
    kl: Ragged
    kl_coef: float  # β actually subtracted (0 when the KL is not added)
    kl_partials: KLPartials
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def current_kl(self) -> float:
        """Mean over this block's rows of the masked row-mean KL (``critic/kl`` for a single-block batch)."""
        return current_kl_from_partials([self.kl_partials])[0]


def _token_reward(response_level_rewards: np.ndarray, mask: np.ndarray, old_log_probs: Ragged,
                  ref_log_probs: Ragged | None, beta: float, kl_penalty: str) -> TokenRewardResult:
    """Steps 1-4 of §2.4: expand, KL, subtract ``β·KL``, KL partials."""
    m = as_mask(mask, old_log_probs.values.shape)
    rewards = expand_to_token_level(response_level_rewards, old_log_probs.offsets)
    if ref_log_probs is None:
        kl = old_log_probs.with_values(np.zeros_like(old_log_probs.values, dtype=np.float32))
    else:
        if not np.array_equal(ref_log_probs.offsets, old_log_probs.offsets):
            raise InvariantError("ref_log_probs rows differ in length from old_log_probs; both need L-1 entries a row")
        kl = old_log_probs.with_values(approx_kl(old_log_probs.values, ref_log_probs.values, kl_penalty, m))
    r = kl.values.astype(np.float64)
    r *= beta
    np.subtract(rewards.values, r, out=r)  # R − β·KL in float64
    parts = kl_partials(kl, m)
    result_rewards = rewards.with_values(r.astype(np.float32))
    metrics = {"critic/kl": current_kl_from_partials([parts])[0], "critic/kl_coef": float(beta)}
    return TokenRewardResult(result_rewards, kl, float(beta), parts, metrics)


def compute_token_reward(response_level_rewards: np.ndarray, mask: np.ndarray, old_log_probs: Ragged,
                         ref_log_probs: Ragged | None, *, kl_coef: float, kl_penalty: str = "kl",
                         add_token_level_kl: bool = False, reward_clip: float | None = None,
                         masked_clip_metric: bool = False) -> TokenRewardResult:
    """ROLL's ``compute_token_reward`` without the controller update (§2.4).

    ``r = expand(R) − β·approx_kl(old, ref, kl_penalty)·m`` with ``β = kl_coef`` if ``add_token_level_kl`` else 0
    (``ref_log_probs`` None: no reference, the KL is 0);
    then, if ``reward_clip`` is truthy (0 and None disable it), ``critic/token_reward_clip_frac`` over all next-token
    positions (over the mask with ``masked_clip_metric``, the [Q-3] fix) and ``r ← clip(r, ±reward_clip)``.
    Metrics: ``critic/kl`` (this block's ``current_kl``), ``critic/kl_coef = β``.
    Caller: ``controller.update(current_kl, n_steps = number of rows)`` (see the module docstring).
    """
    beta = float(kl_coef) if add_token_level_kl else 0.0
    result = _token_reward(response_level_rewards, mask, old_log_probs, ref_log_probs, beta, kl_penalty)
    if not reward_clip:
        return result
    r = result.token_level_rewards.values
    bound = float(reward_clip)
    frac = (masked_clip_fraction(r, mask, low=-bound, high=bound) if masked_clip_metric
            else clip_fraction(r, low=-bound, high=bound))
    clipped = result.token_level_rewards.with_values(np.clip(r, -bound, bound).astype(np.float32))
    metrics = {**result.metrics, "critic/token_reward_clip_frac": frac}
    return TokenRewardResult(clipped, result.kl, result.kl_coef, result.kl_partials, metrics)
