"""Multiple-choice workers (§10): boxed MCQ (BUG-12), general validation rule (BUG-13), CrossThinkQA (BUG-14)."""

from __future__ import annotations

import pytest

from stages.rewards.choice import (CHOICE_REWARDS, CrossThinkQAWorker, GeneralValRuleWorker,
                                   MultipleChoiceBoxedWorker, single_choice_answer)
from stages.rewards.text import repetition_penalty
from tests.rewards.conftest import columns, load_rows


def test_mcq_boxed_scores_and_rewards_the_boxed_letter():
    rows = {"response": [r"I pick \boxed{B}", r"\boxed{(C) Mercury}", "B", r"\boxed{b}", r"\boxed{B} x", r"\boxed{B}"],
            "ground_truth": ["B", "C", "B", "B", "Bravo", ""]}
    out = MultipleChoiceBoxedWorker().score_batch(rows)
    assert out["scores"] == [1.0, 1.0, 0.0, 0.0, 1.0, None]
    # BUG-12: ROLL returned zero rewards; the reward is the score
    assert out["response_level_rewards"] == out["scores"]


def test_mcq_uses_the_last_box_after_thinking():
    out = MultipleChoiceBoxedWorker().score_batch(
        {"response": [r"<think>\boxed{A}?</think>\boxed{D}", r"\boxed{D} no wait \boxed{A}"],
         "ground_truth": ["D", "D"]})
    assert out["scores"] == [1.0, 0.0]


def test_shipped_mcq_rows_score_one_for_the_answer_and_zero_for_another_letter():
    rows = load_rows("mcq")
    assert len(rows) >= 20 and all(r["ground_truth"] in "ABCD" for r in rows)
    worker = MultipleChoiceBoxedWorker()
    right = worker.score_batch(columns(rows, response=[rf"\boxed{{{r['ground_truth']}}}" for r in rows]))
    wrong = worker.score_batch(columns(rows, response=[r"\boxed{%s}" % ("A" if r["ground_truth"] != "A" else "B")
                                                       for r in rows]))
    assert right["scores"] == [1.0] * len(rows) and wrong["scores"] == [0.0] * len(rows)


@pytest.mark.parametrize("answer, text, boxed, letter", [
    (r"so \boxed{C}", "C", True, "C"),
    ("The answer is (B) because", " (B) because", False, "B"),
    ("I think D", "I think D", False, "I"),  # ROLL's rule: first uppercase letter of the whole answer
    ("no letters", "no letters", False, None),
])
def test_single_choice_extraction(answer, text, boxed, letter):
    got = single_choice_answer(answer)
    assert (got.text, got.boxed, got.letter) == (text, boxed, letter)


def test_general_val_scores_listed_tags_and_cannot_score_others():
    rows = {"response": [r"\boxed{A}", "the answer is B", r"\boxed{A}", r"\boxed{A}"],
            "ground_truth": ["A", "C", "A", "A"], "tag": ["ceval", "mmlu_pro", "math", "race_high"]}
    out = GeneralValRuleWorker().score_batch(rows)
    assert out["scores"] == [1.0, 0.0, None, 1.0]  # BUG-13: unlisted tag → None, not a stale score
    assert out["response_level_rewards"] == [0.0, 0.0, None, 0.0]  # validation only
    assert GeneralValRuleWorker(tags=["math"]).score_batch(rows)["scores"] == [None, None, 1.0, None]


# (response, gold) → (correct, boxed) for the reward table
TABLE_ROWS = [(r"\boxed{A}", "A"), ("answer is A", "A"), (r"\boxed{B}", "A"), ("answer is B", "A")]


@pytest.mark.parametrize("reward_type, expected", [
    ("loose", [1.0, 1.0, -1.0, -1.0]), ("soft", [1.0, 0.5, -0.5, -1.0]), ("strict", [1.0, -1.0, -1.0, -1.0])])
def test_crossthinkqa_reward_table(reward_type, expected):
    worker = CrossThinkQAWorker(reward_type=reward_type)
    out = worker.score_batch({"response": [r for r, _ in TABLE_ROWS], "ground_truth": [g for _, g in TABLE_ROWS]})
    assert out["response_level_rewards"] == expected  # texts too short for a repetition penalty
    assert out["scores"] == [1.0 if e > 0 else 0.0 for e in expected]
    assert [CHOICE_REWARDS[reward_type][k] for k in [(True, True), (True, False), (False, True), (False, False)]] \
        == expected


def test_repetition_penalty_hand_computed():
    assert repetition_penalty("a b c a b c", 3, -0.5) == pytest.approx((1 - 3 / 4) * -0.5)
    assert repetition_penalty("a b", 3, -0.5) == 0.0
    assert repetition_penalty("x y z w", 3, -0.5) == 0.0
    with pytest.raises(ValueError):
        repetition_penalty("a b c", 3, 0.5)


def test_crossthinkqa_adds_repetition_penalty():
    text = r"go go go go go go \boxed{A}"  # 7 words, 5 trigrams, 2 unique
    out = CrossThinkQAWorker().score_batch({"response": [text], "ground_truth": ["A"]})
    assert out["response_level_rewards"] == [pytest.approx(1.0 + (1 - 2 / 5) * -0.5)]


def test_crossthinkqa_length_reward_uses_the_real_length():
    """BUG-14: ROLL measured the padded tensor (constant); here two lengths give two rewards."""
    worker = CrossThinkQAWorker(response_length_penalty_coef=0.5, max_response_length=100)
    assert "response_length" in worker.columns
    out = worker.score_batch({"response": [r"\boxed{A}"] * 3, "ground_truth": ["A"] * 3,
                              "response_length": [10, 50, 400]})
    assert out["response_level_rewards"] == [pytest.approx(1 - 0.05), pytest.approx(1 - 0.25), pytest.approx(0.5)]
    assert out["scores"] == [1.0, 1.0, 1.0]


def test_crossthinkqa_rejects_unknown_reward_type():
    with pytest.raises(ValueError, match="reward_type"):
        CrossThinkQAWorker(reward_type="medium")
