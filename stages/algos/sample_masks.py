"""Response masks at generation time and RLVR per-sample masks, ROLL's numerics.

Spec: ALGORITHMS.md §1.9 (``get_pad_mask``, ``get_eos_mask``) and §3.5 (``difficulty_mask``,
``get_sample_level_mask``). Token masks accept a right-padded ``(B, T)`` array, a :class:`Ragged` column or a list of
per-row token lists and return the same form (a list gives a :class:`Ragged`). The sample mask is per row ``(B,)``;
the caller multiplies the token mask ``response_mask[1:]`` of each row by it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from schemas.errors import InvariantError
from stages.algos.ragged import Ragged
from stages.algos.reward_norm import rlvr_group_index

TokenRows = np.ndarray | Ragged | Sequence[Sequence[int]]


def _as_ragged(response_ids: TokenRows) -> tuple[Ragged, bool]:
    """``(Ragged, was_padded_2d)``: a ``(B, T)`` array becomes ``B`` rows of length ``T``."""
    if isinstance(response_ids, Ragged):
        return response_ids, False
    if isinstance(response_ids, np.ndarray) and response_ids.ndim == 2:
        num_rows, width = response_ids.shape
        offsets = np.arange(num_rows + 1, dtype=np.int64) * width
        return Ragged(response_ids.reshape(-1), offsets), True
    return Ragged.from_rows(list(response_ids), dtype=np.int64), False


def _like_input(mask: Ragged, was_padded_2d: bool) -> np.ndarray | Ragged:
    if was_padded_2d:
        width = int(mask.lengths[0]) if mask.num_rows else 0
        return mask.values.reshape(mask.num_rows, width)
    return mask


def _count_before(flags: np.ndarray, x: Ragged) -> np.ndarray:
    """``(N,)`` number of set ``flags`` strictly before each element inside its row."""
    running = np.cumsum(flags, dtype=np.int64)
    before_row = np.concatenate([[0], running])[x.offsets[:-1]]
    return running - flags - np.repeat(before_row, x.lengths)


def get_eos_mask(response_ids: TokenRows, eos_token: int) -> np.ndarray | Ragged:
    """1 up to and including the first ``eos_token`` of each row, 0 after (all 1 without an eos). int64 (§1.9)."""
    x, padded = _as_ragged(response_ids)
    is_eos = (x.values == eos_token).astype(np.int64)
    return _like_input(x.with_values((_count_before(is_eos, x) == 0).astype(np.int64)), padded)


def get_pad_mask(response_ids: TokenRows, pad_token: int, eos_token: int) -> np.ndarray | Ragged:
    """1 where the token is not ``pad_token``; when ``eos_token == pad_token`` the first pad (the eos) is kept (§1.9).

    Raises InvariantError when a row starts with a masked token but has unmasked tokens later (ROLL's assertion).
    """
    x, padded = _as_ragged(response_ids)
    is_pad = (x.values == pad_token).astype(np.int64)
    keep = is_pad == 0
    if eos_token == pad_token:
        keep |= (is_pad == 1) & (_count_before(is_pad, x) == 0)
    starts_masked = np.zeros(x.num_rows, dtype=bool)
    nonempty = x.lengths > 0
    starts_masked[nonempty] = ~keep[x.offsets[:-1][nonempty]]
    kept_per_row = np.bincount(x.row_index(), weights=keep, minlength=x.num_rows)
    bad = np.flatnonzero(starts_masked & (kept_per_row > 0))
    if bad.size:
        raise InvariantError(f"response_ids rows {bad[:10].tolist()} start with pad token {pad_token} but have real "
                             "tokens later; responses must be right-padded — fix the generation output")
    return _like_input(x.with_values(keep.astype(np.int64)), padded)


def difficulty_mask(scores: np.ndarray, n_sample: int, low_threshold: float, high_threshold: float, *,
                    group: np.ndarray | None = None) -> np.ndarray:
    """``(B,)`` bool: the mean score of the row's prompt group lies strictly inside ``(low, high)`` (§3.5).

    Groups are the rows sharing a ``group (B,)`` key when given (the pipeline keys by prompt id), else consecutive
    blocks of ``n_sample`` rows (ROLL on a table sorted by prompt id); ``n_sample ≤ 1`` keeps every row. A NaN score
    ("cannot score") is left out of its group's mean; a group without a scored row is dropped.
    """
    s = np.asarray(scores, dtype=np.float64)
    if n_sample <= 1:
        return np.ones(len(s), dtype=bool)
    index = rlvr_group_index(len(s), n_sample, group)
    scored = ~np.isnan(s)
    count = np.bincount(index[scored], minlength=int(index.max(initial=-1)) + 1).astype(np.float64)
    total = np.bincount(index[scored], weights=s[scored], minlength=len(count))
    with np.errstate(invalid="ignore", divide="ignore"):
        pass_rate = (total / count)[index]
    return (pass_rate > low_threshold) & (pass_rate < high_threshold)  # no scored row: NaN → False


def get_sample_level_mask(response_lengths: np.ndarray, max_new_tokens: int, scores: np.ndarray, n_sample: int, *,
                          max_len_mask: bool = False, use_difficulty_mask: bool = False,
                          difficulty_low_threshold: float = 0.0, difficulty_high_threshold: float = 1.0,
                          error_max_len_clip: bool = False, error_max_len_threshold: int = 9999999999,
                          group: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """RLVR per-sample mask ``s (B,)`` float32 and ROLL's metrics (§3.5).

    ``response_lengths (B,)`` = number of response tokens ``Σ response_mask[1:]``; ``max_new_tokens`` = ``Lmax``.
    1. ``max_len_mask``: drop rows with ``L = Lmax`` (truncated). 2. ``use_difficulty_mask``: keep rows whose prompt
    group's mean score is in ``(low, high)`` (groups: ``group`` keys, else consecutive blocks of ``n_sample``, see
    :func:`difficulty_mask`). 3. ``error_max_len_clip``: keep ``(score = 0 ∧ L < threshold) ∨ score = 1``. Rows with a
    NaN score ("cannot score") get 0. Each ratio metric is its own mask's mean over all rows (1.0 when off);
    ``final_mask_ratio``, ``samples_used`` and ``samples_total`` describe ``s``. Equal to ROLL on scored rows.
    """
    lengths = np.asarray(response_lengths)
    s_scores = np.asarray(scores, dtype=np.float64)
    num_rows = len(lengths)
    if s_scores.shape != (num_rows,):
        raise InvariantError(f"scores has shape {s_scores.shape}, expected ({num_rows},) like response_lengths")
    filters = [
        ("actor/max_len_mask_ratio", max_len_mask, lambda: lengths != max_new_tokens),
        ("actor/difficulty_mask_ratio", use_difficulty_mask,
         lambda: difficulty_mask(s_scores, n_sample, difficulty_low_threshold, difficulty_high_threshold,
                                 group=group)),
        ("actor/error_len_mask_ratio", error_max_len_clip,
         lambda: ((s_scores == 0) & (lengths < error_max_len_threshold)) | (s_scores == 1)),
    ]
    sample_mask = np.ones(num_rows, dtype=np.float32)
    metrics: dict[str, float] = {}
    for metric_name, enabled, build in filters:
        if not enabled:
            metrics[metric_name] = 1.0
            continue
        keep = build().astype(np.float32)
        metrics[metric_name] = float(keep.mean()) if num_rows else 1.0
        sample_mask *= keep
    sample_mask *= (~np.isnan(s_scores)).astype(np.float32)
    metrics["actor/final_mask_ratio"] = float(sample_mask.mean()) if num_rows else 1.0
    metrics["actor/samples_used"] = float(sample_mask.sum())
    metrics["actor/samples_total"] = float(num_rows)
    return sample_mask, metrics
