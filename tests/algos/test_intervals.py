"""The 95 % intervals the learning benchmarks and the report use (stages/algos/intervals.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stages.algos.intervals import Z95, mean_interval, paired_bootstrap_diff, wilson


def test_wilson_interval_matches_its_formula_at_known_points():
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson(50, 100)
    assert (low, high) == pytest.approx((0.4038, 0.5962), abs=1e-4)


def test_paired_bootstrap_is_seeded_and_brackets_the_mean_difference():
    rng = np.random.default_rng(3)
    before = (rng.random(200) < 0.3).astype(float)
    after = np.maximum(before, (rng.random(200) < 0.3).astype(float))
    diff, low, high = paired_bootstrap_diff(before, after)
    assert (diff, low, high) == paired_bootstrap_diff(before, after)
    assert diff == pytest.approx(after.mean() - before.mean()) and 0 < low < diff < high
    assert paired_bootstrap_diff(before, before) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="one length"):
        paired_bootstrap_diff(before, after[:-1])


def test_mean_interval_is_wilsons_for_pass_rates_and_normal_otherwise():
    passes = np.array([1, 0, 0, 1, 0, 0, 0, 0, 1, 0], float)
    assert mean_interval(passes) == wilson(3, 10)
    assert mean_interval(np.zeros(10))[0] == 0.0 and mean_interval(np.zeros(10))[1] > 0  # never a zero width
    scores = np.array([0.5, 0.25, 1.0, 0.75, 0.0, 0.5])
    half = Z95 * scores.std(ddof=1) / np.sqrt(len(scores))
    assert mean_interval(scores) == pytest.approx((scores.mean() - half, scores.mean() + half))
    assert np.isnan(mean_interval(np.array([]))).all()
    assert mean_interval(np.array([0.5])) == (-np.inf, np.inf)
