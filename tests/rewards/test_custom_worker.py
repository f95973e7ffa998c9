"""The custom reward-worker API: the worked example of docs/custom-reward-worker.md, run through the same routing as
the built-ins, in its class and function forms, and the doc's own Python block executed as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from schemas.errors import ConfigError, SchemaError
from stages.rewards.examples.length_reward import LengthReward, closeness, length_reward
from stages.rewards.routing import RewardRouter

DOC = Path(__file__).resolve().parents[2] / "docs" / "custom-reward-worker.md"
CLASS_SPEC = "stages.rewards.examples.length_reward:LengthReward"
FUNCTION_SPEC = "stages.rewards.examples.length_reward:length_reward"


def test_closeness_hand_computed():
    assert closeness(50, 50) == 1.0
    assert closeness(25, 50) == 0.5 and closeness(75, 50) == 0.5
    assert closeness(0, 50) == 0.0 and closeness(200, 50) == 0.0


@pytest.mark.parametrize("spec", [CLASS_SPEC, FUNCTION_SPEC])
def test_example_runs_through_the_router_next_to_a_builtin(spec):
    router = RewardRouter({"essay": {"worker": spec, "kwargs": {"target_words": 4}}, "math": "math_rule"})
    rows = {"domain": ["essay", "math", "essay", "essay"],
            "response": [r"one two \boxed{3} four", r"\boxed{2}", "<think>x</think>", r"a \boxed{b}"],
            "ground_truth": ["", "2", "", ""]}
    out = router.score(rows)
    assert out.score_list() == [1.0, 1.0, None, 1.0]
    assert out.reward_list() == [1.0, 1.0, None, 0.5]
    assert out.worker.tolist() == [spec, "math_rule", spec, spec]


def test_class_and_function_forms_agree():
    rows = {"response": [r"x \boxed{1}", "plain", r"\boxed{2} " + "w " * 60, ""]}
    assert LengthReward(10).score_batch(rows) == length_reward(rows, target_words=10)


def test_example_errors_surface_at_start_up():
    with pytest.raises(ConfigError, match="bad kwargs"):
        RewardRouter({"essay": {"worker": FUNCTION_SPEC, "kwargs": {"target": 3}}})
    with pytest.raises(ValueError, match="target_words must be positive"):
        RewardRouter({"essay": {"worker": CLASS_SPEC, "kwargs": {"target_words": 0}}})
    with pytest.raises(SchemaError, match=r"needs columns \['response'\]"):
        RewardRouter({"essay": CLASS_SPEC}).score({"domain": ["essay"], "text": ["x"]})


def test_the_documented_python_block_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    runnable = [b for b in blocks if "RewardRouter(" in b]
    assert len(runnable) == 1
    exec(compile(runnable[0], str(DOC), "exec"), {})


def test_documented_example_code_matches_the_module():
    """The class shown in the doc is the module's class (modulo the docstring and validation lines)."""
    source = (Path(__file__).resolve().parents[2] / "stages/rewards/examples/length_reward.py").read_text()
    for line in ["score = 1.0 if last_boxed(answer) is not None else 0.0",
                 "rewards.append(score * closeness(len(answer.split()), self.target_words))",
                 "return LengthReward(target_words).score_batch(rows)"]:
        assert line in source and line in DOC.read_text()
