"""Gymnasium-style contract over every registered environment (DESIGN.md: one contract test for all envs).

New environments registered in ``stages.envs.registry.ENVIRONMENTS`` are covered automatically. An env that needs
data is built with its spec's ``demo_kwargs``.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from schemas.errors import ConfigError
from stages.envs import (ENVIRONMENTS, METRICS_AGG_MODE, EnvSpec, EnvStateError, TextEnv, make_demo_env, make_env,
                         restore_env)

NAMES = ENVIRONMENTS.names()
GARBAGE = ["", "   ", "🧊☃️ ∑∫ \x00\x1b[31m \udcff", "<answer>", "</answer><answer", "\\boxed{"]
METRIC_KEYS = {"action_is_valid", "action_is_effective", "success", "format_penalty"}
PENALTY = -0.37


def _texts(env: TextEnv, rnd: random.Random, n: int) -> list[str]:
    """Random responses: mostly legal action texts for the env, some garbage."""
    lookup = getattr(env, "action_lookup", None)
    legal = ([f"<answer>{name}</answer>" for name in lookup.values()] +
             [f"<think>x</think> <answer> {name.lower()} </answer><|im_end|>" for name in lookup.values()]
             if lookup else ["<answer>Paris</answer>", "\\boxed{5}", "<answer>Mars</answer>", "\\boxed{3}"])
    return [rnd.choice(GARBAGE) if rnd.random() < 0.2 else rnd.choice(legal) for _ in range(n)]


def _check_step(result, env: TextEnv) -> None:
    obs, reward, terminated, truncated, info = result
    assert isinstance(obs, str)
    assert type(reward) is float and math.isfinite(reward)
    assert type(terminated) is bool and type(truncated) is bool
    assert METRIC_KEYS <= info["metrics"].keys()
    assert all(type(info["metrics"][k]) is bool for k in METRIC_KEYS - {"format_penalty"})
    assert type(info["metrics"]["format_penalty"]) is float
    assert dict(info["metrics_agg_mode"]) == dict(METRICS_AGG_MODE)
    assert isinstance(info["action_desc"], str) and info["action_desc"]
    assert {"action", "action_content", "think_content"} <= info.keys()
    if not info["metrics"]["action_is_valid"]:
        assert info["metrics"]["format_penalty"] == env.format_penalty
    else:
        assert info["metrics"]["format_penalty"] == 0.0
    json.dumps(info)  # info must be serialisable into a row


@pytest.mark.parametrize("name", NAMES)
def test_spec(name):
    spec = ENVIRONMENTS.get(name)
    assert isinstance(spec, EnvSpec) and issubclass(spec.env_class, TextEnv)
    assert all(isinstance(getattr(spec, k), bool) for k in ("multi_turn", "ends_at_max_steps", "stochastic",
                                                            "needs_data"))
    with pytest.raises(TypeError):
        spec.default_kwargs["max_steps"] = 3  # specs are frozen


@pytest.mark.parametrize("name", NAMES)
def test_reset_is_deterministic_and_typed(name):
    env = make_demo_env(name)
    observations = set()
    for seed in range(6):
        obs, info = env.reset(seed)
        assert isinstance(obs, str) and obs and isinstance(info["env_instruction"], str) and info["env_instruction"]
        other = make_demo_env(name)
        assert other.reset(seed) == (obs, info)
        assert env.render() == obs
        assert env.get_state() == other.get_state()
        observations.add(obs)
    assert len(observations) > 1 or not ENVIRONMENTS.get(name).seeded_start


@pytest.mark.parametrize("name", NAMES)
def test_random_episodes_follow_the_contract(name):
    spec = ENVIRONMENTS.get(name)
    rnd = random.Random(0)
    for seed in range(8):
        env = make_demo_env(name)
        env.reset(seed)
        assert isinstance(env.max_steps, int) and env.max_steps >= 1
        ended = False
        for k, text in enumerate(_texts(env, rnd, 3 * env.max_steps), start=1):
            result = env.step(text)
            _check_step(result, env)
            if spec.multi_turn:
                assert env.render() == result[0]
            if result[2] or result[3]:
                ended = True
                break
            if spec.ends_at_max_steps:
                assert k < env.max_steps, "the env must end an episode within max_steps"
        if spec.ends_at_max_steps:
            assert ended
        if not spec.multi_turn:
            assert k == 1 and ended


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", GARBAGE + ["<answer>fly</answer>"])
def test_garbage_gets_the_format_penalty(name, text):
    env = make_demo_env(name, format_penalty=PENALTY)
    env.reset(1)
    obs, reward, terminated, truncated, info = env.step(text)
    lookup_based = bool(getattr(env, "action_lookup", None))
    if text in GARBAGE or lookup_based:
        assert info["metrics"]["action_is_valid"] is False
    if not info["metrics"]["action_is_valid"]:
        assert info["metrics"]["format_penalty"] == PENALTY and reward <= PENALTY + 1e-12
        assert not info["metrics"]["success"]


@pytest.mark.parametrize("name", NAMES)
def test_stateless_stepping_equals_live(name):
    """Serialise → restore → step at every turn gives what the live env gives (RNG included)."""
    rnd = random.Random(1)
    for seed in range(5):
        live = make_demo_env(name)
        live.reset(seed)
        state = live.get_state()
        for text in _texts(live, rnd, live.max_steps + 3):
            restored = restore_env(state)
            assert restored.get_state() == state
            assert type(live).restore(state).get_state() == state
            expected = live.step(text)
            assert restored.step(text) == expected
            state = restored.get_state()
            assert state == live.get_state()
            if expected[2] or expected[3]:
                break


@pytest.mark.parametrize("name", NAMES)
def test_state_is_compact_deterministic_json(name):
    env = make_demo_env(name)
    env.reset(2)
    state = env.get_state()
    payload = json.loads(state)
    assert state == json.dumps(payload, sort_keys=True, separators=(",", ":"))
    assert payload["env"] == type(env).__name__ and payload["v"] == 1
    assert len(state) < 2000


def test_slippery_stateless_rng_is_carried():
    """Slippery FrozenLake really draws from its RNG (it leaves the non-slippery path) and restored copies follow."""
    texts = ["<answer>Right</answer>", "<answer>Down</answer>", "<answer>Left</answer>", "<answer>Up</answer>"] * 5
    steps, diverged = 0, 0
    for seed in range(15):
        live, plain = make_env("FrozenLakeSlippery", max_steps=50), make_env("FrozenLake", max_steps=50)
        live.reset(seed)
        plain.reset(seed)
        for text in texts:
            copy = restore_env(live.get_state())
            expected = live.step(text)
            assert copy.step(text) == expected
            diverged += expected[0] != plain.step(text)[0]
            steps += 1
            if expected[2]:
                break
    assert steps > 30 and diverged > 0


def test_registry_tags_match_roll_configs():
    assert set(NAMES) >= {"FrozenLake", "FrozenLakeSlippery", "SimpleSokoban", "LargerSokoban",
                          "SokobanDifferentGridVocab", "GemMath", "GemQA"}
    simple, larger = make_env("SimpleSokoban"), make_env("LargerSokoban")
    assert (simple.dim_room, simple.num_boxes) == ((6, 6), 1)
    assert (larger.dim_room, larger.num_boxes, larger.search_depth) == ((10, 10), 2, 10)
    assert make_env("FrozenLake").is_slippery is False and make_env("FrozenLakeSlippery").is_slippery is True
    assert make_env("SimpleSokoban", max_steps=4).max_steps == 4


def test_lookup_errors():
    with pytest.raises(KeyError, match="known: .*SimpleSokoban"):
        make_env("Sokoban9000")
    with pytest.raises(ConfigError, match="env_config"):
        make_env("SimpleSokoban", no_such_option=1)
    with pytest.raises(Exception, match="get_state"):
        restore_env("not json")
    with pytest.raises(Exception, match="not 'SokobanEnv'"):
        make_env("SimpleSokoban").restore(_started_state("FrozenLake"))


def _started_state(name: str) -> str:
    env = make_demo_env(name)
    env.reset(0)
    return env.get_state()


@pytest.mark.parametrize("name", NAMES)
def test_use_before_reset_is_a_clear_error(name):
    env = make_demo_env(name)
    for call in (env.get_state, env.render, lambda: env.step("<answer>Up</answer>")):
        with pytest.raises(EnvStateError, match="reset"):
            call()
