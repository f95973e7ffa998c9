"""The offline example responses (stages/rlvr/example.py): every hand-written answer of the shipped data sets scores
as its kind says with the registered workers (no Ray), and the table is a valid, deterministic responses table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.rlvr_tables import RESPONSES, check_response_rows
from stages.rlvr.example import KINDS, RESPONSE_WRITERS, RLVRExampleSpec, example_table, write_rlvr_example
from tests.rlvr.helpers import REPO

WORKERS = {"math": "math_rule", "mcq": "multiple_choice_boxed", "ifeval": "ifeval", "code": "code_sandbox"}


@pytest.mark.parametrize("domain,limit", [("math", None), ("mcq", None), ("ifeval", None), ("code", 3)])
def test_every_hand_written_answer_scores_as_its_kind(domain, limit):
    import stages.rewards  # noqa: F401
    from stages.rewards import build_worker

    lines = (REPO / "data" / "rlvr" / f"{domain}.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines[:limit]]
    rows: dict[str, list] = {"response": [], "ground_truth": [], "prompt": [], "tag": []}
    kinds = []
    for task in tasks:
        for kind, text in RESPONSE_WRITERS[domain](task).items():
            rows["response"].append(text)
            rows["ground_truth"].append(str(task["ground_truth"]))
            rows["prompt"].append(task["prompt"])
            rows["tag"].append(task["tag"])
            kinds.append(kind)
    scores = build_worker(WORKERS[domain]).score_batch(rows)["scores"]
    for task_kind, score in zip(kinds, scores):
        if task_kind == "correct":
            assert score == 1.0
        elif task_kind == "incorrect":
            assert score == 0.0
        elif domain != "ifeval":
            assert score in (0.0, None)


def test_example_table_is_a_valid_deterministic_responses_table(tmp_path):
    spec = RLVRExampleSpec(limit=2, n=5, seed=3)
    table = example_table(spec)
    RESPONSES.check_schema(table.schema, "example", ("infer_logprobs", "old_log_probs", "ref_log_probs"))
    check_response_rows(table, "example")
    assert table.num_rows == 4 * 2 * 5
    _, counts = np.unique(table.column("prompt_id").to_numpy(zero_copy_only=False), return_counts=True)
    assert set(counts) == {5}
    assert set(table.column("example_kind").to_pylist()) <= set(KINDS)
    assert example_table(spec).equals(table)
    assert not example_table(RLVRExampleSpec(limit=2, n=5, seed=4)).equals(table)
    manifest = write_rlvr_example(spec, str(tmp_path / "out"))
    assert manifest["rows"] == 40 and sum(manifest["kinds"].values()) == 40
    with pytest.raises(FileExistsError, match="already exists"):
        write_rlvr_example(spec, str(tmp_path / "out"))
