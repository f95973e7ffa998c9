"""Returns and advantage recursions over ragged next-token rows (spec ALGORITHMS.md §4.1, §4.2, §4.5, §4.6).

Every recursion here is the linear backward recurrence ``y_t = x_t + c_t·y_{t+1}`` inside a row (``y`` after a row's
last element is 0). :func:`reverse_linear_scan` solves it for all rows at once: a segmented reverse cumsum when every
``c_t = 1``, otherwise a log-depth doubling scan (``⌈log2 L_max⌉`` vectorised passes over the flat values, no loop
over rows or positions). All inputs are next-token columns (``Ragged``, ``L − 1`` entries per row) with a flat token
mask ``m (N,)`` = ``response_mask[1:]`` of each row. Accumulation is float64; outputs are float32.
"""

from __future__ import annotations

import numpy as np

from schemas.errors import InvariantError
from stages.algos.functional import MEAN_EPS, as_mask
from stages.algos.ragged import Ragged, last_index, segment_ids


# ---- the one recursion ---------------------------------------------------------------------------------------------
def reverse_linear_scan(x: np.ndarray, coef: float | np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``(N,)`` float64 ``y`` with ``y_t = x_t + c_t·y_{t+1}`` inside each row and 0 beyond a row's end.

    ``x (N,)``, ``coef`` a scalar or ``(N,)`` (``c_t`` links position ``t`` to ``t+1``), ``offsets (B+1,)``.
    """
    x = np.asarray(x, dtype=np.float64)
    rows = Ragged(x, np.asarray(offsets, dtype=np.int64))
    if np.isscalar(coef) and float(coef) == 1.0:
        return _segmented_reverse_cumsum(x, rows)
    ends = last_index(rows)
    ends = ends[ends >= 0]
    link = np.broadcast_to(np.asarray(coef, dtype=np.float64), x.shape).copy()
    link[ends] = 0.0  # no link across a row end
    return _doubling_scan(x.copy(), link, int(rows.lengths.max(initial=0)))


SCAN_CELLS = 1 << 22  # padded cells per step of the γ = 1 scan (32 MB of float64): bounds its scratch


def _segmented_reverse_cumsum(x: np.ndarray, rows: Ragged) -> np.ndarray:
    """``y_t = Σ_{k ≥ t, same row} x_k`` (the ``γ = 1`` case), summed inside each row from its last element back, as
    ROLL's loop over positions adds them. No sum runs across rows, so a row's values do not depend on which rows share
    its block (a cumsum over the whole block did: its rounding grew with the rows before, BENCHMARKS.md issue 49).

    Rows are laid out reversed in a zero-padded ``(rows, longest row)`` array, at most ``SCAN_CELLS`` cells at a time,
    and summed along its rows (one sequential cumsum per row)."""
    out = np.empty_like(x)
    lengths = rows.lengths
    width = int(lengths.max(initial=0))
    from_end = np.repeat(rows.offsets[1:] - 1, lengths) - np.arange(len(x), dtype=np.int64)  # position counted back
    step = max(1, SCAN_CELLS // max(width, 1))
    for lo in range(0, rows.num_rows, step):
        hi = min(rows.num_rows, lo + step)
        first, last = int(rows.offsets[lo]), int(rows.offsets[hi])
        cell = np.repeat(np.arange(hi - lo, dtype=np.int64) * width, lengths[lo:hi]) + from_end[first:last]
        padded = np.zeros((hi - lo, width))
        padded.reshape(-1)[cell] = x[first:last]
        np.cumsum(padded, axis=1, out=padded)
        out[first:last] = padded.reshape(-1)[cell]
    return out


def _doubling_scan(acc: np.ndarray, link: np.ndarray, max_len: int) -> np.ndarray:
    """Hillis–Steele scan of affine maps: after the pass with stride ``d``, ``y_t = acc_t + link_t·y_{t+d}``."""
    stride = 1
    while stride < max_len:
        shifted_acc = np.zeros_like(acc)
        shifted_acc[:-stride] = acc[stride:]
        shifted_link = np.zeros_like(link)
        shifted_link[:-stride] = link[stride:]
        acc = acc + link * shifted_acc
        link = link * shifted_link
        stride *= 2
    return acc


def _next_in_row(v: np.ndarray, rows: Ragged) -> np.ndarray:
    """``(N,)`` ``v_{t+1}`` inside each row, 0 at a row's last element."""
    out = np.zeros_like(v)
    out[:-1] = v[1:]
    ends = last_index(rows)
    out[ends[ends >= 0]] = 0.0
    return out


def _same_rows(a: Ragged, b: Ragged, what: str) -> None:
    if not np.array_equal(a.offsets, b.offsets):
        raise InvariantError(f"{what}: rows have different lengths than the token rewards; "
                             "all next-token columns of a row must have L-1 entries")


# ---- §4.1 ----------------------------------------------------------------------------------------------------------
def reinforce_returns(rewards: Ragged, gamma: float) -> Ragged:
    """Discounted reward-to-go over **all** positions of each row, no mask: ``G_t = r_t + γ·G_{t+1}`` (§4.1).

    ``advantages = returns = G``. ``γ < 1`` discounts per token, observation tokens included [Q-7].
    """
    return rewards.with_values(reverse_linear_scan(rewards.values, gamma, rewards.offsets).astype(np.float32))


# ---- §4.2 and the [BUG-4] fix -------------------------------------------------------------------------------------
def gae(rewards: Ragged, values: Ragged, mask: np.ndarray | None, gamma: float, lambd: float,
        roll_compat: bool = False) -> tuple[Ragged, Ragged]:
    """Generalised advantage estimation → ``(advantages, returns)``, each ``(N,)`` rows like ``rewards``.

    Default (BUG-4 fixed): per row, the recursion runs over the response positions ``p_1 < … < p_K`` (``m = 1``)
    only: ``δ_k = r_{p_k} + γ·V_{p_{k+1}} − V_{p_k}`` with ``V_{p_{K+1}} = 0``, ``A_k = δ_k + γλ·A_{k+1}``,
    ``returns = A + V`` there; advantages and returns are 0 elsewhere. Rewards and values at non-response positions
    are never read, so observation tokens between turns are skipped (one discount step per response token).

    ``roll_compat=True`` reproduces ROLL's ``compute_gae_advantage_return`` (§4.2): the recursion runs over every
    position of the row with the values as given, ``V`` beyond the row end = 0, ``returns = A + V`` everywhere;
    ``mask`` is ignored. (ROLL's padded rows also run through the padding: pass padded rows to match it exactly.)
    """
    _same_rows(rewards, values, "gae values")
    r = rewards.values.astype(np.float64)
    v = values.values.astype(np.float64)
    if roll_compat:
        delta = r + gamma * _next_in_row(v, rewards) - v
        adv = reverse_linear_scan(delta, gamma * lambd, rewards.offsets)
        return rewards.with_values(adv.astype(np.float32)), rewards.with_values((adv + v).astype(np.float32))
    if mask is None:
        raise InvariantError("gae needs the token mask (response_mask[1:] of each row) unless roll_compat=True")
    resp = np.flatnonzero(as_mask(mask, r.shape, "gae mask") > 0)
    per_row = np.bincount(rewards.row_index()[resp], minlength=rewards.num_rows)
    compact = Ragged(v[resp], np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64))
    delta = r[resp] + gamma * _next_in_row(compact.values, compact) - compact.values
    adv_resp = reverse_linear_scan(delta, gamma * lambd, compact.offsets)
    adv, ret = np.zeros_like(r), np.zeros_like(r)
    adv[resp] = adv_resp
    ret[resp] = adv_resp + compact.values
    return rewards.with_values(adv.astype(np.float32)), rewards.with_values(ret.astype(np.float32))


# ---- §4.5, §4.6: segment (turn) level ----------------------------------------------------------------------------
def _segment_layout(x: Ragged, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seg (N,), seg_last (S,), seg_offsets (B+1,))``: segment id per position (−1 outside), the flat index of
    each segment's last position, and offsets grouping the ``S`` segments by row."""
    seg = segment_ids(x, as_mask(mask, x.values.shape, "segment mask"))
    inside = np.flatnonzero(seg >= 0)
    ids = seg[inside]
    is_last = np.ones(len(ids), dtype=bool)
    is_last[:-1] = ids[1:] != ids[:-1]
    seg_last = inside[is_last]
    per_row = np.bincount(x.row_index()[seg_last], minlength=x.num_rows)
    return seg, seg_last, np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)


def agentic_reinforce_returns(rewards: Ragged, mask: np.ndarray, gamma: float) -> Ragged:
    """Segment-level returns (§4.5): per row, segments (maximal runs of ``m = 1``) from last to first,
    ``G ← r[last position of the segment] + γ·G``, every position of the segment gets ``G``; 0 outside segments.

    Only the reward at each segment's last position is read [Q-8]. ``advantages = returns``.
    """
    seg, seg_last, seg_offsets = _segment_layout(rewards, mask)
    seg_return = reverse_linear_scan(rewards.values[seg_last], gamma, seg_offsets)
    out = np.where(seg >= 0, seg_return[np.maximum(seg, 0)] if len(seg_return) else 0.0, 0.0)
    return rewards.with_values(out.astype(np.float32))


def segment_masked_mean(x: Ragged, mask: np.ndarray) -> Ragged:
    """Each maximal run of ``m = 1`` gets ``Σ_run x / (n_run + 1e-8)`` at its positions, 0 elsewhere (§4.6)."""
    seg, seg_last, _ = _segment_layout(x, mask)
    inside = seg >= 0
    totals = np.bincount(seg[inside], weights=x.values[inside].astype(np.float64), minlength=len(seg_last))
    counts = np.bincount(seg[inside], minlength=len(seg_last))
    means = totals / (counts + MEAN_EPS)
    out = np.where(inside, means[np.maximum(seg, 0)] if len(means) else 0.0, 0.0)
    return x.with_values(out.astype(np.float32))
