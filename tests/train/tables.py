"""Small advantaged tables for the training tests: a prompt then one or two response segments per row, random
tokens, one advantage per row on its response tokens (next-token aligned), optional log-probs and critic values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.tables import ADVANTAGED, FLOATS, MASK, TOKENS


def advantaged_rows(n: int = 8, lengths: tuple[int, int] = (12, 40), seed: int = 0, vocab: int = 1000,
                    multi_turn: bool = False, with_values: bool = True, old_log_probs: bool = False,
                    empty_row: bool = False) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("row_id", "group_id", "traj_id", "turn_idx", "num_turns", "tag",
                                               "input_ids", "response_mask", "score", "episode_score",
                                               "response_level_rewards", "token_level_rewards", "advantages",
                                               "returns", "raw_advantages", "values", "old_log_probs")}
    for i in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        prompt = int(rng.integers(3, max(4, length // 3)))
        mask = np.zeros(length, np.int8)
        mask[prompt:] = 1
        if multi_turn and length - prompt > 6:
            obs = prompt + (length - prompt) // 2
            mask[obs:obs + 3] = 0
        if empty_row and i == n - 1:
            mask[:] = 0
        advantage = float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5))
        loss_mask = mask[1:].astype(np.float32)
        reward = float(advantage > 0)
        token_rewards = np.zeros(length - 1, np.float32)
        if loss_mask.any():
            token_rewards[np.flatnonzero(loss_mask)[-1]] = reward
        cols["row_id"].append(f"r{i:04d}")
        cols["group_id"].append(f"g{i // 4}")
        cols["traj_id"].append(f"t{i}")
        cols["turn_idx"].append(0)
        cols["num_turns"].append(1)
        cols["tag"].append("test")
        cols["input_ids"].append(rng.integers(0, vocab, length).astype(np.int32))
        cols["response_mask"].append(mask)
        cols["score"].append(reward)
        cols["episode_score"].append(reward)
        cols["response_level_rewards"].append(reward)
        cols["token_level_rewards"].append(token_rewards)
        cols["advantages"].append(loss_mask * advantage)
        cols["returns"].append(loss_mask * reward)
        cols["raw_advantages"].append(loss_mask * advantage)
        cols["values"].append(rng.normal(0, 0.1, length - 1).astype(np.float32))
        cols["old_log_probs"].append(loss_mask * rng.uniform(-8, -6, length - 1).astype(np.float32))
    types = {**ADVANTAGED.required, "values": FLOATS, "old_log_probs": FLOATS}
    types.update({"input_ids": TOKENS, "response_mask": MASK})
    names = [c for c in cols if (c != "values" or with_values) and (c != "old_log_probs" or old_log_probs)]
    return pa.table({c: pa.array(cols[c], type=types[c]) for c in names})


def write_table(table: pa.Table, folder: Path, parts: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    step = max(1, -(-table.num_rows // parts))
    for k, start in enumerate(range(0, table.num_rows, step)):
        pq.write_table(table.slice(start, step), folder / f"part-{k:05d}.parquet")
    return folder


def read_folder(folder: Path) -> pa.Table:
    """The rows of a table folder (its Parquet parts in order; the manifest and other files are skipped)."""
    return pa.concat_tables([pq.read_table(p) for p in sorted(Path(folder).glob("*.parquet"))])
