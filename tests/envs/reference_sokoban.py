"""A slow, literal transcription of spec §9.2 level generation (NumPy rooms, recursive search, ``random.sample``).

Used only to check the fast generator in ``stages/envs/sokoban_levels.py`` on configurations the golden vectors do
not cover. Written from the spec text, independently of the implementation under test.
"""

from __future__ import annotations

import random

import numpy as np

DIRS = [(1, 0), (0, 1), (-1, 0), (0, -1)]
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]
MASKS = [
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
]


class Failed(Exception):
    pass


def topology(h: int, w: int, n: int, rnd: random.Random) -> np.ndarray:
    direction = rnd.sample(DIRS, 1)[0]
    pos = np.array([rnd.randint(1, h - 1), rnd.randint(1, w - 1)])
    level = np.zeros((h, w), dtype=int)
    for _ in range(n):
        if rnd.random() < 0.35:
            direction = rnd.sample(DIRS, 1)[0]
        pos = pos + direction
        pos[0] = max(min(pos[0], h - 2), 1)
        pos[1] = max(min(pos[1], w - 2), 1)
        mask = rnd.sample(MASKS, 1)[0]
        level[pos[0] - 1:pos[0] + 2, pos[1] - 1:pos[1] + 2] += mask
    level[level > 0] = 1
    level[:, [0, w - 1]] = 0
    level[[0, h - 1], :] = 0
    return level


def place(room: np.ndarray, nb: int, nrs: np.random.RandomState) -> np.ndarray:
    free = np.where(room == 1)
    if free[0].shape[0] <= nb + 1:
        raise Failed("space")
    i = nrs.randint(free[0].shape[0])
    room[free[0][i], free[1][i]] = 5
    for _ in range(nb):
        free = np.where(room == 1)
        i = nrs.randint(free[0].shape[0])
        room[free[0][i], free[1][i]] = 2
    return room


def reverse_play(state: np.ndarray, fixed: np.ndarray, depth: int, nb: int):
    mapping = {}
    for r, c in zip(*np.where(fixed == 2)):
        mapping[(int(r), int(c))] = (int(r), int(c))
    search = {"explored": set(), "best": (None, -1, mapping)}

    def score_of(m):
        return sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in m.items())

    def visit(st, m, swaps, last_pull, ttl):
        ttl -= 1
        if ttl <= 0 or len(search["explored"]) >= 300000:
            return
        key = st.tobytes()
        if key in search["explored"]:
            return
        score = swaps * score_of(m)
        if np.count_nonzero(st == 2) != nb:
            score = 0
        if score > search["best"][1]:
            search["best"] = (st, score, m)
        search["explored"].add(key)
        for a in range(4):
            nxt, m2, lp2 = st.copy(), dict(m), last_pull
            p = np.argwhere(nxt == 5)[0]
            q = p + MOVES[a]
            if nxt[q[0], q[1]] in (1, 2):
                nxt[p[0], p[1]] = fixed[p[0], p[1]]
                nxt[q[0], q[1]] = 5
                b = p - MOVES[a]
                if nxt[b[0], b[1]] in (3, 4):
                    nxt[p[0], p[1]] = 3
                    nxt[b[0], b[1]] = fixed[b[0], b[1]]
                    for k in m2:
                        if m2[k] == (int(b[0]), int(b[1])):
                            m2[k] = (int(p[0]), int(p[1]))
                            lp2 = k
            visit(nxt, m2, swaps + (lp2 != last_pull), lp2, ttl)

    visit(state, mapping, 0, (-1, -1), depth)
    return search["best"]


def generate(dim, nb: int, depth: int, seed: int):
    """``(room_fixed, room_state)`` for ``seed``, or raises :class:`Failed`."""
    h, w = dim
    n = int(1.7 * (h + w))
    rnd, nrs = random.Random(seed), np.random.RandomState(seed)
    best_score, fixed, state, mapping = 0, None, None, None
    for _ in range(4):
        room = place(topology(h, w, n, rnd), nb, nrs)
        fixed = room.copy()
        fixed[fixed == 5] = 1
        start = room.copy()
        start[start == 2] = 4
        state, best_score, mapping = reverse_play(start, fixed, depth, nb)
        state = state.copy()
        state[state == 3] = 4
        if best_score > 0:
            break
    if best_score <= 0:
        raise Failed("score")
    displacement = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in mapping.items())
    prob = 0.8 if displacement == 1 else 0.5
    if not rnd.random() > prob:
        p = tuple(int(x) for x in np.argwhere(state == 5)[0])
        seen = {p}
        for _ in range(3):
            options = [(p[0] + dr, p[1] + dc) for dr, dc in MOVES
                       if (p[0] + dr, p[1] + dc) not in seen and state[p[0] + dr, p[1] + dc] in (1, 2)]
            if not options:
                break
            q = rnd.choice(options)
            state[p] = fixed[p]
            state[q] = 5
            p = q
            seen.add(p)
            if rnd.random() > 0.5:
                break
    return fixed, state
