"""Token rewards and advantages of any block of rows: the row-parallel part of both pipelines' chain (pure numpy
over ragged next-token columns; spec §2.4 ``compute_token_reward`` then §4.3 ``compute_advantage``).

The one advantages stage (stages/advantages.py) runs :func:`token_batch` over Arrow blocks of a samples table for
agentic and RLVR runs alike. What differs is data, not code: a row's *sample mask* (RLVR's §3.5
``get_sample_level_mask``; the agentic ``get_agentic_response_level_mask`` is all ones) and its *domain* (RLVR
whitens per domain; an agentic table is one domain). ``final_response_mask`` = ``response_mask[1:] × sample mask``
is the mask of the advantages (§4.3 ``response_mask=final_response_mask``).

The statistics that span the whole table (the KL controller's β, per-domain whitening moments) are passed in; the
stage computes them from additive partials over all blocks (:func:`whiten_partials_by_domain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from stages.algos.advantages import AdvantageResult, WhitenStats, compute_advantage
from stages.algos.functional import can_whiten, whiten_partials, whiten_stats_from_partials
from stages.algos.ragged import Ragged
from stages.algos.token_rewards import TokenRewardResult, compute_token_reward


@dataclass(frozen=True)
class TokenRows:
    """``B`` rows in the project's layout: ``input_ids`` of ``L`` tokens, ``token_mask (N,)`` = ``response_mask[1:]``
    of every row (flat, float32), next-token columns (``old_log_probs``, ``ref_log_probs``, ``infer_logprobs``,
    ``values``) of ``L − 1`` entries."""

    input_ids: Ragged
    token_mask: np.ndarray
    next_token: Mapping[str, Ragged]

    @property
    def num_rows(self) -> int:
        return self.input_ids.num_rows


def next_token_mask(response_mask: Ragged) -> np.ndarray:
    """``(N,)`` float32 ``response_mask[1:]`` of every row, flat (next-token aligned)."""
    keep = np.ones(len(response_mask.values), dtype=bool)
    keep[response_mask.offsets[:-1][response_mask.lengths > 0]] = False
    return response_mask.values[keep].astype(np.float32)


def flat_positions(offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Flat indices of every element of ``rows`` (in the given row order) of a ragged column with ``offsets``."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = (offsets[1:] - offsets[:-1])[rows]
    starts = np.repeat(offsets[:-1][rows], lengths)
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return starts + within


def take_rows(x: Ragged, rows: np.ndarray) -> Ragged:
    """Rows ``rows (K,)`` of ``x`` as a new Ragged (no Python loop per row)."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = x.lengths[rows]
    return Ragged(x.values[flat_positions(x.offsets, rows)], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def domain_rows(domains: np.ndarray) -> dict[str, np.ndarray]:
    """Row indices per domain, domains in order of first appearance (ROLL's ``group_by("domain")``)."""
    domains = np.asarray(domains).astype(str)
    names, first, inverse = np.unique(domains, return_index=True, return_inverse=True)
    return {str(names[k]): np.flatnonzero(inverse.reshape(-1) == k) for k in np.argsort(first, kind="stable")}


DomainStats = Mapping[str, "WhitenStats | None"]


def token_rewards(tokens: TokenRows, rewards: np.ndarray, s: Any, kl_coef: float) -> TokenRewardResult:
    """§2.4 for a block: reward at the last token, minus ``β·KL(old‖ref)`` over ``response_mask[1:]``, clipped.

    ``old`` = ``old_log_probs``, else ``infer_logprobs``, else zeros; ``ref`` = ``ref_log_probs``, else ``old`` (KL 0).
    """
    nt = tokens.next_token
    old = nt.get("old_log_probs") or nt.get("infer_logprobs")
    if old is None:
        lengths = tokens.input_ids.lengths - 1
        old = Ragged(np.zeros(int(lengths.sum()), np.float32), np.concatenate([[0], np.cumsum(lengths)]))
    ref = nt.get("ref_log_probs") or old
    return compute_token_reward(rewards, tokens.token_mask, old, ref, kl_coef=kl_coef, kl_penalty=s.kl_penalty,
                                add_token_level_kl=s.add_token_level_kl, reward_clip=s.reward_clip,
                                masked_clip_metric=True)


def final_response_mask(tokens: TokenRows, sample_mask: np.ndarray) -> np.ndarray:
    """``(N,)`` float32 ``response_mask[1:] × s`` (§3.5)."""
    rows = np.repeat(np.arange(tokens.num_rows), tokens.input_ids.lengths - 1)
    return (tokens.token_mask * np.asarray(sample_mask, np.float32)[rows]).astype(np.float32)


@dataclass(frozen=True)
class TokenBatch:
    """A block's token rewards and advantages (``Ragged`` next-token columns in the block's row order), its final
    mask ``(N,)`` and additive partials (KL, clip counts) for the stage's metrics."""

    token_level_rewards: Ragged
    advantages: Ragged
    returns: Ragged
    raw_advantages: Ragged
    final_mask: np.ndarray
    partials: dict[str, float]


def _domain_advantage(tok: Ragged, mask: np.ndarray, values: Ragged | None, s: Any, final: bool,
                      reward_stats: "WhitenStats | None | bool", advantage_stats: "WhitenStats | None | bool"
                      ) -> AdvantageResult:
    """compute_advantage on one domain's rows. A stats argument of ``False`` means "whole table says: do not whiten"
    (``Σm ≤ 1``); ``None`` means "use these rows' own statistics"."""
    return compute_advantage(
        tok, mask, s.adv_estimator, gamma=s.gamma, lambd=s.lambd, values=values,
        whiten_rewards=s.whiten_rewards and reward_stats is not False,
        whiten_advantages=final and s.whiten_advantages and advantage_stats is not False,
        advantage_clip=s.advantage_clip if final else None,
        reward_stats=reward_stats or None, advantage_stats=advantage_stats or None,
        roll_compat_gae=s.roll_compat, masked_clip_metric=True)


def _stats_for(stats: DomainStats | None, domain: str) -> "WhitenStats | None | bool":
    if stats is None:
        return None
    value = stats.get(domain)
    return False if value is None else value


def domain_parts(domains: np.ndarray, offsets: np.ndarray):
    """``(domain, rows (K,), flat positions of their tokens)`` per domain; a block of one domain (every agentic
    block) is one part of all rows with ``slice(None)`` as its positions, so that nothing is copied."""
    groups = domain_rows(domains)
    if len(groups) == 1:
        name, rows = next(iter(groups.items()))
        return [(name, None, slice(None))]
    return [(name, rows, flat_positions(offsets, rows)) for name, rows in groups.items()]


def _part(x: Ragged | None, rows: np.ndarray | None) -> Ragged | None:
    return x if x is None or rows is None else take_rows(x, rows)


def token_batch(tokens: TokenRows, rewards: np.ndarray, sample_mask: np.ndarray, domains: np.ndarray,
                s: Any, kl_coef: float, *, reward_stats: DomainStats | None = None,
                advantage_stats: DomainStats | None = None, final: bool = True) -> TokenBatch:
    """§2.4 then §4.3 per domain on a block of rows.

    ``rewards``/``sample_mask (B,)``: the rows' response-level rewards and sample masks (RLVR: from
    :func:`stages.algos.rlvr_chain.rlvr_response_rewards`; agentic: the rewarded table and all-ones masks);
    ``domains (B,)``: rows are whitened per domain; ``kl_coef`` = the controller's β before this step's update. ``reward_stats``/``advantage_stats``: per-domain whitening moments of the whole table (a domain
    mapped to None is not whitened: its mask sums to ≤ 1); None = the block's own statistics (a one-block table).
    ``final=False`` gives the advantages before whitening and clipping (the statistics pass)."""
    tok = token_rewards(tokens, rewards, s, kl_coef)
    fmask = final_response_mask(tokens, sample_mask)
    values = tokens.next_token.get("values")
    offsets = tok.token_level_rewards.offsets
    parts = domain_parts(domains, offsets)
    whole = len(parts) == 1  # one domain (every agentic block): its results are the columns, nothing to scatter
    cols = {name: None if whole else np.zeros(len(fmask), np.float32)
            for name in ("rewards", "advantages", "returns", "raw")}
    partials = {"kl_sum": tok.kl_partials[0], "rows": float(tok.kl_partials[1]), "final_tokens": float(fmask.sum())}
    if "critic/token_reward_clip_frac" in tok.metrics:
        partials["token_reward_clipped"] = tok.metrics["critic/token_reward_clip_frac"] * float(tokens.token_mask.sum())
    for name, rows, where in parts:
        result = _domain_advantage(_part(tok.token_level_rewards, rows), fmask[where], _part(values, rows), s, final,
                                   _stats_for(reward_stats, name), _stats_for(advantage_stats, name))
        for col, ragged in (("rewards", result.token_level_rewards), ("advantages", result.advantages),
                            ("returns", result.returns), ("raw", result.raw_advantages)):
            if whole:
                cols[col] = ragged.values.astype(np.float32, copy=False)
            else:
                cols[col][where] = ragged.values
        if "critic/advantage_clip_frac" in result.metrics:
            clipped = result.metrics["critic/advantage_clip_frac"] * float(fmask[where].sum())
            partials["adv_clipped"] = partials.get("adv_clipped", 0.0) + clipped
    as_ragged = lambda v: Ragged(v, offsets)  # noqa: E731
    return TokenBatch(as_ragged(cols["rewards"]), as_ragged(cols["advantages"]), as_ragged(cols["returns"]),
                      as_ragged(cols["raw"]), fmask, partials)


def whiten_partials_by_domain(values: np.ndarray, mask: np.ndarray, offsets: np.ndarray,
                              domains: np.ndarray) -> dict[str, tuple[float, float, float]]:
    """Per domain ``(Σm, Σx·m, Σx²·m)`` of flat next-token ``values``/``mask``: additive across blocks."""
    return {name: whiten_partials(values[where], mask[where]) for name, _, where in domain_parts(domains, offsets)}


def stats_from_partials(parts: Mapping[str, tuple[float, float, float]]) -> dict[str, "WhitenStats | None"]:
    """Per-domain whitening ``(mean, var)``, or None where ROLL skips whitening (``Σm ≤ 1``, §4.3 step 1)."""
    return {name: whiten_stats_from_partials(*p) if can_whiten(p[0]) else None for name, p in parts.items()}
