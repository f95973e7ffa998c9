"""The RLVR-specific part of the chain over a ``responses`` table, as pure numpy over ragged columns (the pure
layer: no Ray; spec §0.4 "RLVR pipeline"): the responses' token layout and the whole-table response-level rewards.
The RLVR stages (stages/rlvr/stages.py) run it over Arrow blocks.

ROLL, per step, per domain (order of first appearance): ``get_sample_level_mask`` (§3.5) → ``reward_postprocess``
(§3.3) → ``compute_token_reward`` (§2.4) → ``compute_advantage(response_mask=final_response_mask)`` (§4.3).

Split for a dataflow:

* :func:`rlvr_response_rewards` — the whole-table part over narrow columns (one value a row): sample masks and
  normalised response-level rewards per domain. Groups are the rows sharing a ``prompt_id`` (ROLL sorts by prompt id
  and takes consecutive blocks of ``n``; keying by the id is the same on a sorted table and needs no sort).
* :func:`stages.algos.token_chain.token_batch` — the row-parallel part, shared with the agentic pipeline: token
  rewards and advantages of any block of rows of the samples table, with the statistics that span the table (KL
  coefficient, per-domain whitening moments) passed in.

Rows that a reward worker could not score (``None``, NaN here) are left out of every group statistic (pass rates,
means, stds, running moments, batch moments), get sample mask 0, response reward 0 and therefore zero advantage
(DESIGN.md reward contract). A group (or a domain, for a batch std) left with one scored row has no spread: its
reward is 0 (ROLL would give NaN for a group of one, which config validation rules out for complete groups).

Fixes relative to ROLL: BUG-2 (running moments keyed by domain — the caller passes one tracker per domain), BUG-3
(inherited from ``reward_norm``'s semantics), Q-1 (float32 throughout), Q-3 (clip metrics over the mask), Q-5 (the
KL controller is updated once per step by the caller, not once per domain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from schemas.errors import InvariantError
from stages.algos.ragged import Ragged
from stages.algos.reward_norm import RunningMoments, group_index, resolve_rlvr_norm_types, reward_postprocess
from stages.algos.sample_masks import get_sample_level_mask
from stages.algos.token_chain import TokenRows, domain_rows

# ---- token layout: prompt + response → the project's rows (docs/CONTRIBUTING.md "Ragged token data") ----------------


def concat_rows(head: Ragged, tail: Ragged) -> Ragged:
    """Row-wise concatenation ``head[b] + tail[b]``. ``(B rows, B rows)`` → ``B`` rows."""
    lengths = head.lengths + tail.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.empty(int(offsets[-1]), dtype=np.result_type(head.values, tail.values))
    values[np.repeat(offsets[:-1], head.lengths) + head.position()] = head.values
    values[np.repeat(offsets[:-1] + head.lengths, tail.lengths) + tail.position()] = tail.values
    return Ragged(values, offsets)


def response_to_next_token(values: Ragged, prompt_len: np.ndarray) -> Ragged:
    """Per-response-token values ``(R,)`` a row → next-token layout ``(P + R − 1,)``: zeros on the ``P − 1`` prompt
    positions, then the values (position ``t`` refers to token ``t + 1``, spec §0.1). Needs ``P ≥ 1``."""
    prompt_len = np.asarray(prompt_len, dtype=np.int64)
    lengths = prompt_len - 1 + values.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.zeros(int(offsets[-1]), dtype=np.float32)
    out[np.repeat(offsets[:-1] + prompt_len - 1, values.lengths) + values.position()] = values.values
    return Ragged(out, offsets)


@dataclass(frozen=True)
class ResponseTokens(TokenRows):
    """``B`` responses in the project's row layout (:class:`TokenRows`) with what the responses table adds:
    ``response_mask`` (int8, ``L = P + R`` entries: 0 on the prompt, 1 on the response), ``prompt_len`` and
    ``response_len (B,)``."""

    response_mask: Ragged
    prompt_len: np.ndarray
    response_len: np.ndarray


def response_tokens(prompt_ids: Ragged, response_ids: Ragged,
                    response_aligned: Mapping[str, Ragged] | None = None) -> ResponseTokens:
    """Build the row layout from prompt ``(P,)`` / response ``(R,)`` token ids and per-response-token columns."""
    prompt_len, response_len = prompt_ids.lengths, response_ids.lengths
    if (prompt_len < 1).any():
        raise InvariantError(f"row {int(np.flatnonzero(prompt_len < 1)[0])} has an empty prompt; each response needs "
                             "at least one prompt token")
    input_ids = concat_rows(prompt_ids, response_ids)
    mask = concat_rows(prompt_ids.with_values(np.zeros(len(prompt_ids.values), np.int8)),
                       response_ids.with_values(np.ones(len(response_ids.values), np.int8)))
    token_mask = response_to_next_token(response_ids.with_values(np.ones(len(response_ids.values), np.float32)),
                                        prompt_len).values
    cols = {name: response_to_next_token(col, prompt_len) for name, col in (response_aligned or {}).items()}
    return ResponseTokens(input_ids=input_ids, token_mask=token_mask, next_token=cols, response_mask=mask,
                          prompt_len=prompt_len, response_len=response_len)


# ---- whole-table part: sample masks and response-level rewards per domain ------------------------------------------


def check_groups(prompt_id: np.ndarray, domain: np.ndarray, n: int, where: str) -> None:
    """Every prompt has exactly ``n`` responses, all of one domain. Raises :class:`InvariantError`."""
    ids, inverse, counts = np.unique(np.asarray(prompt_id).astype(str), return_inverse=True, return_counts=True)
    bad = np.flatnonzero(counts != n)
    if bad.size:
        k = int(bad[0])
        raise InvariantError(f"responses table at {where}: prompt_id '{ids[k]}' has {counts[k]} responses, expected "
                             f"num_return_sequences_in_group={n}, because rewards are normalised over complete "
                             "groups; drop incomplete groups or set num_return_sequences_in_group to the number "
                             "generated per prompt")
    dom = group_index(np.asarray(domain), len(domain)) if len(ids) else np.zeros(0, np.int64)
    width = int(dom.max(initial=0)) + 1
    per_prompt = np.bincount(np.unique(inverse.reshape(-1) * width + dom) // width, minlength=len(ids))
    if (per_prompt > 1).any():
        k = int(np.flatnonzero(per_prompt > 1)[0])
        raise InvariantError(f"responses table at {where}: the responses of prompt_id '{ids[k]}' belong to several "
                             "domains; a prompt's group must have one domain (its reward route). Fix the domain column")


def sample_level_mask(response_len: np.ndarray, scores: np.ndarray, group: np.ndarray,
                      s: Any) -> tuple[np.ndarray, dict[str, float]]:
    """§3.5 ``get_sample_level_mask`` for one domain, with the RLVRConfig fields ``s`` and groups keyed by ``group
    (B,)``; unscored rows (NaN) are masked and left out of pass rates. ``(B,)`` float32 and ROLL's metrics."""
    return get_sample_level_mask(
        response_len, s.max_new_tokens if s.max_new_tokens is not None else -1, scores,
        s.num_return_sequences_in_group, group=group, max_len_mask=s.max_len_mask,
        use_difficulty_mask=s.difficulty_mask, difficulty_low_threshold=s.difficulty_low_threshold,
        difficulty_high_threshold=s.difficulty_high_threshold, error_max_len_clip=s.error_max_len_clip,
        error_max_len_threshold=s.error_max_len_threshold)


def normalise_rewards(rewards: np.ndarray, group: np.ndarray, s: Any,
                      running: RunningMoments | None) -> tuple[np.ndarray, dict[str, float]]:
    """§3.2/§3.3 ``reward_postprocess`` for one domain with the RLVRConfig fields ``s``, groups keyed by ``group
    (B,)``. NaN rewards are unscored rows: left out of every statistic (and of ``running``'s update), output 0; a
    group or batch left with one scored value gives 0 (no spread), not ROLL's NaN. ``(B,)`` → ``(B,)`` f32, metrics."""
    r = np.asarray(rewards, dtype=np.float64)
    return reward_postprocess(r, s.adv_estimator, s.norm_mean_type, s.norm_std_type, None, s.reward_clip, running,
                              group=group, scored=~np.isnan(r), zero_without_spread=True)


@dataclass(frozen=True)
class RLVRRewards:
    """The whole-table part's result, rows in input order: ``sample_mask``, ``rewards`` (normalised, clipped, 0 for
    unscored rows) ``(B,)`` float32; ``scored (B,)`` bool; metrics (``<domain>/<name>`` and totals)."""

    sample_mask: np.ndarray
    rewards: np.ndarray
    scored: np.ndarray
    metrics: dict[str, float]


def rlvr_response_rewards(prompt_id: np.ndarray, domain: np.ndarray, scores: np.ndarray, rewards: np.ndarray,
                          response_len: np.ndarray, s: Any, running: dict[str, RunningMoments],
                          where: str = "(table)") -> RLVRRewards:
    """Per domain: sample mask (§3.5) then reward post-processing (§3.3) over the whole table.

    ``scores``/``rewards (B,)`` float with NaN for "cannot score"; ``response_len (B,)`` = ``Σ response_mask[1:]``.
    ``running`` maps domain → RunningMoments (BUG-2 fix); trackers of new domains are added to it and updated."""
    prompt_id = np.asarray(prompt_id).astype(str)
    scores = np.asarray(scores, dtype=np.float64)
    rewards = np.asarray(rewards, dtype=np.float64)
    check_groups(prompt_id, domain, s.num_return_sequences_in_group, where)
    group = group_index(prompt_id, len(prompt_id)) if len(prompt_id) else np.zeros(0, np.int64)
    partly = np.isnan(rewards) != np.isnan(scores)
    unscored_rows = np.isnan(rewards) | np.isnan(scores)  # None in either column: the row cannot be scored
    scores = np.where(unscored_rows, np.nan, scores)
    rewards = np.where(unscored_rows, np.nan, rewards)
    sample_mask = np.zeros(len(scores), np.float32)
    out = np.zeros(len(scores), np.float32)
    metrics: dict[str, float] = {}
    for name, rows in domain_rows(domain).items():
        uses_running = "running" in resolve_rlvr_norm_types(s.adv_estimator, s.norm_mean_type, s.norm_std_type)
        tracker = running.setdefault(name, RunningMoments()) if uses_running else None
        mask, mask_metrics = sample_level_mask(np.asarray(response_len)[rows], scores[rows], group[rows], s)
        normalised, norm_metrics = normalise_rewards(rewards[rows], group[rows], s, tracker)
        sample_mask[rows], out[rows] = mask, normalised
        unscored = float(np.isnan(scores[rows]).sum())
        for key, value in {**mask_metrics, **norm_metrics, "rewards/unscored": unscored}.items():
            metrics[f"{name}/{key}"] = value
        scored_scores = scores[rows][~np.isnan(scores[rows])]
        metrics[f"{name}/critic/score/mean"] = float(scored_scores.mean()) if scored_scores.size else 0.0
    scored = ~np.isnan(scores)
    metrics.update({"actor/samples_used": float(sample_mask.sum()), "actor/samples_total": float(len(scores)),
                    "rewards/unscored": float((~scored).sum()),
                    "rewards/partly_scored": float(partly.sum())})
    return RLVRRewards(sample_mask, out, scored, metrics)


