"""The response-rewards step over hash partitions by group (stages/partitioned.py, issue 49) equals the whole-table
step. Unit level (no Ray), on the spine's ``step_set``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import ResponseRewardSection, section
from schemas.errors import InvariantError
from stages.partials import read_partials
from stages.partitioned import key_hash, partitioned
from stages.response_rewards import NARROW, partition_column, partitioned_rewards, read_narrow, response_rewards_table
from stages.storage import Location
from tests.spine.helpers import GIGPO, GRPO, config


def test_a_key_hashes_the_same_in_batches_of_other_widths():
    alone = key_hash(pa.array(["g_1"]))
    beside_longer = key_hash(pa.array(["a_much_longer_group_id", "g_1"]))
    assert alone[0] == beside_longer[1]
    assert len(set(key_hash(pa.array([f"g_{i}" for i in range(100)])) % np.uint64(7))) == 7


def test_a_partitioned_step_sees_whole_groups_in_row_order_and_returns_the_input_order(tmp_path):
    rng = np.random.default_rng(0)
    keys = rng.choice([f"group-{i}" for i in range(40)], 1000)
    table = pa.table({"key": keys, "x": rng.random(1000)})

    def running_sum(t: pa.Table):  # depends on each group's rows and their order
        x, k = t.column("x").to_numpy(), t.column("key").to_numpy(zero_copy_only=False)
        out = np.empty_like(x)
        for key in set(k):
            rows = np.flatnonzero(k == key)
            out[rows] = np.cumsum(x[rows])
        return pa.table({"key": t.column("key"), "s": out}), t.num_rows

    whole = running_sum(table)[0]
    batches = [table.slice(lo, 77) for lo in range(0, 1000, 77)]
    results, merged = partitioned(batches, "key", 5, running_sum, str(tmp_path), rows=64)
    got = pa.concat_tables(list(merged))
    assert got.equals(whole)
    assert sum(n for n, _ in results) == 1000 and len(results) == 5


@pytest.mark.parametrize("path,overrides", [(GRPO, {}), (GIGPO, {"reward_clip": 0.5}),
                                            (GRPO, {"adv_estimator": "step_reinforce"})])
def test_partitioned_response_rewards_equal_the_whole_table_step(step_set, tmp_path, path, overrides):
    sec = section(config(path, **overrides), ResponseRewardSection)
    samples, columns = Location.of(step_set), NARROW + ["state_hash"]
    whole, metrics = response_rewards_table(read_narrow(samples, columns, None, 1024), sec, "w")
    out = Location.of(str(tmp_path))
    got = pa.concat_tables(list(partitioned_rewards(samples, columns, sec, partition_column(sec), 4, out, "w",
                                                    rows=50)))
    assert got.equals(whole)
    combined = read_partials(out)[0]["metrics"]
    for name, value in metrics.items():  # the step's own metrics combine exactly
        assert combined[name] == value, name
    assert not (tmp_path / "_partials" / "spill").exists()


@pytest.mark.parametrize("overrides,column", [({}, "group_id"), ({"reward_normalization.grouping": "batch"}, None),
                                              ({"reward_normalization.grouping": "tags"}, None),
                                              ({"roll_compat": True}, None),
                                              ({"reward_normalization.grouping": "tags",
                                                "reward_normalization.method": "identity"}, "group_id")])
def test_a_step_whose_statistics_can_span_the_table_is_not_partitioned(overrides, column):
    assert partition_column(section(config(GIGPO, **overrides), ResponseRewardSection)) == column


def test_a_row_id_repeated_in_another_group_is_refused_as_the_whole_table_step_refuses_it(step_set, tmp_path):
    """Partitions hold whole groups, so a row_id given to rows of two groups meets itself in no partition; the
    partitioned step still refuses it, naming the id, before any output row."""
    sec = section(config(GRPO), ResponseRewardSection)
    columns = NARROW + ["state_hash"]
    table = read_narrow(Location.of(step_set), columns, None, 1024)
    groups = table.column("group_id").to_pylist()
    other = next(i for i, g in enumerate(groups) if g != groups[0])  # a row of another group than row 0's
    ids = table.column("row_id").to_pylist()
    ids[other] = ids[0]
    damaged = table.set_column(table.schema.get_field_index("row_id"), "row_id", pa.array(ids, pa.string()))
    (tmp_path / "in").mkdir()
    pq.write_table(damaged, tmp_path / "in" / "part-0.parquet")
    with pytest.raises(InvariantError, match=f"row_id '{ids[0]}' occurs more than once"):
        with pytest.raises(InvariantError) as whole:
            response_rewards_table(damaged, sec, "w")
        raise whole.value  # the whole-table step's own message, for the same damage
    with pytest.raises(InvariantError, match=f"row_id '{ids[0]}' occurs more than once"):
        list(partitioned_rewards(Location.of(str(tmp_path / "in")), columns, sec, partition_column(sec), 4,
                                 Location.of(str(tmp_path / "out")), "w", rows=50))
