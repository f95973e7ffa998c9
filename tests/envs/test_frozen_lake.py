"""FrozenLake (spec §9.1): map generation, dynamics against gymnasium, RNG, text."""

from __future__ import annotations

import random

import numpy as np
import pytest

from schemas.errors import ConfigError
from stages.envs import EnvStateError, make_env
from stages.envs.frozen_lake import (GRID_LOOKUP, FrozenLakeEnv, generate_random_map, np_random, pcg64_random,
                                     pcg64_state)

INSTRUCTION = ("You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
               "unintended direction due to the slippery ice. The answer must be one of action in a turn, format is "
               "<answer>Right</answer>\nThe meaning of each symbol in the state is:\nP: player, _: empty, O: hole, "
               "G: goal, X: player in hole, √: player on goal\nYour available actions are:\nLeft, Down, Right, Up")
NAMES = ["Left", "Down", "Right", "Up"]


def test_instruction_text_is_rolls():
    _, info = FrozenLakeEnv().reset(0)
    assert info["env_instruction"] == INSTRUCTION


@pytest.mark.parametrize("size, p", [(4, 0.8), (6, 0.7), (8, 0.5), (3, 1.0)])
def test_maps_are_valid(size, p):
    for seed in range(25):
        rows = generate_random_map(size, p, seed)
        flat = "".join(rows)
        assert len(rows) == size and all(len(r) == size for r in rows)
        assert flat.count("S") == 1 and flat.count("G") == 1 and set(flat) <= set("SFHG")
        assert rows == generate_random_map(size, p, seed)


def _reference_map(size: int, p: float, seed: int) -> list[str]:
    """Spec §9.1 literally: NumPy's own ``rng.choice`` and a recursive reachability search."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        start, goal = rng.integers(size, size=2), rng.integers(size, size=2)
        if (start == goal).all():
            continue
        board[tuple(start)], board[tuple(goal)] = "S", "G"
        seen = set()

        def reach(r, c):
            if not (0 <= r < size and 0 <= c < size) or (r, c) in seen or board[r, c] == "H":
                return False
            if board[r, c] == "G":
                return True
            seen.add((r, c))
            return any(reach(r + dr, c + dc) for dr, dc in ((1, 0), (0, 1), (-1, 0), (0, -1)))

        if reach(int(start[0]), int(start[1])):
            return ["".join(row) for row in board]


@pytest.mark.parametrize("size, p", [(4, 0.8), (5, 0.6), (8, 0.5)])
def test_map_matches_literal_numpy_choice(size, p):
    for seed in range(40):
        assert generate_random_map(size, p, seed) == _reference_map(size, p, seed), seed


def test_pcg64_matches_numpy():
    for seed in (0, 7, 2**33 + 5):
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
        state, inc = pcg64_state(seed)
        for _ in range(500):
            state, u = pcg64_random(state, inc)
            assert u == gen.random()


@pytest.mark.parametrize("slippery", [False, True])
def test_dynamics_match_gymnasium(slippery):
    gym_fl = pytest.importorskip("gymnasium.envs.toy_text.frozen_lake")
    rnd = random.Random(3)
    for seed in range(30):
        ours = FrozenLakeEnv(size=4, is_slippery=slippery, max_steps=100)
        ours.reset(seed)
        ref = gym_fl.FrozenLakeEnv(desc=generate_random_map(4, 0.8, seed), is_slippery=slippery)
        s, _ = ref.reset(seed=seed)
        assert s == ours.s
        for _ in range(25):
            a = rnd.randrange(4)
            s, r, term, trunc, _ = ref.step(a)
            _, reward, terminated, _, info = ours.step(f"<answer>{NAMES[a]}</answer>")
            assert (ours.s, reward, terminated) == (s, float(r), term)
            assert info["metrics"]["action_is_valid"]
            if term:
                break


def test_render_symbols():
    env = FrozenLakeEnv(is_slippery=False)
    env.reset(11)  # golden: __P_ / _OG_ / O___ / ____ ; Down reaches the goal
    assert env.render() == "__P_\n_OG_\nO___\n____"
    obs, reward, terminated, truncated, info = env.step("<answer>Down</answer>")
    assert obs == "____\n_O√_\nO___\n____" and reward == 1.0 and terminated and not truncated
    assert info["metrics"]["success"] is True


def test_hole_renders_x_and_truncates_only_after_max_steps():
    env = FrozenLakeEnv(is_slippery=False, max_steps=3)
    env.reset(4)  # golden episode: Left, Down, Down, ..., Right falls into the hole
    for text in ["<answer>Left</answer>", "<answer>Down</answer>", "<answer>Down</answer>"]:
        env.step(text)
    obs, reward, terminated, truncated, _ = env.step("<answer>Right</answer>")
    assert "X" in obs and reward == 0.0 and terminated and truncated  # 4 >= max_steps=3, no success
    obs2, reward2, terminated2, _, info = env.step("<answer>Up</answer>")  # terminal cells loop on themselves
    assert (obs2, reward2, terminated2) == (obs, 0.0, True) and not info["metrics"]["action_is_effective"]


def test_invalid_action_gets_penalty_and_keeps_state():
    env = make_env("FrozenLake", format_penalty=-0.3)
    obs, _ = env.reset(5)
    before = env.get_state()
    obs2, reward, terminated, truncated, info = env.step("<answer>Jump</answer>")
    assert (obs2, reward, terminated, truncated) == (obs, -0.3, False, False)
    assert info["metrics"] == {"action_is_effective": False, "action_is_valid": False, "success": False,
                               "format_penalty": -0.3}
    assert info["action_desc"] == "At turn 1, You did not provide a valid action."
    assert env.get_state() != before  # the step counter advanced, the RNG did not
    assert env._rng == FrozenLakeEnv.restore(before)._rng


def test_custom_lookups_render_and_parse():
    env = FrozenLakeEnv(is_slippery=False, grid_lookup={0: "A", 1: ".", 2: "h", 3: "g", 4: "x", 5: "w"},
                        action_lookup={0: "W", 1: "S", 2: "E", 3: "N"})
    obs, info = env.reset(11)
    assert obs == "..A.\n.hg.\nh...\n...." and info["env_instruction"].endswith("W, S, E, N")
    assert env.step("<answer>s</answer>")[0] == "....\n.hw.\nh...\n...."
    assert env.step("<answer>Down</answer>")[4]["metrics"]["action_is_valid"] is False



@pytest.mark.parametrize("seed", [3, 11, 42])
def test_multi_character_symbols_render_one_symbol_per_cell(seed):
    """ROLL joins the symbols of a row's cells, so a symbol may be several characters (``" P"``: one token per cell
    for a BPE tokenizer). Every rendering equals the default one with a space before each cell, player included."""
    spaced = {code: " " + symbol for code, symbol in GRID_LOOKUP.items()}
    plain, wide = FrozenLakeEnv(is_slippery=False), FrozenLakeEnv(is_slippery=False, grid_lookup=spaced)
    observations = [(plain.reset(seed)[0], wide.reset(seed)[0])]
    for move in ("Right", "Down", "Left", "Up", "Down"):
        observations.append((plain.step(f"<answer>{move}</answer>")[0], wide.step(f"<answer>{move}</answer>")[0]))
    for ours, theirs in observations:
        assert theirs == "\n".join("".join(" " + ch for ch in row) for row in ours.split("\n"))


def test_errors():
    with pytest.raises(EnvStateError, match="reset"):
        FrozenLakeEnv().step("<answer>Up</answer>")
    with pytest.raises(ConfigError):
        FrozenLakeEnv(p=0.0)
    with pytest.raises(ConfigError, match="seed"):
        FrozenLakeEnv().reset(-1)
    with pytest.raises(ConfigError, match="seed"):
        FrozenLakeEnv().reset("7")
