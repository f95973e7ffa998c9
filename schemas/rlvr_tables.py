"""Arrow schemas of the RLVR tables and their per-row invariants (spec §0.4 "RLVR pipeline", §10).

Flow of tables (one RLVR step; the tables from ``samples`` on are those of every pipeline, schemas/tables.py)::

    responses ──rewards──▶ scored ──────────────────────────────────┬──response_rewards──▶ rewarded ─┐
        └──────────────────────┴──rlvr_samples──▶ samples ──logprobs (values)──▶ samples ─────┴──advantages──▶ advantaged

* ``responses`` — one row per generated response: ``n = num_return_sequences_in_group`` rows share a ``prompt_id``
  (the group). Token data as the generation engine returns it: ``prompt_ids (P,)``, ``response_ids (R,)``, and the
  optional log-prob / value columns with **one entry per response token** ``(R,)`` (``GenResult.logprobs``). The
  chain turns them into the project's next-token layout (``L − 1 = P + R − 1`` entries, zeros on prompt positions).
  Columns beyond these are passed through to reward workers (a worker may read its own columns).
* ``scored`` — narrow: ``row_id``, the reward worker's ``scores`` and ``response_level_rewards`` (null = the worker
  could not score the row, DESIGN.md reward contract), the name of the worker that scored it and the row's domain.
* ``rewarded`` (``schemas.tables.REWARDED``, written by the response-rewards stage of both pipelines with an RLVR
  section) — narrow: per-row sample mask (§3.5) and normalised response-level reward (§3.3), computed over the whole
  table per domain; unscored rows have ``scored = false``, sample mask 0 and reward 0.
* ``samples`` — the step's token table (``input_ids = prompt_ids + response_ids``, ``response_mask = 0…0 1…1``,
  next-token columns ``L − 1``), on which the log-prob, value, advantages and training stages of both pipelines run.
  The advantages stage, given that ``rewarded`` table, writes ``advantaged`` (``schemas.tables.ADVANTAGED``)
  with the RLVR columns ``final_response_mask`` (``response_mask[1:] × sample mask``, next-token aligned, float32),
  ``domain`` and ``scored``.

"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import InvariantError
from schemas.tables import FLOATS, TOKENS, TableSpec

# Log-prob / value columns of ``responses`` with one entry per response token (R,), converted to L − 1 by the chain.
RESPONSE_ALIGNED = ("infer_logprobs", "old_log_probs", "ref_log_probs", "values")


def check_response_rows(batch: pa.Table, where: str) -> None:
    """Per-row invariants of a ``responses`` batch: a non-empty prompt, response-aligned columns with one entry per
    response token, finite log-probs/values. Raises :class:`InvariantError` naming the row and the fix."""
    row_ids = batch.column("row_id")

    def rid(i: int) -> str:
        return f"row {i} (row_id {row_ids[i].as_py()})"

    prompt_len = pc.list_value_length(batch.column("prompt_ids")).to_numpy(zero_copy_only=False)
    empty = prompt_len == 0
    if empty.any():
        i = int(np.flatnonzero(empty)[0])
        raise InvariantError(f"responses table at {where}: {rid(i)} has an empty prompt_ids; every response needs "
                             "at least one prompt token (the chat template's first token) to be predicted from. "
                             "Store the templated prompt's token ids.")
    response_len = pc.list_value_length(batch.column("response_ids")).to_numpy(zero_copy_only=False)
    for name in RESPONSE_ALIGNED:
        if name not in batch.column_names:
            continue
        got = pc.list_value_length(batch.column(name)).to_numpy(zero_copy_only=False)
        bad = got != response_len
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvariantError(f"responses table at {where}: column '{name}' has {got[i]} entries in {rid(i)} but "
                                 f"response_ids has {response_len[i]}; '{name}' holds one value per response token "
                                 "(as the engine returns them). Fix the producer of this column.")
        flat = pc.list_flatten(batch.column(name)).to_numpy(zero_copy_only=False)
        if flat.size and not np.isfinite(flat).all():
            rows = np.repeat(np.arange(len(got)), got)
            i = int(rows[np.flatnonzero(~np.isfinite(flat))[0]])
            raise InvariantError(f"responses table at {where}: column '{name}' has a NaN or infinite value in "
                                 f"{rid(i)}; values must be finite. Fix or drop that row upstream.")


RESPONSES = TableSpec(
    name="responses",
    required={
        "row_id": pa.string(),
        "prompt_id": pa.string(),
        "domain": pa.string(),
        "tag": pa.string(),
        "prompt": pa.string(),
        "ground_truth": pa.string(),
        "response": pa.string(),
        "prompt_ids": TOKENS,
        "response_ids": TOKENS,
        "finish_reason": pa.string(),
    },
    optional={name: FLOATS for name in RESPONSE_ALIGNED},
    finite=RESPONSE_ALIGNED,
    nullable=("ground_truth", "finish_reason"),
    row_check=check_response_rows,
)

SCORED = TableSpec(
    name="scored",
    required={
        "row_id": pa.string(),
        "scores": pa.float32(),  # null: the worker cannot score this row
        "response_level_rewards": pa.float32(),  # null together with scores (or on its own)
        "reward_worker": pa.string(),
    },
    optional={"domain": pa.string()},  # the responses' domain column: what RLVR normalises rewards by
    nullable=("scores", "response_level_rewards"),
)
