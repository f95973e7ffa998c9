"""Bad input through the CLI: each case exits with status 2 and one message naming the file/folder, column, row or
config field, what was expected and how to fix it; no output folder is committed and the input files are untouched.

Everything knowable from the input and the config — including what only the second stage uses (token columns: mask
lengths, NaN log-probs, ``values`` for GAE) — is checked before any stage runs (stages/preflight.py), so a bad input
leaves no output folder at all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.example import ExampleSpec, generate
from tests.spine.conftest import SMALL
from tests.spine.helpers import GIGPO, modified_copy, read_table, replace_value, set_column, tree_digest


@pytest.fixture(scope="module")
def tiny(data_root) -> str:
    """~112 step-level rows, 5 groups of 8, 2 files."""
    path = str(data_root / "tiny")
    generate(ExampleSpec(samples=100, seed=5, rows_per_file=40, **SMALL), path)
    return path


def _first_traj_with_turns(table: pa.Table, k: int) -> str:
    turns = table.column("num_turns").to_numpy()
    return table.column("traj_id")[int(np.flatnonzero(turns >= k)[0])].as_py()


def _row_of(table: pa.Table, traj: str, turn: int) -> int:
    mask = pc.and_(pc.equal(table.column("traj_id"), traj), pc.equal(table.column("turn_idx"), turn))
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def drop_rows(table: pa.Table, keep) -> pa.Table:
    return table.filter(pa.array(keep))


def drop_trajectory(t: pa.Table) -> pa.Table:
    return drop_rows(t, pc.not_equal(t.column("traj_id"), t.column("traj_id")[0]))


def drop_middle_turn(t: pa.Table) -> pa.Table:
    i = _row_of(t, _first_traj_with_turns(t, 3), 1)
    return drop_rows(t, np.arange(t.num_rows) != i)


def drop_last_turn(t: pa.Table) -> pa.Table:
    traj = _first_traj_with_turns(t, 3)
    n = t.column("num_turns")[_row_of(t, traj, 0)].as_py()
    i = _row_of(t, traj, n - 1)
    return drop_rows(t, np.arange(t.num_rows) != i)


def duplicate_turn(t: pa.Table) -> pa.Table:
    i = _row_of(t, _first_traj_with_turns(t, 3), 1)
    return replace_value(t, "turn_idx", i, 2)


def short_mask(t: pa.Table) -> pa.Table:
    masks = t.column("response_mask").to_pylist()
    masks[5] = masks[5][:-1]
    return set_column(t, "response_mask", masks)


def nan_log_prob(t: pa.Table) -> pa.Table:
    lp = t.column("old_log_probs").to_pylist()
    lp[9][3] = float("nan")
    return set_column(t, "old_log_probs", lp)


def duplicate_row_id(t: pa.Table) -> pa.Table:
    return replace_value(t, "row_id", 4, t.column("row_id")[3].as_py())


def float64_score(t: pa.Table) -> pa.Table:
    return set_column(t, "score", t.column("score").to_numpy().astype(np.float64), pa.float64())


def int64_tokens(t: pa.Table) -> pa.Table:
    return set_column(t, "input_ids", t.column("input_ids").to_pylist(), pa.list_(pa.int64()))


# name → (change to the table, CLI extra args, phrases the message must contain, which stage output may exist)
DATA_CASES = {
    "missing_column": (lambda t: t.drop_columns(["episode_score"]), [],
                       ["missing column 'episode_score'", "of type float", "Produce it upstream"], None),
    "score_float64": (float64_score, [], ["column 'score' has type double, expected float", "Cast it"], None),
    "input_ids_int64": (int64_tokens, [], ["column 'input_ids' has type list<element: int64>",
                                           "expected list<item: int32>", "token ids are list<int32>"], None),
    "nan_score": (lambda t: replace_value(t, "score", 17, float("nan")), [],
                  ["column 'score' is nan in row 17 (row_id", "must be finite", "drop the row"], None),
    "inf_episode_score": (lambda t: replace_value(t, "episode_score", 30, float("inf")), [],
                          ["column 'episode_score' is inf in row 30 (row_id", "must be finite"], None),
    "null_score": (lambda t: replace_value(t, "score", 2, None), [],
                   ["column 'score' is null in row 2 (row_id", "a score is required"], None),
    "incomplete_group": (drop_trajectory, [], ["has 7 trajectories, expected group_size=8",
                                               "Drop incomplete groups or set group_size"], None),
    "group_size_16": (lambda t: t, ["--set", "group_size=16"], ["has 8 trajectories, expected group_size=16"], None),
    "turn_gap": (drop_middle_turn, [], ["has turn indices 0..", "contiguous from 0", "missing or duplicated",
                                            "re-run the rollout"], None),
    "turn_repeated": (duplicate_turn, [], ["contiguous from 0 without repeats", "duplicated"], None),
    "turn_missing_at_end": (drop_last_turn, [], ["rows but num_turns", "one row per turn"], None),
    "duplicate_row_id": (duplicate_row_id, [], ["occurs more than once", "must be unique"], None),
    "mask_length": (short_mask, [], ["column 'response_mask' has", "entries in row 5 (row_id", "input_ids has",
                                     "Fix the producer"], None),
    "nan_log_prob": (nan_log_prob, [], ["column 'old_log_probs' has a NaN or infinite value in row 9 (row_id",
                                        "must be finite"], None),
    "gae_without_values": (lambda t: t.drop_columns(["values"]), ["--set", "adv_estimator=gae"],
                           ["missing column 'values'", "Produce it upstream"], None),
    "empty_table": (lambda t: t.slice(0, 0), [], ["has no rows", "at least one row"], None),
    "null_row_id": (lambda t: replace_value(t, "row_id", 3, None), [],
                    ["identity column 'row_id' is null in row 3", "must be set on every row"], None),
    "null_turn_idx": (lambda t: replace_value(t, "turn_idx", 6, None), [],
                      ["identity column 'turn_idx' is null in row 6"], None),
    "null_group_id": (lambda t: replace_value(t, "group_id", 0, None), [],
                      ["identity column 'group_id' is null in row 0"], None),
    "null_tag": (lambda t: replace_value(t, "tag", 11, None), [],
                 ["column 'tag' is null in row 11 (row_id", "every row needs a value", "drop the row"], None),
    "null_input_ids": (lambda t: replace_value(t, "input_ids", 4, None), [],
                       ["column 'input_ids' is null in row 4 (row_id", "every row needs a value"], None),
}

runner = CliRunner()


def recompute(input_dir, output, *extra, config=GIGPO):
    return runner.invoke(app, ["recompute", "--input", str(input_dir), "--config", str(config), "--output",
                               str(output), *extra])


def assert_user_error(result, phrases: list[str]) -> str:
    assert result.exit_code == 2, f"exit {result.exit_code}; output:\n{result.output}\n{result.exception!r}"
    text = " ".join(result.output.split())  # the terminal may wrap long lines
    assert text.startswith("error: ") or "\nerror: " in result.output, result.output
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{result.output}"
    assert "Traceback" not in result.output and "Logging error" not in result.output
    assert "Failed to apply UDF" not in result.output, "Ray's retry advice is not for user errors"
    lines = result.output.splitlines()
    assert sum(line.startswith("error: ") for line in lines) == 1, f"the error is printed once:\n{result.output}"
    assert not any(w in result.output for w in ("Finished in state", "Task run", "Flow run")), \
        f"Prefect's copies of the error go to the log file, not the console:\n{result.output}"
    return text


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_samples_through_recompute(case, tiny, tmp_path, ray_cluster):
    change, extra, phrases, committed = DATA_CASES[case]
    bad = modified_copy(tiny, tmp_path / "bad", change, rows_per_file=40)
    before = tree_digest(bad)
    out = tmp_path / "out"
    text = assert_user_error(recompute(bad, out, *extra), phrases)
    assert str(Path(bad)) in text, "the message names the input folder or file"
    assert tree_digest(bad) == before, "inputs are never modified"
    if committed is None:
        assert not out.exists(), f"nothing may be committed, found {sorted(p.name for p in out.iterdir())}"
    else:
        assert sorted(p.name for p in out.iterdir()) == [committed]
        assert (out / committed / "manifest.json").exists()


@pytest.mark.parametrize("case", ["missing_column", "score_float64", "nan_score", "incomplete_group", "turn_gap",
                                  "turn_repeated", "turn_missing_at_end", "mask_length", "nan_log_prob",
                                  "null_row_id", "null_tag", "null_input_ids"])
def test_bad_samples_through_validate(case, tiny, tmp_path):
    change, extra, phrases, _ = DATA_CASES[case]
    bad = modified_copy(tiny, tmp_path / "bad", change, rows_per_file=40)
    before = tree_digest(bad)
    assert_user_error(runner.invoke(app, ["validate", bad, "--group-size", "8"]), phrases)
    assert tree_digest(bad) == before


def test_corrupt_parquet_file(tiny, tmp_path, ray_cluster):
    bad = modified_copy(tiny, tmp_path / "bad", lambda t: t, rows_per_file=40)
    victim = Path(bad) / "part-00001.parquet"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # a truncated write
    before = tree_digest(bad)
    out = tmp_path / "out"
    for result in (recompute(bad, out), runner.invoke(app, ["validate", bad]), runner.invoke(app, ["inspect", bad])):
        assert_user_error(result, [str(victim), "is not a readable Parquet file", "re-run that stage"])
    assert not out.exists()
    assert tree_digest(bad) == before


def test_corrupt_data_pages_behind_a_good_footer(tiny, tmp_path, ray_cluster):
    """The footer (and so the schema) reads fine, the data does not decode: named before any stage commits."""
    bad = modified_copy(tiny, tmp_path / "bad", lambda t: t, rows_per_file=40)
    victim = Path(bad) / "part-00001.parquet"
    data = bytearray(victim.read_bytes())
    import pyarrow.parquet as pq

    pq.read_schema(victim)  # the footer is intact
    start = 4 + (len(data) - 8 - int.from_bytes(data[-8:-4], "little")) // 4
    data[start:start + 64] = b"\xff" * 64  # inside the column chunks, before the footer
    victim.write_bytes(bytes(data))
    pq.read_schema(victim)
    out = tmp_path / "out"
    for result in (recompute(bad, out), runner.invoke(app, ["validate", bad])):  # validate reads the data too
        assert_user_error(result, [str(victim), "cannot be decoded", "re-run that stage"])
    assert not out.exists()


def test_files_with_different_schemas(tiny, tmp_path, ray_cluster):
    bad = modified_copy(tiny, tmp_path / "bad", lambda t: t, rows_per_file=40)
    extra = read_table(bad).slice(0, 3).drop_columns(["prompt_len"])
    import pyarrow.parquet as pq

    pq.write_table(extra, Path(bad) / "part-00009.parquet")
    assert_user_error(recompute(bad, tmp_path / "out"), ["part-00009.parquet", "differs from the other files",
                                                          "must share one schema"])
    assert not (tmp_path / "out").exists()


def test_gigpo_needs_step_level_rows(traj_set, tmp_path, ray_cluster):
    """Trajectory-level rows carry no anchor state: GiGPO refuses them (GRPO takes them, see test_cli)."""
    before = tree_digest(traj_set)
    assert_user_error(recompute(traj_set, tmp_path / "out"), [f"samples table at {traj_set}", "'state_hash' is null",
                                                              "GiGPO needs the anchor state of every step row"])
    assert not (tmp_path / "out").exists() and tree_digest(traj_set) == before


def test_missing_and_empty_input_folder(tmp_path, ray_cluster):
    assert_user_error(recompute(tmp_path / "nowhere", tmp_path / "out"), [str(tmp_path / "nowhere"),
                                                                          "does not exist"])
    (tmp_path / "empty").mkdir()
    assert_user_error(recompute(tmp_path / "empty", tmp_path / "out"), ["holds no .parquet files",
                                                                        "rollflow example --output DIR"])
    assert not (tmp_path / "out").exists()


CONFIG_CASES = {
    "reward_clip_zero": ("reward_clip: 0\n", ["reward_clip (0.0) must be null or > 0", "set reward_clip: null"]),
    "advantage_clip_negative": ("advantage_clip: -1\n", ["advantage_clip (-1.0) must be null or > 0"]),
    "unknown_key": ("adv_estimater: grpo\n", ["field 'adv_estimater'", "unknown option"]),
    "bad_enum": ("adv_estimator: ppo\n", ["field 'adv_estimator'", "'gae'", "'grpo'"]),
    "bad_nested_enum": ("reward_normalization:\n  method: zscore\n",
                        ["field 'reward_normalization.method'", "'mean_std'"]),
    "grouping_names_no_column": ("reward_normalization:\n  grouping: traj\n",
                                 ["field 'reward_normalization.grouping'", "'traj_group_id'", "'tags'"]),
    "negative_reward_weight": ("adv_estimator: gigpo\nstep_reward_weight: -1\n",
                               ["step_reward_weight must be >= 0", "use 0 to switch a part off"]),
    "gamma_out_of_range": ("gamma: 1.5\n", ["field 'gamma'", "less than or equal to 1"]),
    "group_size_one": ("adv_estimator: grpo\ngroup_size: 1\nreward_normalization:\n  grouping: traj_group_id\n"
                       "  method: mean_std\n", ["group_size (1) must be at least 2", "set group_size"]),
    "not_a_mapping": ("- adv_estimator\n", ["must hold a mapping"]),
    "not_yaml": ("adv_estimator: [grpo\n", ["is not valid YAML"]),
    "kl_penalty_full": ("kl_penalty: full\n", ["kl_penalty 'full'", "only the sampled tokens' log-probs",
                                               "set kl_penalty to kl, abs, mse or k3"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(case, tiny, tmp_path):
    text, phrases = CONFIG_CASES[case]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    before = tree_digest(tiny)
    message = assert_user_error(recompute(tiny, tmp_path / "out", config=cfg), phrases)
    assert str(cfg) in message, "the message names the config file"
    assert not (tmp_path / "out").exists()
    assert tree_digest(tiny) == before


def test_bad_override_and_missing_config(tiny, tmp_path):
    assert_user_error(recompute(tiny, tmp_path / "out", "--set", "gamma"), ["override 'gamma'", "key=value"])
    assert_user_error(recompute(tiny, tmp_path / "out", "--set", "whiten_advantages=maybe"),
                      ["field 'whiten_advantages'"])
    assert_user_error(recompute(tiny, tmp_path / "out", config=tmp_path / "none.yaml"),
                      ["none.yaml does not exist"])
    assert not (tmp_path / "out").exists()


def test_override_that_is_not_yaml(tiny, tmp_path):
    assert_user_error(recompute(tiny, tmp_path / "out", "--set", "gamma=[1"),
                      ["override 'gamma=[1'", "is not valid YAML", "quote it"])
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file_or_under_one(tiny, tmp_path):
    """Refused before any stage, with the path named (the cleanup of a failed commit never hides the cause)."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert_user_error(recompute(tiny, afile), [str(afile), "is an existing file", "pass a folder"])
    assert_user_error(recompute(tiny, afile / "sub" / "out"), [str(afile), "which is a file"])
    assert afile.read_text() == "keep me"
