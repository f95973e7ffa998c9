"""The synthetic RLVR tasks (stages/rlvr/synthetic.py) and the shipped quickstart task's config and data. No model
runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.config import load_config
from schemas.rlvr_train_config import RLVRTrainConfig
from stages.rewards.registry import build_worker
from stages.rlvr.generate import prompts_section, read_prompt_rows
from stages.rlvr.synthetic import TASKS, make_rows
from tests.rlvr.helpers import REPO

QUICKSTART = "add2"
CONFIG = REPO / "configs" / f"rlvr_train_{QUICKSTART}.yaml"


def _right_and_wrong(task: str, gold: str) -> tuple[str, str]:
    """A response the task's worker must score 1 and one it must score 0."""
    if TASKS[task][1] == "ifeval":
        return "the sea is calm and grey tonight.", "The Sea is calm and grey tonight."
    if TASKS[task][1] == "math_rule":
        return f"So the sum is \\boxed{{{gold}}}.", f"So the sum is \\boxed{{{int(gold) + 1}}}."
    other = "A" if gold != "A" else "B"
    return f"The largest is \\boxed{{{gold}}}.", f"The largest is \\boxed{{{other}}}."


@pytest.mark.parametrize("task", list(TASKS))
def test_a_task_is_the_same_on_every_call_and_its_splits_differ(task):
    rows = make_rows(task, 20, "heldout")
    assert rows == make_rows(task, 20, "heldout")
    assert rows != make_rows(task, 20, "train")
    assert rows != make_rows(task, 20, "heldout", seed=1)
    for row in rows:
        assert set(row) == {"id", "domain", "tag", "prompt", "ground_truth"} and row["domain"] == f"{task}_heldout"
    assert len({row["id"] for row in rows}) == 20


@pytest.mark.parametrize("task", list(TASKS))
def test_the_tasks_worker_scores_a_right_answer_1_and_a_wrong_one_0(task):
    row = make_rows(task, 1, "heldout")[0]
    right, wrong = _right_and_wrong(task, row["ground_truth"])
    worker = build_worker(TASKS[task][1])
    scores = worker.score_batch({"response": [right, wrong], "ground_truth": [row["ground_truth"]] * 2})["scores"]
    assert scores == [1.0, 0.0]


def test_the_quickstart_config_loads_and_its_shipped_files_are_the_generators_output():
    config = load_config(RLVRTrainConfig, CONFIG)
    files = {}
    for prompts in (config.prompts, config.validation.prompts):
        section = prompts_section(prompts.data_dir, prompts.domains, prompts.limit)
        rows = read_prompt_rows(section)
        (name,) = prompts.domains
        assert rows and {r["domain"] for r in rows} == {name}
        files[name.rsplit("_", 1)[1]] = [json.loads(line) for line in
                                        (REPO / "data" / "rlvr" / f"{name}.jsonl").read_text().splitlines()]
    assert files["train"] == make_rows(QUICKSTART, len(files["train"]), "train")
    train_prompts = {r["prompt"] for r in files["train"]}
    assert files["heldout"] == make_rows(QUICKSTART, len(files["heldout"]), "heldout", exclude=frozenset(train_prompts))
    assert not train_prompts & {r["prompt"] for r in files["heldout"]}
    assert config.rewards.routes[f"{QUICKSTART}_train"].worker == TASKS[QUICKSTART][1]
    assert config.validation_rewards().routes[f"{QUICKSTART}_heldout"].worker == TASKS[QUICKSTART][1]
