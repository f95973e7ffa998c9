"""The environments' data-file reader (stages/envs/records.py): the three formats give the same records, and every
kind of bad file is a ConfigError that names the file, where in it, and the fix — also through an environment."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.errors import ConfigError
from stages.envs import make_env
from stages.envs.records import read_records

RECORDS = [{"question": "1+1?", "answer": "2"}, {"question": "2+3?", "answer": "5"}]


def _write(path, fmt):
    if fmt == "jsonl":
        path.write_text("\n" + "\n\n".join(json.dumps(r) for r in RECORDS) + "\n")  # blank lines are skipped
    elif fmt == "json":
        path.write_text(json.dumps(RECORDS))
    elif fmt == "json-data":
        path.write_text(json.dumps({"data": RECORDS}))
    else:
        pq.write_table(pa.Table.from_pylist(RECORDS), path)
    return path


@pytest.mark.parametrize("fmt, suffix", [("jsonl", ".jsonl"), ("json", ".json"), ("json-data", ".json"),
                                         ("parquet", ".parquet")])
def test_every_format_gives_the_same_records(tmp_path, fmt, suffix):
    assert read_records(_write(tmp_path / f"d{suffix}", fmt)) == RECORDS


@pytest.mark.parametrize("name, content, words", [
    ("d.jsonl", '{"question": "a", "answer": "1"}\n\n{"question": "b", answer: 2}\n', ["line 3 is not JSON",
                                                                                     "fix the file"]),
    ("d.jsonl", '{"question": "a", "answer": "1"}\n["b", "2"]\n', ["record 1 is an array, not an object",
                                                                  "fix the file"]),
    ("d.json", '[{"question": "a", "answer": "1"},', ["the file is not JSON", "fix the file"]),
    ("d.json", '{"rows": [{"question": "a"}]}', ["expected a JSON list of records", "found an object"]),
    ("d.json", '"just a string"', ["expected a JSON list", "found a string"]),
    ("d.json", '[{"question": "a"}, 3]', ["record 1 is a number"]),
    ("d.parquet", "PAR1 this is not parquet", ["not a readable Parquet file", "write it again"]),
    ("d.csv", "question,answer\n", ["unsupported data file type '.csv'", ".jsonl, .json, .parquet"]),
])
def test_a_bad_file_names_itself_where_and_the_fix(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        read_records(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    for word in words:
        assert word in message, message


def test_text_that_is_not_utf8_says_how_to_save_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ConfigError, match="not UTF-8 text.*save the file as UTF-8"):
        read_records(path)


@pytest.mark.parametrize("env, kwargs", [("GemMath", {}), ("gem", {"env_id": "math:GSM8K"})])
def test_an_environment_over_a_bad_file_raises_the_readers_error(tmp_path, env, kwargs):
    """Both users of the reader — the single-turn env and GEM's dataset envs (when gem is installed) — pass the
    error on instead of a JSON traceback."""
    if env == "gem":
        pytest.importorskip("gem")
    bad = tmp_path / "math.json"
    bad.write_text("[{")
    with pytest.raises(ConfigError, match=f"{bad}: the file is not JSON"):
        make_env(env, data_path=str(bad), **kwargs)


def test_parquet_data_serves_the_single_turn_env(tmp_path):
    env = make_env("GemMath", data_path=str(_write(tmp_path / "math.parquet", "parquet")))
    question, _ = env.reset(0)
    assert question in {r["question"] for r in RECORDS}
    assert env.step("\\boxed{" + str(env.answer) + "}")[1] == 1.0
