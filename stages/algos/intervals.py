"""95 % intervals for held-out scores: Wilson's interval of one pass rate, and a paired bootstrap of the difference
between two evaluations of the same items (before and after training). Pure numpy."""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n`` (``(0, 1)`` when ``n`` is 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_bootstrap_diff(before: np.ndarray, after: np.ndarray, resamples: int = 10000, seed: int = 0,
                          level: float = 0.95) -> tuple[float, float, float]:
    """(mean(after − before), low, high): the percentile interval of the mean difference over ``resamples``
    resamplings of the items with replacement; ``before`` and ``after`` are the scores of the same items, shape
    (n,)."""
    before, after = np.asarray(before, float), np.asarray(after, float)
    if before.shape != after.shape or before.ndim != 1 or len(before) == 0:
        raise ValueError(f"paired scores must be two non-empty vectors of one length, got {before.shape} and "
                         f"{after.shape}")
    diff = after - before
    idx = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(diff.mean()), float(low), float(high)


def mean_interval(values: np.ndarray, z: float = Z95) -> tuple[float, float]:
    """95 % interval of the mean of ``values`` (shape (n,)): Wilson's when every value is 0 or 1 (a pass rate),
    else the normal approximation ``mean ± z·sd/√n`` (sample sd); ``(nan, nan)`` for no values."""
    values = np.asarray(values, float)
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    if np.isin(values, (0.0, 1.0)).all():
        return wilson(float(values.sum()), n, z)
    half = z * float(values.std(ddof=1)) / math.sqrt(n) if n > 1 else float("inf")
    return float(values.mean()) - half, float(values.mean()) + half
