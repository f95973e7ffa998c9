"""Masked primitives over flat token arrays (spec ALGORITHMS.md §1, conventions §0.3).

Global reductions (``masked_mean``, ``masked_sum``, whitening statistics, clip fractions) take flat arrays: ``x (N,)`` and a
same-shaped 0/1 mask ``m (N,)`` (bool, int or float). They also accept any matching shapes, since they never look at
rows; per-row reductions are in :mod:`stages.algos.ragged`. ROLL's ``masked_normalize`` (§1.5) is used by neither
ROLL's RL pipelines nor ours and is not provided.

Whitening is split in three so that a stage can compute the statistics across Ray Data blocks::

    parts = sum_partials([whiten_partials(x_k, m_k) for each block k])   # (count, sum, sum of squares), float64
    mean, var = whiten_stats_from_partials(*parts)                       # unbiased variance
    y_k = whiten_with(x_k, mean, var)                                    # per block

``masked_whiten(x, m)`` is exactly those three steps on one block (``masked_whiten(x_k, m_k, stats=(mean, var))`` the
last one on block ``k``). Accumulation is float64; outputs are float32.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from schemas.errors import InvariantError

MEAN_EPS = 1e-8  # masked mean denominator Σm + 1e-8 (§0.3)
WHITEN_EPS = 1e-8  # (σ² + 1e-8)^(-1/2) (§1.4)

WhitenPartials = tuple[float, float, float]  # (count Σm, Σ x·m, Σ x²·m), float64, additive across blocks


def as_mask(m: np.ndarray, shape: tuple[int, ...], what: str = "mask") -> np.ndarray:
    """``m`` as a float64 0/1 array of ``shape``; a clear error when the shapes disagree."""
    m = np.asarray(m)
    if m.shape != tuple(shape):
        raise InvariantError(f"{what} has shape {m.shape} but the values have shape {tuple(shape)}; "
                             "the token mask must have one entry per value (response_mask[1:] of each row)")
    return m.astype(np.float64, copy=False)


# ---- §1.1, §1.2 ----------------------------------------------------------------------------------------------------
def masked_sum(x: np.ndarray, m: np.ndarray) -> float:
    """``Σ x·m`` over all elements (§1.2, ``dim=None``)."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.sum(x * as_mask(m, x.shape)))


def masked_mean(x: np.ndarray, m: np.ndarray) -> float:
    """``Σ x·m / (Σm + 1e-8)`` over all elements; 0 when nothing is selected (§1.1, ``dim=None``)."""
    x = np.asarray(x, dtype=np.float64)
    mf = as_mask(m, x.shape)
    return float(np.sum(x * mf) / (np.sum(mf) + MEAN_EPS))


# ---- §1.3, §1.4: whitening, split for distributed statistics ------------------------------------------------------
def whiten_partials(x: np.ndarray, m: np.ndarray) -> WhitenPartials:
    """``(Σm, Σ x·m, Σ x²·m)`` in float64; add them elementwise across blocks (:func:`sum_partials`)."""
    x = np.asarray(x, dtype=np.float64)
    mf = as_mask(m, x.shape)
    xm = x * mf
    return float(mf.sum()), float(xm.sum()), float((xm * x).sum())


def sum_partials(parts: Iterable[WhitenPartials]) -> WhitenPartials:
    """Elementwise sum of :func:`whiten_partials` results (``(0, 0, 0)`` for none)."""
    count, total, total_sq = 0.0, 0.0, 0.0
    for c, s, q in parts:
        count, total, total_sq = count + c, total + s, total_sq + q
    return count, total, total_sq


def whiten_stats_from_partials(count: float, total: float, total_sq: float,
                               unbiased: bool = True) -> tuple[float, float]:
    """``(μ, σ²)`` from summed partials, as ROLL's ``masked_mean`` / ``masked_var`` (§1.3).

    ``μ = Σxm/(n + 1e-8)``, biased ``v = Σ(x−μ)²m/(n + 1e-8)``, unbiased ``v·n/(n−1)``. Unbiased needs ``n ≥ 2``.
    """
    if unbiased and count == 0:
        raise InvariantError("masked variance needs at least one masked element, the mask sums to 0; "
                             "skip whitening when the batch has no response token")
    if unbiased and count == 1:
        raise InvariantError("masked variance with a mask that sums to 1 divides by zero (n/(n-1)); "
                             "skip whitening when the batch has a single response token")
    mean = total / (count + MEAN_EPS)
    squared_dev = max(total_sq - 2.0 * mean * total + mean * mean * count, 0.0)  # Σ (x−μ)² m
    var = squared_dev / (count + MEAN_EPS)
    if unbiased:
        var *= count / (count - 1.0)
    return mean, var


def whiten_with(x: np.ndarray, mean: float, var: float, shift_mean: bool = True) -> np.ndarray:
    """``(x − μ)·(σ² + 1e-8)^(-1/2)`` on **every** element (``+ μ`` back if not ``shift_mean``), float32 (§1.4)."""
    y = (np.asarray(x, dtype=np.float64) - mean) / np.sqrt(var + WHITEN_EPS)
    if not shift_mean:
        y = y + mean
    return y.astype(np.float32)


def masked_whiten(x: np.ndarray, m: np.ndarray, shift_mean: bool = True,
                  stats: tuple[float, float] | None = None) -> np.ndarray:
    """Batch-wide whitening with pooled statistics of the masked elements, applied to all elements (§1.4).

    ``stats``: the whole batch's ``(μ, σ²)`` when ``x`` is one block of it (:func:`whiten_stats_from_partials` of the
    summed :func:`whiten_partials` of every block); default: those of ``x`` itself. ROLL's ``masked_var`` (§1.3) is
    ``whiten_stats_from_partials(*whiten_partials(x, m), unbiased)[1]``.
    """
    mean, var = stats if stats is not None else whiten_stats_from_partials(*whiten_partials(x, m))
    return whiten_with(x, mean, var, shift_mean=shift_mean)


def can_whiten(count: float) -> bool:
    """ROLL disables whitening when ``Σm ≤ 1`` over the whole batch (§4.3 step 1)."""
    return count > 1


# ---- §1.7 ----------------------------------------------------------------------------------------------------------
def clip_counts(x: np.ndarray, *, low: float, high: float, m: np.ndarray | None = None) -> tuple[int, int]:
    """``(#{x > high} + #{x < low}, #elements)``, over all elements or only where ``m = 1``; additive over blocks."""
    x = np.asarray(x)
    outside = (x > high) | (x < low)
    if m is None:
        return int(outside.sum()), int(x.size)
    keep = as_mask(m, x.shape) > 0
    return int((outside & keep).sum()), int(keep.sum())


def clip_fraction(x: np.ndarray, *, low: float, high: float) -> float:
    """ROLL's ``compute_clip_fraction``: clipped fraction over **all** elements, 0 if empty (§1.7, [Q-3]).

    Over ragged rows "all elements" are the real next-token positions (prompt and response), not ROLL's padding.
    """
    clipped, total = clip_counts(x, low=low, high=high)
    return clipped / total if total else 0.0


def masked_clip_fraction(x: np.ndarray, m: np.ndarray, *, low: float, high: float) -> float:
    """Clipped fraction over the masked elements only (the [Q-3] fix), 0 if the mask is empty."""
    clipped, total = clip_counts(x, low=low, high=high, m=m)
    return clipped / total if total else 0.0
