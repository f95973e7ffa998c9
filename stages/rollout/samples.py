"""Turn rows → training samples (spec §11.2) and ROLL's rollout metrics (§11, §12). Pure pyarrow/numpy.

Step level (StepEnvManager, GiGPO): one sample per turn: ``input_ids`` = that turn's prompt + response,
``score`` = the step reward, ``state_hash`` of the observation the action was taken in.
Trajectory level (TrajEnvManager): one sample per episode, from its last row: ``input_ids`` = the whole
conversation (every prompt segment and every response), ``response_mask`` 1 on every response segment,
``score`` = the episode return. Both carry ``episode_score`` (the return), ``num_turns``, the sampler's
``infer_logprobs`` (next-token aligned, 0 off the response) and deterministic ``row_id``\\ s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.rollout_config import SamplesSection
from schemas.tables import FLOATS, MASK, SAMPLES, TOKENS, staleness_column
from stages.example import row_id
from stages.rollout.tables import STOP_REASONS


@dataclass(frozen=True)
class EpisodeSummary:
    """Per-trajectory facts the row-parallel conversion needs: ``traj_id → (episode_score, num_turns)``."""

    score: dict[str, float]
    num_turns: dict[str, int]


def episode_summary(narrow: pa.Table) -> EpisodeSummary:
    """From the narrow columns of every played turn (``turn_idx >= 0``)."""
    agg = narrow.group_by("traj_id").aggregate([("reward", "sum"), ("turn_idx", "count")])
    ids = agg.column("traj_id").to_pylist()
    return EpisodeSummary(dict(zip(ids, agg.column("reward_sum").to_numpy().astype(np.float64).tolist())),
                          dict(zip(ids, agg.column("turn_idx_count").to_numpy().astype(int).tolist())))


def _flat(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list column → (flat values, per-row lengths)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.flatten().to_numpy(zero_copy_only=False), arr.value_lengths().fill_null(0).to_numpy()


def concat_rows(first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray],
                list_type: pa.DataType) -> pa.Array:
    """Row-wise concatenation of two ragged columns given as ``(values, lengths)`` → a list array.

    Vectorised: each value's output position = its row's output start + (offset of its segment) + its index inside
    the segment. ``list_type`` is the Arrow list type of the result (e.g. list<int32>).
    """
    (a, la), (b, lb) = first, second
    offsets = np.concatenate([[0], np.cumsum(la + lb)]).astype(np.int64)
    out = np.empty(int(offsets[-1]), dtype=list_type.value_type.to_pandas_dtype())
    for values, lens, shift in ((a, la, np.zeros_like(la)), (b, lb, la)):
        rows = np.repeat(np.arange(len(lens)), lens)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        within = np.arange(values.size) - starts[rows]
        out[offsets[:-1][rows] + shift[rows] + within] = values
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(out, list_type.value_type))


def _first_one(mask_values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Index of the first 1 of every row of a ragged 0/1 column (row length if none)."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    ones = np.flatnonzero(mask_values == 1)
    first = lengths.astype(np.int64).copy()
    uniq, idx = np.unique(rows[ones], return_index=True)
    first[uniq] = ones[idx] - starts[uniq]
    return first


def turns_to_samples(batch: pa.Table, section: SamplesSection, episodes: EpisodeSummary) -> pa.Table:
    """Turn rows (already filtered: step level all played turns, trajectory level each episode's last row) →
    ``samples`` rows."""
    n = batch.num_rows
    prompt, response = _flat(batch.column("prompt_ids")), _flat(batch.column("response_ids"))
    ctx_mask, ctx_lp = _flat(batch.column("context_mask")), _flat(batch.column("context_logprobs"))
    logprobs = _flat(batch.column("logprobs"))
    ones = (np.ones(response[0].size, np.int8), response[1])
    input_ids = concat_rows(prompt, response, TOKENS)
    response_mask = concat_rows((ctx_mask[0].astype(np.int8), ctx_mask[1]), ones, MASK)
    infer = concat_rows((ctx_lp[0].astype(np.float32), ctx_lp[1]), (logprobs[0].astype(np.float32), logprobs[1]),
                        FLOATS)
    traj = batch.column("traj_id").to_pylist()
    turn = batch.column("turn_idx").to_pylist()
    seeds = batch.column("level_seed").to_pylist()
    episode_score = np.array([episodes.score[t] for t in traj], dtype=np.float32)
    num_turns = np.array([episodes.num_turns[t] for t in traj], dtype=np.int32)
    step_level = section.sample_level == "step"
    if step_level:
        ids = [row_id(section.run_name, section.iteration, s, t, k) for s, t, k in zip(seeds, traj, turn)]
        score = batch.column("reward").cast(pa.float32())
        turn_idx = pa.array(turn, pa.int32())
        state = batch.column("state_hash")
        prompt_len = prompt[1].astype(np.int32)
    else:
        ids = [row_id(section.run_name, section.iteration, s, t, "trajectory") for s, t in zip(seeds, traj)]
        score = pa.array(episode_score, pa.float32())
        turn_idx = pa.array(np.zeros(n, np.int32))
        state = pa.nulls(n, pa.string())
        mask_values, mask_lengths = _flat(response_mask)
        prompt_len = _first_one(mask_values, mask_lengths).astype(np.int32)
    columns = {
        "row_id": pa.array(ids, pa.string()), "group_id": batch.column("group_id"), "traj_id": batch.column("traj_id"),
        "turn_idx": turn_idx, "num_turns": pa.array(num_turns, pa.int32()), "tag": batch.column("tag"),
        "input_ids": input_ids, "response_mask": response_mask, "score": score,
        "episode_score": pa.array(episode_score, pa.float32()), "state_hash": state, "infer_logprobs": infer,
        "prompt_len": pa.array(prompt_len, pa.int32()),
    }
    columns.update(staleness_column(section.staleness, n))  # played ahead: how far behind the trained policy
    schema = SAMPLES.arrow_schema(present=list(columns))
    return pa.table({f.name: columns[f.name] for f in schema}, schema=schema)


# ---- metrics ---------------------------------------------------------------------------------------------------

def rollout_metrics(narrow: pa.Table, response_tokens: int, prompt_tokens: int) -> dict[str, float]:
    """ROLL's env metrics (per-trajectory aggregation by metrics_agg_mode, then the mean over trajectories) plus
    rollflow's rollout summary. ``narrow``: the narrow columns of every played turn."""
    if narrow.num_rows == 0:
        return {"rollout/episodes": 0.0, "rollout/turns": 0.0}
    t = narrow.append_column("valid", pc.cast(narrow.column("action_valid"), pa.float64())) \
        .append_column("effective", pc.cast(narrow.column("action_effective"), pa.float64())) \
        .append_column("penalised", pc.cast(pc.invert(narrow.column("action_valid")), pa.float64())) \
        .append_column("cut", pc.cast(narrow.column("response_truncated"), pa.float64()))
    per_traj = t.group_by(["tag", "traj_id"]).aggregate([
        ("valid", "mean"), ("effective", "mean"), ("format_penalty", "mean"), ("turn_idx", "count"),
        ("reward", "sum")])
    last = t.filter(pc.field("done")).select(["traj_id", "success", "stop_reason"])
    tags = sorted(set(per_traj.column("tag").to_pylist()))
    metrics: dict[str, float] = {}
    success_by_traj = dict(zip(last.column("traj_id").to_pylist(), last.column("success").to_pylist()))
    for tag in tags:
        sel = per_traj.filter(pc.field("tag") == tag)
        success = [float(bool(success_by_traj.get(x, False))) for x in sel.column("traj_id").to_pylist()]
        metrics[f"env/{tag}/success"] = float(np.mean(success))
        metrics[f"env/{tag}/action_is_valid"] = float(pc.mean(sel.column("valid_mean")).as_py())
        metrics[f"env/{tag}/action_is_effective"] = float(pc.mean(sel.column("effective_mean")).as_py())
        metrics[f"env/{tag}/format_penalty"] = float(pc.mean(sel.column("format_penalty_mean")).as_py())
        metrics[f"env/{tag}/num_actions"] = float(pc.mean(sel.column("turn_idx_count")).as_py())
    episodes, turns = per_traj.num_rows, narrow.num_rows
    scores = per_traj.column("reward_sum").to_numpy()
    stops = last.column("stop_reason").to_pylist()
    metrics.update({
        "env/response_length": response_tokens / turns,
        "rollout/episodes": float(episodes),
        "rollout/turns": float(turns),
        "rollout/success_rate": float(np.mean([bool(v) for v in success_by_traj.values()])) if success_by_traj
        else 0.0,
        "rollout/valid_action_rate": float(pc.mean(t.column("valid")).as_py()),
        "rollout/format_penalty_rate": float(pc.mean(t.column("penalised")).as_py()),
        "rollout/truncated_response_rate": float(pc.mean(t.column("cut")).as_py()),
        "rollout/mean_episode_length": turns / episodes,
        "rollout/response_tokens": float(response_tokens),
        "rollout/prompt_tokens": float(prompt_tokens),
        "rollout/episode_score/mean": float(scores.mean()),
        "rollout/episode_score/max": float(scores.max()),
        "rollout/episode_score/min": float(scores.min()),
    })
    for reason in STOP_REASONS:
        metrics[f"rollout/stop/{reason}"] = stops.count(reason) / episodes
    metrics.update(per_tag_metrics(t, per_traj, success_by_traj))
    return metrics


def per_tag_metrics(turns: pa.Table, per_traj: pa.Table, success_by_traj: dict[str, bool]) -> dict[str, float]:
    """The rollout totals split by environment tag (a mixed rollout): ``rollout/<tag>/{episodes, success_rate,
    valid_action_rate, mean_episode_length, episode_score/mean}``, each computed as its total is over that tag's
    episodes and turns. ``turns``: every played turn with a float ``valid`` column; ``per_traj``: one row per
    episode (tag, traj_id, turn_idx_count, reward_sum)."""
    out: dict[str, float] = {}
    for tag in sorted(set(per_traj.column("tag").to_pylist())):
        episodes = per_traj.filter(pc.field("tag") == tag)
        played = turns.filter(pc.field("tag") == tag)
        ids = episodes.column("traj_id").to_pylist()
        out[f"rollout/{tag}/episodes"] = float(len(ids))
        out[f"rollout/{tag}/success_rate"] = float(np.mean([bool(success_by_traj.get(x, False)) for x in ids]))
        out[f"rollout/{tag}/valid_action_rate"] = float(pc.mean(played.column("valid")).as_py())
        out[f"rollout/{tag}/mean_episode_length"] = played.num_rows / len(ids)
        out[f"rollout/{tag}/episode_score/mean"] = float(pc.mean(episodes.column("reward_sum")).as_py())
    return out
