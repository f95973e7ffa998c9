"""Arrow schemas of every table boundary, and the invariants each table must hold.

Layout (docs/CONTRIBUTING.md): one row per training sample. ``input_ids`` holds the whole token sequence (prompt,
responses and, for multi-turn trajectory rows, the observation turns between them); ``response_mask`` marks the
policy-generated tokens and has the same length ``L``; next-token columns have ``L - 1`` entries. Nothing is padded.

Tables:
* ``samples`` — stored trajectories (rollout output, recompute input). Step-level rows (one per turn, GiGPO) carry
  ``turn_idx`` = the step and a ``state_hash``; trajectory-level rows carry ``turn_idx = 0`` and ``num_turns``.
* ``rewarded`` — narrow: ``row_id`` plus the response-level reward columns.
* ``advantaged`` — ``samples`` plus rewards, token rewards, advantages and returns: what training reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import InvariantError, SchemaError

TOKENS = pa.list_(pa.int32())
MASK = pa.list_(pa.int8())
FLOATS = pa.list_(pa.float32())


@dataclass(frozen=True)
class TableSpec:
    """A table contract: required columns (name → type), optional columns, and which list columns are
    token-aligned (length ``L``) or next-token-aligned (length ``L - 1``)."""

    name: str
    required: dict[str, pa.DataType]
    optional: dict[str, pa.DataType] = field(default_factory=dict)
    token_aligned: tuple[str, ...] = ()
    next_token_aligned: tuple[str, ...] = ()
    finite: tuple[str, ...] = ()
    nullable: tuple[str, ...] = ()  # required columns whose null is a value (e.g. "the worker cannot score this row")
    # further per-row invariants of this table (batch, where) -> None, run by check_row_invariants after its own
    row_check: Callable[[pa.Table, str], None] | None = field(default=None, compare=False)

    def arrow_schema(self, present: list[str] | None = None) -> pa.Schema:
        """The schema with all required columns and the optional ones named in ``present``."""
        cols = dict(self.required)
        cols.update({k: v for k, v in self.optional.items() if present is None or k in present})
        return pa.schema([pa.field(k, v) for k, v in cols.items()])

    def check_schema(self, schema: pa.Schema, where: str, needs: tuple[str, ...] = ()) -> None:
        """Raise :class:`SchemaError` naming ``where`` if a column is missing or has another type."""
        wanted = dict(self.required)
        wanted.update({k: self.optional[k] for k in needs if k in self.optional})
        for col in needs:
            if col not in wanted:
                wanted[col] = None  # type: ignore[assignment]
        for col, typ in wanted.items():
            if col not in schema.names:
                raise SchemaError(
                    f"{self.name} table at {where}: missing column '{col}'"
                    + (f" of type {typ}" if typ is not None else "")
                    + f"; present: {', '.join(schema.names)}. Produce it upstream (or regenerate the data) before this stage."
                )
            actual = schema.field(col).type
            if typ is not None and not actual.equals(typ):
                raise SchemaError(
                    f"{self.name} table at {where}: column '{col}' has type {actual}, expected {typ}. "
                    f"Cast it when writing (pyarrow: table.cast(...)); token ids are list<int32>, log-probs list<float32>."
                )
        for col, typ in self.optional.items():
            if col in schema.names and not schema.field(col).type.equals(typ):
                raise SchemaError(f"{self.name} table at {where}: optional column '{col}' has type "
                                  f"{schema.field(col).type}, expected {typ}.")


IDENTITY = {
    "row_id": pa.string(),
    "group_id": pa.string(),
    "traj_id": pa.string(),
    "turn_idx": pa.int32(),
}

SAMPLES = TableSpec(
    name="samples",
    required={
        **IDENTITY,
        "num_turns": pa.int32(),
        "tag": pa.string(),
        "input_ids": TOKENS,
        "response_mask": MASK,
        "score": pa.float32(),
        "episode_score": pa.float32(),
    },
    optional={
        "state_hash": pa.string(),
        "infer_logprobs": FLOATS,
        "old_log_probs": FLOATS,
        "ref_log_probs": FLOATS,
        "values": FLOATS,
        "prompt_len": pa.int32(),
        # asynchronous generation (async_generation_ratio > 0): training steps between the policy that played the
        # row and the one trained on it
        "staleness": pa.int32(),
    },
    token_aligned=("response_mask",),
    next_token_aligned=("infer_logprobs", "old_log_probs", "ref_log_probs", "values"),
    finite=("score", "episode_score", "infer_logprobs", "old_log_probs", "ref_log_probs", "values"),
)

def staleness_column(staleness: int | None, rows: int) -> dict[str, pa.Array]:
    """The samples' ``staleness`` column of ``rows`` rows played ``staleness`` training steps behind the policy
    trained on them (a rollout played ahead, async_generation_ratio > 0), by name; {} for rows played in turn
    (``staleness`` None: no column, the table as before the option)."""
    return {} if staleness is None else {"staleness": pa.array(np.full(rows, staleness, np.int32))}


REWARDED = TableSpec(
    name="rewarded",
    required={
        "row_id": pa.string(),
        "response_level_rewards": pa.float32(),
    },
    optional={
        "step_rewards": pa.float32(),
        "episode_rewards_norm": pa.float32(),
        "step_rewards_norm": pa.float32(),
        "state_group_id": pa.string(),
        # RLVR (stages/response_rewards.py with an RLVR section): the §3.5 sample mask and the domain the rows are
        # whitened by; ``score`` is the worker's score, 0 where it could not score (``scored`` false)
        "prompt_id": pa.string(),
        "domain": pa.string(),
        "scored": pa.bool_(),
        "score": pa.float32(),
        "sample_mask": pa.float32(),
    },
    finite=("response_level_rewards", "step_rewards", "score", "sample_mask"),
)

ADVANTAGED = TableSpec(
    name="advantaged",
    required={
        **SAMPLES.required,
        "response_level_rewards": pa.float32(),
        "token_level_rewards": FLOATS,
        "advantages": FLOATS,
        "returns": FLOATS,
        "raw_advantages": FLOATS,
    },
    optional={**SAMPLES.optional, **{k: v for k, v in REWARDED.optional.items() if k in (
        "step_rewards", "episode_rewards_norm", "step_rewards_norm", "state_group_id", "domain", "scored")},
        # RLVR: response_mask[1:] × the row's sample mask, the mask of the advantages and of the loss (§4.3, §6.5)
        "final_response_mask": FLOATS},
    token_aligned=SAMPLES.token_aligned,
    next_token_aligned=SAMPLES.next_token_aligned + ("token_level_rewards", "advantages", "returns", "raw_advantages",
                                                     "final_response_mask"),
    finite=SAMPLES.finite + ("response_level_rewards", "token_level_rewards", "advantages", "returns",
                             "final_response_mask"),
)

TABLES = {spec.name: spec for spec in (SAMPLES, REWARDED, ADVANTAGED)}


# ---- invariants ------------------------------------------------------------------------------------------------

def _first_bad_row(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _refuse_first_bad(bad: np.ndarray, message: Callable[[int], str]) -> None:
    """``bad``: one bool per row (or group, trajectory). An :class:`InvariantError` with ``message(i)`` for the first
    ``i`` it marks; nothing when it marks none."""
    if bad.any():
        raise InvariantError(message(_first_bad_row(bad)))


def check_row_invariants(spec: TableSpec, batch: pa.Table, where: str) -> None:
    """Per-row invariants (block-local): aligned list lengths and finite numbers. Raises :class:`InvariantError`."""
    names = batch.column_names
    row_ids = batch.column("row_id") if "row_id" in names else None

    def rid(i: int) -> str:
        return f"row {i} (row_id {row_ids[i].as_py()})" if row_ids is not None else f"row {i}"

    for col in spec.required:
        if col in names and col not in spec.finite + spec.nullable and batch.column(col).null_count:
            i = _first_bad_row(batch.column(col).is_null().to_numpy(zero_copy_only=False))
            raise InvariantError(f"{spec.name} table at {where}: column '{col}' is null in {rid(i)}; every row needs a "
                                 f"value there. Fix the producer of the data or drop the row.")
    if "input_ids" in names:
        base = pc.list_value_length(batch.column("input_ids")).to_numpy(zero_copy_only=False)
        for col in spec.token_aligned + spec.next_token_aligned:
            if col not in names:
                continue
            want = base if col in spec.token_aligned else np.maximum(base - 1, 0)
            got = pc.list_value_length(batch.column(col)).to_numpy(zero_copy_only=False)
            _refuse_first_bad(got != want, lambda i: (
                f"{spec.name} table at {where}: column '{col}' has {got[i]} entries in {rid(i)} but input_ids has "
                f"{base[i]} tokens; expected {want[i]} ({'L' if col in spec.token_aligned else 'L-1, next-token aligned'}). "
                "Fix the producer of this column."))
    for col in spec.finite:
        if col not in names:
            continue
        arr = batch.column(col)
        if pa.types.is_list(arr.type):
            flat = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
            if flat.size and not np.isfinite(flat).all():
                lens = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
                rows = np.repeat(np.arange(len(lens)), lens)
                i = int(rows[np.flatnonzero(~np.isfinite(flat))[0]])
                raise InvariantError(f"{spec.name} table at {where}: column '{col}' has a NaN or infinite value in "
                                     f"{rid(i)}; values must be finite. Fix or drop that row upstream.")
        else:
            if arr.null_count:
                i = _first_bad_row(arr.is_null().to_numpy(zero_copy_only=False))
                raise InvariantError(f"{spec.name} table at {where}: column '{col}' is null in {rid(i)}; "
                                     "a score is required for every row.")
            vals = arr.to_numpy(zero_copy_only=False).astype(np.float64)
            _refuse_first_bad(~np.isfinite(vals), lambda i: (
                f"{spec.name} table at {where}: column '{col}' is {vals[i]} in {rid(i)}; values must be finite. Fix "
                "the reward/environment that produced it or drop the row."))
    if spec.row_check is not None:
        spec.row_check(batch, where)


def check_structure(table: pa.Table, where: str, group_size: int | None) -> None:
    """Whole-table invariants on the narrow identity columns: unique row ids, contiguous turn indices per
    trajectory, and complete groups of ``group_size`` trajectories. Raises :class:`InvariantError`."""
    row_id = table.column("row_id")
    if pc.count_distinct(row_id).as_py() != len(row_id):
        counts = pc.value_counts(row_id)
        dup = [c["values"] for c in counts.to_pylist() if c["counts"] > 1][0]
        raise InvariantError(f"table at {where}: row_id '{dup}' occurs more than once; row ids must be unique.")
    with_turns = "num_turns" in table.column_names
    traj = table.select(["traj_id", "turn_idx"] + (["num_turns"] if with_turns else [])).group_by("traj_id").aggregate(
        [("turn_idx", "min"), ("turn_idx", "max"), ("turn_idx", "count"), ("turn_idx", "count_distinct")]
        + ([("num_turns", "min"), ("num_turns", "max")] if with_turns else []))
    lo, hi, n, distinct = (traj.column(c).to_numpy() for c in ("turn_idx_min", "turn_idx_max", "turn_idx_count",
                                                                 "turn_idx_count_distinct"))
    _refuse_first_bad((lo != 0) | (hi != n - 1) | (distinct != n), lambda i: (
        f"table at {where}: trajectory '{traj.column('traj_id')[i].as_py()}' has turn indices {lo[i]}..{hi[i]} "
        f"({distinct[i]} distinct) over {n[i]} rows; they must be contiguous from 0 without repeats. A turn is "
        "missing or duplicated: re-run the rollout for it or drop the trajectory."))
    if with_turns:  # step-level rows: one per turn; trajectory-level rows: one per trajectory
        t_lo, t_hi = traj.column("num_turns_min").to_numpy(), traj.column("num_turns_max").to_numpy()
        _refuse_first_bad((t_lo != t_hi) | ((n != 1) & (n != t_lo)), lambda i: (
            f"table at {where}: trajectory '{traj.column('traj_id')[i].as_py()}' has {n[i]} rows but num_turns "
            f"{t_lo[i]}..{t_hi[i]}; step-level data needs one row per turn (trajectory-level data one row per "
            "trajectory) with the same num_turns on each. A turn is missing: re-run the rollout for it or drop "
            "the trajectory."))
    if group_size:
        groups = table.select(["group_id", "traj_id"]).group_by("group_id").aggregate([("traj_id", "count_distinct")])
        sizes = groups.column("traj_id_count_distinct").to_numpy()
        _refuse_first_bad(sizes != group_size, lambda i: (
            f"table at {where}: group '{groups.column('group_id')[i].as_py()}' has {sizes[i]} trajectories, expected "
            f"group_size={group_size}, because advantages are normalised over complete groups. Drop incomplete "
            "groups or set group_size to the size the data was generated with."))
