"""The worker contract, the registry's one lookup site and domain routing (stages/rewards/{base,registry,routing})."""

from __future__ import annotations

import math

import numpy as np
import pytest

import stages.rewards  # noqa: F401  (registers the built-ins)
from schemas.errors import ConfigError, InvariantError, SchemaError
from stages.rewards.base import FunctionWorker, check_outputs, token_level_zeros
from stages.rewards.registry import REWARD_WORKERS, build_worker, resolve_worker
from stages.rewards.routing import RewardRoute, RewardRouter, split_by_domain

BUILT_INS = ["code_sandbox", "crossthinkqa", "detection", "general_val_rule", "ifeval", "llm_judge", "math_rule",
             "multiple_choice_boxed"]


def constant_worker(rows, value=0.5):
    """A function worker used by the routing tests: every row gets ``value``."""
    return [value] * len(rows["response"])


def marks_worker(rows):
    """Scores each row by its own ``mark`` column, so reordering bugs show."""
    return {"scores": [float(m) for m in rows["mark"]], "response_level_rewards": [2.0 * m for m in rows["mark"]]}


class NeedsGenerate:
    requires = ("generate",)

    def __init__(self, generate, suffix="!"):
        self.generate, self.suffix = generate, suffix

    def score_batch(self, rows):
        replies = self.generate([r + self.suffix for r in rows["response"]])
        return {"scores": [float(len(r)) for r in replies]}


def test_every_builtin_is_registered_and_resolves_to_its_class():
    assert REWARD_WORKERS.names() == BUILT_INS
    for name in BUILT_INS:
        assert resolve_worker(name) is REWARD_WORKERS.get(name)


def test_registry_refuses_a_duplicate_name():
    with pytest.raises(ValueError, match="registered twice"):
        REWARD_WORKERS.register("math_rule")(object)


def test_custom_spec_resolves_module_colon_name():
    assert resolve_worker(f"{__name__}:constant_worker") is constant_worker
    assert resolve_worker("stages.rewards.math_rule:MathRuleWorker") is REWARD_WORKERS.get("math_rule")


@pytest.mark.parametrize("spec, message", [
    ("no_such_worker", "unknown reward worker 'no_such_worker'; registered: code_sandbox"),
    ("not_a_module_xyz:thing", "cannot import module 'not_a_module_xyz'"),
    (f"{__name__}:missing_attr", "has no attribute 'missing_attr'"),
    (f"{__name__}:BUILT_INS", "not a class or function"),
    (":x", "written 'module:name'"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve_worker(spec)


def test_build_worker_passes_kwargs_and_rejects_unknown_ones():
    worker = build_worker(f"{__name__}:constant_worker", {"value": 0.25})
    assert isinstance(worker, FunctionWorker)
    assert worker.score_batch({"response": ["a", "b"]})["scores"] == [0.25, 0.25]
    with pytest.raises(ConfigError, match="bad kwargs"):
        build_worker(f"{__name__}:constant_worker", {"valu": 1})
    with pytest.raises(ConfigError, match="bad kwargs"):
        build_worker("math_rule", {"timeout": 3})


def test_services_are_injected_only_when_required_and_never_from_config():
    fake = lambda prompts: [p * 2 for p in prompts]  # noqa: E731
    worker = build_worker(f"{__name__}:NeedsGenerate", {"suffix": "?"}, services={"generate": fake})
    assert worker.score_batch({"response": ["ab"]})["scores"] == [6.0]
    with pytest.raises(ConfigError, match="needs the 'generate' service"):
        build_worker(f"{__name__}:NeedsGenerate")
    with pytest.raises(ConfigError, match="run-time service"):
        build_worker(f"{__name__}:NeedsGenerate", {"generate": fake}, services={"generate": fake})


def test_router_reassembles_rows_in_input_order_and_matches_a_per_row_loop():
    rng = np.random.default_rng(0)
    domains = rng.choice(["a", "b", "c"], size=40).tolist()
    marks = rng.integers(0, 100, size=40).tolist()
    rows = {"domain": domains, "mark": marks, "response": ["r"] * 40}
    routes = {"a": f"{__name__}:marks_worker", "b": {"worker": f"{__name__}:marks_worker"},
              "c": {"worker": f"{__name__}:constant_worker", "kwargs": {"value": -1.0}}}
    out = RewardRouter(routes).score(rows)
    expected = [(-1.0, -1.0) if d == "c" else (float(m), 2.0 * m) for d, m in zip(domains, marks)]
    assert out.scores.dtype == np.float32 and out.response_level_rewards.dtype == np.float32
    assert out.scores.tolist() == [e[0] for e in expected]
    assert out.response_level_rewards.tolist() == [e[1] for e in expected]
    assert out.worker.tolist() == [routes[d] if d == "a" else routes[d]["worker"] for d in domains]


def test_router_uses_the_fallback_route_and_names_unrouted_domains():
    rows = {"tag": ["x", "y"], "response": ["r", "r"]}
    out = RewardRouter({"*": f"{__name__}:constant_worker"}, domain_column="tag").score(rows)
    assert out.scores.tolist() == [0.5, 0.5]
    with pytest.raises(ConfigError, match="no worker for tag 'y'; routed domains: x"):
        RewardRouter({"x": f"{__name__}:constant_worker"}, domain_column="tag").score(rows)


def test_router_checks_the_domain_column_and_the_worker_columns():
    router = RewardRouter({"math": {"worker": "math_rule"}})
    with pytest.raises(SchemaError, match="no 'domain' column"):
        router.score({"response": ["x"], "ground_truth": ["1"]})
    with pytest.raises(SchemaError, match=r"needs columns \['ground_truth'\]"):
        router.score({"domain": ["math"], "response": ["x"]})


def test_bad_route_configs_are_config_errors():
    with pytest.raises(ConfigError, match="reward routes are empty"):
        RewardRouter({})
    with pytest.raises(ConfigError, match="expected a worker name"):
        RewardRouter({"math": {"worker": "math_rule", "kwarg": {}}})
    assert RewardRoute.parse("m", "math_rule") == RewardRoute("math_rule", {})


def test_none_becomes_nan_and_bad_outputs_are_errors():
    scores, rewards = check_outputs({"scores": [1, None, 0.5]}, 3, "w")
    assert np.isnan(scores[1]) and rewards.tolist()[0] == 1.0 and math.isnan(rewards[1])
    with pytest.raises(InvariantError, match="returned 2 scores for 3 rows"):
        check_outputs({"scores": [1, 2]}, 3, "w")
    with pytest.raises(InvariantError, match="not finite"):
        check_outputs({"scores": [float("nan")]}, 1, "w")
    with pytest.raises(InvariantError, match="is not a number"):
        check_outputs({"scores": ["high"]}, 1, "w")
    with pytest.raises(InvariantError, match="must return a dict"):
        check_outputs([1.0], 1, "w")


def test_cannot_score_rows_stay_none_through_the_router():
    rows = {"domain": ["math", "math"], "response": [r"\boxed{3}", r"\boxed{3}"], "ground_truth": ["3", ""]}
    out = RewardRouter({"math": "math_rule"}).score(rows)
    assert out.score_list() == [1.0, None] and out.reward_list() == [1.0, None]
    assert out.scored.tolist() == [True, False]


def test_split_by_domain_keeps_first_appearance_order():
    groups = split_by_domain(["b", "a", "b", "c", "a"])
    assert list(groups) == ["b", "a", "c"]
    assert [g.tolist() for g in groups.values()] == [[0, 2], [1, 4], [3]]


def test_token_level_rewards_are_float32_zeros_of_each_row_length():
    ragged = token_level_zeros([3, 0, 2])
    assert ragged.values.dtype == np.float32 and ragged.values.tolist() == [0.0] * 5
    assert ragged.lengths.tolist() == [3, 0, 2]
    with pytest.raises(InvariantError):
        token_level_zeros([-1])
