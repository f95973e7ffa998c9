"""FrozenLake as ROLL plays it (spec §9.1): random maps, gymnasium dynamics, ROLL's text, rewards and metrics.

Gymnasium is not needed at run time: its RNG is NumPy's ``Generator(PCG64(SeedSequence(seed)))`` and its
dynamics (``categorical_sample`` over a transition list) are re-implemented below, draw for draw.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from schemas.errors import ConfigError
from stages.envs.base import (EnvStateError, TextEnv, check_seed, fresh_seed, int_keyed, retry_seed,
                              step_info)
from stages.envs.parser import DEFAULT_ACTION_PATTERN, DEFAULT_SPECIAL_TOKENS, ActionParser
from stages.envs.registry import ROLL_MAX_STEPS, EnvSpec, register_env

LEFT, DOWN, RIGHT, UP = 0, 1, 2, 3
ACTION_LOOKUP = {LEFT: "Left", DOWN: "Down", RIGHT: "Right", UP: "Up"}
# grid codes → symbols; the map letters → grid codes (S is shown as F)
GRID_LOOKUP = {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"}
MAP_LOOKUP = {"P": 0, "F": 1, "H": 2, "G": 3}
PLAYER_IN_HOLE, PLAYER_ON_GOAL = 4, 5
GRID_VOCAB = {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole", "√": "player on goal"}
INSTRUCTION = ("You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
               "unintended direction due to the slippery ice. The answer must be one of action in a turn, format is "
               "<answer>Right</answer>")

# gymnasium's slippery transition probabilities for (a-1, a, a+1) with success_rate = 1/3, and their cumsum
_SUCCESS_RATE = 1.0 / 3.0
_FAIL_RATE = (1.0 - _SUCCESS_RATE) / 2.0
_SLIPPERY_CDF = tuple(float(x) for x in np.cumsum([_FAIL_RATE, _SUCCESS_RATE, _FAIL_RATE]))
_DETERMINISTIC_CDF = (1.0,)
_MOVES = {LEFT: (0, -1), DOWN: (1, 0), RIGHT: (0, 1), UP: (-1, 0)}


def np_random(seed: int) -> np.random.Generator:
    """gymnasium ``seeding.np_random(seed)``: ``Generator(PCG64(SeedSequence(seed)))``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))


# NumPy's PCG64 (128-bit LCG + XSL-RR output) and Generator.random(), in Python, so that the env's RNG state is two
# ints that serialise into the row and restore without building NumPy objects. Checked draw for draw in the tests.
_PCG_MULTIPLIER = 0x2360ED051FC65DA44385DF649FCCF645
_MASK64, _MASK128 = (1 << 64) - 1, (1 << 128) - 1


def pcg64_state(seed: int) -> tuple[int, int]:
    """``(state, inc)`` of gymnasium's ``np_random(seed)`` bit generator."""
    state = np.random.PCG64(np.random.SeedSequence(seed)).state["state"]
    return int(state["state"]), int(state["inc"])


def pcg64_random(state: int, inc: int) -> tuple[int, float]:
    """One ``Generator.random()`` draw: returns the new state and a double in ``[0, 1)``."""
    state = (state * _PCG_MULTIPLIER + inc) & _MASK128
    mixed = ((state >> 64) ^ state) & _MASK64
    rot = state >> 122
    word = ((mixed >> rot) | (mixed << ((-rot) & 63))) & _MASK64
    return state, (word >> 11) * (1.0 / 9007199254740992.0)


def _goal_reachable(cells: list[str], size: int, start: int) -> bool:
    """4-neighbour search from ``start`` over non-``H`` cells of the flat ``cells``; True once a ``G`` is entered."""
    frontier, seen = [start], {start}
    while frontier:
        r, c = divmod(frontier.pop(), size)
        for nr, nc in ((r + 1, c), (r, c + 1), (r - 1, c), (r, c - 1)):
            cell = nr * size + nc
            if not (0 <= nr < size and 0 <= nc < size) or cell in seen:
                continue
            if cells[cell] == "G":
                return True
            if cells[cell] != "H":
                seen.add(cell)
                frontier.append(cell)
    return False


def _frozen_or_hole(rng: np.random.Generator, size: int, p: float) -> list[str]:
    """``rng.choice(["F", "H"], (size, size), p=[p, 1 - p])`` flattened, drawing exactly what NumPy draws:
    ``size²`` doubles ``u`` and ``cdf.searchsorted(u, side="right")`` with ``cdf = cumsum(p) / sum``."""
    cdf = np.cumsum(np.asarray([p, 1 - p], dtype=np.float64))
    cdf /= cdf[-1]
    index = cdf.searchsorted(rng.random(size * size), side="right")
    return ["F" if i == 0 else "H" for i in index.tolist()]


def generate_random_map(size: int = 4, p: float = 0.8, seed: int | None = None) -> list[str]:
    """ROLL's ``generate_random_map`` (spec §9.1): ``size`` rows of ``S/F/H/G``; ``p`` = P(frozen tile).

    Draws ``board, start, goal`` from one gymnasium RNG until ``start != goal`` and ``G`` is reachable from ``S``.
    """
    rng = np_random(fresh_seed() if seed is None else seed)
    while True:
        cells = _frozen_or_hole(rng, size, p)
        start = rng.integers(size, size=2).tolist()
        goal = rng.integers(size, size=2).tolist()
        if start == goal:
            continue
        start_cell, goal_cell = start[0] * size + start[1], goal[0] * size + goal[1]
        cells[start_cell], cells[goal_cell] = "S", "G"
        if _goal_reachable(cells, size, start_cell):
            return ["".join(cells[r * size:(r + 1) * size]) for r in range(size)]


@lru_cache(maxsize=16)
def _neighbours(size: int) -> tuple[tuple[int, int, int, int], ...]:
    """``(size²,)`` rows of the cell reached by Left, Down, Right, Up (clipped at the border)."""
    table = []
    for cell in range(size * size):
        r, c = divmod(cell, size)
        table.append(tuple(min(max(r + dr, 0), size - 1) * size + min(max(c + dc, 0), size - 1)
                           for dr, dc in (_MOVES[a] for a in range(4))))
    return tuple(table)


@lru_cache(maxsize=4096)
def _base_rows(desc: tuple[str, ...], symbols: tuple[tuple[str, str], ...]) -> tuple[tuple[str, ...], ...]:
    """``(size, size)`` observation symbols of the map without the player (``S`` shown as ``F``); a symbol may be
    several characters (a ``grid_lookup`` of e.g. ``" P"``), so rows stay lists of cells until rendered."""
    table = dict(symbols)
    return tuple(tuple(table["F" if ch == "S" else ch] for ch in row) for row in desc)


class FrozenLakeEnv(TextEnv):
    """ROLL's ``FrozenLakeEnv`` (spec §9.1). Actions ``0 Left, 1 Down, 2 Right, 3 Up``; reward 1 on entering ``G``.

    The env never ends an episode by step count (the env manager does, spec §11); it only flags ``truncated`` when it
    terminates without success at or after ``max_steps``. ``map_seed`` is accepted for ROLL configs; it has no
    effect because every ``reset(seed)`` draws the map from ``seed``.
    """

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = True, map_seed: int | None = None,
                 max_steps: int = 20, format_penalty: float = 0.0,
                 grid_lookup: Mapping | None = None, grid_vocab: Mapping | None = None,
                 map_lookup: Mapping | None = None, action_lookup: Mapping | None = None,
                 env_instruction: str | None = None, action_pattern: str = DEFAULT_ACTION_PATTERN,
                 special_token_list: Sequence[str] | None = DEFAULT_SPECIAL_TOKENS, roll_compat: bool = False,
                 render_mode: str | None = None) -> None:
        if int(size) < 2 or not 0.0 < float(p) <= 1.0:
            raise ConfigError(f"FrozenLake: size must be >= 2 and p (P(frozen tile)) in (0, 1], got size={size}, "
                              f"p={p}; fix the env_config")
        self.size, self.p, self.is_slippery = int(size), float(p), bool(is_slippery)
        self.max_steps, self.format_penalty = int(max_steps), float(format_penalty)
        self.action_lookup = int_keyed(action_lookup, "FrozenLake.action_lookup") or dict(ACTION_LOOKUP)
        self.grid_lookup = int_keyed(grid_lookup, "FrozenLake.grid_lookup") or dict(GRID_LOOKUP)
        self.grid_vocab = dict(grid_vocab) if grid_vocab is not None else dict(GRID_VOCAB)
        self.map_lookup = ({(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in map_lookup.items()}
                           if map_lookup is not None else dict(MAP_LOOKUP))
        missing = [k for k in (*self.map_lookup.values(), PLAYER_IN_HOLE, PLAYER_ON_GOAL) if k not in self.grid_lookup]
        if missing or not {"P", "F", "H", "G"} <= self.map_lookup.keys():
            raise ConfigError("FrozenLake: map_lookup must map P, F, H, G to grid codes and grid_lookup must name "
                              f"codes {sorted(set(self.map_lookup.values()) | {4, 5})}; fix the env_config")
        self._symbols = tuple(sorted((letter, self.grid_lookup[code]) for letter, code in self.map_lookup.items()))
        self._player_symbols = {"H": self.grid_lookup[PLAYER_IN_HOLE], "G": self.grid_lookup[PLAYER_ON_GOAL]}
        self._player_symbol = self.grid_lookup[self.map_lookup["P"]]
        self.env_instruction = env_instruction if env_instruction is not None else INSTRUCTION
        self.parser = ActionParser(action_pattern, self.action_lookup, special_token_list)
        self.roll_compat = bool(roll_compat)
        self._cdf = _SLIPPERY_CDF if self.is_slippery else _DETERMINISTIC_CDF
        self._set_config({
            "size": self.size, "p": self.p, "is_slippery": self.is_slippery, "map_seed": map_seed,
            "max_steps": self.max_steps, "format_penalty": self.format_penalty, "grid_lookup": grid_lookup,
            "grid_vocab": grid_vocab, "map_lookup": map_lookup, "action_lookup": action_lookup,
            "env_instruction": env_instruction, "action_pattern": action_pattern,
            "special_token_list": special_token_list, "roll_compat": self.roll_compat})
        self.desc: tuple[str, ...] | None = None
        self.seed: int | None = None
        self.s = 0
        self.step_count = 0
        self._rng = (0, 0)

    # ---- episode -------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        seed = check_seed(seed, "FrozenLake.reset")
        seed = fresh_seed() if seed is None else seed
        for _ in range(100):  # ROLL retries on RuntimeError/RuntimeWarning with a derived seed
            try:
                desc = generate_random_map(self.size, self.p, seed)
                break
            except (RuntimeError, RuntimeWarning):
                seed = retry_seed(seed, self.roll_compat)
        else:
            raise EnvStateError("FrozenLake.reset: level generation failed 100 times; check size and p")
        self._set_map(tuple(desc))
        state, inc = pcg64_state(seed)
        state, _ = pcg64_random(state, inc)  # gymnasium's reset draws the start state (categorical over one S)
        self._rng = (state, inc)
        self.s = self._flat.index("S")
        self.seed, self.step_count = seed, 0
        return self.render(), {"env_instruction": self.get_instructions()}

    def _set_map(self, desc: tuple[str, ...]) -> None:
        self.desc = desc
        self._flat = "".join(desc)
        self._rows = _base_rows(desc, self._symbols)
        self._next = _neighbours(self.size)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        if self.desc is None:
            raise EnvStateError("FrozenLake.step() called before reset(seed); reset the env first")
        self.step_count += 1
        parsed = self.parser(action_text)
        if parsed.action is None or parsed.action not in _MOVES:
            info = step_info(parsed.as_info(), valid=False, effective=False, success=self._on_goal(),
                             format_penalty=self.format_penalty,
                             action_desc=f"At turn {self.step_count}, You did not provide a valid action.")
            return self.render(), self.format_penalty, False, False, info
        prev = self.s
        reward, terminated = self._move(parsed.action)
        success = self._on_goal()
        truncated = terminated and not success and self.step_count >= self.max_steps
        effective = prev != self.s
        verb = (f"you moved {parsed.action_content}, which is effective." if effective
                else f"you tried to move {parsed.action_content}, which is not effective yet.")
        info = step_info(parsed.as_info(), valid=True, effective=effective, success=success, format_penalty=0.0,
                         action_desc=f"At turn {self.step_count}, {verb}")
        return self.render(), reward, terminated, truncated, info

    def _move(self, action: int) -> tuple[float, bool]:
        """gymnasium ``FrozenLakeEnv.step``: one categorical draw, then the chosen transition."""
        state, inc = self._rng
        state, u = pcg64_random(state, inc)
        self._rng = (state, inc)
        if self._flat[self.s] in "GH":  # terminal cells loop on themselves with reward 0
            return 0.0, True
        choice = 0  # np.argmax(cdf > u): the first edge above u, 0 if none
        for i, edge in enumerate(self._cdf):
            if edge > u:
                choice = i
                break
        direction = (action - 1 + choice) % 4 if self.is_slippery else action
        self.s = self._next[self.s][direction]
        new_letter = self._flat[self.s]
        return (1.0 if new_letter == "G" else 0.0), new_letter in "GH"

    def _on_goal(self) -> bool:
        return self._flat[self.s] == "G"

    # ---- text ----------------------------------------------------------------------------------------------------
    def render(self) -> str:
        if self.desc is None:
            raise EnvStateError("FrozenLake.render() called before reset(seed); reset the env first")
        r, c = divmod(self.s, self.size)
        rows = ["".join(row) for row in self._rows]
        symbol = self._player_symbols.get(self._flat[self.s], self._player_symbol)
        rows[r] = "".join(self._rows[r][:c]) + symbol + "".join(self._rows[r][c + 1:])
        return "\n".join(rows)

    def get_instructions(self) -> str:
        vocab = ", ".join(f"{k}: {v}" for k, v in self.grid_vocab.items())
        actions = ", ".join(self.action_lookup.values())
        return (self.env_instruction + "\nThe meaning of each symbol in the state is:\n" + vocab
                + "\nYour available actions are:\n" + actions)

    # ---- state ---------------------------------------------------------------------------------------------------
    def _started(self) -> bool:
        return self.desc is not None

    def _dynamic_state(self) -> dict:
        return {"map": "/".join(self.desc), "pos": self.s, "seed": self.seed, "steps": self.step_count,
                "rng": [self._rng[0], self._rng[1]]}

    def _load_dynamic_state(self, state: Mapping[str, Any]) -> None:
        try:
            desc = tuple(str(state["map"]).split("/"))
            pos, seed, steps = int(state["pos"]), state["seed"], int(state["steps"])
            rng_state, inc = (int(x) for x in state["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvStateError(f"FrozenLake state is malformed ({exc!r}); pass the string get_state() returned") \
                from None
        if len(desc) != self.size or any(len(row) != self.size for row in desc) or not 0 <= pos < self.size ** 2:
            raise EnvStateError(f"FrozenLake state holds a map or position that does not fit size={self.size}; pass "
                                "the string get_state() returned by an env with the same size")
        self._set_map(desc)
        self.s, self.seed, self.step_count, self._rng = pos, seed, steps, (rng_state, inc)


# ---- registration (spec §9; ROLL example configs) -----------------------------------------------------------------
register_env("FrozenLake", EnvSpec(
    FrozenLakeEnv, {"is_slippery": False, "max_steps": ROLL_MAX_STEPS, "format_penalty": -0.01},
    ends_at_max_steps=False, description="4x4 FrozenLake, not slippery (ROLL example config)"))
register_env("FrozenLakeSlippery", EnvSpec(
    FrozenLakeEnv, {"is_slippery": True, "max_steps": ROLL_MAX_STEPS, "format_penalty": -0.01},
    ends_at_max_steps=False, stochastic=True, description="4x4 FrozenLake, slippery (gymnasium 1/3 dynamics)"))
