"""Helpers of the RLVR tests: golden chain case ↔ responses rows, padded views of ragged columns, configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import load_config
from schemas.rlvr_config import RLVRConfig
from schemas.rlvr_tables import RESPONSES
from stages.algos.ragged import Ragged

REPO = Path(__file__).resolve().parents[2]
GOLDEN_ROUTE = {"worker": "tests.rlvr.workers:ground_truth_as_score"}


def config(path: str | None = None, **fields) -> RLVRConfig:
    """A validated RLVRConfig from a YAML file and/or fields (dotted keys with '__')."""
    data = {k.replace("__", "."): v for k, v in fields.items()}
    if path is None and "rewards" not in data:
        data["rewards"] = {"routes": {"*": GOLDEN_ROUTE}}
    return load_config(RLVRConfig, path, data)


# manifest params of ROLL's RLVR chain → RLVRConfig fields (same name unless listed here)
CHAIN_PARAM_FIELDS = {"num_return_sequences": "num_return_sequences_in_group"}
_NOT_FROM_PARAMS = {"rewards", "runtime", "domain_column", "roll_compat", "max_new_tokens",
                    "num_return_sequences_in_group"}


def chain_params(case) -> dict:
    """The params of a golden RLVR chain case, each one an RLVRConfig option (an unknown one fails the test)."""
    return case.check_params((set(RLVRConfig.model_fields) - _NOT_FROM_PARAMS) | set(CHAIN_PARAM_FIELDS))


def golden_config(case, **fields) -> RLVRConfig:
    """RLVRConfig of a golden chain case: every param mapped; max_new_tokens = the case's responses width."""
    mapped = {CHAIN_PARAM_FIELDS.get(k, k): v for k, v in chain_params(case).items()}
    return config(max_new_tokens=int(case.inputs["responses_width"]), **{**mapped, **fields})


def golden_rows(case, domain: str = "golden", prefix: str = "g") -> dict[str, list]:
    """The chain case as ``responses`` rows: row b = tokens 0..L-1 of the padded row, the prompt is everything before
    the first response token; log-probs per response token; ground_truth carries the score (see workers.py)."""
    i = case.inputs
    n = case.params["num_return_sequences"]
    lengths = i["attention_mask"].sum(-1)
    cols: dict[str, list] = {name: [] for name in RESPONSES.required}
    cols.update({"old_log_probs": [], "ref_log_probs": []})
    for b in range(len(lengths)):
        length = int(lengths[b])
        mask = i["response_mask"][b, :length]
        prompt_len = int(np.argmax(mask))
        assert mask[:prompt_len].sum() == 0 and mask[prompt_len:].all(), "RLVR rows: prompt then one response"
        tokens = (np.arange(length) % 50 + 3).astype(np.int32)
        cols["row_id"].append(f"{prefix}{b:03d}")
        cols["prompt_id"].append(f"{prefix}-prompt-{b // n:02d}")
        cols["domain"].append(domain)
        cols["tag"].append(domain)
        cols["prompt"].append("p")
        cols["ground_truth"].append(repr(float(i["scores"][b])))
        cols["response"].append("r")
        cols["prompt_ids"].append(tokens[:prompt_len].tolist())
        cols["response_ids"].append(tokens[prompt_len:].tolist())
        cols["finish_reason"].append("stop")
        for name in ("old_log_probs", "ref_log_probs"):
            cols[name].append(i[name][b, prompt_len - 1: length - 1].astype(np.float32).tolist())
    return cols


def responses_table(cols: dict[str, list]) -> pa.Table:
    extra = [k for k in cols if k not in RESPONSES.required and k not in RESPONSES.optional]
    schema = RESPONSES.arrow_schema(present=list(cols))
    schema = pa.schema(list(schema) + [pa.field(k, pa.string()) for k in extra])
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in schema}, schema=schema)


def write_responses(cols: dict[str, list], folder: Path, rows_per_file: int | None = None) -> str:
    """A plain folder of Parquet files (no manifest) holding the rows."""
    table = responses_table(cols)
    folder.mkdir(parents=True)
    step = rows_per_file or max(table.num_rows, 1)
    for k, start in enumerate(range(0, table.num_rows, step)):
        pq.write_table(table.slice(start, step), folder / f"part-{k:05d}.parquet")
    return str(folder)


def padded(column, width: int) -> np.ndarray:
    """A ragged Arrow column (or Ragged) → right-padded float array ``(B, width)``."""
    r = column if isinstance(column, Ragged) else Ragged.from_arrow(column, np.float64)
    return r.to_padded(width).astype(np.float64)


def read_folder(folder: str, columns: list[str] | None = None) -> pa.Table:
    files = sorted(Path(folder).glob("*.parquet"))
    return pa.concat_tables([pq.read_table(f, columns=columns) for f in files])
