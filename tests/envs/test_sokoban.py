"""Sokoban (spec §9.2): level generation against a literal reference, push dynamics, rewards, text, Q-16."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas.errors import ConfigError
from stages.envs import EnvStateError, make_env, retry_seed
from stages.envs.sokoban import SokobanEnv
from stages.envs.sokoban_levels import NoSolvableLevel, NotEnoughSpace, generate_room, num_gen_steps
from tests.envs import reference_sokoban as ref

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTION = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
               "When you are right next to a box, you can push it by moving in the same direction. You cannot push "
               "a box through a wall, and you cannot pull a box. The answer must be one of action in a turn, format "
               "is <answer>Right</answer>.\nThe meaning of each symbol in the state is:\n#: wall, _: empty, "
               "O: target, √: box on target, X: box, P: player, S: player on target\nYour available actions are:\n"
               "Up, Down, Left, Right")
FAILING_LARGER_SEED = 3  # LargerSokoban: seed 3 finds no level (RuntimeWarning in ROLL) and is retried


def _ours(dim, nb, depth, seed):
    try:
        level = generate_room(dim, num_gen_steps(dim), nb, depth, random.Random(seed), np.random.RandomState(seed))
    except (NotEnoughSpace, NoSolvableLevel):
        return None
    return level.room_fixed, level.room_state


@pytest.mark.parametrize("dim, nb, depth, seeds", [
    ((6, 6), 1, 300, range(20)),
    ((10, 10), 2, 10, range(25)),
    ((7, 7), 2, 30, range(15)),
    ((8, 8), 3, 40, range(5)),
])
def test_generation_matches_literal_reference(dim, nb, depth, seeds):
    for seed in seeds:
        try:
            expected = ref.generate(dim, nb, depth, seed)
        except ref.Failed:
            expected = None
        got = _ours(dim, nb, depth, seed)
        assert (got is None) == (expected is None), seed
        if got is not None:
            np.testing.assert_array_equal(got[0], expected[0], err_msg=f"room_fixed seed {seed}")
            np.testing.assert_array_equal(got[1], expected[1], err_msg=f"room_state seed {seed}")


def test_level_invariants_and_solvable():
    env = make_env("SimpleSokoban")
    for seed in range(30):
        env.reset(seed)
        fixed, room = env.rooms()
        assert (fixed[[0, -1], :] == 0).all() and (fixed[:, [0, -1]] == 0).all()
        assert (room == 5).sum() == 1 and (room == 4).sum() == 1 and (room == 3).sum() == 0
        assert (fixed == 2).sum() == 1 and set(np.unique(fixed)) <= {0, 1, 2}
        assert env.shortest_solution(30) is not None


def test_instruction_and_default_symbols():
    _, info = SokobanEnv(dim_room=(6, 6), num_boxes=1).reset(0)
    assert info["env_instruction"] == INSTRUCTION


def test_different_grid_vocab():
    env = make_env("SokobanDifferentGridVocab")
    obs, info = env.reset(2)
    plain = SokobanEnv(dim_room=(6, 6), num_boxes=1, search_depth=30)
    plain_obs, _ = plain.reset(2)
    assert obs == plain_obs.translate(str.maketrans("#_O√XPS", "W.GCBA@"))
    assert "W: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target" \
        in info["env_instruction"]


def _room_env(rows: list[str], max_steps: int = 10, penalty: float = -0.15) -> SokobanEnv:
    """An env holding a hand-made room: ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on target,
    ``P`` player, ``S`` player on target."""
    codes = {"#": (0, 0), "_": (1, 1), "O": (2, 2), "X": (1, 4), "√": (2, 3), "P": (1, 5), "S": (2, 5)}
    fixed = "".join(str(codes[ch][0]) for row in rows for ch in row)
    room = "".join(str(codes[ch][1]) for row in rows for ch in row)
    env = SokobanEnv(dim_room=(len(rows), len(rows[0])), num_boxes=fixed.count("2"), max_steps=max_steps,
                     format_penalty=penalty)
    env._load_dynamic_state({"fixed": fixed, "room": room, "seed": None, "steps": 0, "on_target": room.count("3")})
    return env


def test_push_onto_target_wins():
    env = _room_env(["#####", "#PXO#", "#####"])
    obs, reward, terminated, truncated, info = env.step("<answer>Right</answer>")
    assert obs == "#####\n#_P√#\n#####"
    assert reward == pytest.approx(-0.1 + 1 + 10) and terminated and not truncated
    assert info["metrics"]["success"] and info["action_desc"] == "At turn 1, you moved Right, which is effective."


def test_push_off_target_and_blocked_push():
    env = _room_env(["######", "#P√__#", "#_XO_#", "######"])
    obs, reward, terminated, _, _ = env.step("<answer>Right</answer>")
    assert obs == "######\n#_SX_#\n#_XO_#\n######" and reward == pytest.approx(-1.1) and not terminated
    env.step("<answer>Right</answer>")                      # box to the last floor cell before the wall
    obs, reward, _, _, info = env.step("<answer>Right</answer>")  # box against the wall: nothing moves
    assert obs == "######\n#_OPX#\n#_XO_#\n######" and reward == pytest.approx(-0.1)
    assert not info["metrics"]["action_is_effective"]


def test_invalid_text_is_counted_noop_with_penalty_and_max_steps():
    env = _room_env(["#####", "#P_O#", "#X__#", "#####"], max_steps=2)
    obs0 = env.render()
    obs, reward, terminated, truncated, info = env.step("I push up")
    assert (obs, terminated, truncated) == (obs0, False, False) and reward == pytest.approx(-0.25)
    assert info["metrics"]["format_penalty"] == -0.15 and info["action"] is None
    obs, reward, terminated, truncated, _ = env.step("<answer>Right</answer>")
    assert terminated and truncated  # done after exactly max_steps without success


def test_shortest_solution_solves():
    env = make_env("SimpleSokoban")
    for seed in range(10):
        env.reset(seed)
        names = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}
        plan = env.shortest_solution()
        *_, info = [env.step(f"<answer>{names[a]}</answer>") for a in plan][-1]
        assert info["metrics"]["success"]


def test_retry_seed_is_deterministic_and_used():
    assert retry_seed(3) == int.from_bytes(__import__("hashlib").sha256(b"3").digest()[:4], "big")
    assert _ours((10, 10), 2, 10, FAILING_LARGER_SEED) is None
    env = make_env("LargerSokoban")
    env.reset(FAILING_LARGER_SEED)
    seed = FAILING_LARGER_SEED
    while _ours((10, 10), 2, 10, seed) is None:
        seed = retry_seed(seed)
    assert env.seed == seed
    np.testing.assert_array_equal(env.rooms()[1], _ours((10, 10), 2, 10, seed)[1])


def _run_with_hash_seed(hash_seed: str, code: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_q16_levels_do_not_depend_on_pythonhashseed():
    code = ("from stages.envs import make_env\n"
            f"e = make_env('LargerSokoban'); e.reset({FAILING_LARGER_SEED}); print(e.get_state())")
    assert _run_with_hash_seed("1", code) == _run_with_hash_seed("2", code)


def test_roll_compat_retry_uses_python_hash():
    """``roll_compat=True`` retries with ``abs(hash(str(seed))) % 2**32`` like ROLL (golden runs: PYTHONHASHSEED=0)."""
    code = ("import json, random, numpy as np\n"
            "from stages.envs import make_env\n"
            "from stages.envs.sokoban_levels import generate_room, NoSolvableLevel, NotEnoughSpace\n"
            f"seed = {FAILING_LARGER_SEED}\n"
            "while True:\n"
            "    try:\n"
            "        generate_room((10, 10), 34, 2, 10, random.Random(seed), np.random.RandomState(seed)); break\n"
            "    except (NoSolvableLevel, NotEnoughSpace):\n"
            "        seed = abs(hash(str(seed))) % 2**32\n"
            f"e = make_env('LargerSokoban', roll_compat=True); e.reset({FAILING_LARGER_SEED})\n"
            "print(json.dumps([e.seed, seed]))")
    used, expected = json.loads(_run_with_hash_seed("0", code))
    assert used == expected != FAILING_LARGER_SEED


def test_errors():
    with pytest.raises(EnvStateError, match="reset"):
        SokobanEnv().render()
    with pytest.raises(ConfigError):
        SokobanEnv(dim_room=(2, 6))
    with pytest.raises(ConfigError, match="seed"):
        SokobanEnv(dim_room=(6, 6), num_boxes=1).reset(2**32)
    with pytest.raises(EnvStateError, match="one player"):
        _room_env(["#####", "#__O#", "#X__#", "#####"])
