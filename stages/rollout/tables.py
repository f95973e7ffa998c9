"""The turn table: one row per episode per played turn (the reset table uses the same schema with ``turn_idx = -1``).

A row holds everything the next turn needs, so stepping is stateless and a turn can be re-run from the committed
table before it: the environment state after the step (``env_state``, JSON), the step-level text history
(``history``, JSON), and the exact prompt token ids of the next turn (``next_prompt_ids``; empty once ``done``).
For the turn just played it records the prompt (``prompt_ids``; at trajectory level the whole conversation so far),
the sampled ``response_ids`` with the sampler's ``logprobs``, the finish reason, the reply text, the parsed action,
the reward and the termination flags.

``context_mask`` / ``context_logprobs`` describe ``prompt_ids``: 1 / the sampler's log-prob on tokens the policy
generated in earlier turns of the same conversation (trajectory level), 0 elsewhere; ``context_logprobs`` is
next-token aligned (``len(prompt_ids) - 1`` entries). A trajectory's sample is its last row's prompt + response.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.tables import FLOATS, MASK, TOKENS, TableSpec

TURNS = TableSpec(
    name="turns",
    required={
        "traj_id": pa.string(),
        "group_id": pa.string(),
        "tag": pa.string(),
        "env_id": pa.int32(),          # episode index in the rollout: group_index * group_size + env_index
        "group_index": pa.int32(),
        "env_index": pa.int32(),
        "level_seed": pa.int64(),
        "turn_idx": pa.int32(),        # -1 for the reset row
        "observation": pa.string(),    # the state the action was taken in (reset row: the first state)
        "state_hash": pa.string(),     # spec §11.2: SHA-256 of "str:" + observation
        "prompt_ids": TOKENS,
        "context_mask": MASK,
        "context_logprobs": FLOATS,
        "response_ids": TOKENS,
        "logprobs": FLOATS,
        "finish_reason": pa.string(),  # stop | length ("" on the reset row)
        "response_truncated": pa.bool_(),
        "text": pa.string(),
        "action_content": pa.string(),
        "action_valid": pa.bool_(),
        "action_effective": pa.bool_(),
        "action_desc": pa.string(),
        "reward": pa.float32(),
        "format_penalty": pa.float32(),
        "success": pa.bool_(),
        "env_terminated": pa.bool_(),
        "env_truncated": pa.bool_(),
        "episode_return": pa.float32(),  # sum of rewards up to and including this turn
        "done": pa.bool_(),
        "stop_reason": pa.string(),      # "" while running; terminated | max_steps | max_tokens | invalid_action
        "next_observation": pa.string(),
        "env_state": pa.string(),
        "history": pa.string(),
        "next_prompt_ids": TOKENS,
    },
)

STOP_TERMINATED = "terminated"
STOP_MAX_STEPS = "max_steps"
STOP_MAX_TOKENS = "max_tokens"
STOP_INVALID = "invalid_action"
STOP_REASONS = (STOP_TERMINATED, STOP_MAX_STEPS, STOP_MAX_TOKENS, STOP_INVALID)

# columns the samples stage and `rollflow show` read
NARROW_COLUMNS = ["traj_id", "group_id", "tag", "env_id", "turn_idx", "reward", "done", "stop_reason",
                  "action_valid", "action_effective", "success", "format_penalty", "response_truncated",
                  "episode_return"]


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Row dicts (every TURNS column) → a table with exactly the TURNS schema."""
    schema = TURNS.arrow_schema()
    return pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
