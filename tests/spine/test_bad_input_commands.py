"""Bad input through the other table commands (issue 17): ``rollflow score``, ``logprobs``, ``values`` and
``train-step`` check their input table before Prefect and Ray start — schema, every row's invariants, an empty
table, the output path — and refuse a bad one with exit status 2 and one message naming the file, column, row and
fix; no output folder is created and the input is untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from stages.example import ExampleSpec, generate
from tests.rlvr.helpers import GOLDEN_ROUTE, write_responses
from tests.spine.conftest import SMALL
from tests.spine.helpers import read_table, replace_value, set_column, tree_digest, write_samples

runner = CliRunner()


def _responses(n_prompts: int = 3, n: int = 4) -> dict[str, list]:
    rng = np.random.default_rng(7)
    cols: dict[str, list] = {}
    for b in range(n_prompts * n):
        rlen = int(rng.integers(1, 6))
        old = rng.normal(-1, 0.3, rlen).astype(np.float32)
        row = {"row_id": f"r{b:03d}", "prompt_id": f"p{b // n}", "domain": "math", "tag": "math", "prompt": "p",
               "ground_truth": str(b % 2), "response": "r", "prompt_ids": [5, 6, 7], "response_ids": [8] * rlen,
               "finish_reason": "stop", "infer_logprobs": old.tolist()}
        for k, v in row.items():
            cols.setdefault(k, []).append(v)
    return cols


def _changed(cols: dict[str, list], column: str, row: int, value) -> dict[str, list]:
    out = {k: list(v) for k, v in cols.items()}
    out[column][row] = value
    return out


RESPONSE_CASES = {
    "empty_prompt": (lambda c: _changed(c, "prompt_ids", 5, []), ["has an empty prompt_ids", "row 5 (row_id r005)",
                                                                  "Store the templated prompt's token ids"]),
    "logprob_length": (lambda c: _changed(c, "infer_logprobs", 2, c["infer_logprobs"][2] + [-1.0]),
                       ["column 'infer_logprobs' has", "row 2 (row_id r002)", "one value per response token"]),
    "nan_logprob": (lambda c: _changed(c, "infer_logprobs", 7, [float("nan")] * len(c["infer_logprobs"][7])),
                    ["column 'infer_logprobs' has a NaN or infinite value in row 7 (row_id r007)"]),
    "null_prompt_id": (lambda c: _changed(c, "prompt_id", 1, None),
                       ["column 'prompt_id' is null in row 1 (row_id r001)", "every row needs a value"]),
    "missing_response": (lambda c: c, ["missing column 'response'", "Produce it upstream"]),
    "no_parquet_files": (lambda c: {k: [] for k in c}, ["holds no .parquet files", "pass a stage output folder"]),
}


def _refused(result, phrases: list[str]) -> None:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"one message, once:\n{result.output}"
    for phrase in phrases:
        assert phrase in result.output, f"{phrase!r} not in:\n{result.output}"
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def score_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("score-config") / "score.yaml"
    path.write_text(yaml.safe_dump({"rewards": {"routes": {"math": GOLDEN_ROUTE}}, "adv_estimator": "grpo",
                                    "num_return_sequences_in_group": 4, "add_token_level_kl": True}))
    return str(path)


@pytest.mark.parametrize("case", sorted(RESPONSE_CASES))
def test_bad_responses_through_score(case, score_config, tmp_path):
    change, phrases = RESPONSE_CASES[case]
    responses = write_responses(change(_responses()), tmp_path / "responses")
    if case == "missing_response":  # the helper writes every required column: drop it from the written file
        table = read_table(responses).drop_columns(["response"])
        for f in Path(responses).glob("*.parquet"):
            f.unlink()
        responses = write_samples(table, tmp_path / "without_response")
    before = tree_digest(responses)
    out = tmp_path / "out"
    _refused(runner.invoke(app, ["score", "--input", responses, "--config", score_config, "--output", str(out),
                                 "--advantages"]), phrases)
    assert not out.exists() and tree_digest(responses) == before


def test_score_with_token_kl_needs_log_probs_before_any_stage(score_config, tmp_path):
    """The advantages stage (third of the command) needs old_log_probs for the token-level KL: known up front."""
    responses = write_responses(_responses(), tmp_path / "responses")  # infer_logprobs only
    out = tmp_path / "out"
    _refused(runner.invoke(app, ["score", "--input", responses, "--config", score_config, "--output", str(out),
                                 "--advantages"]), ["missing column 'old_log_probs'"])
    assert not out.exists(), "not even the reward stage's table is committed"


@pytest.fixture(scope="module")
def samples(data_root) -> str:
    path = str(data_root / "commands_samples")
    generate(ExampleSpec(samples=24, seed=3, rows_per_file=1000, **SMALL), path)
    return path


def _short_mask(t: pa.Table) -> pa.Table:
    masks = t.column("response_mask").to_pylist()
    masks[3] = masks[3][:-1]
    return set_column(t, "response_mask", masks)


SAMPLE_CASES = {
    "mask_length": (_short_mask, ["column 'response_mask' has", "entries in row 3 (row_id"]),
    "null_input_ids": (lambda t: replace_value(t, "input_ids", 2, None), ["column 'input_ids' is null in row 2"]),
    "empty_table": (lambda t: t.slice(0, 0), ["has no rows"]),
}


@pytest.mark.parametrize("command", ["logprobs", "values", "train-step"])
@pytest.mark.parametrize("case", sorted(SAMPLE_CASES))
def test_bad_samples_through_the_training_commands(command, case, samples, tmp_path, tiny_model):
    change, phrases = SAMPLE_CASES[case]
    table = change(read_table(samples))
    if command == "train-step":  # an advantaged table: the same rows with the training columns
        table = _advantaged(table)
    bad = write_samples(table, tmp_path / "bad")
    out = tmp_path / "out"
    _refused(runner.invoke(app, [command, "--samples", bad, "--checkpoint", str(tiny_model), "--output", str(out)]),
             phrases)
    assert not out.exists()


def _advantaged(table: pa.Table) -> pa.Table:
    """``table`` plus zero-valued advantage columns of the right lengths (a table train-step accepts)."""
    lengths = [max(len(ids) - 1, 0) if ids is not None else 0 for ids in table.column("input_ids").to_pylist()]
    zeros = pa.array([[0.0] * n for n in lengths], pa.list_(pa.float32()))
    for name in ("token_level_rewards", "advantages", "returns", "raw_advantages"):
        table = table.append_column(name, zeros)
    return table.append_column("response_level_rewards", pa.array([0.0] * table.num_rows, pa.float32()))


def test_train_step_with_gae_needs_values_and_an_output_that_is_not_a_file(samples, tmp_path, tiny_model):
    table = read_table(samples)
    good = write_samples(_advantaged(table.drop_columns([c for c in ("values",) if c in table.column_names])),
                         tmp_path / "adv")
    config = tmp_path / "gae.yaml"
    config.write_text("adv_estimator: gae\n")
    _refused(runner.invoke(app, ["train-step", "--samples", good, "--checkpoint", str(tiny_model), "--config",
                                 str(config), "--output", str(tmp_path / "ckpt")]), ["missing column 'values'"])
    assert not (tmp_path / "ckpt").exists()
    file = tmp_path / "a-file"
    file.write_text("x")
    _refused(runner.invoke(app, ["logprobs", "--samples", samples, "--checkpoint", str(tiny_model), "--output",
                                 str(file)]), ["is an existing file"])
    assert Path(file).read_text() == "x"
