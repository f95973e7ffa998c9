"""Sokoban level generation as ROLL does it (gym_sokoban 0.0.6 + ROLL's player walk; spec §9.2).

Bit-exact with ROLL given the same seed: CPython's ``random.Random(seed)`` stands for the seeded global ``random``
and ``np.random.RandomState(seed)`` for the seeded legacy ``np.random``. Rooms are ``(H, W)`` grids:
``room_fixed``: 0 wall, 1 floor, 2 target; ``room_state``: 0 wall, 1 floor, 2 empty target, 3 box on target,
4 box off target, 5 player.

The reverse-play search runs on flat ``bytearray`` rooms (keys ``bytes(room)``) with an explicit stack that visits
states in exactly the order of gym_sokoban's recursive depth-first search (children where the player cannot move
are left out: they equal their already explored parent, so the recursion returns at once for them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER = 0, 1, 2, 3, 4, 5
TOPOLOGY_DIRECTIONS = [(1, 0), (0, 1), (-1, 0), (0, -1)]
# reverse-play / walk moves, in gym_sokoban's CHANGE_COORDINATES order: up, down, left, right
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]
TOPOLOGY_MASKS = [
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
]
P_CHANGE_DIRECTION = 0.35
MAX_EXPLORED_STATES = 300_000
GENERATION_TRIES = 4


class NotEnoughSpace(RuntimeError):
    """The topology has too few floor cells for the player and the boxes (ROLL's RuntimeError)."""


class NoSolvableLevel(RuntimeWarning):
    """Reverse play found no level with displaced boxes in any try (ROLL's RuntimeWarning)."""


@dataclass(frozen=True)
class SokobanLevel:
    """A generated level. ``box_mapping`` maps each target ``(r, c)`` to the box that belongs to it."""

    room_fixed: np.ndarray
    room_state: np.ndarray
    box_mapping: dict[tuple[int, int], tuple[int, int]]


def num_gen_steps(dim_room: tuple[int, int]) -> int:
    """ROLL's topology walk length: ``int(1.7 * (H + W))``."""
    return int(1.7 * (dim_room[0] + dim_room[1]))


_MASK_OFFSETS = [[(r - 1, c - 1) for r in range(3) for c in range(3) if mask[r][c]] for mask in TOPOLOGY_MASKS]


def room_topology(dim: tuple[int, int], num_steps: int, py_rng: random.Random) -> np.ndarray:
    """Random walk stamping 3×3 masks; floor where any mask landed, walls on the border. ``(H, W)`` int64.

    ``py_rng.choice(seq)`` stands for gym_sokoban's ``random.sample(seq, 1)[0]``: CPython draws the same single
    ``_randbelow(len(seq))`` for both.
    """
    dim_x, dim_y = dim
    direction = py_rng.choice(TOPOLOGY_DIRECTIONS)
    row, col = py_rng.randint(1, dim_x - 1), py_rng.randint(1, dim_y - 1)
    stamped = set()
    for _ in range(num_steps):
        if py_rng.random() < P_CHANGE_DIRECTION:
            direction = py_rng.choice(TOPOLOGY_DIRECTIONS)
        row = max(min(row + direction[0], dim_x - 2), 1)
        col = max(min(col + direction[1], dim_y - 2), 1)
        for dr, dc in py_rng.choice(_MASK_OFFSETS):
            stamped.add((row + dr) * dim_y + col + dc)
    level = np.zeros(dim_x * dim_y, dtype=np.int64)
    level[list(stamped)] = FLOOR
    level = level.reshape(dim)
    level[:, [0, dim_y - 1]] = WALL
    level[[0, dim_x - 1], :] = WALL
    return level


def place_player_and_targets(room: np.ndarray, num_boxes: int, np_rng: np.random.RandomState) -> np.ndarray:
    """Player then ``num_boxes`` targets on random floor cells (row-major candidate lists, legacy ``randint``)."""
    floor = np.where(room == FLOOR)
    if floor[0].shape[0] <= num_boxes + 1:
        raise NotEnoughSpace(f"Not enough free spots (#{floor[0].shape[0]}) to place 1 player and {num_boxes} boxes.")
    ind = np_rng.randint(floor[0].shape[0])
    room[floor[0][ind], floor[1][ind]] = PLAYER
    for _ in range(num_boxes):
        floor = np.where(room == FLOOR)
        ind = np_rng.randint(floor[0].shape[0])
        room[floor[0][ind], floor[1][ind]] = TARGET
    return room


def reverse_play(room_state: np.ndarray, room_fixed: np.ndarray, search_depth: int
                 ) -> tuple[np.ndarray, int, dict[tuple[int, int], tuple[int, int]]]:
    """gym_sokoban's ``reverse_playing``: depth-first pulls from the solved room; best = first room with the highest
    ``swaps × Σ|box − target|₁`` among rooms with every target uncovered. Returns ``(room, score, box_mapping)``.

    ``swaps`` counts how often the pulled box changes along the path (``last_pull`` = target index of the last
    pulled box, inherited by the children; -1 before any pull), as in ROLL's copy of the search.
    """
    height, width = room_fixed.shape
    fixed = bytes(room_fixed.astype(np.uint8).ravel())
    targets = [int(i) for i in np.flatnonzero(room_fixed.ravel() == TARGET)]
    num_targets = len(targets)
    target_rc = [divmod(t, width) for t in targets]
    deltas = [dr * width + dc for dr, dc in MOVES]

    def displacement(mapping: tuple[int, ...]) -> int:
        total = 0
        for (tr, tc), box in zip(target_rc, mapping):
            br, bc = divmod(box, width)
            total += abs(br - tr) + abs(bc - tc)
        return total

    start = bytearray(room_state.astype(np.uint8).ravel())
    best_room, best_score, best_mapping = None, -1, tuple(targets)
    explored: set[bytes] = set()
    # stack entries: (room, player cell, mapping target-order → box cell, box swaps, last pulled target, ttl)
    stack = [(start, start.index(PLAYER), tuple(targets), 0, -1, search_depth)]
    while stack:
        room, player, mapping, swaps, last_pull, ttl = stack.pop()
        ttl -= 1
        if ttl <= 0 or len(explored) >= MAX_EXPLORED_STATES:
            continue
        key = bytes(room)
        if key in explored:
            continue
        score = swaps * displacement(mapping) if room.count(TARGET) == num_targets else 0
        if score > best_score:
            best_room, best_score, best_mapping = room, score, mapping
        explored.add(key)
        children = []
        for delta in deltas:
            nxt = player + delta
            if room[nxt] != FLOOR and room[nxt] != TARGET:
                continue  # no move: the child equals this (explored) room, a no-op in the recursion
            child = bytearray(room)
            child[player] = fixed[player]
            child[nxt] = PLAYER
            child_mapping, child_last_pull = mapping, last_pull
            box = player - delta
            if child[box] == BOX_ON_TARGET or child[box] == BOX:
                child[player] = BOX_ON_TARGET
                child[box] = fixed[box]
                k = mapping.index(box)
                child_mapping = mapping[:k] + (player,) + mapping[k + 1:]
                child_last_pull = k
            children.append((child, nxt, child_mapping, swaps + (child_last_pull != last_pull), child_last_pull,
                             ttl))
        stack.extend(reversed(children))
    room_out = np.frombuffer(bytes(best_room), dtype=np.uint8).astype(np.int64).reshape(height, width)
    mapping_out = {rc: divmod(box, width) for rc, box in zip(target_rc, best_mapping)}
    return room_out, best_score, mapping_out


def box_displacement(box_mapping: dict[tuple[int, int], tuple[int, int]]) -> int:
    """``Σ_targets |box − target|₁``."""
    return sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in box_mapping.items())


def generate_room(dim: tuple[int, int], num_steps: int, num_boxes: int, search_depth: int,
                  py_rng: random.Random, np_rng: np.random.RandomState) -> SokobanLevel:
    """One seeded generation attempt (spec §9.2 steps 1–6). Raises ``NotEnoughSpace`` / ``NoSolvableLevel``."""
    score, room_fixed, room_state, box_mapping = 0, None, None, {}
    for _ in range(GENERATION_TRIES):
        room = place_player_and_targets(room_topology(dim, num_steps, py_rng), num_boxes, np_rng)
        room_fixed = room.copy()
        room_fixed[room_fixed == PLAYER] = FLOOR
        start = room.copy()
        start[start == TARGET] = BOX
        room_state, score, box_mapping = reverse_play(start, room_fixed, search_depth)
        room_state[room_state == BOX_ON_TARGET] = BOX
        if score > 0:
            break
    if score <= 0:
        raise NoSolvableLevel("Generated Model with score == 0")
    _walk_player(room_state, room_fixed, box_displacement(box_mapping), py_rng)
    return SokobanLevel(room_fixed, room_state, box_mapping)


def _walk_player(room_state: np.ndarray, room_fixed: np.ndarray, displacement: int, py_rng: random.Random) -> None:
    """ROLL's random player walk (spec §9.2 step 6), in place."""
    prob = 0.8 if displacement == 1 else 0.5
    if py_rng.random() > prob:
        return
    height, width = room_state.shape
    pr, pc = (int(x) for x in np.argwhere(room_state == PLAYER)[0])
    visited = {(pr, pc)}
    for _ in range(3):
        candidates = []
        for dr, dc in MOVES:
            nr, nc = pr + dr, pc + dc
            if 0 <= nr < height and 0 <= nc < width and (nr, nc) not in visited \
                    and room_state[nr, nc] in (FLOOR, TARGET):
                candidates.append((nr, nc))
        if not candidates:
            break
        nr, nc = py_rng.choice(candidates)
        room_state[pr, pc] = room_fixed[pr, pc]
        room_state[nr, nc] = PLAYER
        pr, pc = nr, nc
        visited.add((pr, pc))
        if py_rng.random() > 0.5:
            break
