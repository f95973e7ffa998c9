"""A ``responses`` table built from ``data/rlvr/*.jsonl`` with hand-written responses (no model), so the reward stage
and the RLVR chain run offline.

Every prompt gets ``n`` responses, each one of three kinds (seeded per prompt, so groups have different pass rates):

* ``correct`` — the reference answer in the form the domain's worker expects (``\\boxed{42}``, the reference program
  in a ```python block, ``\\boxed{B}``, the compliant IFEval response);
* ``incorrect`` — a well-formed wrong answer (the answer + 1, the wrong program, another letter, the violating
  response);
* ``garbage`` — text without an answer (no box, no code block).

Token ids are a toy byte tokenizer (``BOS`` then UTF-8 bytes + 3); log-probs are seeded random numbers (``old`` =
``infer``, ``ref`` = ``old`` + small noise), so the KL options have something to work on. The kind of each row is
kept in the column ``example_kind`` (passed through to the workers, ignored by them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.rlvr_tables import RESPONSES
from stages.rewards.math_rule import normalise_answer, plain_number
from stages.storage import MANIFEST, Location

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "rlvr"
DOMAINS = ("math", "code", "mcq", "ifeval")
KINDS = ("correct", "incorrect", "garbage")
BOS = 1


@dataclass(frozen=True)
class RLVRExampleSpec:
    """``n`` responses per prompt; ``limit`` prompts per domain (None: all); ``mix`` = probabilities of the kinds."""

    domains: tuple[str, ...] = DOMAINS
    n: int = 8
    limit: int | None = None
    seed: int = 0
    mix: tuple[float, float, float] = (0.5, 0.3, 0.2)
    rows_per_file: int = 256
    data_dir: str = field(default=str(DATA_DIR))


def row_id(*parts: object) -> str:
    """Deterministic row id: SHA-256 of the joined parts."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:24]


def _wrong_number(answer: str) -> str:
    """``answer + 1`` for a plain number or ``\\frac{a}{b}``; else a number that differs from it."""
    value = plain_number(normalise_answer(answer))
    if value is None:
        return "123456789"
    wrong = value + 1
    return str(wrong.numerator) if wrong.denominator == 1 else (
        f"{float(wrong):g}" if Fraction(f"{float(wrong):g}") == wrong else f"{wrong.numerator}/{wrong.denominator}")


def _math(task: dict) -> dict[str, str]:
    lead = "Let me work it out step by step.\n\nThe answer is "
    return {"correct": f"{lead}\\boxed{{{task['ground_truth']}}}.",
            "incorrect": f"{lead}\\boxed{{{_wrong_number(task['ground_truth'])}}}.",
            "garbage": "I am not sure what is being asked here."}


def _code(task: dict) -> dict[str, str]:
    return {"correct": f"Here is my solution.\n```python\n{task['reference_solution']}```",
            "incorrect": f"Here is my solution.\n```python\n{task['wrong_solution']}```",
            "garbage": "I would rather not write any code for this."}


def _mcq(task: dict) -> dict[str, str]:
    letters = "ABCD"
    wrong = letters[(letters.index(task["ground_truth"]) + 1) % 4]
    return {"correct": f"Considering the options, the answer is \\boxed{{{task['ground_truth']}}}.",
            "incorrect": f"Considering the options, the answer is \\boxed{{{wrong}}}.",
            "garbage": "these options all look plausible to me"}


def _ifeval(task: dict) -> dict[str, str]:
    return {"correct": task["compliant_response"], "incorrect": task["violating_response"],
            "garbage": "?? ?? ??"}


RESPONSE_WRITERS: dict[str, Callable[[dict], dict[str, str]]] = {"math": _math, "code": _code, "mcq": _mcq,
                                                                 "ifeval": _ifeval}


def toy_tokens(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def _tasks(spec: RLVRExampleSpec) -> list[dict]:
    tasks = []
    for domain in spec.domains:
        if domain not in RESPONSE_WRITERS:
            raise ValueError(f"unknown example domain '{domain}'; choose from {', '.join(DOMAINS)}")
        lines = (Path(spec.data_dir) / f"{domain}.jsonl").read_text().splitlines()
        tasks += [json.loads(line) for line in lines[: spec.limit] if line.strip()]
    return tasks


def example_rows(spec: RLVRExampleSpec) -> dict[str, list]:
    """All rows of the example as columns (prompt groups contiguous)."""
    cols: dict[str, list] = {name: [] for name in RESPONSES.required}
    cols.update({"infer_logprobs": [], "old_log_probs": [], "ref_log_probs": [], "example_kind": []})
    for task in _tasks(spec):
        rng = np.random.default_rng([spec.seed, int(row_id(task["id"])[:8], 16)])
        texts = RESPONSE_WRITERS[task["domain"]](task)
        kinds = rng.choice(len(KINDS), size=spec.n, p=np.asarray(spec.mix) / np.sum(spec.mix))
        prompt_ids = [BOS] + toy_tokens(task["prompt"])
        for sample, kind in enumerate(kinds):
            response = texts[KINDS[kind]]
            response_ids = toy_tokens(response)
            old = rng.uniform(-3.0, -0.01, len(response_ids)).astype(np.float32)
            cols["row_id"].append(row_id("rlvr-example", spec.seed, task["id"], sample))
            cols["prompt_id"].append(task["id"])
            cols["domain"].append(task["domain"])
            cols["tag"].append(task.get("tag", task["domain"]))
            cols["prompt"].append(task["prompt"])
            cols["ground_truth"].append(str(task["ground_truth"]))
            cols["response"].append(response)
            cols["prompt_ids"].append(prompt_ids)
            cols["response_ids"].append(response_ids)
            cols["finish_reason"].append("stop")
            cols["infer_logprobs"].append(old)
            cols["old_log_probs"].append(old)
            cols["ref_log_probs"].append((old + rng.normal(0.0, 0.05, len(old))).astype(np.float32))
            cols["example_kind"].append(KINDS[kind])
    return cols


def example_table(spec: RLVRExampleSpec) -> pa.Table:
    cols = example_rows(spec)
    schema = RESPONSES.arrow_schema(present=list(cols)).append(pa.field("example_kind", pa.string()))
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in schema}, schema=schema)


def _data_digest(spec: RLVRExampleSpec) -> str:
    """SHA-256 over the data files the example reads (a changed data set gives another fingerprint)."""
    h = hashlib.sha256()
    for domain in spec.domains:
        h.update((Path(spec.data_dir) / f"{domain}.jsonl").read_bytes())
    return h.hexdigest()


def write_rlvr_example(spec: RLVRExampleSpec, output: str) -> dict:
    """Write the example ``responses`` table as Parquet parts plus a manifest into the new folder ``output``."""
    out = Location.of(output)
    if out.exists():
        raise FileExistsError(f"{out.path} already exists; choose a new --output folder or delete it first")
    table = example_table(spec)
    tmp = out.parent.child(f".{out.name}.tmp-rlvr-example")
    tmp.rmtree()
    tmp.fs.create_dir(tmp.path, recursive=True)
    files = []
    for i, start in enumerate(range(0, max(table.num_rows, 1), spec.rows_per_file)):
        name = f"part-{i:05d}.parquet"
        with tmp.fs.open_output_stream(f"{tmp.path}/{name}") as f:
            pq.write_table(table.slice(start, spec.rows_per_file), f)
        files.append({"name": name, "rows": min(spec.rows_per_file, table.num_rows - start)})
    params = asdict(spec) | {"data_dir": None}
    kinds = {k: int(v) for k, v in zip(*np.unique(table.column("example_kind").to_numpy(zero_copy_only=False),
                                                   return_counts=True))}
    manifest = {"stage": "rlvr_example", "version": "1", "table": "responses", "rows": table.num_rows,
                "files": files, "prompts": len(set(table.column("prompt_id").to_pylist())), "kinds": kinds,
                "params": params,
                "fingerprint": hashlib.sha256(json.dumps(params, sort_keys=True).encode()
                                              + _data_digest(spec).encode()).hexdigest()}
    tmp.child(MANIFEST).write_text(json.dumps(manifest, indent=1))
    tmp.rename(out)
    return manifest
