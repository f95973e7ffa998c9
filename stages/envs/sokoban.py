"""Sokoban as ROLL plays it (spec §9.2): ROLL's levels, gym_sokoban's push dynamics and rewards, ROLL's text.

Rooms live as flat row-major ASCII-digit byte strings of the codes of :mod:`stages.envs.sokoban_levels`
(``b"0"`` wall ... ``b"5"`` player), which serialise as-is; the player on a target renders as grid code 6.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from typing import Any, Mapping, Sequence

import numpy as np

from schemas.errors import ConfigError
from stages.envs.base import EnvStateError, TextEnv, check_seed, fresh_seed, int_keyed, retry_seed, step_info
from stages.envs.parser import DEFAULT_ACTION_PATTERN, DEFAULT_SPECIAL_TOKENS, ActionParser
from stages.envs.registry import ROLL_MAX_STEPS, EnvSpec, register_env
from stages.envs.sokoban_levels import (BOX, BOX_ON_TARGET, FLOOR, PLAYER, TARGET, NoSolvableLevel, NotEnoughSpace,
                                        generate_room, num_gen_steps)

ACTION_LOOKUP = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}
_ACTION_MOVES = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}
PLAYER_ON_TARGET = 6
GRID_LOOKUP = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
GRID_VOCAB = {"#": "wall", "_": "empty", "O": "target", "√": "box on target", "X": "box", "P": "player",
              "S": "player on target"}
INSTRUCTION = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
               "When you are right next to a box, you can push it by moving in the same direction. You cannot push "
               "a box through a wall, and you cannot pull a box. The answer must be one of action in a turn, format "
               "is <answer>Right</answer>.")
# gym_sokoban rewards
PENALTY_FOR_STEP = -0.1
REWARD_BOX_ON_TARGET = 1.0
PENALTY_BOX_OFF_TARGET = -1.0
REWARD_FINISHED = 10.0
MAX_RESET_RETRIES = 100


_DIGIT = [ord(str(code)) for code in range(7)]  # rooms are held as ASCII digit strings/bytearrays
_D_FLOOR, _D_TARGET, _D_BOX_ON_TARGET, _D_BOX, _D_PLAYER = (_DIGIT[c] for c in
                                                            (FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER))
_D_WALKABLE = (_D_FLOOR, _D_TARGET)
_D_BOXES = (_D_BOX, _D_BOX_ON_TARGET)
_TLS = threading.local()


def _legacy_np_random(seed: int) -> np.random.RandomState:
    """A legacy ``RandomState`` seeded with ``seed`` (reused per thread: constructing one costs ~0.3 ms)."""
    rng = getattr(_TLS, "np_rng", None)
    if rng is None:
        rng = _TLS.np_rng = np.random.RandomState()
    rng.seed(seed)
    return rng


class SokobanEnv(TextEnv):
    """ROLL's ``SokobanEnv`` (spec §9.2). Actions ``1 Up, 2 Down, 3 Left, 4 Right`` (push or move).

    Invalid text is a counted no-op step (``-0.1``) plus ``format_penalty``. The episode is done when all boxes are
    on targets or after exactly ``max_steps`` env steps (``truncated`` = done without success).
    """

    def __init__(self, dim_room: Sequence[int] = (10, 10), max_steps: int = 20, num_boxes: int = 4,
                 search_depth: int = 300, format_penalty: float = 0.0, grid_lookup: Mapping | None = None,
                 grid_vocab: Mapping | None = None, action_lookup: Mapping | None = None,
                 env_instruction: str | None = None, action_pattern: str = DEFAULT_ACTION_PATTERN,
                 special_token_list: Sequence[str] | None = DEFAULT_SPECIAL_TOKENS, roll_compat: bool = False,
                 render_mode: str | None = None) -> None:
        dim = tuple(int(x) for x in dim_room)
        if len(dim) != 2 or min(dim) < 3 or int(num_boxes) < 1 or int(search_depth) < 1:
            raise ConfigError(f"Sokoban: need dim_room=(H, W) with H, W >= 3, num_boxes >= 1, search_depth >= 1; got "
                              f"dim_room={dim_room}, num_boxes={num_boxes}, search_depth={search_depth}")
        self.dim_room, self.num_boxes, self.search_depth = dim, int(num_boxes), int(search_depth)
        self.num_gen_steps = num_gen_steps(dim)
        self.max_steps, self.format_penalty = int(max_steps), float(format_penalty)
        self.action_lookup = int_keyed(action_lookup, "Sokoban.action_lookup") or dict(ACTION_LOOKUP)
        self.grid_lookup = int_keyed(grid_lookup, "Sokoban.grid_lookup") or dict(GRID_LOOKUP)
        if not set(GRID_LOOKUP) <= self.grid_lookup.keys():
            raise ConfigError(f"Sokoban: grid_lookup must name the codes 0-6, got {sorted(self.grid_lookup)}; "
                              "fix the env_config")
        self._symbols = {_DIGIT[code]: symbol for code, symbol in self.grid_lookup.items() if 0 <= code <= 6}
        self.grid_vocab = dict(grid_vocab) if grid_vocab is not None else dict(GRID_VOCAB)
        self.env_instruction = env_instruction if env_instruction is not None else INSTRUCTION
        self.parser = ActionParser(action_pattern, self.action_lookup, special_token_list)
        self.roll_compat = bool(roll_compat)
        self._set_config({
            "dim_room": dim, "max_steps": self.max_steps, "num_boxes": self.num_boxes,
            "search_depth": self.search_depth, "format_penalty": self.format_penalty, "grid_lookup": grid_lookup,
            "grid_vocab": grid_vocab, "action_lookup": action_lookup, "env_instruction": env_instruction,
            "action_pattern": action_pattern, "special_token_list": special_token_list,
            "roll_compat": self.roll_compat})
        height, width = dim
        self._deltas = {a: dr * width + dc for a, (dr, dc) in _ACTION_MOVES.items()}
        self._fixed: bytes | None = None
        self._room = bytearray()
        self.player = 0
        self.num_env_steps = 0
        self.boxes_on_target = 0
        self.seed: int | None = None

    # ---- episode -------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        seed = check_seed(seed, "Sokoban.reset", upper=2**32)
        seed = fresh_seed() if seed is None else seed
        for _ in range(MAX_RESET_RETRIES):
            try:
                level = generate_room(self.dim_room, self.num_gen_steps, self.num_boxes, self.search_depth,
                                      random.Random(seed), _legacy_np_random(seed))
                break
            except (NotEnoughSpace, NoSolvableLevel):
                seed = retry_seed(seed, self.roll_compat)  # ROLL: abs(hash(str(seed))) % 2**32
        else:
            raise EnvStateError(f"Sokoban.reset: no level after {MAX_RESET_RETRIES} seeds for dim_room="
                                f"{self.dim_room}, num_boxes={self.num_boxes}; use a larger room or fewer boxes")
        self.seed = seed
        self._fixed = bytes(_DIGIT[int(c)] for c in level.room_fixed.ravel())
        self._room = bytearray(_DIGIT[int(c)] for c in level.room_state.ravel())
        self.player = self._room.index(_D_PLAYER)
        self.num_env_steps, self.boxes_on_target = 0, 0
        return self.render(), {"env_instruction": self.get_instructions()}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        if self._fixed is None:
            raise EnvStateError("Sokoban.step() called before reset(seed); reset the env first")
        parsed = self.parser(action_text)
        previous = self.player
        if parsed.action is None or parsed.action not in self._deltas:
            reward, done = self._gym_step(None)
            reward += self.format_penalty
            info = step_info(parsed.as_info(), valid=False, effective=False, success=self._success(),
                             format_penalty=self.format_penalty,
                             action_desc=f"At turn {self.num_env_steps}, You did not provide a valid action.")
            return self.render(), reward, done, False, info
        reward, done = self._gym_step(parsed.action)
        success = self._success()
        effective = previous != self.player
        verb = (f"you moved {parsed.action_content}, which is effective." if effective
                else f"you tried to move {parsed.action_content}, which is not effective yet.")
        info = step_info(parsed.as_info(), valid=True, effective=effective, success=success, format_penalty=0.0,
                         action_desc=f"At turn {self.num_env_steps}, {verb}")
        return self.render(), reward, done, done and not success, info

    def _gym_step(self, action: int | None) -> tuple[float, bool]:
        """gym_sokoban ``step``: count the step, push-or-move (``None`` = no-op), reward, done."""
        self.num_env_steps += 1
        if action is not None:
            self._push_or_move(self._deltas[action])
        reward = PENALTY_FOR_STEP
        on_target = self._room.count(_D_BOX_ON_TARGET)
        if on_target > self.boxes_on_target:
            reward += REWARD_BOX_ON_TARGET
        elif on_target < self.boxes_on_target:
            reward += PENALTY_BOX_OFF_TARGET
        all_on_target = on_target == self._fixed.count(_D_TARGET)  # no empty target, player on none
        if all_on_target:
            reward += REWARD_FINISHED
        self.boxes_on_target = on_target
        return reward, all_on_target or self.num_env_steps == self.max_steps

    def _push_or_move(self, delta: int) -> None:
        room, fixed, here = self._room, self._fixed, self.player
        ahead = here + delta
        beyond = ahead + delta
        if room[ahead] in _D_BOXES and 0 <= beyond < len(room) and room[beyond] in _D_WALKABLE:
            room[beyond] = _D_BOX_ON_TARGET if fixed[beyond] == _D_TARGET else _D_BOX
        elif room[ahead] not in _D_WALKABLE:
            return
        room[ahead] = _D_PLAYER
        room[here] = fixed[here]
        self.player = ahead

    def _success(self) -> bool:
        return self.boxes_on_target == self.num_boxes

    # ---- text ----------------------------------------------------------------------------------------------------
    def render(self) -> str:
        if self._fixed is None:
            raise EnvStateError("Sokoban.render() called before reset(seed); reset the env first")
        cells = self._room.decode("ascii")
        if self._fixed[self.player] == _D_TARGET:
            cells = cells[:self.player] + str(PLAYER_ON_TARGET) + cells[self.player + 1:]
        width = self.dim_room[1]
        return "\n".join(cells[i:i + width] for i in range(0, len(cells), width)).translate(self._symbols)

    def get_instructions(self) -> str:
        vocab = ", ".join(f"{k}: {v}" for k, v in self.grid_vocab.items())
        actions = ", ".join(self.action_lookup.values())
        return (self.env_instruction + "\nThe meaning of each symbol in the state is:\n" + vocab
                + "\nYour available actions are:\n" + actions)

    def rooms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(room_fixed, room_state)`` as ``(H, W)`` int64 arrays (gym_sokoban's codes)."""
        if self._fixed is None:
            raise EnvStateError("Sokoban.rooms() called before reset(seed); reset the env first")
        fixed = np.frombuffer(self._fixed, dtype=np.uint8).astype(np.int64) - _DIGIT[0]
        room = np.frombuffer(bytes(self._room), dtype=np.uint8).astype(np.int64) - _DIGIT[0]
        return fixed.reshape(self.dim_room), room.reshape(self.dim_room)

    def shortest_solution(self, max_depth: int = 30) -> list[int] | None:
        """Breadth-first shortest action list (ids 1–4) solving the current room, or ``None`` beyond ``max_depth``."""
        fixed, room = self.rooms()
        return shortest_solution(fixed.ravel().tolist(), room.ravel().tolist(), self.dim_room[1], max_depth)

    # ---- state ---------------------------------------------------------------------------------------------------
    def _started(self) -> bool:
        return self._fixed is not None

    def _dynamic_state(self) -> dict:
        return {"fixed": self._fixed.decode("ascii"), "room": self._room.decode("ascii"), "seed": self.seed,
                "steps": self.num_env_steps, "on_target": self.boxes_on_target}

    def _load_dynamic_state(self, state: Mapping[str, Any]) -> None:
        try:
            fixed, room = str(state["fixed"]).encode("ascii"), bytearray(str(state["room"]), "ascii")
            steps, on_target, seed = int(state["steps"]), int(state["on_target"]), state["seed"]
        except (KeyError, TypeError, ValueError, UnicodeError) as exc:
            raise EnvStateError(f"Sokoban state is malformed ({exc!r}); pass the string get_state() returned") \
                from None
        size = self.dim_room[0] * self.dim_room[1]
        digits = set(_DIGIT[:6])
        if len(fixed) != size or len(room) != size or room.count(_D_PLAYER) != 1 \
                or not set(fixed) <= digits or not set(room) <= digits:
            raise EnvStateError(f"Sokoban state does not hold one player in a {self.dim_room} room of codes 0-5; "
                                "pass the string get_state() returned by an env with the same dim_room")
        self._fixed, self._room, self.player = fixed, room, room.index(_D_PLAYER)
        self.num_env_steps, self.boxes_on_target, self.seed = steps, on_target, seed


def shortest_solution(room_fixed: Sequence[int], room_state: Sequence[int], width: int,
                      max_depth: int = 30) -> list[int] | None:
    """BFS over ``(player, boxes)`` with gym_sokoban push rules; actions ``1 Up, 2 Down, 3 Left, 4 Right``."""
    fixed = list(room_fixed)
    walls = {i for i, c in enumerate(fixed) if c == 0}
    targets = frozenset(i for i, c in enumerate(fixed) if c == TARGET)
    boxes = frozenset(i for i, c in enumerate(room_state) if c in (BOX, BOX_ON_TARGET))
    start = (list(room_state).index(PLAYER), boxes)
    if boxes == targets:
        return []
    deltas = [(a, dr * width + dc) for a, (dr, dc) in _ACTION_MOVES.items()]
    parents: dict = {start: None}
    frontier = deque([(start, 0)])
    while frontier:
        (player, boxes), depth = frontier.popleft()
        if depth >= max_depth:
            continue
        for action, delta in deltas:
            ahead = player + delta
            if ahead in walls:
                continue
            new_boxes = boxes
            if ahead in boxes:
                beyond = ahead + delta
                if beyond in walls or beyond in boxes or not 0 <= beyond < len(fixed):
                    continue
                new_boxes = (boxes - {ahead}) | {beyond}
            node = (ahead, new_boxes)
            if node in parents:
                continue
            parents[node] = ((player, boxes), action)
            if new_boxes == targets:
                path = []
                while parents[node] is not None:
                    node, act = parents[node]
                    path.append(act)
                return path[::-1]
            frontier.append((node, depth + 1))
    return None


# ---- registration (spec §9; ROLL example configs) -----------------------------------------------------------------
register_env("SimpleSokoban", EnvSpec(
    SokobanEnv, {"dim_room": (6, 6), "num_boxes": 1, "max_steps": ROLL_MAX_STEPS, "format_penalty": -0.15},
    description="6x6 Sokoban, 1 box"))
register_env("LargerSokoban", EnvSpec(
    SokobanEnv, {"dim_room": (10, 10), "num_boxes": 2, "search_depth": 10, "max_steps": ROLL_MAX_STEPS,
                 "format_penalty": -0.15},
    description="10x10 Sokoban, 2 boxes, search_depth 10"))
register_env("SokobanDifferentGridVocab", EnvSpec(
    SokobanEnv, {"dim_room": (6, 6), "num_boxes": 1, "search_depth": 30, "max_steps": ROLL_MAX_STEPS,
                 "format_penalty": -0.15,
                 "grid_lookup": {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"},
                 "grid_vocab": {"W": "wall", ".": "empty", "G": "target", "C": "box on target", "B": "box",
                                "A": "player", "@": "player on target"}},
    description="6x6 Sokoban, 1 box, alternative symbols"))
