"""Single-turn GEM-style math and QA environments."""

from __future__ import annotations

import json

import pytest

from schemas.errors import ConfigError
from stages.envs import EnvStateError, TextEnv, make_env
from stages.envs.single_turn import (TERMINAL_STATE, last_boxed_content, math_answers_equal, normalize_qa_answer)

MATH = [{"question": "1+1?", "answer": "2"}, {"question": "Half of 3?", "answer": "\\frac{3}{2}"},
        {"question": "Big?", "answer": "1,000"}]
QA = [{"question": "Capital of France?", "answer": "Paris"},
      {"question": "Red planet?", "answer": ["Mars", "planet Mars"]}]


@pytest.mark.parametrize("text, content", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{a{b}c}", "a{b}c"),
    ("\\boxed 7$", "7"),
    ("\\fbox{x}", "x"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed_content(text, content):
    assert last_boxed_content(text) == content


@pytest.mark.parametrize("pred, gold, equal", [
    ("2", "2", True), ("2.0", "2", True), ("$2$", "2", True), ("1000", "1,000", True),
    ("\\dfrac{3}{2}", "\\frac{3}{2}", True), ("1.5", "\\frac{3}{2}", True), ("3/2", "1.5", True),
    ("10^\\circ", "10", True), ("\\text{cat}", "cat", True), ("(1,2)", "(1, 2)", True),
    ("3", "2", False), ("x+1", "1+x", False), ("(1,2)", "12", False),
])
def test_math_equality(pred, gold, equal):
    assert math_answers_equal(pred, gold) is equal


def test_qa_normalisation():
    assert normalize_qa_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_qa_answer("an apple") == "apple"


def test_math_episode_rewards_and_termination():
    env = make_env("GemMath", data=MATH, format_penalty=-0.5)
    for seed in range(10):
        question, info = env.reset(seed)
        assert question in {m["question"] for m in MATH} and "\\boxed{}" in info["env_instruction"]
        gold = next(m["answer"] for m in MATH if m["question"] == question)
        obs, reward, terminated, truncated, info = env.step(f"thinking... \\boxed{{{gold}}}")
        assert (obs, reward, terminated, truncated) == (TERMINAL_STATE, 1.0, True, False)
        assert info["metrics"]["success"] and info["metrics"]["format_penalty"] == 0.0
    env.reset(0)
    assert env.step("\\boxed{999}")[1] == 0.0
    env.reset(0)
    _, reward, terminated, _, info = env.step("the answer is 2")
    assert reward == -0.5 and terminated and info["metrics"] == {
        "action_is_effective": False, "action_is_valid": False, "success": False, "format_penalty": -0.5}
    _, reward, terminated, _, info = env.step("\\boxed{2}")  # after the end: no reward, nothing raised
    assert (reward, terminated, info["metrics"]["action_is_valid"]) == (0.0, True, False)


def test_item_choice_is_gem_rule():
    import random
    env = make_env("GemQA", data=QA)
    for seed in range(20):
        question, _ = env.reset(seed)
        assert question == QA[random.Random(seed).randint(0, len(QA) - 1)]["question"]


def test_qa_episode():
    env = make_env("GemQA", data=QA)
    env.reset(1)
    index = env.index
    good = "Paris" if index == 0 else "the planet mars"
    assert env.step(f"<think>hm</think><answer>{good}</answer>")[1] == 1.0
    env.reset(1)
    assert env.step("<answer>Berlin</answer>")[1] == 0.0
    env.reset(1)
    _, reward, _, _, info = env.step("<answer></answer>")
    assert reward == 0.0 and not info["metrics"]["action_is_valid"]


def test_data_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"q": r["question"], "a": r["answer"]}) for r in QA) + "\n")
    env = make_env("GemQA", data_path=str(path), question_key="q", answer_key="a")
    question, _ = env.reset(3)
    assert question in {r["question"] for r in QA}
    state = env.get_state()
    assert str(path) in state and "Capital" in state  # the file path and the current item, not the dataset
    again = TextEnv.restore(state)
    assert again.reset(3)[0] == question  # the restored env re-reads the file


def test_in_memory_data_restore_needs_override():
    env = make_env("GemMath", data=MATH)
    env.reset(5)
    restored = TextEnv.restore(env.get_state())
    assert restored.step("\\boxed{" + str(env.answer) + "}")[1] == 1.0  # the current item travels in the state
    with pytest.raises(EnvStateError, match="data"):
        restored.reset(1)
    assert TextEnv.restore(env.get_state(), data=MATH).reset(5) == env.reset(5)


def test_data_errors(tmp_path):
    with pytest.raises(ConfigError, match="question"):
        make_env("GemMath", data=[{"problem": "x", "answer": "1"}])
    with pytest.raises(ConfigError, match="does not exist"):
        make_env("GemMath", data_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="either"):
        make_env("GemMath", data=MATH, data_path="x.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1"):
        make_env("GemMath", data_path=str(bad))
