"""Instruction-following worker (§10 ifeval, BUG-15 fixed) and its constraint checks."""

from __future__ import annotations

import json

import pytest

from stages.rewards.ifeval import CONSTRAINTS, IFEvalWorker, check_constraint, instruction_score
from tests.rewards.conftest import columns, load_rows


def test_shipped_prompts_compliant_pass_and_violating_fail():
    rows = load_rows("ifeval")
    assert len(rows) >= 20
    worker = IFEvalWorker(repetition_max_penalty=0.0)
    good = worker.score_batch(columns(rows, response=[r["compliant_response"] for r in rows]))
    bad = worker.score_batch(columns(rows, response=[r["violating_response"] for r in rows]))
    assert good["scores"] == [1.0] * len(rows), [r["id"] for r, s in zip(rows, good["scores"]) if s != 1.0]
    assert bad["scores"] == [0.0] * len(rows), [r["id"] for r, s in zip(rows, bad["scores"]) if s != 0.0]


def test_every_shipped_constraint_name_is_known():
    for row in load_rows("ifeval"):
        for constraint in json.loads(row["ground_truth"]):
            assert constraint["func_name"] in CONSTRAINTS, row["id"]


def test_rows_without_a_usable_constraint_are_none_and_the_rest_stay_aligned():
    """BUG-15: ROLL skipped the penalty append (misaligned lists) and reused a stale result."""
    lower = json.dumps({"func_name": "validate_lowercase"})
    rows = {"response": ["all lower", "all lower", "all lower", "Upper", "all lower", "all lower"],
            "ground_truth": [lower, json.dumps({"N": 3}), json.dumps({"func_name": "no_such_check"}), lower,
                             json.dumps({"func_name": "validate_word_constraint", "N": 3}), "not json"]}
    out = IFEvalWorker().score_batch(rows)
    assert out["scores"] == [1.0, None, None, 0.0, None, None]
    assert out["response_level_rewards"] == [1.0, None, None, 0.0, None, None]


def test_reward_adds_the_repetition_penalty_of_the_whole_response():
    text = "la la la la la la"  # 4 trigrams, 1 unique
    out = IFEvalWorker().score_batch({"response": [text], "ground_truth": [json.dumps({"func_name":
                                                                                         "validate_lowercase"})]})
    assert out["scores"] == [1.0] and out["response_level_rewards"] == [pytest.approx(1.0 + 0.75 * -0.5)]


def test_constraints_are_checked_after_thinking():
    constraint = json.dumps({"func_name": "validate_no_commas"})
    out = IFEvalWorker().score_batch({"response": ["<think>a, b</think>no commas here"], "ground_truth": [constraint]})
    assert out["scores"] == [1.0]


def test_a_list_of_constraints_must_all_hold():
    both = [{"func_name": "validate_lowercase"}, {"func_name": "validate_no_commas"}]
    assert instruction_score("fine text", both) == 1.0
    assert instruction_score("fine, text", both) == 0.0


def test_keyword_frequency_counts_the_keyword_not_every_word():
    constraint = {"func_name": "verify_keyword_frequency", "word": "data", "N": 2}
    assert check_constraint("data and more data", constraint) is True
    assert check_constraint("data and more words", constraint) is False  # ROLL counted 4 words here


@pytest.mark.parametrize("text, constraint, expected", [
    ("one two three", {"func_name": "validate_word_constraint", "N": 3, "quantifier": "around"}, True),
    ("a b c d e f g h i j k l", {"func_name": "validate_word_constraint", "N": 10, "quantifier": "around"}, False),
    ("One. Two! Three?", {"func_name": "verify_sentence_constraint", "N": 3, "quantifier": "at least"}, True),
    ("the cat", {"func_name": "validate_forbidden_words", "forbidden_words": ["category"]}, True),
    ("aaa", {"func_name": "verify_letter_frequency", "letter": "a", "N": 3}, True),
    ("SECTION 1 a SECTION 2 b", {"func_name": "validate_sections", "N": 2, "section_splitter": "SECTION"}, True),
    ("I say yes.", {"func_name": "validate_choice", "options": ["yes", "no"]}, True),
    ("Repeat this. Then more", {"func_name": "validate_repeat_prompt", "original_prompt": "Repeat this."}, True),
    ("THE NASA AND ESA", {"func_name": "validate_frequency_capital_words", "N": 2, "quantifier": "at least"}, True),
    ("```json\n{\"a\": 1}\n```", {"func_name": "validate_json_format"}, True),
])
def test_constraint_checks(text, constraint, expected):
    assert check_constraint(text, constraint) is expected


def test_unsupported_or_malformed_constraints_cannot_be_scored():
    assert instruction_score("hola", {"func_name": "validate_response_language", "language": "es"}) is None
    assert instruction_score("x", {"func_name": "verify_letter_frequency", "letter": "ab", "N": 1}) is None
    assert instruction_score("x", {"func_name": "validate_word_constraint", "N": 1, "quantifier": "exactly"}) is None
    assert instruction_score("x", []) is None
