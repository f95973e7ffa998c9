"""The recompute chain's tables stay those of the chain before issue 49's speed-ups, row for row.

The digests below are of every column (in row order) of the two tables the chain wrote at d423def (before issue 49)
on the spine's ``step_set`` (``rollflow example``: 411 FrozenLake step rows, seed 1), with the GiGPO config (the
shared ``base_run``) and the GRPO config of ``benchmarks/recompute.py`` (token-level k3 KL). A change to any value,
row order, column or type changes a digest; the failure names the table and the columns that differ.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from stages import response_rewards
from tests.spine.helpers import GIGPO, GRPO, read_table, run_recompute

INPUT_COLUMNS = {
    "row_id": "8300415442cf2948", "group_id": "dc6f73f46dd9fcc8", "traj_id": "061d43c2b030e531",
    "turn_idx": "4a2fda94d64c3595", "num_turns": "e1b7aefb444834d2", "tag": "e79e23bdd406907c",
    "input_ids": "5f65ec14dbb691cd", "response_mask": "67a20c7c199f9bea", "score": "5b914a39f55e154c",
    "episode_score": "b387cc5a8eb10469", "state_hash": "f4934ceba8de0dc3", "infer_logprobs": "d74dfc8130d03c52",
    "old_log_probs": "92a43681a508baa5", "ref_log_probs": "f859201a20e0178c", "values": "6609b28f2c3d5065",
    "prompt_len": "e13e352bd8edc62e",
}
GIGPO_REWARDED = {
    "row_id": "8300415442cf2948", "response_level_rewards": "f011385b16580460", "step_rewards": "34d95d41518a2bd2",
    "episode_rewards_norm": "d48c4fde7bc834a2", "step_rewards_norm": "31108cfaa7eaebba",
    "state_group_id": "09d0cd2c66952421",
}
GRPO_REWARDED = {"row_id": "8300415442cf2948", "response_level_rewards": "d9fde0479f2479f7"}
EXPECTED = {
    "gigpo": {
        "rewarded": GIGPO_REWARDED,
        "advantaged": {**INPUT_COLUMNS, **GIGPO_REWARDED, "token_level_rewards": "5f621618c48d6cff",
                       "advantages": "9e76c486f5932bbd", "returns": "58a27176c798f239",
                       "raw_advantages": "58a27176c798f239"},
    },
    "grpo": {
        "rewarded": GRPO_REWARDED,
        "advantaged": {**INPUT_COLUMNS, **GRPO_REWARDED, "token_level_rewards": "8c02a04d9eec141c",
                       "advantages": "51568495300b6529", "returns": "bfe5c871868ad406",
                       "raw_advantages": "bfe5c871868ad406"},
    },
}
ROWS = 411


def column_digests(folder: Path) -> tuple[int, dict[str, str], list[str]]:
    """(rows, column → sha256 prefix of its values in row order, column names in order) of the table in ``folder``."""
    table = read_table(folder)
    digests = {name: hashlib.sha256(json.dumps(table.column(name).to_pylist()).encode()).hexdigest()[:16]
               for name in table.column_names}
    return table.num_rows, digests, table.column_names


def assert_recorded(folder: Path, expected: dict[str, str], what: str) -> None:
    rows, got, names = column_digests(folder)
    assert rows == ROWS, f"{what}: {rows} rows, the recorded chain wrote {ROWS}"
    assert sorted(names) == sorted(expected), f"{what}: columns {names}, recorded {sorted(expected)}"
    differ = sorted(name for name in expected if got[name] != expected[name])
    assert not differ, f"{what}: columns {differ} differ from the recorded chain's"


@pytest.mark.parametrize("table", ["rewarded", "advantaged"])
def test_gigpo_tables_equal_the_recorded_chain(base_run, table):
    assert_recorded(Path(base_run) / table, EXPECTED["gigpo"][table], f"GiGPO {table}")


def test_grpo_tables_with_token_kl_equal_the_recorded_chain(step_set, tmp_path, ray_cluster):
    run_recompute(step_set, str(tmp_path / "grpo"), GRPO)
    for table in ("rewarded", "advantaged"):
        assert_recorded(tmp_path / "grpo" / table, EXPECTED["grpo"][table], f"GRPO {table}")


def test_tables_of_the_rewards_step_in_partitions_equal_the_recorded_chain(step_set, tmp_path, ray_cluster,
                                                                           monkeypatch):
    """A memory budget for ~100 rows at once: the rewards step runs over 5 hash partitions by group (stages/
    partitioned.py) and writes its rows back in the samples' order; the tables stay the recorded ones."""
    monkeypatch.setattr(response_rewards, "STEP_BYTES_PER_ROW", int(response_rewards.memory_budget_bytes() // 100))
    run_recompute(step_set, str(tmp_path / "gigpo"), GIGPO)
    for table in ("rewarded", "advantaged"):
        assert_recorded(tmp_path / "gigpo" / table, EXPECTED["gigpo"][table], f"GiGPO {table} (partitioned)")
