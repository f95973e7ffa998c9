"""The records of a local data file, for the environments that read a data set (the single-turn math/QA envs, GEM's
dataset envs): one reader for ``.jsonl``, ``.json`` and ``.parquet``, whose errors name the file, the line or record,
and the fix. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import ConfigError

SUFFIXES = (".jsonl", ".json", ".parquet")


def read_records(path: Path) -> list[dict]:
    """The records of ``path``: one JSON object per line (``.jsonl``, blank lines skipped), a JSON list of objects or
    ``{"data": [...]}`` (``.json``), or a Parquet table's rows (``.parquet``). ConfigError for another suffix, a line
    or file that is not JSON, an unreadable Parquet file, or a record that is not an object."""
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: unsupported data file type '{path.suffix}'; use one of {', '.join(SUFFIXES)}")
    if path.suffix == ".parquet":
        records = _parquet_rows(path)
    elif path.suffix == ".jsonl":
        records = [_json(line, path, f"line {n}") for n, line in enumerate(_text(path).splitlines(), 1)
                   if line.strip()]
    else:
        records = _json(_text(path), path, "the file")
        records = records.get("data", records) if isinstance(records, dict) else records
        if not isinstance(records, list):
            raise ConfigError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}}), found "
                              f"{_json_kind(records)}; fix the file")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: record {i} is {_json_kind(record)}, not an object of named fields; "
                              "fix the file")
    return records


def _json_kind(value) -> str:
    """What ``value`` is, in JSON's words ("an array", "a number", ...)."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc}); save the file as UTF-8") from None


def _json(text: str, path: Path, where: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: {where} is not JSON ({exc}); fix the file") from None


def _parquet_rows(path: Path) -> list[dict]:
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path}: not a readable Parquet file ({exc}); write it again or use .jsonl") from None
