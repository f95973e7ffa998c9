"""The table contracts (schemas/tables.py): schema checks, per-row invariants, whole-table structure."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from schemas.errors import InvariantError, SchemaError
from schemas.tables import (ADVANTAGED, FLOATS, MASK, REWARDED, SAMPLES, TABLES, TOKENS, check_row_invariants,
                            check_structure)


def samples(n_rows: int = 4, **override) -> pa.Table:
    """A valid tiny samples table: one group of two 2-turn trajectories, rows of 3, 4, 5, 6 tokens."""
    lengths = [3, 4, 5, 6][:n_rows]
    cols = {
        "row_id": [f"r{i}" for i in range(n_rows)],
        "group_id": ["g"] * n_rows,
        "traj_id": ["a", "a", "b", "b"][:n_rows],
        "turn_idx": [0, 1, 0, 1][:n_rows],
        "num_turns": [2] * n_rows,
        "tag": ["FrozenLake"] * n_rows,
        "input_ids": [list(range(n)) for n in lengths],
        "response_mask": [[0] + [1] * (n - 1) for n in lengths],
        "score": [0.0, 1.0, 0.5, -0.5][:n_rows],
        "episode_score": [1.0, 1.0, 0.0, 0.0][:n_rows],
        "old_log_probs": [[-0.5] * (n - 1) for n in lengths],
    }
    cols.update(override)
    schema = SAMPLES.arrow_schema(present=list(cols))
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in schema}, schema=schema)


def test_specs_are_consistent():
    assert set(TABLES) == {"samples", "rewarded", "advantaged"}
    for spec in TABLES.values():
        assert not set(spec.required) & set(spec.optional)
        for col in spec.token_aligned + spec.next_token_aligned:
            assert col in spec.required or col in spec.optional
    # the advantaged table is samples plus columns: every samples column keeps its type
    for name, typ in {**SAMPLES.required, **SAMPLES.optional}.items():
        assert {**ADVANTAGED.required, **ADVANTAGED.optional}[name] == typ
    assert SAMPLES.required["input_ids"] == TOKENS and SAMPLES.required["response_mask"] == MASK
    assert SAMPLES.optional["old_log_probs"] == FLOATS


def test_valid_table_passes_every_check():
    t = samples()
    SAMPLES.check_schema(t.schema, "here", needs=("old_log_probs",))
    check_row_invariants(SAMPLES, t, "here")
    check_structure(t, "here", group_size=2)


def test_missing_required_column_names_it_and_the_fix():
    t = samples().drop_columns(["score"])
    with pytest.raises(SchemaError, match=r"samples table at runs/x: missing column 'score' of type float; present: "
                                          r"row_id, .*Produce it upstream"):
        SAMPLES.check_schema(t.schema, "runs/x")


def test_needed_optional_column():
    t = samples()
    with pytest.raises(SchemaError, match="missing column 'values' of type list<item: float>"):
        SAMPLES.check_schema(t.schema, "here", needs=("values",))
    with pytest.raises(SchemaError, match="missing column 'made_up'"):
        SAMPLES.check_schema(t.schema, "here", needs=("made_up",))


@pytest.mark.parametrize("col,typ", [("score", pa.float64()), ("turn_idx", pa.int64()),
                                     ("input_ids", pa.list_(pa.int64())), ("response_mask", pa.list_(pa.int32())),
                                     ("row_id", pa.large_string())])
def test_wrong_type_of_required_column(col, typ):
    t = samples()
    schema = t.schema.set(t.schema.get_field_index(col), pa.field(col, typ))
    with pytest.raises(SchemaError, match=rf"column '{col}' has type .* expected {t.schema.field(col).type}"):
        SAMPLES.check_schema(schema, "here")


def test_wrong_type_of_optional_column():
    t = samples()
    schema = t.schema.set(t.schema.get_field_index("old_log_probs"), pa.field("old_log_probs", pa.list_(pa.float64())))
    with pytest.raises(SchemaError, match="optional column 'old_log_probs' has type list<item: double>"):
        SAMPLES.check_schema(schema, "here")


def test_mask_length_mismatch_names_row_and_row_id():
    t = samples(response_mask=[[0, 1, 1], [0, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    with pytest.raises(InvariantError, match=r"column 'response_mask' has 3 entries in row 1 \(row_id r1\) but "
                                             r"input_ids has 4 tokens; expected 4"):
        check_row_invariants(SAMPLES, t, "here")


def test_next_token_column_needs_l_minus_one_entries():
    lp = [[-0.5] * 2, [-0.5] * 3, [-0.5] * 5, [-0.5] * 5]
    with pytest.raises(InvariantError, match=r"'old_log_probs' has 5 entries in row 2 \(row_id r2\).*expected 4 "
                                             r"\(L-1, next-token aligned\)"):
        check_row_invariants(SAMPLES, samples(old_log_probs=lp), "here")


@pytest.mark.parametrize("value,word", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_non_finite_scalar(value, word):
    t = samples(score=[0.0, 1.0, value, 0.0])
    with pytest.raises(InvariantError, match=rf"column 'score' is {word} in row 2 \(row_id r2\); values must be "
                                             "finite"):
        check_row_invariants(SAMPLES, t, "here")


def test_non_finite_list_value_names_its_row():
    lp = [[-0.5] * 2, [-0.5] * 3, [-0.5, -0.5, float("nan"), -0.5], [-0.5] * 5]
    with pytest.raises(InvariantError, match=r"'old_log_probs' has a NaN or infinite value in row 2 \(row_id r2\)"):
        check_row_invariants(SAMPLES, samples(old_log_probs=lp), "here")


def test_null_score():
    with pytest.raises(InvariantError, match=r"column 'score' is null in row 1 \(row_id r1\)"):
        check_row_invariants(SAMPLES, samples(score=[0.0, None, 1.0, 1.0]), "here")


def test_rewarded_rows_without_token_columns():
    t = pa.table({"row_id": ["a", "b"], "response_level_rewards": pa.array([1.0, float("nan")], pa.float32())})
    REWARDED.check_schema(t.schema, "here")
    with pytest.raises(InvariantError, match="'response_level_rewards' is nan in row 1"):
        check_row_invariants(REWARDED, t, "here")


def test_empty_rows_are_legal():
    t = samples(input_ids=[[], [0], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]],
                response_mask=[[], [1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]],
                old_log_probs=[[], [], [-1.0] * 4, [-1.0] * 5])
    check_row_invariants(SAMPLES, t, "here")


def test_structure_duplicate_row_id():
    with pytest.raises(InvariantError, match="row_id 'r0' occurs more than once"):
        check_structure(samples(row_id=["r0", "r0", "r2", "r3"]), "here", None)


@pytest.mark.parametrize("turns,phrase", [([1, 2, 0, 1], "turn indices 1..2"), ([0, 2, 0, 1], "turn indices 0..2"),
                                          ([0, 0, 0, 1], "turn indices 0..0")])
def test_structure_turns_must_be_contiguous_from_zero(turns, phrase):
    with pytest.raises(InvariantError, match=rf"trajectory 'a' has {phrase}.*contiguous from 0"):
        check_structure(samples(turn_idx=turns), "here", None)


def test_structure_repeated_turn_with_the_right_range():
    """Turns 0, 2, 2 span 0..2 over 3 rows, but turn 1 is missing and 2 repeated."""
    t = samples(3, traj_id=["a", "a", "a"], turn_idx=[0, 2, 2], num_turns=[3, 3, 3])
    with pytest.raises(InvariantError, match=r"trajectory 'a' has turn indices 0..2 \(2 distinct\) over 3 rows"):
        check_structure(t, "here", None)


def test_structure_rows_must_match_num_turns():
    with pytest.raises(InvariantError, match=r"trajectory 'a' has 2 rows but num_turns 3..3"):
        check_structure(samples(num_turns=[3, 3, 2, 2]), "here", None)
    with pytest.raises(InvariantError, match=r"trajectory 'a' has 2 rows but num_turns 2..3"):
        check_structure(samples(num_turns=[2, 3, 2, 2]), "here", None)
    # trajectory-level rows: one row per trajectory whatever its number of turns
    check_structure(samples(2, traj_id=["a", "b"], turn_idx=[0, 0], num_turns=[4, 1]), "here", 2)
    # without num_turns the check is skipped
    check_structure(samples().drop_columns(["num_turns"]), "here", None)


def test_structure_group_size():
    check_structure(samples(), "here", 2)
    with pytest.raises(InvariantError, match=r"group 'g' has 2 trajectories, expected group_size=3.*Drop incomplete "
                                             "groups"):
        check_structure(samples(), "here", 3)
    check_structure(samples(), "here", None)


def test_arrow_schema_keeps_declared_order():
    names = SAMPLES.arrow_schema(present=["values", "state_hash"]).names
    assert names[: len(SAMPLES.required)] == list(SAMPLES.required)
    assert names[len(SAMPLES.required):] == ["state_hash", "values"]
    assert len(SAMPLES.arrow_schema().names) == len(SAMPLES.required) + len(SAMPLES.optional)
    assert np.all([n in SAMPLES.arrow_schema().names for n in SAMPLES.optional])
