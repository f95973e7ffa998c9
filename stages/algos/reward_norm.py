"""Response-level reward normalisation over narrow columns (one value per row), ROLL's numerics.

Spec: ALGORITHMS.md §5.2 (agentic ``agentic_reward_norm`` and ``RewardNormalizationConfig`` resolution), §3.1
(``RunningMoments``), §3.2 (RLVR ``reward_norm``), §3.3 (``reward_postprocess``; its clip fraction is §1.7's
:func:`stages.algos.functional.clip_fraction`). ROLL's §3.4 ``group_reward_norm`` helper (unused by its pipelines) is
:func:`reward_norm` with ``norm_mean_type: group`` and ``norm_std_type: group | None``; its ``div_std_global``
variant is not offered.

Every function takes ``(B,)`` arrays and returns ``(B,)`` float32 in the input row order. Statistics are computed in
float64 and cast at the end. Batch-scope statistics can be injected (``batch_mean`` / ``batch_std``) so that a stage
working block by block can pass statistics computed over the whole table; the main path is one call over the whole
narrow table, which fits in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from schemas.capabilities import estimator_capabilities
from schemas.errors import ConfigError, InvariantError
from stages.algos.functional import clip_fraction

STD_EPS = 1e-6  # added to every std before dividing (§0.3)
KNOWN_METHODS = ("identity", "mean", "mean_std", "asym_clip")
AGENTIC_NORM_TYPES = (None, "batch", "group")
RLVR_NORM_TYPES = (None, "batch", "group", "running")


class NormTypes(NamedTuple):
    """Resolved normalisation: ``mean_type`` / ``std_type`` in ``batch | group | running | None``."""

    mean_type: str | None
    std_type: str | None


# ---- §5.2 RewardNormalizationConfig.__post_init__ ------------------------------------------------------------------
def canonical_method(method: str | None) -> str:
    """The deprecated ``method`` field as ROLL keeps it: unknown values (and None) become ``identity``."""
    return method if method in KNOWN_METHODS else "identity"


def resolve_norm_types(grouping: str = "batch", method: str | None = "identity",
                       norm_mean_type: str | None = None, norm_std_type: str | None = None) -> NormTypes:
    """Resolve ``(grouping, method, explicit types)`` to the types ``agentic_reward_norm`` uses (§5.2).

    Scope is ``batch`` when ``grouping == "batch"``, else ``group``. ``identity`` → (None, None), ``mean`` →
    (scope, None), ``mean_std``/``asym_clip`` → (scope, scope). An explicit type wins; the derived one only fills a
    field left None.
    """
    scope = "batch" if grouping == "batch" else "group"
    derived_by_method = {
        "identity": (None, None),
        "mean": (scope, None),
        "mean_std": (scope, scope),
        "asym_clip": (scope, scope),
    }
    derived_mean, derived_std = derived_by_method[canonical_method(method)]
    return NormTypes(norm_mean_type if norm_mean_type is not None else derived_mean,
                     norm_std_type if norm_std_type is not None else derived_std)


def resolve_rlvr_norm_types(adv_estimator: str, norm_mean_type: str | None,
                            norm_std_type: str | None) -> NormTypes:
    """§3.3 step 1 as a resolved value (the config is never mutated): an estimator whose table row says
    ``forces_group_norm`` (``grpo``) forces ``(group, group)``."""
    if estimator_capabilities(adv_estimator).forces_group_norm:
        return NormTypes("group", "group")
    return NormTypes(norm_mean_type, norm_std_type)


def _check_type(value: str | None, allowed: tuple, field: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{field} = {value!r} is not one of {list(allowed)}; set it to one of those")


# ---- grouping helpers --------------------------------------------------------------------------------------------
def group_index(keys: np.ndarray | None, num_rows: int) -> np.ndarray:
    """``(B,)`` int64 dense group index of each row (all 0 when ``keys`` is None: the whole batch is one group)."""
    if keys is None:
        return np.zeros(num_rows, dtype=np.int64)
    keys = np.asarray(keys)
    if keys.shape != (num_rows,):
        raise InvariantError(f"group key column has shape {keys.shape}, expected ({num_rows},) like the values; "
                             "pass one key per row")
    return np.unique(keys, return_inverse=True)[1].reshape(-1).astype(np.int64)


@dataclass(frozen=True)
class GroupMoments:
    """Per-group ``count``, ``mean`` and unbiased ``std`` (NaN for singleton groups), each ``(G,)`` float64."""

    count: np.ndarray
    mean: np.ndarray
    std: np.ndarray


def group_moments(x: np.ndarray, index: np.ndarray) -> GroupMoments:
    """Statistics of ``x (B,)`` per group ``index (B,)`` via ``bincount`` (torch ``std``: ddof=1)."""
    count = np.bincount(index).astype(np.float64)
    mean = np.bincount(index, weights=x) / np.maximum(count, 1)
    sq_dev = np.bincount(index, weights=(x - mean[index]) ** 2, minlength=len(count))
    with np.errstate(divide="ignore", invalid="ignore"):
        std = np.sqrt(np.where(count > 1, sq_dev / (count - 1), np.nan))
    return GroupMoments(count, mean, std)


def batch_moments(x: np.ndarray) -> tuple[float, float]:
    """``(mean, unbiased std)`` of all of ``x (B,)``; std is NaN for ``B = 1``. Use it to inject batch statistics."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        raise InvariantError("batch statistics of an empty reward column; the table has no rows")
    std = float(np.std(x, ddof=1)) if x.size > 1 else math.nan
    return float(np.mean(x)), std


def _as_values(values: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise InvariantError(f"{what} must be one value per row, shape (B,); got shape {x.shape}")
    return x


# ---- §5.2 agentic_reward_norm --------------------------------------------------------------------------------------
def agentic_reward_norm(values: np.ndarray, group_keys: np.ndarray | None, mean_type: str | None,
                        std_type: str | None, *, batch_mean: float | None = None,
                        batch_std: float | None = None) -> np.ndarray:
    """Agentic normalisation (§5.2). ``values (B,)``, ``group_keys (B,)`` or None (grouping ``batch``) → ``(B,)`` f32.

    mean: ``batch`` → batch mean, ``group`` → group mean, None → 0. std: ``batch`` / ``group`` unbiased, None → none.
    With a std: ``(x − mean)/(std + 1e-6)`` where the row's group has more than one row and ``|std| > 1e-6``, else 0
    (the group-size test applies to a batch std too — ROLL's Q-9, kept). Without: ``x − mean``.
    ``batch_mean``/``batch_std`` override the batch statistics (e.g. computed over the whole table).
    """
    _check_type(mean_type, AGENTIC_NORM_TYPES, "reward_normalization.norm_mean_type")
    _check_type(std_type, AGENTIC_NORM_TYPES, "reward_normalization.norm_std_type")
    x = _as_values(values, "agentic_reward_norm values")
    index = group_index(group_keys, len(x))
    groups = group_moments(x, index)
    if "batch" in (mean_type, std_type) and (batch_mean is None or batch_std is None):
        own_mean, own_std = batch_moments(x)
        batch_mean = own_mean if batch_mean is None else batch_mean
        batch_std = own_std if batch_std is None else batch_std
    mean_by_type = {None: lambda: 0.0, "batch": lambda: batch_mean, "group": lambda: groups.mean[index]}
    centred = x - mean_by_type[mean_type]()
    if std_type is None:
        return centred.astype(np.float32)
    std = np.broadcast_to(batch_std if std_type == "batch" else groups.std[index], x.shape)
    with np.errstate(invalid="ignore"):
        usable = (groups.count[index] > 1) & (np.abs(std) > STD_EPS)
    out = np.zeros_like(x)
    out[usable] = centred[usable] / (std[usable] + STD_EPS)
    return out.astype(np.float32)


# ---- §3.1 RunningMoments ---------------------------------------------------------------------------------------------
class RunningMoments:
    """Running mean/variance across iterations (§3.1). One per RLVR domain (BUG-2 fix: the caller keys by domain).

    State: ``mean``, biased running ``var``, ``std`` (with ``count/(count−1)`` correction) and ``count``; starts at
    ``(0, 1, 1, 1e-24)``. JSON-able through :meth:`state_dict` / :meth:`from_state`.
    """

    def __init__(self, mean: float = 0.0, var: float = 1.0, std: float = 1.0, count: float = 1e-24) -> None:
        self.mean, self.var, self.std, self.count = float(mean), float(var), float(std), float(count)

    def update(self, xs: np.ndarray) -> tuple[float, float]:
        """Fold ``xs (n,)`` in; return the batch ``(mean, unbiased std)`` (std NaN for ``n = 1``)."""
        x = np.asarray(xs, dtype=np.float64).reshape(-1)
        n = x.size
        if n == 0:
            raise InvariantError("RunningMoments.update got no values; update only with a non-empty reward batch")
        batch_mean, batch_var = float(x.mean()), float(x.var())
        delta = batch_mean - self.mean
        total = self.count + n
        self.var = (self.var * self.count + delta**2 * self.count * n / total + batch_var * n) / total
        self.mean += delta * n / total
        self.std = math.sqrt(self.var * total / (total - 1))
        self.count = total
        return batch_mean, math.sqrt(batch_var * n / (n - 1)) if n > 1 else math.nan

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "std": self.std, "count": self.count}

    @classmethod
    def from_state(cls, state: dict[str, float]) -> "RunningMoments":
        missing = {"mean", "var", "std", "count"} - set(state)
        if missing:
            raise InvariantError(f"RunningMoments state lacks {sorted(missing)}; pass what state_dict() returned")
        return cls(state["mean"], state["var"], state["std"], state["count"])

    def __repr__(self) -> str:
        return f"RunningMoments(mean={self.mean}, var={self.var}, std={self.std}, count={self.count})"


# ---- §3.2 reward_norm (RLVR) -----------------------------------------------------------------------------------------
def consecutive_groups(num_rows: int, n_sample: int) -> np.ndarray:
    """``(B,)`` group index for consecutive groups of ``n_sample`` rows (the RLVR prompt groups)."""
    if num_rows % n_sample:
        raise InvariantError(f"{num_rows} rows are not a whole number of prompt groups of {n_sample} "
                             "(num_return_sequences); keep complete groups, sorted so each prompt's rows are adjacent")
    return np.arange(num_rows, dtype=np.int64) // n_sample


def rlvr_group_index(num_rows: int, n_sample: int | None, group: np.ndarray | None) -> np.ndarray:
    """``(B,)`` dense group index: ``group (B,)`` keys when given (rows sharing a prompt id, in any order), else
    consecutive blocks of ``n_sample`` rows (ROLL, on a table sorted by prompt id); ``n_sample ≤ 0`` or None without
    keys: the whole batch is one group."""
    if group is not None:
        return group_index(group, num_rows)
    if n_sample is not None and n_sample > 0:
        return consecutive_groups(num_rows, n_sample)
    return np.zeros(num_rows, dtype=np.int64)


def _scored_rows(num_rows: int, scored: np.ndarray | None) -> np.ndarray:
    if scored is None:
        return np.ones(num_rows, dtype=bool)
    mask = np.asarray(scored, dtype=bool)
    if mask.shape != (num_rows,):
        raise InvariantError(f"scored mask has shape {mask.shape}, expected ({num_rows},) like the rewards")
    return mask


def reward_norm(r: np.ndarray, n_sample: int | None, mean_type: str | None, std_type: str | None,
                running: RunningMoments | None = None, *, batch_mean: float | None = None,
                batch_std: float | None = None, group: np.ndarray | None = None, scored: np.ndarray | None = None,
                zero_without_spread: bool = False) -> np.ndarray:
    """RLVR normalisation (§3.2). ``r (B,)`` → ``(B,)`` float32, ``(r − mean)/(std + 1e-6)`` or ``r − mean``.

    Groups: ``group (B,)`` keys when given (the pipeline keys by prompt id), else consecutive blocks of ``n_sample``
    rows (``n_sample ≤ 0``: the whole batch is one group). ``running`` is updated with the scored values before it is
    read (pass the domain's own tracker: BUG-2). BUG-3 fixed: a group std with a non-group mean divides each row by
    its own group's std, output stays ``(B,)``. ``scored (B,)`` bool: rows where it is False ("cannot score") are left
    out of every statistic (group, batch, running) and get 0; with no scored row the result is all 0 and ``running``
    is untouched. A group (or batch) of one value has no std: NaN as ROLL, or 0 with ``zero_without_spread``.
    """
    _check_type(mean_type, RLVR_NORM_TYPES, "norm_mean_type")
    _check_type(std_type, RLVR_NORM_TYPES, "norm_std_type")
    r = _as_values(r, "response_level_rewards")
    keep = _scored_rows(len(r), scored)
    index_all = rlvr_group_index(len(r), n_sample, group)
    out = np.zeros(len(r), dtype=np.float32)
    if scored is not None and not keep.any():
        return out
    x, index = r[keep], np.unique(index_all[keep], return_inverse=True)[1].reshape(-1).astype(np.int64)
    if "running" in (mean_type, std_type):
        if running is None:
            raise ConfigError("norm_mean_type/norm_std_type = 'running' needs the domain's RunningMoments; "
                              "pass running=<the tracker of this domain>")
        running.update(x)
    if "batch" in (mean_type, std_type) and (batch_mean is None or batch_std is None):
        own_mean, own_std = batch_moments(x)
        batch_mean = own_mean if batch_mean is None else batch_mean
        batch_std = own_std if batch_std is None else batch_std
    groups = group_moments(x, index) if "group" in (mean_type, std_type) else None
    stat_by_type = {
        None: lambda moment: 0.0,
        "batch": lambda moment: batch_mean if moment == "mean" else batch_std,
        "group": lambda moment: getattr(groups, moment)[index],
        "running": lambda moment: getattr(running, moment),
    }
    centred = x - stat_by_type[mean_type]("mean")
    if std_type is None:
        out[keep] = centred.astype(np.float32)
        return out
    std = np.broadcast_to(np.asarray(stat_by_type[std_type]("std"), dtype=np.float64), x.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        normalised = (centred / (std + STD_EPS)).astype(np.float32)
    if zero_without_spread:
        normalised[np.isnan(std)] = 0.0
    out[keep] = normalised
    return out


# ---- §3.3 -----------------------------------------------------------------------------------------------------------
def clip_rewards(rewards: np.ndarray, reward_clip: float | None) -> tuple[np.ndarray, dict[str, float]]:
    """Clamp to ``±reward_clip`` when it is truthy; metric ``critic/reward_clip_frac``, ROLL's clip fraction over
    all of ``rewards`` (§1.7; empty dict when not clipping)."""
    if not reward_clip:
        return rewards, {}
    frac = clip_fraction(rewards, low=-reward_clip, high=reward_clip)
    return np.clip(rewards, -reward_clip, reward_clip).astype(rewards.dtype), {"critic/reward_clip_frac": frac}


def reward_postprocess(r: np.ndarray, adv_estimator: str, norm_mean_type: str | None, norm_std_type: str | None,
                       n_sample: int | None, reward_clip: float | None = None,
                       running: RunningMoments | None = None, *, group: np.ndarray | None = None,
                       scored: np.ndarray | None = None,
                       zero_without_spread: bool = False) -> tuple[np.ndarray, dict[str, float]]:
    """RLVR per-domain reward post-processing (§3.3): normalise then clip. ``r (B,)`` → ``(B,)`` float32, metrics.

    ``grpo`` uses ``(group, group)`` (see :func:`resolve_rlvr_norm_types`); nothing is mutated. ``group``,
    ``scored`` and ``zero_without_spread`` are :func:`reward_norm`'s. The metric ``critic/reward_clip_frac`` is over
    the scored rows (0.0 when no clip is set or no row is scored).
    """
    types = resolve_rlvr_norm_types(adv_estimator, norm_mean_type, norm_std_type)
    normalised = reward_norm(r, n_sample, types.mean_type, types.std_type, running, group=group, scored=scored,
                             zero_without_spread=zero_without_spread)
    keep = _scored_rows(len(normalised), scored)
    clipped, metrics = clip_rewards(normalised[keep], reward_clip)
    normalised[keep] = clipped
    return normalised, {"critic/reward_clip_frac": 0.0, **metrics}
