"""Agentic response-level rewards over narrow columns (one value per row), ROLL's numerics.

Spec: ALGORITHMS.md §5.1 (``compute_discounted_returns``), §5.3 (``build_state_group``), §5.4
(``compute_response_level_rewards``), §5.5 (``get_agentic_response_level_mask``). Defects fixed by default, with
``roll_compat=True`` reproducing ROLL: BUG-5 (state groups keyed by ``(traj_group_id, state_hash)``) and BUG-6
(GiGPO step-level types honour the explicit ``norm_mean_type`` / ``norm_std_type``).

Which reward branch runs is the estimator registry entry's ``response_reward`` value, one of
:data:`RESPONSE_REWARD_KINDS` (gigpo → ``gigpo``, step_reinforce → ``step_return``, every other estimator →
``episode``); nothing here branches on an estimator name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from schemas.errors import ConfigError, InvariantError, SchemaError
from stages.algos.reward_norm import agentic_reward_norm, clip_rewards, group_index, resolve_norm_types

STATE_GROUP_SEPARATOR = "::"  # corrected state_group_id = f"{traj_group_id}::{state_hash}"


# ---- §5.1 compute_discounted_returns ---------------------------------------------------------------------------------
def discounted_returns(traj_id: np.ndarray, step: np.ndarray, step_scores: np.ndarray, gamma: float) -> np.ndarray:
    """Per-trajectory discounted return of each step row (§5.1): ``G_t = r_t + γ·G_{t+1}`` in step order.

    ``traj_id (B,)`` keys, ``step (B,)`` int, ``step_scores (B,)`` → ``(B,)`` float32 in the original row order.
    Rows are sorted by ``(traj_id, step)`` (stable, so duplicate steps keep their row order, as in ROLL); the
    backward recursion runs over step depth for all trajectories at once (loop length = longest trajectory).
    """
    rewards = np.asarray(step_scores, dtype=np.float64)
    steps = np.asarray(step)
    num_rows = len(rewards)
    if steps.shape != (num_rows,) or np.asarray(traj_id).shape != (num_rows,):
        raise InvariantError(f"discounted_returns: traj_id {np.shape(traj_id)}, step {steps.shape} and step_scores "
                             f"{rewards.shape} must all be (B,); step-wise batches have one step per row")
    traj = group_index(traj_id, num_rows)
    order = np.lexsort((steps, traj))  # by trajectory, then step
    sorted_traj = traj[order]
    starts = np.flatnonzero(np.r_[True, sorted_traj[1:] != sorted_traj[:-1]]) if num_rows else np.zeros(0, int)
    lengths = np.diff(np.r_[starts, num_rows])
    depth = np.arange(num_rows) - np.repeat(starts, lengths)  # position of each sorted row inside its trajectory
    has_next = np.flatnonzero(depth + 1 < np.repeat(lengths, lengths))  # sorted rows with a later step
    has_next = has_next[np.argsort(depth[has_next], kind="stable")]
    level_bounds = np.searchsorted(depth[has_next], np.arange(int(lengths.max(initial=0)) + 1))
    returns_sorted = rewards[order].copy()
    for k in range(len(level_bounds) - 2, -1, -1):  # deepest level first: G_t needs G_{t+1}
        rows = has_next[level_bounds[k]:level_bounds[k + 1]]
        returns_sorted[rows] += gamma * returns_sorted[rows + 1]
    out = np.empty(num_rows, dtype=np.float64)
    out[order] = returns_sorted
    return out.astype(np.float32)


# ---- §5.3 build_state_group ------------------------------------------------------------------------------------------
def build_state_group(traj_group_id: np.ndarray, state_hash: np.ndarray,
                      roll_compat: bool = False) -> tuple[np.ndarray, dict[str, float]]:
    """GiGPO anchor-state groups (§5.3). ``(B,)`` keys → ``state_group_id (B,)`` str, metrics.

    Corrected (BUG-5): ``state_group_id = f"{traj_group_id}::{state_hash}"``, so identical states of different
    groups stay apart. ``roll_compat``: the bare ``state_hash`` (ROLL). Metrics ``system/state_batch_size/{max,mean,
    min}`` are over the ``(traj_group_id, state_hash)`` buckets in both modes.
    """
    groups = np.asarray(traj_group_id).astype(str)
    hashes = np.asarray(state_hash).astype(str)
    if groups.shape != hashes.shape or groups.ndim != 1:
        raise InvariantError(f"build_state_group: traj_group_id {groups.shape} and state_hash {hashes.shape} must "
                             "both be (B,)")
    if roll_compat:
        state_group_id = hashes
    else:
        state_group_id = np.char.add(np.char.add(groups, STATE_GROUP_SEPARATOR), hashes)
    bucket_codes = group_index(groups, len(groups)) * (len(groups) + 1) + group_index(hashes, len(groups))
    sizes = np.unique(bucket_codes, return_counts=True)[1].astype(np.float64)
    metrics = {} if sizes.size == 0 else {
        "system/state_batch_size/max": float(sizes.max()),
        "system/state_batch_size/mean": float(sizes.mean()),
        "system/state_batch_size/min": float(sizes.min()),
    }
    return state_group_id, metrics


# ---- §5.4 compute_response_level_rewards -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardNormSettings:
    """The agentic ``reward_normalization`` section as the raw fields (resolution happens here, §5.2)."""

    grouping: str = "batch"
    method: str | None = "identity"
    norm_mean_type: str | None = None
    norm_std_type: str | None = None


@dataclass(frozen=True)
class ResponseRewards:
    """``rewards (B,)`` float32, extra ``(B,)`` columns (GiGPO: episode/step parts, ``state_group_id``), metrics."""

    rewards: np.ndarray
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def _column(columns: Mapping[str, np.ndarray], name: str, why: str) -> np.ndarray:
    if name not in columns:
        raise SchemaError(f"response-level rewards ({why}) need column '{name}'; the table has "
                          f"{sorted(columns)} — produce it upstream (step-wise env manager / rollout stage)")
    return np.asarray(columns[name])


def _normalise(values: np.ndarray, columns: Mapping[str, np.ndarray], grouping: str, mean_type: str | None,
               std_type: str | None) -> np.ndarray:
    keys = None if grouping == "batch" else _column(columns, grouping, f"grouping '{grouping}'")
    return agentic_reward_norm(values, keys, mean_type, std_type)


def _episode_rewards(columns, norm: RewardNormSettings, weights, roll_compat) -> ResponseRewards:
    """Default branch: normalise ``Σ_t scores`` per row (column ``score_sum``)."""
    types = resolve_norm_types(norm.grouping, norm.method, norm.norm_mean_type, norm.norm_std_type)
    values = _column(columns, "score_sum", "episode rewards")
    return ResponseRewards(_normalise(values, columns, norm.grouping, *types))


def _step_return_rewards(columns, norm: RewardNormSettings, weights, roll_compat) -> ResponseRewards:
    """step_reinforce: normalise the discounted step returns (column ``step_rewards``)."""
    types = resolve_norm_types(norm.grouping, norm.method, norm.norm_mean_type, norm.norm_std_type)
    values = _column(columns, "step_rewards", "step returns")
    return ResponseRewards(_normalise(values, columns, norm.grouping, *types))


def gigpo_step_norm_types(norm: RewardNormSettings, roll_compat: bool = False):
    """Types of the GiGPO step-level normalisation over ``state_group_id`` (§5.4 step 3).

    ROLL (BUG-6, ``roll_compat``): from ``method`` alone. Corrected: explicit ``norm_mean_type``/``norm_std_type``
    win, ``method`` fills the fields left None (the same rule as the episode level).
    """
    if roll_compat:
        return resolve_norm_types("state_group_id", norm.method)
    return resolve_norm_types("state_group_id", norm.method, norm.norm_mean_type, norm.norm_std_type)


def _gigpo_rewards(columns, norm: RewardNormSettings, weights, roll_compat) -> ResponseRewards:
    """GiGPO: ``w_ep·norm(episode_scores) + w_step·norm(step_rewards by anchor state)``."""
    episode_weight, step_weight = weights
    episode_types = resolve_norm_types(norm.grouping, norm.method, norm.norm_mean_type, norm.norm_std_type)
    episode_norm = _normalise(_column(columns, "episode_scores", "gigpo"), columns, norm.grouping, *episode_types)
    state_group_id, metrics = build_state_group(_column(columns, "traj_group_id", "gigpo"),
                                                _column(columns, "state_hash", "gigpo"), roll_compat)
    step_norm = agentic_reward_norm(_column(columns, "step_rewards", "gigpo"), state_group_id,
                                    *gigpo_step_norm_types(norm, roll_compat))
    rewards = (episode_weight * episode_norm.astype(np.float64)
               + step_weight * step_norm.astype(np.float64)).astype(np.float32)
    extra = {"episode_rewards_norm": episode_norm, "step_rewards_norm": step_norm, "state_group_id": state_group_id}
    return ResponseRewards(rewards, extra, metrics)


RESPONSE_REWARD_BRANCHES: dict[str, Callable[..., ResponseRewards]] = {
    "episode": _episode_rewards,
    "step_return": _step_return_rewards,
    "gigpo": _gigpo_rewards,
}
RESPONSE_REWARD_KINDS = tuple(RESPONSE_REWARD_BRANCHES)


def compute_response_level_rewards(response_reward: str, columns: Mapping[str, np.ndarray],
                                   reward_normalization: RewardNormSettings = RewardNormSettings(), *,
                                   episode_reward_weight: float = 1.0, step_reward_weight: float = 1.0,
                                   reward_clip: float | None = None, roll_compat: bool = False) -> ResponseRewards:
    """One scalar reward per row (§5.4), then the optional clip to ``±reward_clip``.

    ``response_reward`` (from the estimator's registry entry) picks the branch; ``columns`` maps names to ``(B,)``
    arrays: ``episode`` reads ``score_sum`` (``Σ_t scores`` of the row), ``step_return`` reads ``step_rewards``,
    ``gigpo`` reads ``episode_scores``, ``step_rewards``, ``traj_group_id``, ``state_hash``; every branch also reads
    the ``grouping`` column unless grouping is ``batch``. Metric ``critic/reward_clip_frac`` only when clipping; GiGPO
    adds ``system/state_batch_size/*``. ``episode_rewards_norm``/``step_rewards_norm`` are before weights and clip.
    """
    if response_reward not in RESPONSE_REWARD_BRANCHES:
        raise ConfigError(f"response_reward '{response_reward}' is unknown; the estimator registry entry must "
                          f"give one of {list(RESPONSE_REWARD_KINDS)}")
    branch = RESPONSE_REWARD_BRANCHES[response_reward]
    result = branch(columns, reward_normalization, (episode_reward_weight, step_reward_weight), roll_compat)
    rewards, clip_metrics = clip_rewards(result.rewards, reward_clip)
    return ResponseRewards(rewards, result.columns, {**result.metrics, **clip_metrics})


# ---- §5.5 get_agentic_response_level_mask ----------------------------------------------------------------------------
def agentic_response_level_mask(num_rows: int) -> tuple[np.ndarray, dict[str, float]]:
    """ROLL's agentic sample mask is a no-op (§5.5): ``s = 1 (B,)`` float32 and its metrics.

    The caller's ``final_response_mask`` is the token mask ``response_mask[1:]`` times ``s`` (the advantages stage,
    ``stages.algos.token_chain.final_response_mask``).
    """
    metrics = {
        "actor/max_len_mask_ratio": 1.0,
        "actor/final_mask_ratio": 1.0,
        "actor/samples_used": float(num_rows),
        "actor/samples_total": float(num_rows),
    }
    return np.ones(num_rows, dtype=np.float32), metrics
