"""Independent, deliberately plain float64 references of the token-level algorithms (spec §2.1, §4), written per
row from the spec text, for the golden and property tests. ``roll=True`` follows ROLL, defects included (BUG-4:
GAE over every column with the unmasked critic values); the default is the corrected semantics."""

from __future__ import annotations

import numpy as np

WHITEN_EPS = 1e-8


def loop_reward_to_go(r: np.ndarray, gamma: float) -> np.ndarray:
    out, g = np.zeros(len(r)), 0.0
    for t in reversed(range(len(r))):
        g = r[t] + gamma * g
        out[t] = g
    return out


def loop_gae_roll(r: np.ndarray, v: np.ndarray, gamma: float, lambd: float) -> tuple[np.ndarray, np.ndarray]:
    """ROLL's GAE (§4.2): every column, unmasked values, V = 0 beyond the last column."""
    adv, a, next_v = np.zeros(len(r)), 0.0, 0.0
    for t in reversed(range(len(r))):
        a = r[t] + gamma * next_v - v[t] + gamma * lambd * a
        adv[t], next_v = a, v[t]
    return adv, adv + np.asarray(v, dtype=np.float64)


def loop_gae_fixed(r: np.ndarray, v: np.ndarray, m: np.ndarray, gamma: float,
                   lambd: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE over the response positions of one row only, in order, V = 0 after the last one (BUG-4 fixed)."""
    adv, ret = np.zeros(len(r)), np.zeros(len(r))
    a, next_v = 0.0, 0.0
    for t in reversed([t for t in range(len(r)) if m[t] > 0]):
        a = r[t] + gamma * next_v - v[t] + gamma * lambd * a
        adv[t], ret[t], next_v = a, a + v[t], v[t]
    return adv, ret


def loop_segments(m: np.ndarray) -> list[tuple[int, int]]:
    segs, t = [], 0
    while t < len(m):
        if m[t] > 0:
            s = t
            while t < len(m) and m[t] > 0:
                t += 1
            segs.append((s, t))
        else:
            t += 1
    return segs


def loop_agentic_reinforce(r: np.ndarray, m: np.ndarray, gamma: float) -> np.ndarray:
    """§4.5: per segment, last to first, G ← r[end−1] + γ·G on every position of the segment."""
    out, g = np.zeros(len(r)), 0.0
    for s, e in reversed(loop_segments(m)):
        g = r[e - 1] + gamma * g
        out[s:e] = g
    return out


def loop_segment_mean(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x))
    for s, e in loop_segments(m):
        out[s:e] = np.sum(x[s:e], dtype=np.float64) / (e - s + 1e-8)
    return out


def ref_approx_kl(lp: np.ndarray, lb: np.ndarray, kind: str, mask: np.ndarray | None = None) -> np.ndarray:
    """§2.1 per token (kl | abs | mse | k3)."""
    lp, lb = np.asarray(lp, dtype=np.float64), np.asarray(lb, dtype=np.float64)
    d = lp - lb
    out = {"kl": lambda: d, "abs": lambda: np.abs(d), "mse": lambda: 0.5 * d * d,
           "k3": lambda: np.clip(np.exp(-d) + d - 1.0, -10.0, 10.0)}[kind]()
    return out if mask is None else out * mask


def ref_whiten(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """§1.4 with the unbiased variance over the selected elements, applied to every element."""
    sel = x[m > 0]
    return (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + WHITEN_EPS)


def reference_compute_advantage(rewards: np.ndarray, m: np.ndarray, p: dict, *, values: np.ndarray | None = None,
                                opd_kl: np.ndarray | None = None, roll: bool = False) -> dict:
    """§4.3 / §4.4 on padded (B, T) arrays with the advantage mask ``m``: {advantages, returns, raw_advantages,
    token_level_rewards, values (masked, gae), clip_frac (or None)}. ``p``: adv_estimator, gamma, lambd,
    whiten_rewards, whiten_advantages, advantage_clip, use_opd, is_pure_opd. ``roll``: ROLL's GAE [BUG-4]."""
    m = np.asarray(m, dtype=np.float64)
    gamma, lambd = float(p["gamma"]), float(p["lambd"])
    can_whiten = m.sum() > 1                                   # §4.3 step 1
    r = np.asarray(rewards, dtype=np.float64)
    out = {"values": None}
    if p.get("is_pure_opd"):
        a = ret = raw = -np.asarray(opd_kl, dtype=np.float64)
    else:
        if p.get("whiten_rewards") and can_whiten:
            r = ref_whiten(r, m)
        r = r * m
        est = p["adv_estimator"]
        a, ret = np.zeros_like(r), np.zeros_like(r)
        for b in range(r.shape[0]):
            if est == "gae":
                v = np.asarray(values[b], dtype=np.float64)
                a[b], ret[b] = loop_gae_roll(r[b], v, gamma, lambd) if roll else \
                    loop_gae_fixed(r[b], v, m[b], gamma, lambd)
            elif est == "agentic_reinforce":
                a[b] = ret[b] = loop_agentic_reinforce(r[b], m[b], gamma)
            elif est in ("reinforce", "grpo", "gigpo", "step_reinforce"):
                a[b] = ret[b] = loop_reward_to_go(r[b], gamma)
            else:
                raise ValueError(f"estimator {est!r}")
        if est == "gae":
            out["values"] = np.asarray(values, dtype=np.float64) * m
        raw = a.copy()
        if p.get("use_opd"):
            a = a - np.asarray(opd_kl, dtype=np.float64)
    if p.get("whiten_advantages") and can_whiten:
        a = ref_whiten(a, m)
    a = a * m
    frac = None
    if p.get("advantage_clip") is not None:
        c = float(p["advantage_clip"])
        frac = float(np.mean((a > c) | (a < -c)))              # over all (B, T) positions, as ROLL
        a = np.clip(a, -c, c)
    out.update(advantages=a, returns=ret, raw_advantages=raw, token_level_rewards=r, clip_frac=frac)
    return out
